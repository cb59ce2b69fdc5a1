"""Where each token of a sequence is read from: the one definition of the token regions.

With ``n`` visible tokens (:func:`visible_tokens`), ``length`` committed
tokens and ``stored`` leading block-table entries that hold a page
(:func:`stored_pages`), a position ``t < n`` is read from

* the **sink** window when ``t < sink_tokens`` (unquantized, every loop);
* the **pages** when ``sink_tokens <= t < pages_end``, with
  ``pages_end = max(0, min(n - recent_tokens, min(length // page_size, stored) * page_size))``
  (packed 4-bit tiles of every loop, a residual chain);
* the **ring** when ``t >= ring_start = max(pages_end, n - window_tokens)``
  (unquantized; the recent window plus the page still being filled; the
  ring holds position ``t`` in slot ``t % window_tokens``, :func:`ring_slot`).

The regions are disjoint. Their union is every ``t < n`` unless a page was
lost (its block-table entry is -1): pages are read only up to the first
lost page, and of the positions after it only those still in the ring (the
latest ``window_tokens``) are read; the others are lost. The cache stores
no page after a lost one (a sequence's pages are a prefix of its
block-table row), so a kernel may also stop at any -1 entry it meets.

:func:`regions` computes these bounds, and every JAX computation of them
uses it: :func:`~jflashloop.paged_cache.reconstruct` and the reference
attention through :func:`Regions.masks`, the fused kernels through the
``bounds`` they receive (``[n, pages_end]`` per sequence,
``jflashloop.ops._decode_attention.kernel_inputs``), prefill through
:func:`ring_positions`. The kernels' own loops and the numpy oracle
(``jflashloop_reference.paged_cache``) restate them independently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ._config import CacheConfig
from ._layout import PagedKVCache


def visible_tokens(cache: PagedKVCache, *, include_pending: bool = False) -> jax.Array:
    """int32 ``[max_sequences]``: the tokens attention sees in each slot.

    ``lengths``, plus the pending token written by :func:`~jflashloop.paged_cache.write_token`
    with ``include_pending``, at most ``max_tokens_per_sequence`` (a full
    sequence's token is dropped, not stored), and 0 for an inactive slot
    (whatever ``include_pending`` says).
    """
    visible = jnp.minimum(cache.lengths + int(include_pending), cache.config.max_tokens_per_sequence)
    return jnp.where(cache.active, visible, 0).astype(jnp.int32)


def stored_pages(cache: PagedKVCache) -> jax.Array:
    """int32 ``[max_sequences]``: leading block-table entries of each slot that hold a page.

    A page that could not be stored (``ERROR_OUT_OF_PAGES``) has entry -1,
    and so has every later page of the sequence; reading a sequence's pages
    stops at its first such entry, so a page of another sequence is never
    read in its place.
    """
    width = cache.block_tables.shape[1]
    columns = jnp.arange(width, dtype=jnp.int32)
    # The first -1 column (one row reduction; a cumulative product is a slow scan on GPUs).
    return jnp.min(jnp.where(cache.block_tables < 0, columns, width), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Regions:
    """The token regions of one sequence, or of every sequence (elementwise).

    Attributes:
      visible: int32: ``n``, the positions ``t < n`` attention sees.
      pages_end: int32 ``>= 0``: positions ``sink_tokens <= t < pages_end``
        are read from packed pages (also the end of the page region the
        fused kernels read: block-table columns below ``ceil(pages_end / page_size)``).
      ring_start: int32: positions ``t >= ring_start`` (and ``>= sink_tokens``,
        ``< visible``) are read from the ring.
      sink_tokens: static: the sink window's length.
    """

    visible: jax.Array
    pages_end: jax.Array
    ring_start: jax.Array
    sink_tokens: int

    def masks(self, positions: int) -> dict[str, jax.Array]:
        """bool ``[positions]`` masks ``"sink"``, ``"ring"`` and ``"pages"`` of one sequence (``t < positions``)."""
        t = jnp.arange(positions)
        inside = t < self.visible
        sink = inside & (t < self.sink_tokens)
        ring = inside & ~sink & (t >= self.ring_start)
        pages = inside & ~sink & (t < self.pages_end)
        return {"sink": sink, "ring": ring, "pages": pages}


def regions(
    config: CacheConfig, length: jax.Array, visible: jax.Array, stored: jax.Array | None = None
) -> Regions:
    """The :class:`Regions` of sequences with ``length`` committed and ``visible`` visible tokens.

    Args:
      length: int32 (any shape): committed tokens (decides how many pages are packed).
      visible: int32, same shape: tokens attention sees (:func:`visible_tokens`).
      stored: int32, same shape: :func:`stored_pages` (default: every full page was stored).
    """
    pages = length // config.page_size
    if stored is not None:
        pages = jnp.minimum(pages, stored)
    pages_end = jnp.maximum(jnp.minimum(visible - config.recent_tokens, pages * config.page_size), 0)
    ring_start = jnp.maximum(pages_end, visible - config.window_tokens)  # the ring holds no older position
    return Regions(visible=visible, pages_end=pages_end, ring_start=ring_start, sink_tokens=config.sink_tokens)


def window_mask(
    config: CacheConfig, length: jax.Array, visible: jax.Array, positions: int, *,
    stored: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """``regions(config, length, visible, stored).masks(positions)``, for one sequence.

    Returns:
      bool ``[positions]`` masks ``sink``, ``ring``, ``pages`` (see the module docstring).
    """
    return regions(config, length, visible, stored).masks(positions)


def ring_slot(config: CacheConfig, position: jax.Array) -> jax.Array:
    """The ring slot that holds ``position`` (int32, elementwise): ``position % window_tokens``."""
    return position % config.window_tokens


def ring_positions(config: CacheConfig, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each ring slot, the latest position ``< length`` it holds, and whether one exists.

    Returns:
      ``(positions, held)``: int32 and bool ``[window_tokens]``.
    """
    capacity = config.window_tokens
    slots = jnp.arange(capacity)
    positions = slots + capacity * jnp.floor_divide(length - 1 - slots, capacity)
    return positions, positions >= 0
