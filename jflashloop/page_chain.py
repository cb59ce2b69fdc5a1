"""Encoding and decoding whole pages of every loop as a residual chain.

A page of ``page_size`` tokens is packed once all of its rows are known. For
each loop the stored tiles are:

* loop 1: the base, ``encode(K_1)``;
* a dense loop r: ``encode(K_r - rec_{r-1})``;
* a sparse loop r: per KV head, the ``rows`` token rows of the page with the
  largest residual energy ``|K_r - rec_{r-1}|^2 + |V_r - rec_{r-1}|^2``
  (summed over channels, ties to the lower position), stored compactly in
  position order with their positions in ``row_positions``.

``rec`` is the float32 reconstruction (closed loop). Sink rows (the first
``sink_tokens`` positions of a sequence, which live in page 0 and are read
from the unquantized sink window) are replaced by row ``sink_tokens`` before
encoding, so they neither widen a K group's range nor take a sparse row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .cache_config import CacheConfig
from .codecs import CodecSpec
from .codecs._rotated import int4_rotated_input
from .paged_stream import (
    PagedStream,
    can_encode_page_pairs,
    decode_tiles,
    encode_page_pairs,
    encode_tiles,
)


@dataclasses.dataclass(frozen=True)
class LoopTiles:
    """The stored tiles of one loop for some pages.

    Attributes:
      keys, values: :class:`PagedStream` (``rows`` per tile).
      row_positions: sparse loops only: int8 ``[kv_heads, pages, rows]``, the
        position inside the page that each compact row updates (increasing;
        -1 marks an unused row); None for dense loops.
    """

    keys: PagedStream
    values: PagedStream
    row_positions: jax.Array | None

    def take(self, pages: jax.Array) -> LoopTiles:
        return jax.tree.map(lambda leaf: leaf[:, pages], self)

    def put(self, pages: jax.Array, tiles: LoopTiles) -> LoopTiles:
        return jax.tree.map(lambda leaf, new: leaf.at[:, pages].set(new, mode="drop"), self, tiles)


jax.tree_util.register_dataclass(
    LoopTiles, data_fields=["keys", "values", "row_positions"], meta_fields=[]
)


def mask_sink_rows(x: jax.Array, page_numbers: jax.Array, sink_tokens: int) -> jax.Array:
    """Replace rows ``< sink_tokens`` of page 0 by row ``sink_tokens``.

    Args:
      x: ``[..., pages, page_size, kv_heads, head_dim]``.
      page_numbers: int32 ``[pages]``: each page's index within its sequence.
    """
    if sink_tokens == 0:
        return x
    page_size = x.shape[-3]
    rows = jnp.arange(page_size)
    source = jnp.where((page_numbers[:, None] == 0) & (rows[None, :] < sink_tokens), sink_tokens, rows)
    source = source.reshape((1,) * (x.ndim - 4) + source.shape + (1, 1))
    return jnp.take_along_axis(x, source, axis=-3)


def _select_rows(energy: jax.Array, eligible: jax.Array, rows: int) -> jax.Array:
    """Positions of the ``rows`` largest energies per (page, head), increasing.

    Args:
      energy: float32 ``[pages, page_size, kv_heads]``.
      eligible: bool ``[pages, page_size]``.
    Returns:
      int32 ``[pages, kv_heads, rows]``; ``page_size`` marks an unused row.
    """
    page_size = energy.shape[1]
    scores = jnp.where(eligible[:, :, None], energy, -jnp.inf).transpose(0, 2, 1)
    top_scores, top_positions = jax.lax.top_k(scores, rows)
    positions = jnp.where(top_scores > -jnp.inf, top_positions, page_size)
    return jnp.sort(positions, axis=-1)


def _gather_rows(x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x[page, positions[page, head, r], head]`` -> ``[pages, rows, kv_heads, D]`` (0 when unused)."""
    page_size = x.shape[1]
    clipped = jnp.minimum(positions, page_size - 1)
    per_head = jnp.take_along_axis(x.transpose(0, 2, 1, 3), clipped[..., None], axis=2)
    per_head = jnp.where((positions < page_size)[..., None], per_head, 0.0)
    return per_head.transpose(0, 2, 1, 3)


def _scatter_add_rows(x: jax.Array, positions: jax.Array, rows: jax.Array) -> jax.Array:
    """``x[page, positions[page, head, r], head] += rows[page, r, head]`` (unused rows dropped)."""
    pages, _, heads, _ = x.shape
    page_index = jnp.arange(pages)[:, None, None]
    head_index = jnp.arange(heads)[None, :, None]
    updates = rows.transpose(0, 2, 1, 3)  # [pages, heads, rows, D]
    return x.at[page_index, positions, head_index].add(updates, mode="drop")


def input_saturations(rows: jax.Array, spec: CodecSpec) -> jax.Array:
    """int32 ``[pages]``: elements of ``rows`` ``[pages, rows, kv_heads, head_dim]``
    that ``spec``'s input rule stores at its limit, unseen in the stored metadata.

    ``int4_rotated`` (:func:`~jflashloop.codecs._rotated.int4_rotated_input`):
    values beyond +-2**64, and non-finite ones (a residual that overflowed
    float32). The other formats count from their stored metadata instead
    (``paged_cache``), so they give 0 here.
    """
    if spec.format != "int4_rotated":
        return jnp.zeros((rows.shape[0],), jnp.int32)
    _, nonfinite, saturated = int4_rotated_input(rows)
    return jnp.sum(nonfinite | saturated, axis=(1, 2, 3), dtype=jnp.int32)


def pack_pages(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    config: CacheConfig,
    implementation: str | None = None,
) -> tuple[LoopTiles, ...]:
    """Encode full pages of every loop as a closed-loop residual chain.

    Args:
      keys, values: float32 ``[loops, pages, page_size, kv_heads, head_dim]``
        (already rounded to the cache's window dtype).
      page_numbers: int32 ``[pages]``, each page's index within its sequence.
      config: the cache configuration (codecs, sparse rows, sink tokens).
    Returns:
      One :class:`LoopTiles` per loop, each holding ``pages`` tiles.
    """
    return pack_pages_with_saturations(keys, values, page_numbers, config, implementation)[0]


def pack_pages_with_saturations(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    config: CacheConfig,
    implementation: str | None = None,
) -> tuple[tuple[LoopTiles, ...], jax.Array]:
    """:func:`pack_pages`, and int32 ``[pages]``: each page's :func:`input_saturations`
    summed over every loop's K and V."""
    page_size = config.page_size
    positions_in_sequence = page_numbers[:, None] * page_size + jnp.arange(page_size)[None, :]
    eligible = positions_in_sequence >= config.sink_tokens

    saturated = jnp.zeros(page_numbers.shape, jnp.int32)
    tiles = []
    reconstructed_keys = reconstructed_values = None
    for loop_index, storage in enumerate(config.loops):
        if loop_index == 0 and not storage.is_sparse and can_encode_page_pairs(
            page_size, keys.shape[-1], storage.key_spec, storage.value_spec, implementation
        ):
            # One kernel reads both streams in place and masks the sink rows itself.
            key_tiles, value_tiles = encode_page_pairs(
                keys[0], values[0], page_numbers, storage.key_spec, storage.value_spec, config.sink_tokens
            )
            loop_tiles = LoopTiles(key_tiles, value_tiles, None)
            tiles.append(loop_tiles)
            if config.num_loops > 1:
                reconstructed_keys, reconstructed_values = apply_loop(loop_tiles, None, None)
            continue
        loop_keys = mask_sink_rows(keys[loop_index], page_numbers, config.sink_tokens)
        loop_values = mask_sink_rows(values[loop_index], page_numbers, config.sink_tokens)
        if loop_index == 0:
            key_rows, value_rows = loop_keys, loop_values
        else:
            key_rows = loop_keys - reconstructed_keys
            value_rows = loop_values - reconstructed_values
        row_positions = None
        if storage.is_sparse:
            energy = jnp.sum(key_rows**2, axis=-1) + jnp.sum(value_rows**2, axis=-1)
            positions = _select_rows(energy, eligible, storage.sparse_rows_per_page)
            key_rows = _gather_rows(key_rows, positions)
            value_rows = _gather_rows(value_rows, positions)
            row_positions = jnp.where(positions < page_size, positions, -1).astype(jnp.int8)
            row_positions = row_positions.transpose(1, 0, 2)  # [heads, pages, rows]
        saturated = saturated + input_saturations(key_rows, storage.key_spec)
        saturated = saturated + input_saturations(value_rows, storage.value_spec)
        key_tiles = encode_tiles(key_rows, storage.key_spec, implementation)
        value_tiles = encode_tiles(value_rows, storage.value_spec, implementation)
        loop_tiles = LoopTiles(key_tiles, value_tiles, row_positions)
        tiles.append(loop_tiles)
        if loop_index + 1 < config.num_loops:
            reconstructed_keys, reconstructed_values = apply_loop(
                loop_tiles, reconstructed_keys, reconstructed_values
            )
    return tuple(tiles), saturated


def apply_loop(
    loop_tiles: LoopTiles, keys: jax.Array | None, values: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Reconstruct a loop from its predecessor's float32 ``[pages, page_size, H, D]``.

    With ``keys is None`` the tiles are the base and are simply decoded.
    """
    decoded_keys = decode_tiles(loop_tiles.keys)
    decoded_values = decode_tiles(loop_tiles.values)
    if keys is None:
        return decoded_keys, decoded_values
    if loop_tiles.row_positions is None:
        return keys + decoded_keys, values + decoded_values
    positions = loop_tiles.row_positions.astype(jnp.int32).transpose(1, 0, 2)
    positions = jnp.where(positions < 0, keys.shape[1], positions)  # unused rows: dropped
    return (
        _scatter_add_rows(keys, positions, decoded_keys),
        _scatter_add_rows(values, positions, decoded_values),
    )


def unpack_pages(tiles: tuple[LoopTiles, ...], loop: int) -> tuple[jax.Array, jax.Array]:
    """float32 K and V ``[pages, page_size, H, D]`` of loop ``loop`` (0-based)."""
    keys = values = None
    for loop_tiles in tiles[: loop + 1]:
        keys, values = apply_loop(loop_tiles, keys, values)
    return keys, values
