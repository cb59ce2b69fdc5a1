"""The cache's state machine: create, prefill, write_token + commit, append, free.

Every operation is functional and jittable with static shapes. Bad input
raises eagerly where it can be known (static shapes and dtypes always;
slots, lengths and free pages when they are concrete); what cannot raise
under ``jit`` sets ``error_flags`` bits (``jflashloop.cache._layout``) and
per-sequence counters. A page is packed (quantize-on-write,
``jflashloop.cache._pages``) when its last token is committed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._validation import (
    check_index,
    check_integer_scalar,
    check_static_index,
    concrete_int,
    is_concrete,
)
from ..codecs._floats import cast_saturating, flush_subnormals
from ._config import CacheConfig
from ._layout import (
    ERROR_INVALID_LENGTH,
    ERROR_NONFINITE_INPUT,
    ERROR_OUT_OF_PAGES,
    ERROR_SATURATED,
    ERROR_SEQUENCE_FULL,
    ERROR_SLOT_REPLACED,
    LayerPool,
    LoopTiles,
    PagedKVCache,
)
from ._pages import NO_TILES, empty_stream, pack_pages_with_saturations, tile_saturations
from ._regions import ring_positions, ring_slot


def create(config: CacheConfig) -> PagedKVCache:
    """An empty cache: every page free, no sequence active."""
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
    c = config
    window_dtype = jnp.dtype(c.window_dtype)
    layers = []
    for layer_index in range(c.num_layers):
        loops = []
        layer_config = c.layer(layer_index)  # that layer's loop policy
        for loop_index, storage in enumerate(layer_config.loops):
            rows = layer_config.rows(loop_index)
            if rows == 0:
                loops.append(NO_TILES)
                continue
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
        page_refs=jnp.zeros((c.num_pages,), jnp.int32),
        error_flags=jnp.zeros((c.max_sequences,), jnp.int32),
        nonfinite_counts=jnp.zeros((c.max_sequences,), jnp.int32),
        saturation_counts=jnp.zeros((c.max_sequences,), jnp.int32),
        config=config,
    )


def _allocate(page_refs: jax.Array, wanted: jax.Array, rank: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Give each ``wanted`` request (bool ``[n]``) a distinct free page, the lowest free ids first.

    Requests are served in index order, or in the order of ``rank`` (int32
    ``[n]``: each wanted request's 0-based place among the wanted ones).
    Returns ``(page_ids [n] int32 (num_pages where none), page_refs (1 for
    the granted pages), granted [n] bool)``.
    """
    num_pages = page_refs.shape[0]
    free_ids = jnp.nonzero(page_refs == 0, size=wanted.shape[0], fill_value=num_pages)[0].astype(jnp.int32)
    if rank is None:
        rank = jnp.cumsum(wanted.astype(jnp.int32)) - 1
    page_ids = jnp.where(wanted, free_ids[jnp.clip(rank, 0, wanted.shape[0] - 1)], num_pages)
    granted = wanted & (page_ids < num_pages)
    page_ids = jnp.where(granted, page_ids, num_pages)
    page_refs = page_refs.at[page_ids].set(1, mode="drop")
    return page_ids, page_refs, granted


def release_pages(page_refs: jax.Array, row: jax.Array) -> jax.Array:
    """``page_refs`` with one reference fewer for each page of block-table ``row`` (int32, -1 = none)."""
    return page_refs.at[jnp.where(row >= 0, row, page_refs.shape[0])].add(-1, mode="drop")


def _window_rows(head_major: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Rows ``positions`` of ``head_major`` ``[loops, H, tokens, D]``, zero where not ``valid``.

    Returns ``[loops, H, len(positions), D]``; positions beyond the prompt
    (fewer tokens than the window) are never gathered.
    """
    rows = head_major[:, :, jnp.clip(positions, 0, head_major.shape[2] - 1)]
    return jnp.where(valid[None, None, :, None], rows, jnp.zeros((), rows.dtype))


def _stored_values(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the cache stores (and packs from) for input K/V ``x``, as float32.

    Values are rounded to the window ``dtype``; NaN and +-inf become 0,
    finite values beyond the window dtype's range become its largest finite
    value of the same sign, and float32 subnormals become zeros of their sign
    (as the codecs read them).

    Returns:
      ``(values, nonfinite, overflow)``: float32 values and two bool masks,
      all of ``x``'s shape.
    """
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    rounded, overflow = cast_saturating(x, dtype)
    rounded = jnp.where(finite, rounded, jnp.zeros((), dtype))
    return flush_subnormals(rounded.astype(jnp.float32)), ~finite, overflow


def _count_per_sequence(mask: jax.Array, sequence_axis: int) -> jax.Array:
    """int32 ``[sequences]``: True elements of ``mask`` per index of ``sequence_axis``."""
    axes = tuple(axis for axis in range(mask.ndim) if axis != sequence_axis % mask.ndim)
    return jnp.sum(mask, axis=axes, dtype=jnp.int32)


def _check_kv(name: str, x, expected: tuple[int, ...], layout: str) -> None:
    """An array (not a nested list) whose shape is ``expected`` (``None`` entries are free), of a float dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
    shape = tuple(x.shape)
    if len(shape) != len(expected) or any(e is not None and e != g for e, g in zip(expected, shape, strict=True)):
        raise ValueError(f"{name} must be {layout}, got shape {shape}")
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, float16), got {dtype}")


def check_kv_pair(keys, values, expected: tuple[int | None, ...], layout: str) -> None:
    """:func:`_check_kv` of both, and equal shapes."""
    _check_kv("keys", keys, expected, layout)
    _check_kv("values", values, expected, layout)
    if tuple(values.shape) != tuple(keys.shape):
        raise ValueError(f"values shape {tuple(values.shape)} must equal keys shape {tuple(keys.shape)}")


def check_prefill_arrays(cache: PagedKVCache, keys, values) -> None:
    """``prefill``'s checks of ``keys`` and ``values`` (static: shapes and dtypes).

    Both must be arrays ``[layers, loops, tokens, kv_heads, head_dim]`` of
    the cache's shape, of a float dtype, of equal shapes, with ``tokens >= 1``.
    """
    c = cache.config
    layout = (f"[layers={c.num_layers}, loops={c.num_loops}, tokens, "
              f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]")
    check_kv_pair(keys, values, (c.num_layers, c.num_loops, None, c.num_kv_heads, c.head_dim), layout)
    if keys.shape[2] == 0:
        raise ValueError("keys must hold at least one token (pass length=0 with padding for an empty prompt)")


def check_append_arrays(cache: PagedKVCache, keys, values) -> None:
    """``append``'s checks of ``keys`` and ``values``: arrays
    ``[layers, loops, max_sequences, kv_heads, head_dim]`` of a float dtype."""
    c = cache.config
    expected = (c.num_layers, c.num_loops, c.max_sequences, c.num_kv_heads, c.head_dim)
    layout = (f"[layers={c.num_layers}, loops={c.num_loops}, max_sequences={c.max_sequences}, "
              f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]")
    _check_kv("keys", keys, expected, layout)
    _check_kv("values", values, expected, layout)


def check_prefill_values(cache: PagedKVCache, slot, tokens: int, length) -> None:
    """Eager checks of ``prefill``'s slot, length and free pages (each when concrete).

    ``prefill`` runs them itself; call them before a jitted ``prefill`` to get
    the same errors (inside ``jit`` the values are tracers and are not checked).
    """
    c = cache.config
    check_index("slot", slot, c.max_sequences)
    check_integer_scalar("length", length)
    slot_value, length_value = concrete_int(slot), concrete_int(length)
    if length_value is not None:
        if not 0 <= length_value <= tokens:
            raise ValueError(f"length must be in [0, tokens={tokens}], got {length_value}")
        if length_value > c.max_tokens_per_sequence:
            raise ValueError(
                f"length {length_value} exceeds the sequence capacity max_pages_per_sequence * "
                f"page_size = {c.max_pages_per_sequence} * {c.page_size} = {c.max_tokens_per_sequence}"
            )
    if slot_value is None or not (is_concrete(cache.active) and is_concrete(cache.page_refs)):
        return
    if bool(cache.active[slot_value]):
        raise ValueError(
            f"slot {slot_value} is already active (it holds {int(cache.lengths[slot_value])} tokens); "
            "free it first (paged_cache.free)"
        )
    if length_value is not None:
        needed = length_value // c.page_size
        available = int(np.asarray(cache.page_free).sum())
        if needed > available:
            raise ValueError(
                f"prefill of {length_value} tokens needs {needed} free pages, the pool has {available} "
                f"(num_pages={c.num_pages})"
            )


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
      slot: int32 scalar in ``[0, max_sequences)``, the sequence slot (must be free).
      keys, values: ``[layers, loops, tokens, kv_heads, head_dim]`` (a float
        dtype; rounded to ``window_dtype`` first).
      length: int32 scalar in ``[0, min(tokens, max_tokens_per_sequence)]``,
        tokens to keep (default ``tokens``); the rest is padding, so prompts
        of several lengths can share one compiled shape.
    Returns:
      The new cache: full pages packed, the sink and ring windows filled.
    Raises:
      ValueError, TypeError, IndexError: on wrong shapes or dtypes, and, when
        the values are concrete (outside ``jit``), on a slot out of range or
        already active, a length out of range or beyond capacity, or too few
        free pages. Under ``jit`` these set ``error_flags`` instead (see the
        module docstring); non-finite K/V are stored as 0 and counted.
    """
    c = cache.config
    check_prefill_arrays(cache, keys, values)
    tokens = keys.shape[2]
    if length is None:
        length = tokens
    check_prefill_values(cache, slot, tokens, length)
    requested = jnp.asarray(length, jnp.int32)
    slot = jnp.asarray(slot, jnp.int32)
    page_size = c.page_size
    slot_ok = (slot >= 0) & (slot < c.max_sequences)
    slot_index = jnp.where(slot_ok, slot, c.max_sequences)  # out of range: every write dropped
    length = jnp.clip(requested, 0, tokens)
    error = jnp.where(length != requested, ERROR_INVALID_LENGTH, 0)
    error = error | jnp.where(length > c.max_tokens_per_sequence, ERROR_SEQUENCE_FULL, 0)
    length = jnp.minimum(length, c.max_tokens_per_sequence)
    keys, nonfinite_k, overflow_k = _stored_values(keys, cache.window_dtype)
    values, nonfinite_v, overflow_v = _stored_values(values, cache.window_dtype)
    kept = (jnp.arange(tokens) < length)[None, None, :, None, None]
    nonfinite = jnp.sum(nonfinite_k & kept, dtype=jnp.int32) + jnp.sum(nonfinite_v & kept, dtype=jnp.int32)
    saturated = jnp.sum(overflow_k & kept, dtype=jnp.int32) + jnp.sum(overflow_v & kept, dtype=jnp.int32)

    # A sequence still in the slot is replaced: its pages go back to the pool first.
    old_row = cache.block_tables[jnp.clip(slot, 0, c.max_sequences - 1)]
    replaced = slot_ok & cache.active[jnp.clip(slot, 0, c.max_sequences - 1)]
    error = error | jnp.where(replaced, ERROR_SLOT_REPLACED, 0)
    page_refs = release_pages(cache.page_refs, jnp.where(replaced, old_row, -1))

    # Full pages: allocate and pack.
    max_full = min(tokens // page_size, c.max_pages_per_sequence)
    full_pages = length // page_size
    page_numbers = jnp.arange(max_full, dtype=jnp.int32)
    wanted = (page_numbers < full_pages) & slot_ok
    page_ids, page_refs, granted = _allocate(page_refs, wanted)
    error = error | jnp.where(jnp.any(wanted & ~granted), ERROR_OUT_OF_PAGES, 0)
    block_row = jnp.full((c.max_pages_per_sequence,), -1, jnp.int32)
    block_row = block_row.at[:max_full].set(jnp.where(granted, page_ids, -1))

    ring_tokens, ring_held = ring_positions(c, length)
    sink_positions = jnp.arange(c.sink_tokens)
    new_layers = []
    for layer_index, layer in enumerate(cache.layers):
        layer_keys, layer_values = keys[layer_index], values[layer_index]
        loops = layer.loops
        if max_full:
            pages_k = layer_keys[:, : max_full * page_size].reshape(
                c.num_loops, max_full, page_size, c.num_kv_heads, c.head_dim
            )
            pages_v = layer_values[:, : max_full * page_size].reshape(pages_k.shape)
            tiles, unseen = pack_pages_with_saturations(pages_k, pages_v, page_numbers, c.layer(layer_index),
                                                        implementation)
            saturated = saturated + jnp.sum(jnp.where(granted, tile_saturations(tiles) + unseen, 0))
            loops = tuple(pool.put(page_ids, new) for pool, new in zip(loops, tiles, strict=True))
        # [loops, tokens, H, D] -> [loops, H, tokens, D] for the head-major windows.
        head_major_k = layer_keys.transpose(0, 2, 1, 3).astype(cache.window_dtype)
        head_major_v = layer_values.transpose(0, 2, 1, 3).astype(cache.window_dtype)

        def windows(stored, head_major, positions, valid):
            return stored.at[:, slot_index].set(_window_rows(head_major, positions, valid), mode="drop")

        new_layers.append(
            LayerPool(
                loops=loops,
                sink_keys=windows(layer.sink_keys, head_major_k, sink_positions, sink_positions < length),
                sink_values=windows(layer.sink_values, head_major_v, sink_positions, sink_positions < length),
                ring_keys=windows(layer.ring_keys, head_major_k, ring_tokens, ring_held),
                ring_values=windows(layer.ring_values, head_major_v, ring_tokens, ring_held),
            )
        )
    error = error | jnp.where(nonfinite > 0, ERROR_NONFINITE_INPUT, 0)
    error = error | jnp.where(saturated > 0, ERROR_SATURATED, 0)
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=cache.block_tables.at[slot_index].set(block_row, mode="drop"),
        lengths=cache.lengths.at[slot_index].set(length, mode="drop"),
        active=cache.active.at[slot_index].set(True, mode="drop"),
        page_refs=page_refs,
        error_flags=cache.error_flags.at[slot_index].set(error, mode="drop"),
        nonfinite_counts=cache.nonfinite_counts.at[slot_index].set(nonfinite, mode="drop"),
        saturation_counts=cache.saturation_counts.at[slot_index].set(saturated, mode="drop"),
    )


def write_token(
    cache: PagedKVCache, layer: int, loop: int, keys: jax.Array, values: jax.Array
) -> PagedKVCache:
    """Put one new token's K/V of (``layer``, ``loop``) into every sequence's ring.

    The token sits at position ``lengths[b]`` and is visible to attention with
    ``include_pending=True``; :func:`commit` counts it.

    Args:
      layer, loop: 0-based Python ints.
      keys, values: ``[max_sequences, kv_heads, head_dim]`` (a float dtype).
        Entries of inactive slots, and of sequences already holding
        ``max_tokens_per_sequence`` tokens (the token is dropped; :func:`commit`
        flags ``ERROR_SEQUENCE_FULL``), are neither stored nor counted: the
        cache stays bit-identical for those slots.

    NaN/+-inf entries of the stored tokens are stored as 0, counted in
    ``nonfinite_counts`` and flagged ``ERROR_NONFINITE_INPUT``; values beyond
    the window dtype's range are stored as its largest finite value and
    counted in ``saturation_counts`` (``ERROR_SATURATED``).
    """
    c = cache.config
    check_static_index("layer", layer, c.num_layers)
    check_static_index("loop", loop, c.num_loops)
    layout = f"[max_sequences={c.max_sequences}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]"
    expected = (c.max_sequences, c.num_kv_heads, c.head_dim)
    _check_kv("keys", keys, expected, layout)
    _check_kv("values", values, expected, layout)
    keys, nonfinite_k, overflow_k = _stored_values(keys, cache.window_dtype)
    values, nonfinite_v, overflow_v = _stored_values(values, cache.window_dtype)
    keys, values = keys.astype(cache.window_dtype), values.astype(cache.window_dtype)
    stored = cache.active & (cache.lengths < c.max_tokens_per_sequence)
    nonfinite = jnp.where(
        stored, _count_per_sequence(nonfinite_k, 0) + _count_per_sequence(nonfinite_v, 0), 0
    )
    saturated = jnp.where(
        stored, _count_per_sequence(overflow_k, 0) + _count_per_sequence(overflow_v, 0), 0
    )
    pool = cache.layers[layer]
    ring_slot_index = jnp.where(stored, ring_slot(c, cache.lengths), c.window_tokens)  # out of range: dropped
    sequences = jnp.arange(c.max_sequences)
    ring_k = pool.ring_keys.at[loop, sequences, :, ring_slot_index].set(keys, mode="drop")
    ring_v = pool.ring_values.at[loop, sequences, :, ring_slot_index].set(values, mode="drop")
    sink_k, sink_v = pool.sink_keys, pool.sink_values
    if c.sink_tokens:
        in_sink = stored & (cache.lengths < c.sink_tokens)
        sink_slot = jnp.where(in_sink, cache.lengths, c.sink_tokens)  # out of range: dropped
        sink_k = sink_k.at[loop, sequences, :, sink_slot].set(keys, mode="drop")
        sink_v = sink_v.at[loop, sequences, :, sink_slot].set(values, mode="drop")
    layers = list(cache.layers)
    layers[layer] = dataclasses.replace(
        pool, ring_keys=ring_k, ring_values=ring_v, sink_keys=sink_k, sink_values=sink_v
    )
    flags = jnp.where(nonfinite > 0, ERROR_NONFINITE_INPUT, 0) | jnp.where(saturated > 0, ERROR_SATURATED, 0)
    return dataclasses.replace(
        cache,
        layers=tuple(layers),
        error_flags=cache.error_flags | flags,
        nonfinite_counts=cache.nonfinite_counts + nonfinite,
        saturation_counts=cache.saturation_counts + saturated,
    )


def _pack_completed_pages(cache: PagedKVCache, completes: jax.Array, implementation) -> PagedKVCache:
    """Pack, for each sequence with ``completes[b]``, its page ending at ``lengths[b]``."""
    c = cache.config
    page_size = c.page_size
    page_number = cache.lengths // page_size - 1  # the page that just became full
    rows = jnp.arange(c.max_sequences)
    # No page is stored after a lost one (it would never be read): a sequence's pages are a prefix of its row.
    previous = cache.block_tables[rows, jnp.clip(page_number - 1, 0, c.max_pages_per_sequence - 1)]
    after_lost = (page_number > 0) & (previous < 0)
    storable = completes & (page_number < c.max_pages_per_sequence)
    wanted = storable & ~after_lost
    page_ids, page_refs, granted = _allocate(cache.page_refs, wanted)
    errors = jnp.where(storable & ~granted, ERROR_OUT_OF_PAGES, 0)
    errors = errors | jnp.where(completes & ~storable, ERROR_SEQUENCE_FULL, 0)
    positions = page_number[:, None] * page_size + jnp.arange(page_size)[None, :]  # [B, P]
    ring_index = ring_slot(c, positions)[None, :, None, :, None]

    def page_rows(ring):  # ring [loops, B, H, W, D] -> page rows [loops, B, P, H, D]
        rows = jnp.take_along_axis(ring, ring_index, axis=3)
        return rows.transpose(0, 1, 3, 2, 4).astype(jnp.float32)

    new_layers = []
    saturated = jnp.zeros((c.max_sequences,), jnp.int32)
    for layer_index, layer in enumerate(cache.layers):
        pages_k, pages_v = page_rows(layer.ring_keys), page_rows(layer.ring_values)
        tiles, unseen = pack_pages_with_saturations(pages_k, pages_v, jnp.maximum(page_number, 0),
                                                    c.layer(layer_index), implementation)
        saturated = saturated + jnp.where(granted, tile_saturations(tiles) + unseen, 0)
        loops = tuple(pool.put(page_ids, new) for pool, new in zip(layer.loops, tiles, strict=True))
        new_layers.append(dataclasses.replace(layer, loops=loops))
    errors = errors | jnp.where(saturated > 0, ERROR_SATURATED, 0)
    column = jnp.where(granted, page_number, c.max_pages_per_sequence)  # out of range: dropped
    block_tables = cache.block_tables.at[rows, column].set(page_ids, mode="drop")
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=block_tables,
        page_refs=page_refs,
        error_flags=cache.error_flags | errors,
        saturation_counts=cache.saturation_counts + saturated,
    )


def commit(cache: PagedKVCache, *, implementation: str | None = None) -> PagedKVCache:
    """Count the pending token of every active sequence; pack pages that filled.

    Under ``jit``, commit before anything in the same computation reads the
    page pools (a decode step commits the previous step's token first, then
    writes and attends: :mod:`jflashloop.models.serving_loop`). The packing
    runs in a conditional that rewrites the pools; where an attention of the
    same computation read them before it, XLA copies every pool to keep that
    read intact (a whole-pool copy per step).
    """
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
    check_append_arrays(cache, keys, values)
    for layer in range(c.num_layers):
        for loop in range(c.num_loops):
            cache = write_token(cache, layer, loop, keys[layer, loop], values[layer, loop])
    return commit(cache, implementation=implementation)


def free(cache: PagedKVCache, slot: jax.Array | int) -> PagedKVCache:
    """Release a sequence: the slot empties and each of its pages loses a reference.

    A page returns to the pool when no sequence holds it any more (pages
    shared by :func:`fork` stay with the other sequences).

    ``slot`` must be in ``[0, max_sequences)`` (checked when concrete; under
    ``jit`` an out-of-range slot changes nothing). Freeing an inactive slot
    is a no-op.
    """
    c = cache.config
    check_index("slot", slot, c.max_sequences)
    slot = jnp.asarray(slot, jnp.int32)
    slot_ok = (slot >= 0) & (slot < c.max_sequences)
    slot_index = jnp.where(slot_ok, slot, c.max_sequences)  # out of range: every write dropped
    row = jnp.where(slot_ok, cache.block_tables[jnp.clip(slot, 0, c.max_sequences - 1)], -1)
    page_refs = release_pages(cache.page_refs, row)

    def cleared(array, value):
        return array.at[slot_index].set(value, mode="drop")

    return dataclasses.replace(
        cache,
        block_tables=cleared(cache.block_tables, -1),
        lengths=cleared(cache.lengths, 0),
        active=cleared(cache.active, False),
        page_refs=page_refs,
        error_flags=cleared(cache.error_flags, 0),
        nonfinite_counts=cleared(cache.nonfinite_counts, 0),
        saturation_counts=cleared(cache.saturation_counts, 0),
    )
