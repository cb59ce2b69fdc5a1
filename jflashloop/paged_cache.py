"""The paged cross-loop cache's operations: ``jflashloop.paged_cache.create/prefill/append/...``.

:class:`PagedKVCache` is a paged, cross-loop, 4-bit KV cache (functional,
jittable). This namespace re-exports its operations from ``jflashloop/cache/``.

Conventions follow vLLM / JAX ``paged_attention``: a pool of ``num_pages``
pages shared by all sequences, a block table ``[max_sequences,
max_pages_per_sequence]`` of page ids (-1 = none) and per-sequence lengths.
Each layer has its own pool arrays addressed by the same page ids.

Where a token lives (``n`` = tokens visible, ``packed = length // page_size``
complete pages; :func:`regions` is the one definition):

* ``t < sink_tokens``: the sink window (unquantized, every loop);
* ``t >= min(n - recent_tokens, packed * page_size)``: the ring of recent
  tokens (unquantized, every loop; capacity ``max(recent_tokens, page_size)``,
  indexed ``t % capacity``): the recent window plus the page being filled;
* otherwise: the page pool, as a residual chain of page tiles.

A page the pool could not hold is lost (block-table entry -1): a sequence's
pages are read only up to its first lost page, the positions after it that
are still in the ring are read from the ring, the others are not attended.

A page is packed (quantize-on-write) when its last token is committed; the
tokens of a page that is not yet full stay unquantized, since a channel-axis
K group needs all of its rows.

Decoding a step: :func:`write_token` puts the new token's K/V of one (layer,
loop) into the ring (not yet counted in ``lengths``), attention reads the
``lengths + 1`` visible tokens, and :func:`commit` counts the token for every
active sequence and packs pages that became full. :func:`append` does both for
all layers and loops at once; :func:`append_tokens` appends a chunk of up to
``chunk`` tokens per sequence (chunked prefill, the accepted tokens of
speculative decoding), bit-identical to that many ``append`` calls.

Prefix sharing: :func:`fork` starts a free slot with the first tokens of
another sequence, sharing its full packed pages (``page_refs`` counts each
page's holders; a page returns to the pool when the last one frees it) and
copying its windows; appends to either never change what the other reads.

Bad input raises eagerly where it can be known (static shapes and dtypes
always; slots, lengths and free pages when they are concrete, i.e. outside
``jit``). What cannot raise under ``jit`` sets bits of ``error_flags`` per
sequence, and :func:`check` raises them on the host:

* ``ERROR_OUT_OF_PAGES``: the pool ran out; a full page was not stored (nor
  any later page of the sequence).
* ``ERROR_SEQUENCE_FULL``: tokens beyond ``max_pages_per_sequence * page_size``
  were dropped (a dropped token changes nothing else in the cache).
* ``ERROR_NONFINITE_INPUT``: NaN/+-inf K/V were stored as 0 (counted in
  ``nonfinite_counts``).
* ``ERROR_SLOT_REPLACED``: ``prefill`` into an active slot replaced its
  sequence (its pages went back to the pool first).
* ``ERROR_INVALID_LENGTH``: ``prefill``'s ``length`` was outside ``[0, tokens]``
  and was clamped.
* ``ERROR_SATURATED`` (a warning: :func:`check` raises it only with
  ``allow_saturation=False``): values were stored at their format's limit
  (counted in ``saturation_counts``).

An out-of-range slot under ``jit`` makes ``prefill`` and ``free`` no-ops and
reads as an empty slot in :func:`reconstruct`; an inactive slot stores no
decode token and attends to nothing.
Layers, loops and slots are 0-based Python ints (loop 0 is the base).
:func:`validate` checks the whole structure on the host (after loading or
transferring a cache). ``docs/reliability.md`` lists every rule.
"""

from .cache._chunks import append_tokens as append_tokens
from .cache._chunks import check_chunk_arrays as check_chunk_arrays
from .cache._inspect import bookkeeping_problems as bookkeeping_problems
from .cache._inspect import check as check
from .cache._inspect import reconstruct as reconstruct
from .cache._inspect import sequence_regions as sequence_regions
from .cache._inspect import structure_problems as structure_problems
from .cache._inspect import validate as validate
from .cache._layout import ERROR_INVALID_LENGTH as ERROR_INVALID_LENGTH
from .cache._layout import ERROR_NONFINITE_INPUT as ERROR_NONFINITE_INPUT
from .cache._layout import ERROR_OUT_OF_PAGES as ERROR_OUT_OF_PAGES
from .cache._layout import ERROR_SATURATED as ERROR_SATURATED
from .cache._layout import ERROR_SEQUENCE_FULL as ERROR_SEQUENCE_FULL
from .cache._layout import ERROR_SLOT_REPLACED as ERROR_SLOT_REPLACED
from .cache._layout import WARNING_BITS as WARNING_BITS
from .cache._layout import LayerPool as LayerPool
from .cache._layout import LoopTiles as LoopTiles
from .cache._layout import PagedKVCache as PagedKVCache
from .cache._layout import PagedStream as PagedStream
from .cache._regions import Regions as Regions
from .cache._regions import regions as regions
from .cache._regions import stored_pages as stored_pages
from .cache._regions import visible_tokens as visible_tokens
from .cache._regions import window_mask as window_mask
from .cache._sharing import check_fork_values as check_fork_values
from .cache._sharing import fork as fork
from .cache._state import append as append
from .cache._state import check_append_arrays as check_append_arrays
from .cache._state import check_prefill_arrays as check_prefill_arrays
from .cache._state import check_prefill_values as check_prefill_values
from .cache._state import commit as commit
from .cache._state import create as create
from .cache._state import free as free
from .cache._state import prefill as prefill
from .cache._state import write_token as write_token

__all__ = [
    "ERROR_INVALID_LENGTH",
    "ERROR_NONFINITE_INPUT",
    "ERROR_OUT_OF_PAGES",
    "ERROR_SATURATED",
    "ERROR_SEQUENCE_FULL",
    "ERROR_SLOT_REPLACED",
    "WARNING_BITS",
    "LayerPool",
    "LoopTiles",
    "PagedKVCache",
    "PagedStream",
    "Regions",
    "append",
    "append_tokens",
    "bookkeeping_problems",
    "check",
    "check_append_arrays",
    "check_chunk_arrays",
    "check_fork_values",
    "check_prefill_arrays",
    "check_prefill_values",
    "commit",
    "create",
    "fork",
    "free",
    "prefill",
    "reconstruct",
    "regions",
    "sequence_regions",
    "stored_pages",
    "structure_problems",
    "validate",
    "visible_tokens",
    "window_mask",
    "write_token",
]
