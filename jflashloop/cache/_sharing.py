"""Prefix sharing: :func:`fork` starts a sequence on another's packed pages.

A page is shared, not copied: ``page_refs`` counts the block-table entries
that hold it, and it returns to the pool when the last one is released
(:func:`~jflashloop.paged_cache.free`, or a ``prefill`` that replaces a
sequence). Pages are written only when they are allocated, so appends to
either sequence never change what the other reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._validation import check_index, check_integer_scalar, concrete_int, is_concrete
from ._layout import ERROR_INVALID_LENGTH, ERROR_OUT_OF_PAGES, ERROR_SLOT_REPLACED, PagedKVCache
from ._pages import unpack_pages
from ._regions import ring_positions
from ._state import _stored_values, release_pages


def check_fork_values(cache: PagedKVCache, source_slot, target_slot, tokens=None) -> None:
    """Eager checks of :func:`fork`'s arguments (each when concrete).

    Raises:
      IndexError: a slot outside ``[0, max_sequences)``.
      ValueError: the same slot twice, an inactive source, an active target,
        ``tokens`` outside ``[0, lengths[source_slot]]``.
      TypeError: a slot or ``tokens`` that is not an integer scalar.
    """
    c = cache.config
    check_index("source_slot", source_slot, c.max_sequences)
    check_index("target_slot", target_slot, c.max_sequences)
    if tokens is not None:
        check_integer_scalar("tokens", tokens)
    source, target = concrete_int(source_slot), concrete_int(target_slot)
    if source is None or target is None:
        return
    if source == target:
        raise ValueError(f"source_slot and target_slot must differ, got {source} twice")
    if not (is_concrete(cache.active) and is_concrete(cache.lengths)):
        return
    if not bool(cache.active[source]):
        raise ValueError(f"source_slot {source} holds no sequence")
    if bool(cache.active[target]):
        raise ValueError(
            f"target_slot {target} is already active (it holds {int(cache.lengths[target])} tokens); "
            "free it first (paged_cache.free)"
        )
    count = concrete_int(tokens) if tokens is not None else None
    length = int(cache.lengths[source])
    if count is not None and not 0 <= count <= length:
        raise ValueError(f"tokens must be in [0, lengths[{source}]={length}], got {count}")


def fork(
    cache: PagedKVCache,
    source_slot: jax.Array | int,
    target_slot: jax.Array | int,
    tokens: jax.Array | int | None = None,
) -> PagedKVCache:
    """Start the free ``target_slot`` with the first ``tokens`` tokens of ``source_slot``.

    The source's full packed pages among those tokens (block-table columns
    ``< tokens // page_size``) are shared: the target's block table points at
    them and ``page_refs`` counts one more reference each; nothing is
    copied in the pool. The windows are copied: the target's sink holds the
    source's first ``min(tokens, sink_tokens)`` rows, and its ring the rows
    an independent prefill of the same tokens would hold (the recent window
    and the page being filled).

    Each ring row comes from the source's ring while it still holds that
    position (bit for bit), from the source's sink for the first
    ``sink_tokens`` positions, and otherwise (a fork point more than
    ``window_tokens - recent_tokens`` tokens behind the source's end, as far
    as the ring is concerned) decoded from the source's packed page and
    rounded to ``window_dtype``: attention then sees the page's quantized
    values in the target's recent window, and when the target's partial page
    fills it is packed again from those decoded rows (a second rounding of
    its first ``tokens % page_size`` rows). A fork at ``tokens =
    lengths[source]`` (the default) copies the source's windows bit for
    bit: the target then holds exactly what the source holds, and what a
    prefill of the same history followed by the same appends would hold.

    Call it between decode steps: a token written with ``write_token`` and
    not yet committed is not carried over.

    The target inherits the source's ``error_flags`` (except
    ``ERROR_OUT_OF_PAGES``, set only when one of the shared columns is a lost
    page, and ``ERROR_SLOT_REPLACED``) and its ``nonfinite_counts`` and
    ``saturation_counts`` (they describe the whole source history).

    Args:
      cache: the cache.
      source_slot, target_slot: int32 scalars in ``[0, max_sequences)``, an
        active and a free slot (may be traced).
      tokens: int32 scalar in ``[0, lengths[source_slot]]`` (default: every
        committed token of the source; may be traced).
    Returns:
      The new cache (jittable; donate the cache to update it in place).
    Raises:
      IndexError, ValueError, TypeError: as :func:`check_fork_values`, when
        the values are concrete. Under ``jit`` an out-of-range or inactive
        source, or the same slot twice, changes nothing; ``tokens`` beyond
        the source's length is clamped and flags the target
        ``ERROR_INVALID_LENGTH``; an active target is replaced (its pages
        lose a reference) and flagged ``ERROR_SLOT_REPLACED``.
    """
    c = cache.config
    check_fork_values(cache, source_slot, target_slot, tokens)
    source = jnp.asarray(source_slot, jnp.int32)
    target = jnp.asarray(target_slot, jnp.int32)
    in_range = (source >= 0) & (source < c.max_sequences) & (target >= 0) & (target < c.max_sequences)
    src = jnp.clip(source, 0, c.max_sequences - 1)
    tgt = jnp.clip(target, 0, c.max_sequences - 1)
    ok = in_range & (source != target) & cache.active[src]
    target_index = jnp.where(ok, tgt, c.max_sequences)  # out of range: every write dropped
    length = cache.lengths[src]
    requested = length if tokens is None else jnp.asarray(tokens, jnp.int32)
    count = jnp.clip(requested, 0, length)
    replaced = cache.active[tgt]

    # Pages: the target's first count // page_size columns are the source's.
    page_size = c.page_size
    columns = jnp.arange(c.max_pages_per_sequence)
    source_row = cache.block_tables[src]
    shared = columns < count // page_size
    target_row = jnp.where(shared, source_row, -1)
    page_refs = release_pages(cache.page_refs, jnp.where(replaced, cache.block_tables[tgt], -1))
    page_refs = page_refs.at[jnp.where(target_row >= 0, target_row, c.num_pages)].add(1, mode="drop")
    page_refs = jnp.where(ok, page_refs, cache.page_refs)

    inherited = cache.error_flags[src] & ~(ERROR_OUT_OF_PAGES | ERROR_SLOT_REPLACED)
    error = inherited | jnp.where(count != requested, ERROR_INVALID_LENGTH, 0)
    error = error | jnp.where(replaced, ERROR_SLOT_REPLACED, 0)
    error = error | jnp.where(jnp.any(shared & (source_row < 0)), ERROR_OUT_OF_PAGES, 0)

    # Where each of the target's ring rows comes from.
    positions, held = ring_positions(c, count)  # [W]
    source_positions, _ = ring_positions(c, length)
    from_ring = held & (source_positions == positions)
    from_sink = held & ~from_ring & (positions < c.sink_tokens)
    # The source pages that can hold the other rows: the window's span of consecutive pages.
    span = c.window_tokens // page_size + 2
    first_page = jnp.maximum(count - c.window_tokens, 0) // page_size
    page_numbers = first_page + jnp.arange(span)
    page_ids = source_row[jnp.clip(page_numbers, 0, c.max_pages_per_sequence - 1)]
    stored = (page_numbers < length // page_size) & (page_ids >= 0)
    decoded_row = jnp.clip(positions - first_page * page_size, 0, span * page_size - 1)
    sink_row = jnp.clip(positions, 0, max(c.sink_tokens - 1, 0))
    sink_kept = jnp.arange(c.sink_tokens) < count

    def target_ring(ring, sink, decoded):
        """ring [loops, H, W, D], sink [loops, H, SINK, D], decoded [loops, W, H, D] -> [loops, H, W, D]."""
        rows = decoded.transpose(0, 2, 1, 3)
        if c.sink_tokens:
            rows = jnp.where(from_sink[None, None, :, None], sink[:, :, sink_row].astype(rows.dtype), rows)
        rows = jnp.where(from_ring[None, None, :, None], ring.astype(rows.dtype), rows)
        return jnp.where(held[None, None, :, None], rows, jnp.zeros((), rows.dtype))

    new_layers = []
    for layer_index, layer in enumerate(cache.layers):
        tiles = tuple(loop_tiles.take(jnp.maximum(page_ids, 0)) for loop_tiles in layer.loops)
        decoded_k, decoded_v = [], []
        for loop in range(c.num_loops):
            keys, values = unpack_pages(tiles, loop, c.layer(layer_index))  # [span, P, H, D]
            for out, x in ((decoded_k, keys), (decoded_v, values)):
                x = jnp.where(stored[:, None, None, None], x, 0.0).reshape(span * page_size, *x.shape[2:])
                out.append(_stored_values(x[decoded_row], cache.window_dtype)[0].astype(cache.window_dtype))
        ring_k = target_ring(layer.ring_keys[:, src], layer.sink_keys[:, src], jnp.stack(decoded_k))
        ring_v = target_ring(layer.ring_values[:, src], layer.sink_values[:, src], jnp.stack(decoded_v))
        sink_k = jnp.where(sink_kept[None, None, :, None], layer.sink_keys[:, src], 0)
        sink_v = jnp.where(sink_kept[None, None, :, None], layer.sink_values[:, src], 0)
        new_layers.append(dataclasses.replace(
            layer,
            sink_keys=layer.sink_keys.at[:, target_index].set(sink_k.astype(layer.sink_keys.dtype), mode="drop"),
            sink_values=layer.sink_values.at[:, target_index].set(sink_v.astype(layer.sink_values.dtype),
                                                                  mode="drop"),
            ring_keys=layer.ring_keys.at[:, target_index].set(ring_k.astype(layer.ring_keys.dtype), mode="drop"),
            ring_values=layer.ring_values.at[:, target_index].set(ring_v.astype(layer.ring_values.dtype),
                                                                  mode="drop"),
        ))

    def put(array, value):
        return array.at[target_index].set(value, mode="drop")

    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=put(cache.block_tables, target_row),
        lengths=put(cache.lengths, count),
        active=put(cache.active, True),
        page_refs=page_refs,
        error_flags=put(cache.error_flags, error),
        nonfinite_counts=put(cache.nonfinite_counts, cache.nonfinite_counts[src]),
        saturation_counts=put(cache.saturation_counts, cache.saturation_counts[src]),
    )
