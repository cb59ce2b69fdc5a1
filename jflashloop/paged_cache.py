"""`PagedKVCache`: a paged, cross-loop, 4-bit KV cache (functional, jittable).

Conventions follow vLLM / JAX ``paged_attention``: a pool of ``num_pages``
pages shared by all sequences, a block table ``[max_sequences,
max_pages_per_sequence]`` of page ids (-1 = none) and per-sequence lengths.
Each layer has its own pool arrays addressed by the same page ids.

Where a token lives (``n`` = tokens visible, ``packed = length // page_size``
complete pages; :func:`window_mask` is the one definition):

* ``t < sink_tokens``: the sink window (unquantized, every loop);
* ``t >= min(n - recent_tokens, packed * page_size)``: the ring of recent
  tokens (unquantized, every loop; capacity ``max(recent_tokens, page_size)``,
  indexed ``t % capacity``): the recent window plus the page being filled;
* otherwise: the page pool, as a residual chain (``page_chain``).

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
all layers and loops at once.

Bad input raises eagerly where it can be known (static shapes and dtypes
always; slots, lengths and free pages when they are concrete, i.e. outside
``jit``). What cannot raise under ``jit`` sets bits of ``error_flags`` per
sequence, and :func:`check` raises them on the host:

* ``ERROR_OUT_OF_PAGES``: the pool ran out; a full page was not stored.
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
:func:`validate` checks the whole structure on the host (after loading or
transferring a cache). ``docs/reliability.md`` lists every rule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .cache_config import CacheConfig
from .codecs._floats import FLOAT16_MAX, cast_saturating, flush_subnormals
from .page_chain import LoopTiles, pack_pages_with_saturations, unpack_pages
from .paged_stream import PagedStream, empty_stream
from .validation import (
    CacheStateError,
    check_index,
    check_integer_scalar,
    check_static_index,
    concrete_int,
    is_concrete,
)

ERROR_OUT_OF_PAGES = 1
ERROR_SEQUENCE_FULL = 2
ERROR_NONFINITE_INPUT = 4
ERROR_SLOT_REPLACED = 8
ERROR_INVALID_LENGTH = 16
ERROR_SATURATED = 32
_ERROR_TEXT = {
    ERROR_OUT_OF_PAGES: "the page pool ran out of free pages (a full page was not stored)",
    ERROR_SEQUENCE_FULL: "the sequence exceeded max_pages_per_sequence * page_size tokens",
    ERROR_NONFINITE_INPUT: "NaN or +-inf K/V were written (stored as 0; see nonfinite_counts)",
    ERROR_SLOT_REPLACED: "prefill replaced a sequence that was still active in this slot",
    ERROR_INVALID_LENGTH: "prefill's length was outside [0, tokens] and was clamped",
    ERROR_SATURATED: "values were stored at their format's limit (see saturation_counts)",
}
WARNING_BITS = ERROR_SATURATED


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
      nonfinite_counts: int32 ``[max_sequences]``: NaN/+-inf K/V elements
        written to the sequence (each stored as 0).
      saturation_counts: int32 ``[max_sequences]``: elements of the sequence
        stored at their format's limit: window values beyond the window
        dtype's range (stored as its largest finite value) and members of INT4
        groups whose float16 min or scale is +-65504 (or of NVFP4 tiles with a
        non-finite tensor scale, or ``int4_rotated`` values beyond +-2**64)
        when their page is packed.
      config: :class:`CacheConfig`.
    """

    layers: tuple[LayerPool, ...]
    block_tables: jax.Array
    lengths: jax.Array
    active: jax.Array
    page_free: jax.Array
    error_flags: jax.Array
    nonfinite_counts: jax.Array
    saturation_counts: jax.Array
    config: CacheConfig = dataclasses.field(metadata={"static": True})

    @property
    def window_dtype(self):
        return jnp.dtype(self.config.window_dtype)


jax.tree_util.register_dataclass(
    PagedKVCache,
    data_fields=[
        "layers", "block_tables", "lengths", "active", "page_free", "error_flags",
        "nonfinite_counts", "saturation_counts",
    ],
    meta_fields=["config"],
)


def create(config: CacheConfig) -> PagedKVCache:
    """An empty cache: every page free, no sequence active."""
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
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
        nonfinite_counts=jnp.zeros((c.max_sequences,), jnp.int32),
        saturation_counts=jnp.zeros((c.max_sequences,), jnp.int32),
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


def _stream_saturations(stream: PagedStream) -> jax.Array:
    """int32 ``[pages]``: elements of each tile stored at the format's limit.

    INT4: members of groups whose float16 min or scale is +-65504 or not
    finite (what saturation stores); NVFP4: every element of a tile whose
    float32 tensor scale is not finite. ``int4_rotated`` is counted from its
    input instead (``page_chain.input_saturations``); the other rotated
    formats are not counted.
    """
    spec = stream.spec
    if spec.format not in ("int4", "nvfp4"):
        return jnp.zeros((stream.payload.shape[1],), jnp.int32)
    if spec.format == "nvfp4":
        bad = ~jnp.isfinite(stream.global_scale)  # [heads, pages]
        return jnp.sum(bad, axis=0, dtype=jnp.int32) * (stream.rows * stream.head_dim)
    at_limit = ~(jnp.abs(stream.minimum.astype(jnp.float32)) < FLOAT16_MAX) | ~(
        jnp.abs(stream.scale.astype(jnp.float32)) < FLOAT16_MAX
    )  # [heads, pages, a, b]
    if spec.axis == "channel":
        members = jnp.full((at_limit.shape[-1],), spec.group_size, jnp.int32)
    else:
        starts = np.arange(at_limit.shape[-1]) * spec.group_size
        members = jnp.asarray(np.minimum(spec.group_size, stream.head_dim - starts), jnp.int32)
    return jnp.sum(jnp.where(at_limit, members, 0), axis=(0, 2, 3), dtype=jnp.int32)


def _tile_saturations(tiles: tuple[LoopTiles, ...]) -> jax.Array:
    """int32 ``[pages]``: elements stored at a limit, over every loop's K and V tiles."""
    total = 0
    for loop_tiles in tiles:
        total = total + _stream_saturations(loop_tiles.keys) + _stream_saturations(loop_tiles.values)
    return total


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


def check_prefill_arrays(cache: PagedKVCache, keys, values) -> None:
    """``prefill``'s checks of ``keys`` and ``values`` (static: shapes and dtypes).

    Both must be arrays ``[layers, loops, tokens, kv_heads, head_dim]`` of
    the cache's shape, of a float dtype, of equal shapes, with ``tokens >= 1``.
    """
    c = cache.config
    layout = (f"[layers={c.num_layers}, loops={c.num_loops}, tokens, "
              f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]")
    expected = (c.num_layers, c.num_loops, None, c.num_kv_heads, c.head_dim)
    _check_kv("keys", keys, expected, layout)
    _check_kv("values", values, expected, layout)
    if tuple(values.shape) != tuple(keys.shape):
        raise ValueError(f"values shape {tuple(values.shape)} must equal keys shape {tuple(keys.shape)}")
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
    if slot_value is None or not (is_concrete(cache.active) and is_concrete(cache.page_free)):
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
    page_free = cache.page_free.at[jnp.where(replaced & (old_row >= 0), old_row, c.num_pages)].set(
        True, mode="drop"
    )

    # Full pages: allocate and pack.
    max_full = min(tokens // page_size, c.max_pages_per_sequence)
    full_pages = length // page_size
    page_numbers = jnp.arange(max_full, dtype=jnp.int32)
    wanted = (page_numbers < full_pages) & slot_ok
    page_ids, page_free, granted = _allocate(page_free, wanted)
    error = error | jnp.where(jnp.any(wanted & ~granted), ERROR_OUT_OF_PAGES, 0)
    block_row = jnp.full((c.max_pages_per_sequence,), -1, jnp.int32)
    block_row = block_row.at[:max_full].set(jnp.where(granted, page_ids, -1))

    ring_positions, ring_valid = _ring_slots(c, length)
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
            tiles, unseen = pack_pages_with_saturations(pages_k, pages_v, page_numbers, c, implementation)
            saturated = saturated + jnp.sum(jnp.where(granted, _tile_saturations(tiles) + unseen, 0))
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
                ring_keys=windows(layer.ring_keys, head_major_k, ring_positions, ring_valid),
                ring_values=windows(layer.ring_values, head_major_v, ring_positions, ring_valid),
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
        page_free=page_free,
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
    ring_slot = jnp.where(stored, cache.lengths % c.window_tokens, c.window_tokens)  # out of range: dropped
    sequences = jnp.arange(c.max_sequences)
    ring_k = pool.ring_keys.at[loop, sequences, :, ring_slot].set(keys, mode="drop")
    ring_v = pool.ring_values.at[loop, sequences, :, ring_slot].set(values, mode="drop")
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
    saturated = jnp.zeros((c.max_sequences,), jnp.int32)
    for layer in cache.layers:
        pages_k, pages_v = page_rows(layer.ring_keys), page_rows(layer.ring_values)
        tiles, unseen = pack_pages_with_saturations(pages_k, pages_v, jnp.maximum(page_number, 0), c, implementation)
        saturated = saturated + jnp.where(granted, _tile_saturations(tiles) + unseen, 0)
        loops = tuple(pool.put(page_ids, new) for pool, new in zip(layer.loops, tiles, strict=True))
        new_layers.append(dataclasses.replace(layer, loops=loops))
    errors = errors | jnp.where(saturated > 0, ERROR_SATURATED, 0)
    rows = jnp.arange(c.max_sequences)
    column = jnp.where(granted, page_number, c.max_pages_per_sequence)  # out of range: dropped
    block_tables = cache.block_tables.at[rows, column].set(page_ids, mode="drop")
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=block_tables,
        page_free=page_free,
        error_flags=cache.error_flags | errors,
        saturation_counts=cache.saturation_counts + saturated,
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
    check_append_arrays(cache, keys, values)
    for layer in range(c.num_layers):
        for loop in range(c.num_loops):
            cache = write_token(cache, layer, loop, keys[layer, loop], values[layer, loop])
    return commit(cache, implementation=implementation)


def free(cache: PagedKVCache, slot: jax.Array | int) -> PagedKVCache:
    """Release a sequence: its pages return to the pool and the slot empties.

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
    page_free = cache.page_free.at[jnp.where(row >= 0, row, c.num_pages)].set(True, mode="drop")

    def cleared(array, value):
        return array.at[slot_index].set(value, mode="drop")

    return dataclasses.replace(
        cache,
        block_tables=cleared(cache.block_tables, -1),
        lengths=cleared(cache.lengths, 0),
        active=cleared(cache.active, False),
        page_free=page_free,
        error_flags=cleared(cache.error_flags, 0),
        nonfinite_counts=cleared(cache.nonfinite_counts, 0),
        saturation_counts=cleared(cache.saturation_counts, 0),
    )


def visible_tokens(cache: PagedKVCache, *, include_pending: bool = False) -> jax.Array:
    """int32 ``[max_sequences]``: the tokens attention sees in each slot.

    ``lengths``, plus the pending token written by :func:`write_token` with
    ``include_pending``, at most ``max_tokens_per_sequence`` (a full
    sequence's token is dropped, not stored), and 0 for an inactive slot
    (whatever ``include_pending`` says).
    """
    visible = jnp.minimum(cache.lengths + int(include_pending), cache.config.max_tokens_per_sequence)
    return jnp.where(cache.active, visible, 0).astype(jnp.int32)


def stored_pages(cache: PagedKVCache) -> jax.Array:
    """int32 ``[max_sequences]``: leading block-table entries of each slot that hold a page.

    A page that could not be stored (``ERROR_OUT_OF_PAGES``) has entry -1;
    reading a sequence's pages stops at its first such entry, so a page of
    another sequence is never read in its place.
    """
    present = (cache.block_tables >= 0).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(present, axis=1), axis=1, dtype=jnp.int32)


def window_start(
    config: CacheConfig, length: jax.Array, visible: jax.Array, stored: jax.Array | None = None
) -> jax.Array:
    """The first position read from the ring (int32, elementwise; may be negative).

    ``min(visible - recent_tokens, packed_end)`` with ``packed_end =
    min(length // page_size, stored) * page_size``: positions ``sink_tokens
    <= t < start`` are read from pages, later ones from the ring.

    Args:
      length: committed tokens (decides how many pages are packed).
      visible: tokens attention sees (:func:`visible_tokens`).
      stored: :func:`stored_pages` (default: every full page was stored).
    """
    pages = length // config.page_size
    if stored is not None:
        pages = jnp.minimum(pages, stored)
    return jnp.minimum(visible - config.recent_tokens, pages * config.page_size)


def window_mask(
    config: CacheConfig, length: jax.Array, visible: jax.Array, positions: int, *,
    stored: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Where each position ``t < positions`` is read from, for one sequence.

    Args:
      length: committed tokens (decides how many pages are packed).
      visible: tokens attention sees (:func:`visible_tokens`).
      positions: static number of positions to describe.
      stored: the sequence's :func:`stored_pages` (default: all of its full pages).
    Returns:
      bool ``[positions]`` masks ``sink``, ``ring``, ``pages``. They are
      disjoint and their union is ``t < visible``, except after a lost page:
      from the first page not stored on, only the positions still in the ring
      (the latest ``window_tokens``) are read, the others are lost.
    """
    t = jnp.arange(positions)
    inside = t < visible
    sink = inside & (t < config.sink_tokens)
    start = window_start(config, length, visible, stored)
    ring_start = jnp.maximum(start, visible - config.window_tokens)  # the ring holds no older position
    ring = inside & ~sink & (t >= ring_start)
    pages = inside & ~sink & (t < start)
    return {"sink": sink, "ring": ring, "pages": pages}


def _sequence_view(cache: PagedKVCache, slot: jax.Array, include_pending: bool):
    """``(index, visible, regions)`` of ``slot`` for :func:`reconstruct` and attention.

    ``index`` is ``slot`` clipped into range; a ``slot`` outside ``[0,
    max_sequences)`` (a tracer under ``jit``) sees nothing: ``visible`` 0 and
    every region empty, so it never reads another slot.
    """
    c = cache.config
    positions = c.max_tokens_per_sequence + int(include_pending)
    index = jnp.clip(slot, 0, c.max_sequences - 1)
    inside = (slot >= 0) & (slot < c.max_sequences)
    visible = jnp.where(inside, visible_tokens(cache, include_pending=include_pending)[index], 0)
    regions = window_mask(c, cache.lengths[index], visible, positions, stored=stored_pages(cache)[index])
    return index, visible, regions


def sequence_regions(
    cache: PagedKVCache, slot: jax.Array | int, *, include_pending: bool = False
) -> dict[str, jax.Array]:
    """The :func:`window_mask` of sequence ``slot``, as :func:`reconstruct` reads it.

    Returns:
      bool ``[positions]`` masks ``sink``, ``ring`` and ``pages``, with
      ``positions = max_tokens_per_sequence + include_pending``; attention
      attends exactly to their union. All empty for an inactive slot and,
      under ``jit``, for a slot outside ``[0, max_sequences)``.
    """
    check_index("slot", slot, cache.config.max_sequences)
    return _sequence_view(cache, jnp.asarray(slot, jnp.int32), include_pending)[2]


def reconstruct(
    cache: PagedKVCache, layer: int, loop: int, slot: jax.Array | int, *, include_pending: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference decode of one sequence's loop-``loop`` K/V to dense float32.

    Args:
      layer, loop: 0-based Python ints.
      slot: the sequence slot, in ``[0, max_sequences)`` (checked when
        concrete; under ``jit`` a slot out of range reads as an empty slot:
        ``visible`` 0 and zeros).
      include_pending: also show the token written by :func:`write_token` and
        not yet committed.
    Returns:
      ``(keys, values, visible)``: float32 ``[positions, kv_heads, head_dim]``
      with ``positions = max_tokens + include_pending`` (zero beyond
      ``visible`` and at positions lost with a page, see
      :func:`sequence_regions`) and the int32 number of visible tokens
      (:func:`visible_tokens`: 0 for an inactive slot, at most
      ``max_tokens_per_sequence``, so the last position is zero when
      ``include_pending``).
    """
    c = cache.config
    check_static_index("layer", layer, c.num_layers)
    check_static_index("loop", loop, c.num_loops)
    check_index("slot", slot, c.max_sequences)
    return _reconstruct(cache, layer, loop, jnp.asarray(slot, jnp.int32), include_pending)


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _reconstruct(cache: PagedKVCache, layer: int, loop: int, slot: jax.Array, include_pending: bool):
    """:func:`reconstruct` after its argument checks, compiled (eager calls stay fast)."""
    c = cache.config
    pool = cache.layers[layer]
    slot, visible, masks = _sequence_view(cache, slot, include_pending)
    pages = jnp.maximum(cache.block_tables[slot], 0)  # -1 (lost) entries are masked out below
    tiles = tuple(loop_tiles.take(pages) for loop_tiles in pool.loops)
    page_keys, page_values = unpack_pages(tiles, loop)
    positions = c.max_tokens_per_sequence + int(include_pending)
    shape = (c.max_tokens_per_sequence, c.num_kv_heads, c.head_dim)
    page_keys, page_values = page_keys.reshape(shape), page_values.reshape(shape)
    if include_pending:  # the shape callers rely on (a full sequence drops its pending token)
        page_keys = jnp.pad(page_keys, ((0, 1), (0, 0), (0, 0)))
        page_values = jnp.pad(page_values, ((0, 1), (0, 0), (0, 0)))
    shape = (positions, c.num_kv_heads, c.head_dim)
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


def check(cache: PagedKVCache, *, allow_saturation: bool = True) -> None:
    """Raise ``RuntimeError`` on the host if any sequence has an error flag set.

    Args:
      allow_saturation: when False, ``ERROR_SATURATED`` (values stored at their
        format's limit, see ``saturation_counts``) raises too.
    """
    flags = np.asarray(cache.error_flags)
    ignored = WARNING_BITS if allow_saturation else 0
    messages = []
    for slot in np.flatnonzero(flags & ~ignored):
        reasons = [text for bit, text in _ERROR_TEXT.items() if flags[slot] & bit & ~ignored]
        counts = []
        if flags[slot] & ERROR_NONFINITE_INPUT:
            counts.append(f"nonfinite_counts={int(cache.nonfinite_counts[slot])}")
        if flags[slot] & ERROR_SATURATED & ~ignored:
            counts.append(f"saturation_counts={int(cache.saturation_counts[slot])}")
        suffix = f" ({', '.join(counts)})" if counts else ""
        messages.append(f"sequence slot {slot}: " + "; ".join(reasons) + suffix)
    if messages:
        raise RuntimeError("PagedKVCache errors: " + " | ".join(messages))


def _expected_leaf_shapes(config: CacheConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``keystr path -> (shape, dtype)`` of every array of an empty cache of ``config``."""
    template = jax.eval_shape(lambda: create(config))
    leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    return {jax.tree_util.keystr(path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in leaves}


def structure_problems(cache: PagedKVCache) -> list[str]:
    """Every array of ``cache`` whose shape or dtype differs from what its config implies."""
    expected = _expected_leaf_shapes(cache.config)
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    actual = {jax.tree_util.keystr(path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in leaves}
    problems = [f"missing array {name}" for name in expected if name not in actual]
    problems += [f"unexpected array {name}" for name in actual if name not in expected]
    for name, (shape, dtype) in expected.items():
        if name in actual and actual[name] != (shape, dtype):
            problems.append(f"{name} must be {dtype} {shape}, got {actual[name][1]} {actual[name][0]}")
    return problems


def bookkeeping_problems(cache: PagedKVCache) -> list[str]:
    """Host-side consistency of block tables, free list, lengths, flags and sparse rows.

    Returns a list of human-readable problems (empty when consistent).
    """
    c = cache.config
    tables = np.asarray(cache.block_tables)
    lengths = np.asarray(cache.lengths)
    active = np.asarray(cache.active)
    page_free = np.asarray(cache.page_free)
    flags = np.asarray(cache.error_flags)
    problems = []
    outside = (tables < -1) | (tables >= c.num_pages)
    for slot, column in zip(*np.nonzero(outside), strict=True):
        problems.append(
            f"block_tables[{slot}, {column}] = {tables[slot, column]} is outside the pool [0, {c.num_pages}) and not -1"
        )
    owners: dict[int, list[tuple[int, int]]] = {}
    for slot, column in zip(*np.nonzero((tables >= 0) & ~outside), strict=True):
        owners.setdefault(int(tables[slot, column]), []).append((int(slot), int(column)))
    for page, places in owners.items():
        if len(places) > 1:
            problems.append(f"page {page} is owned more than once, by (slot, column) {places}")
        if page_free[page]:
            problems.append(f"page {page} is in block_tables{places[0]} but marked free in page_free")
    for page in np.flatnonzero(~page_free):
        if int(page) not in owners:
            problems.append(f"page {page} is marked used in page_free but no block table holds it")
    for slot in range(c.max_sequences):
        held = np.flatnonzero(tables[slot] >= 0)
        if not active[slot]:
            if held.size:
                problems.append(f"inactive slot {slot} holds pages {tables[slot, held].tolist()}")
            if lengths[slot]:
                problems.append(f"inactive slot {slot} has length {lengths[slot]} (must be 0)")
            continue
        if not 0 <= lengths[slot] <= c.max_tokens_per_sequence:
            problems.append(
                f"lengths[{slot}] = {lengths[slot]} is outside [0, max_tokens_per_sequence="
                f"{c.max_tokens_per_sequence}]"
            )
            continue
        full_pages = int(lengths[slot]) // c.page_size
        beyond = held[held >= full_pages]
        if beyond.size:
            problems.append(
                f"slot {slot} holds pages at block-table columns {beyond.tolist()} beyond its "
                f"{full_pages} full page(s) (length {lengths[slot]})"
            )
        missing = [column for column in range(full_pages) if tables[slot, column] < 0]
        if missing and not flags[slot] & ERROR_OUT_OF_PAGES:
            problems.append(
                f"slot {slot} (length {lengths[slot]}) has no page at block-table columns {missing} "
                "and no ERROR_OUT_OF_PAGES flag"
            )
    for layer_index, layer in enumerate(cache.layers):
        for loop_index, loop_tiles in enumerate(layer.loops):
            if loop_tiles.row_positions is None:
                continue
            positions = np.asarray(loop_tiles.row_positions)[:, sorted(owners)].astype(np.int32)
            if ((positions < -1) | (positions >= c.page_size)).any():
                problems.append(
                    f"layers[{layer_index}].loops[{loop_index}].row_positions of used pages must be "
                    f"in [-1, page_size={c.page_size})"
                )
            used = np.where(positions < 0, c.page_size + 1, positions)
            if (np.diff(used, axis=-1) <= 0).any():
                problems.append(
                    f"layers[{layer_index}].loops[{loop_index}].row_positions of used pages must be "
                    "strictly increasing, with unused rows (-1) last"
                )
    return problems


def validate(cache: PagedKVCache) -> None:
    """Check on the host that ``cache`` is internally consistent (after loading or transfer).

    Checks: every array has the shape and dtype its config implies; block
    tables hold -1 or page ids inside the pool; no page is owned twice;
    ``page_free`` is exactly the complement of the pages in block tables;
    lengths are within capacity; an active sequence holds a page for each of
    its full pages (unless flagged ``ERROR_OUT_OF_PAGES``) and none beyond;
    inactive slots hold no pages and length 0; sparse row positions of used
    pages are in range and increasing.

    Raises:
      CacheStateError: listing every problem found.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    problems = structure_problems(cache)
    if not problems:
        problems = bookkeeping_problems(cache)
    if problems:
        shown = problems[:20]
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise CacheStateError("inconsistent PagedKVCache: " + "; ".join(shown) + more)
