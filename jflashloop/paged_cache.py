"""`PagedKVCache`: a paged, cross-loop, 4-bit KV cache (functional, jittable).

Conventions follow vLLM / JAX ``paged_attention``: a pool of ``num_pages``
pages shared by all sequences, a block table ``[max_sequences,
max_pages_per_sequence]`` of page ids (-1 = none) and per-sequence lengths.
Each layer has its own pool arrays addressed by the same page ids.

Where a token lives (``n`` = tokens visible, ``packed = length // page_size``
complete pages):

* ``t < sink_tokens``: the sink window (unquantized, every loop);
* ``t >= min(n - recent_tokens, packed * page_size)``: the ring of recent
  tokens (unquantized, every loop; capacity ``max(recent_tokens, page_size)``,
  indexed ``t % capacity``): the recent window plus the page being filled;
* otherwise: the page pool, as a residual chain (``page_chain``).

A page is packed (quantize-on-write) when its last token is committed; the
tokens of a page that is not yet full stay unquantized, since a channel-axis
K group needs all of its rows.

Decoding a step: :func:`write_token` puts the new token's K/V of one (layer,
loop) into the ring (not yet counted in ``lengths``), attention reads the
``lengths + 1`` visible tokens, and :func:`commit` counts the token for every
active sequence and packs pages that became full. :func:`append` does both for
all layers and loops at once.

Errors that cannot raise under ``jit`` (pool exhausted, block table full) set
bits of ``error_flags`` per sequence; :func:`check` raises them on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .cache_config import CacheConfig
from .page_chain import LoopTiles, pack_pages, unpack_pages
from .paged_stream import empty_stream

ERROR_OUT_OF_PAGES = 1
ERROR_SEQUENCE_FULL = 2
_ERROR_TEXT = {
    ERROR_OUT_OF_PAGES: "the page pool ran out of free pages (a full page was not stored)",
    ERROR_SEQUENCE_FULL: "the sequence exceeded max_pages_per_sequence * page_size tokens",
}


@dataclasses.dataclass(frozen=True)
class LayerPool:
    """One layer's storage.

    Attributes:
      loops: one :class:`~jflashloop.page_chain.LoopTiles` per loop, each with
        ``num_pages`` tiles.
      sink_keys, sink_values: ``window_dtype`` ``[loops, max_sequences, kv_heads, sink_tokens, head_dim]``.
      ring_keys, ring_values: ``window_dtype`` ``[loops, max_sequences, kv_heads, window_tokens, head_dim]``.
    """

    loops: tuple[LoopTiles, ...]
    sink_keys: jax.Array
    sink_values: jax.Array
    ring_keys: jax.Array
    ring_values: jax.Array


jax.tree_util.register_dataclass(
    LayerPool,
    data_fields=["loops", "sink_keys", "sink_values", "ring_keys", "ring_values"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The cache (a pytree; ``config`` is static).

    Attributes:
      layers: one :class:`LayerPool` per layer.
      block_tables: int32 ``[max_sequences, max_pages_per_sequence]``, -1 = no page.
      lengths: int32 ``[max_sequences]``: committed tokens per sequence.
      active: bool ``[max_sequences]``: slots holding a sequence.
      page_free: bool ``[num_pages]``.
      error_flags: int32 ``[max_sequences]``: OR of ``ERROR_*`` bits.
      config: :class:`CacheConfig`.
    """

    layers: tuple[LayerPool, ...]
    block_tables: jax.Array
    lengths: jax.Array
    active: jax.Array
    page_free: jax.Array
    error_flags: jax.Array
    config: CacheConfig = dataclasses.field(metadata={"static": True})

    @property
    def window_dtype(self):
        return jnp.dtype(self.config.window_dtype)


jax.tree_util.register_dataclass(
    PagedKVCache,
    data_fields=["layers", "block_tables", "lengths", "active", "page_free", "error_flags"],
    meta_fields=["config"],
)


def create(config: CacheConfig) -> PagedKVCache:
    """An empty cache: every page free, no sequence active."""
    c = config
    window_dtype = jnp.dtype(c.window_dtype)
    layers = []
    for _ in range(c.num_layers):
        loops = []
        for loop_index, storage in enumerate(c.loops):
            rows = c.rows(loop_index)
            keys = empty_stream(storage.key_spec, c.num_kv_heads, c.num_pages, rows, c.head_dim)
            values = empty_stream(storage.value_spec, c.num_kv_heads, c.num_pages, rows, c.head_dim)
            row_positions = (
                jnp.full((c.num_kv_heads, c.num_pages, rows), -1, jnp.int8) if storage.is_sparse else None
            )
            loops.append(LoopTiles(keys, values, row_positions))
        sink_shape = (c.num_loops, c.max_sequences, c.num_kv_heads, c.sink_tokens, c.head_dim)
        ring_shape = (c.num_loops, c.max_sequences, c.num_kv_heads, c.window_tokens, c.head_dim)
        layers.append(
            LayerPool(
                loops=tuple(loops),
                sink_keys=jnp.zeros(sink_shape, window_dtype),
                sink_values=jnp.zeros(sink_shape, window_dtype),
                ring_keys=jnp.zeros(ring_shape, window_dtype),
                ring_values=jnp.zeros(ring_shape, window_dtype),
            )
        )
    return PagedKVCache(
        layers=tuple(layers),
        block_tables=jnp.full((c.max_sequences, c.max_pages_per_sequence), -1, jnp.int32),
        lengths=jnp.zeros((c.max_sequences,), jnp.int32),
        active=jnp.zeros((c.max_sequences,), bool),
        page_free=jnp.ones((c.num_pages,), bool),
        error_flags=jnp.zeros((c.max_sequences,), jnp.int32),
        config=config,
    )


def _allocate(page_free: jax.Array, wanted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Give each ``wanted`` request (bool ``[n]``) a distinct free page, in order.

    Returns ``(page_ids [n] int32 (num_pages where none), page_free, granted [n] bool)``.
    """
    num_pages = page_free.shape[0]
    free_ids = jnp.nonzero(page_free, size=wanted.shape[0], fill_value=num_pages)[0].astype(jnp.int32)
    rank = jnp.cumsum(wanted.astype(jnp.int32)) - 1
    page_ids = jnp.where(wanted, free_ids[jnp.clip(rank, 0, wanted.shape[0] - 1)], num_pages)
    granted = wanted & (page_ids < num_pages)
    page_ids = jnp.where(granted, page_ids, num_pages)
    page_free = page_free.at[page_ids].set(False, mode="drop")
    return page_ids, page_free, granted


def _ring_slots(config: CacheConfig, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each ring slot, the latest position ``< length`` stored there and whether it exists."""
    capacity = config.window_tokens
    slots = jnp.arange(capacity)
    positions = slots + capacity * jnp.floor_divide(length - 1 - slots, capacity)
    return positions, positions >= 0


def _window_values(x: jax.Array, dtype) -> jax.Array:
    """Round to the window dtype; what the cache stores and packs from, as float32."""
    return x.astype(dtype).astype(jnp.float32)


def prefill(
    cache: PagedKVCache,
    slot: jax.Array | int,
    keys: jax.Array,
    values: jax.Array,
    length: jax.Array | int | None = None,
    *,
    implementation: str | None = None,
) -> PagedKVCache:
    """Write a whole prompt's K/V (every layer and loop) into an empty slot.

    Args:
      cache: the cache.
      slot: int32 scalar, the sequence slot (must be free).
      keys, values: ``[layers, loops, tokens, kv_heads, head_dim]`` (any float
        dtype; rounded to ``window_dtype`` first).
      length: int32 scalar, tokens to keep (default ``tokens``); the rest is
        padding, so prompts of several lengths can share one compiled shape.
    Returns:
      The new cache: full pages packed, the sink and ring windows filled.
    """
    c = cache.config
    expected = (c.num_layers, c.num_loops)
    if keys.shape[:2] != expected or keys.shape[3:] != (c.num_kv_heads, c.head_dim):
        raise ValueError(
            f"keys must be [layers={c.num_layers}, loops={c.num_loops}, tokens, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}], got {tuple(keys.shape)}"
        )
    if values.shape != keys.shape:
        raise ValueError(f"values shape {tuple(values.shape)} must equal keys shape {tuple(keys.shape)}")
    tokens = keys.shape[2]
    length = jnp.asarray(tokens if length is None else length, jnp.int32)
    slot = jnp.asarray(slot, jnp.int32)
    page_size = c.page_size
    keys = _window_values(keys, cache.window_dtype)
    values = _window_values(values, cache.window_dtype)

    # Full pages: allocate and pack.
    max_full = min(tokens // page_size, c.max_pages_per_sequence)
    full_pages = length // page_size
    error = jnp.where(full_pages > c.max_pages_per_sequence, ERROR_SEQUENCE_FULL, 0)
    page_numbers = jnp.arange(max_full, dtype=jnp.int32)
    page_ids, page_free, granted = _allocate(cache.page_free, page_numbers < full_pages)
    error = error | jnp.where(jnp.any((page_numbers < full_pages) & ~granted), ERROR_OUT_OF_PAGES, 0)
    block_row = jnp.full((c.max_pages_per_sequence,), -1, jnp.int32)
    block_row = block_row.at[:max_full].set(jnp.where(granted, page_ids, -1))

    ring_positions, ring_valid = _ring_slots(c, length)
    new_layers = []
    for layer_index, layer in enumerate(cache.layers):
        layer_keys, layer_values = keys[layer_index], values[layer_index]
        loops = layer.loops
        if max_full:
            pages_k = layer_keys[:, : max_full * page_size].reshape(
                c.num_loops, max_full, page_size, c.num_kv_heads, c.head_dim
            )
            pages_v = layer_values[:, : max_full * page_size].reshape(pages_k.shape)
            tiles = pack_pages(pages_k, pages_v, page_numbers, c, implementation)
            loops = tuple(pool.put(page_ids, new) for pool, new in zip(loops, tiles, strict=True))
        # [loops, tokens, H, D] -> [loops, H, tokens, D] for the head-major windows.
        head_major_k = layer_keys.transpose(0, 2, 1, 3).astype(cache.window_dtype)
        head_major_v = layer_values.transpose(0, 2, 1, 3).astype(cache.window_dtype)
        sink_k = layer.sink_keys.at[:, slot].set(head_major_k[:, :, : c.sink_tokens])
        sink_v = layer.sink_values.at[:, slot].set(head_major_v[:, :, : c.sink_tokens])
        gather = jnp.clip(ring_positions, 0, tokens - 1)
        ring_k = jnp.where(ring_valid[None, None, :, None], head_major_k[:, :, gather], 0)
        ring_v = jnp.where(ring_valid[None, None, :, None], head_major_v[:, :, gather], 0)
        new_layers.append(
            LayerPool(
                loops=loops,
                sink_keys=sink_k,
                sink_values=sink_v,
                ring_keys=layer.ring_keys.at[:, slot].set(ring_k),
                ring_values=layer.ring_values.at[:, slot].set(ring_v),
            )
        )
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=cache.block_tables.at[slot].set(block_row),
        lengths=cache.lengths.at[slot].set(jnp.minimum(length, c.max_tokens_per_sequence)),
        active=cache.active.at[slot].set(True),
        page_free=page_free,
        error_flags=cache.error_flags.at[slot].set(error),
    )


def write_token(
    cache: PagedKVCache, layer: int, loop: int, keys: jax.Array, values: jax.Array
) -> PagedKVCache:
    """Put one new token's K/V of (``layer``, ``loop``) into every sequence's ring.

    The token sits at position ``lengths[b]`` and is visible to attention with
    ``include_pending=True``; :func:`commit` counts it.

    Args:
      layer, loop: 0-based Python ints.
      keys, values: ``[max_sequences, kv_heads, head_dim]``.
    """
    c = cache.config
    expected = (c.max_sequences, c.num_kv_heads, c.head_dim)
    if keys.shape != expected or values.shape != expected:
        raise ValueError(f"keys and values must be {expected}, got {tuple(keys.shape)} and {tuple(values.shape)}")
    pool = cache.layers[layer]
    ring_slot = cache.lengths % c.window_tokens
    sequences = jnp.arange(c.max_sequences)
    ring_k = pool.ring_keys.at[loop, sequences, :, ring_slot].set(keys.astype(cache.window_dtype))
    ring_v = pool.ring_values.at[loop, sequences, :, ring_slot].set(values.astype(cache.window_dtype))
    sink_k, sink_v = pool.sink_keys, pool.sink_values
    if c.sink_tokens:
        in_sink = cache.lengths < c.sink_tokens
        sink_slot = jnp.where(in_sink, cache.lengths, c.sink_tokens)  # out of range: dropped
        sink_k = sink_k.at[loop, sequences, :, sink_slot].set(keys.astype(cache.window_dtype), mode="drop")
        sink_v = sink_v.at[loop, sequences, :, sink_slot].set(values.astype(cache.window_dtype), mode="drop")
    layers = list(cache.layers)
    layers[layer] = dataclasses.replace(
        pool, ring_keys=ring_k, ring_values=ring_v, sink_keys=sink_k, sink_values=sink_v
    )
    return dataclasses.replace(cache, layers=tuple(layers))


def _pack_completed_pages(cache: PagedKVCache, completes: jax.Array, implementation) -> PagedKVCache:
    """Pack, for each sequence with ``completes[b]``, its page ending at ``lengths[b]``."""
    c = cache.config
    page_size, capacity = c.page_size, c.window_tokens
    page_number = cache.lengths // page_size - 1  # the page that just became full
    wanted = completes & (page_number < c.max_pages_per_sequence)
    page_ids, page_free, granted = _allocate(cache.page_free, wanted)
    errors = jnp.where(wanted & ~granted, ERROR_OUT_OF_PAGES, 0)
    errors = errors | jnp.where(completes & ~wanted, ERROR_SEQUENCE_FULL, 0)
    positions = page_number[:, None] * page_size + jnp.arange(page_size)[None, :]  # [B, P]
    ring_index = (positions % capacity)[None, :, None, :, None]

    def page_rows(ring):  # ring [loops, B, H, W, D] -> page rows [loops, B, P, H, D]
        rows = jnp.take_along_axis(ring, ring_index, axis=3)
        return rows.transpose(0, 1, 3, 2, 4).astype(jnp.float32)

    new_layers = []
    for layer in cache.layers:
        pages_k, pages_v = page_rows(layer.ring_keys), page_rows(layer.ring_values)
        tiles = pack_pages(pages_k, pages_v, jnp.maximum(page_number, 0), c, implementation)
        loops = tuple(pool.put(page_ids, new) for pool, new in zip(layer.loops, tiles, strict=True))
        new_layers.append(dataclasses.replace(layer, loops=loops))
    rows = jnp.arange(c.max_sequences)
    column = jnp.where(granted, page_number, c.max_pages_per_sequence)  # out of range: dropped
    block_tables = cache.block_tables.at[rows, column].set(page_ids, mode="drop")
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=block_tables,
        page_free=page_free,
        error_flags=cache.error_flags | errors,
    )


def commit(cache: PagedKVCache, *, implementation: str | None = None) -> PagedKVCache:
    """Count the pending token of every active sequence; pack pages that filled."""
    c = cache.config
    lengths = cache.lengths + cache.active.astype(jnp.int32)
    at_capacity = cache.active & (cache.lengths >= c.max_tokens_per_sequence)
    lengths = jnp.where(at_capacity, cache.lengths, lengths)
    cache = dataclasses.replace(
        cache,
        lengths=lengths,
        error_flags=cache.error_flags | jnp.where(at_capacity, ERROR_SEQUENCE_FULL, 0),
    )
    completes = cache.active & ~at_capacity & (lengths % c.page_size == 0)
    return jax.lax.cond(
        jnp.any(completes),
        lambda cache: _pack_completed_pages(cache, completes, implementation),
        lambda cache: cache,
        cache,
    )


def append(
    cache: PagedKVCache, keys: jax.Array, values: jax.Array, *, implementation: str | None = None
) -> PagedKVCache:
    """Append one decode token to every active sequence (all layers and loops).

    Args:
      keys, values: ``[layers, loops, max_sequences, kv_heads, head_dim]``.
    Returns:
      The new cache (use ``jax.jit(append, donate_argnums=0)`` to update in place).
    """
    c = cache.config
    expected = (c.num_layers, c.num_loops, c.max_sequences, c.num_kv_heads, c.head_dim)
    if keys.shape != expected or values.shape != expected:
        raise ValueError(f"keys and values must be {expected}, got {tuple(keys.shape)} and {tuple(values.shape)}")
    for layer in range(c.num_layers):
        for loop in range(c.num_loops):
            cache = write_token(cache, layer, loop, keys[layer, loop], values[layer, loop])
    return commit(cache, implementation=implementation)


def free(cache: PagedKVCache, slot: jax.Array | int) -> PagedKVCache:
    """Release a sequence: its pages return to the pool and the slot empties."""
    c = cache.config
    row = cache.block_tables[slot]
    page_free = cache.page_free.at[jnp.where(row >= 0, row, c.num_pages)].set(True, mode="drop")
    return dataclasses.replace(
        cache,
        block_tables=cache.block_tables.at[slot].set(-1),
        lengths=cache.lengths.at[slot].set(0),
        active=cache.active.at[slot].set(False),
        page_free=page_free,
        error_flags=cache.error_flags.at[slot].set(0),
    )


def window_mask(
    config: CacheConfig, length: jax.Array, visible: jax.Array, positions: int
) -> dict[str, jax.Array]:
    """Where each position ``t < positions`` is read from, for one sequence.

    Args:
      length: committed tokens (decides how many pages are packed).
      visible: tokens attention sees (``length`` or ``length + 1``).
      positions: static number of positions to describe.
    Returns:
      bool ``[positions]`` masks ``sink``, ``ring``, ``pages`` (disjoint,
      their union is ``t < visible``).
    """
    t = jnp.arange(positions)
    inside = t < visible
    sink = inside & (t < config.sink_tokens)
    packed_end = (length // config.page_size) * config.page_size
    window_start = jnp.minimum(visible - config.recent_tokens, packed_end)
    ring = inside & ~sink & (t >= window_start)
    pages = inside & ~sink & ~ring
    return {"sink": sink, "ring": ring, "pages": pages}


def reconstruct(
    cache: PagedKVCache, layer: int, loop: int, slot: jax.Array | int, *, include_pending: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference decode of one sequence's loop-``loop`` K/V to dense float32.

    Args:
      layer, loop: 0-based Python ints.
      slot: the sequence slot.
      include_pending: also show the token written by :func:`write_token` and
        not yet committed.
    Returns:
      ``(keys, values, visible)``: float32 ``[positions, kv_heads, head_dim]``
      with ``positions = max_tokens + include_pending`` (zero beyond
      ``visible``) and the int32 number of visible tokens.
    """
    c = cache.config
    pool = cache.layers[layer]
    length = cache.lengths[slot]
    visible = length + (1 if include_pending else 0)
    pages = jnp.maximum(cache.block_tables[slot], 0)
    tiles = tuple(loop_tiles.take(pages) for loop_tiles in pool.loops)
    page_keys, page_values = unpack_pages(tiles, loop)
    positions = c.max_tokens_per_sequence + int(include_pending)
    shape = (c.max_tokens_per_sequence, c.num_kv_heads, c.head_dim)
    page_keys, page_values = page_keys.reshape(shape), page_values.reshape(shape)
    if include_pending:  # room for a pending token of a full sequence
        page_keys = jnp.pad(page_keys, ((0, 1), (0, 0), (0, 0)))
        page_values = jnp.pad(page_values, ((0, 1), (0, 0), (0, 0)))
    shape = (positions, c.num_kv_heads, c.head_dim)
    masks = window_mask(c, length, visible, positions)
    t = jnp.arange(positions)
    ring_k = pool.ring_keys[loop, slot][:, t % c.window_tokens].transpose(1, 0, 2).astype(jnp.float32)
    ring_v = pool.ring_values[loop, slot][:, t % c.window_tokens].transpose(1, 0, 2).astype(jnp.float32)
    sink_index = jnp.minimum(t, max(c.sink_tokens - 1, 0))
    if c.sink_tokens:
        sink_k = pool.sink_keys[loop, slot][:, sink_index].transpose(1, 0, 2).astype(jnp.float32)
        sink_v = pool.sink_values[loop, slot][:, sink_index].transpose(1, 0, 2).astype(jnp.float32)
    else:
        sink_k = sink_v = jnp.zeros(shape, jnp.float32)

    def combine(sink, ring, paged):
        out = jnp.where(masks["pages"][:, None, None], paged, 0.0)
        out = jnp.where(masks["ring"][:, None, None], ring, out)
        return jnp.where(masks["sink"][:, None, None], sink, out)

    return combine(sink_k, ring_k, page_keys), combine(sink_v, ring_v, page_values), visible


def check(cache: PagedKVCache) -> None:
    """Raise ``RuntimeError`` on the host if any sequence has an error flag set."""
    flags = np.asarray(cache.error_flags)
    messages = []
    for slot in np.flatnonzero(flags):
        reasons = [text for bit, text in _ERROR_TEXT.items() if flags[slot] & bit]
        messages.append(f"sequence slot {slot}: " + "; ".join(reasons))
    if messages:
        raise RuntimeError("PagedKVCache errors: " + " | ".join(messages))
