"""Page tiles: each full page of every loop stored as a residual chain, and read back.

A page of ``page_size`` tokens is packed once all of its rows are known. For
each loop (0-based; :func:`jflashloop._chains.encode_loops`, the algebra the
dense chains use too) the stored tiles are:

* loop 0: the base, ``encode(K_0)``;
* a dense loop r: ``encode(K_r - rec_{r-1})``;
* a sparse loop r: per KV head, the ``rows`` token rows of the page with the
  largest residual energy ``|K_r - rec_{r-1}|^2 + |V_r - rec_{r-1}|^2``
  (summed over channels, ties to the lower position), stored compactly in
  position order with their positions in ``row_positions``.

``rec`` is the float32 reconstruction (closed loop). Sink rows (the first
``sink_tokens`` positions of a sequence, which live in page 0 and are read
from the unquantized sink window) are replaced by row ``sink_tokens`` before
encoding (``jflashloop.ops._page_quantization.mask_sink_rows``), so they
neither widen a K group's range nor take a sparse row.

The tiles are encoded by the page-quantization op
(``jflashloop.ops._page_quantization``) and decoded by the codecs. What a
packed page stored at a format's limit is counted here, by the codecs' own
saturation rules (``jflashloop.codecs._statistics``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _chains
from ..codecs import CodecSpec, decode
from ..codecs._rotated import int4_rotated_input
from ..codecs._spec import AFFINE_FORMATS
from ..codecs._statistics import int4_saturated_groups, nvfp4_saturated
from ..ops import _dispatch
from ..ops._page_quantization import (
    each_head,
    encode_pages,
    encode_tiles,
    encode_tiles_with_codec,
    mask_sink_rows,
)
from ._config import CacheConfig, LoopStorage
from ._layout import LoopTiles, PagedStream, tile_packed

NO_TILES = LoopTiles(None, None, None)
"""The tiles of a loop that stores no rows (``sparse_rows_per_page=0``, a predicted loop): no leaves."""


def empty_stream(spec: CodecSpec, kv_heads: int, pages: int, rows: int, head_dim: int) -> PagedStream:
    """An all-zero pool of ``pages`` tiles (the shapes and dtypes of the codec's encode)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _stream_template(spec, kv_heads, pages, rows, head_dim))


@functools.lru_cache(maxsize=256)
def _stream_template(spec: CodecSpec, kv_heads: int, pages: int, rows: int, head_dim: int) -> PagedStream:
    """The shapes and dtypes of ``pages`` encoded tiles (traced once per layout: a cache's loops and layers
    share it)."""
    return jax.eval_shape(
        lambda: encode_tiles_with_codec(jnp.zeros((pages, rows, kv_heads, head_dim), jnp.float32), spec, "xla")
    )


def decode_tiles(stream: PagedStream) -> jax.Array:
    """Decode every tile: float32 ``[pages, rows, kv_heads, head_dim]``."""
    decoded = each_head(lambda packed, spec: jax.vmap(lambda p: decode(p, jnp.float32))(
        dataclasses.replace(packed, spec=spec)), tile_packed(stream), stream.spec)
    return jnp.transpose(decoded[:, :, :, 0, :], (1, 2, 0, 3))


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


def input_saturations(rows: jax.Array, spec: CodecSpec) -> jax.Array:
    """int32 ``[pages]``: elements of ``rows`` ``[pages, rows, kv_heads, head_dim]``
    that ``spec``'s input rule stores at its limit, unseen in the stored metadata.

    ``int4_rotated`` (:func:`~jflashloop.codecs._rotated.int4_rotated_input`):
    values beyond +-2**64, and non-finite ones (a residual that overflowed
    float32). The other formats are counted from their stored metadata
    instead (:func:`stream_saturations`), so they give 0 here.
    """
    if spec.format != "int4_rotated":
        return jnp.zeros((rows.shape[0],), jnp.int32)
    _, nonfinite, saturated = int4_rotated_input(rows)
    return jnp.sum(nonfinite | saturated, axis=(1, 2, 3), dtype=jnp.int32)


def stream_saturations(stream: PagedStream) -> jax.Array:
    """int32 ``[pages]``: elements of each tile stored at the format's limit.

    The affine formats (INT4, INT3, INT2): members of groups whose stored float16 min or scale saturated
    (:func:`~jflashloop.codecs._statistics.int4_saturated_groups`); NVFP4:
    every element of a tile whose float32 tensor scale is not finite
    (:func:`~jflashloop.codecs._statistics.nvfp4_saturated`). ``int4_rotated``
    is counted from its input instead (:func:`input_saturations`); the other
    rotated formats are not counted.
    """
    spec = stream.spec
    if spec.format not in (*AFFINE_FORMATS, "nvfp4"):
        return jnp.zeros((stream.payload.shape[1],), jnp.int32)
    if spec.format == "nvfp4":
        bad = nvfp4_saturated(stream.global_scale)  # [heads, pages]
        return jnp.sum(bad, axis=0, dtype=jnp.int32) * (stream.rows * stream.head_dim)
    at_limit = int4_saturated_groups(stream.minimum, stream.scale)  # [heads, pages, a, b]
    if spec.axis == "channel":
        members = jnp.full((at_limit.shape[-1],), spec.group_size, jnp.int32)
    else:
        starts = np.arange(at_limit.shape[-1]) * spec.group_size
        members = jnp.asarray(np.minimum(spec.group_size, stream.head_dim - starts), jnp.int32)
    return jnp.sum(jnp.where(at_limit, members, 0), axis=(0, 2, 3), dtype=jnp.int32)


def tile_saturations(tiles: tuple[LoopTiles, ...]) -> jax.Array:
    """int32 ``[pages]``: elements stored at a limit, over every loop's K and V tiles."""
    total = 0
    for loop_tiles in tiles:
        if loop_tiles.keys is not None:  # a loop with no rows stores nothing
            total = total + stream_saturations(loop_tiles.keys) + stream_saturations(loop_tiles.values)
    return total


def pack_pages(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    config: CacheConfig,
    implementation: str | _dispatch.Implementation | None = None,
) -> tuple[LoopTiles, ...]:
    """Encode full pages of every loop as a closed-loop residual chain.

    Args:
      keys, values: float32 ``[loops, pages, page_size, kv_heads, head_dim]``
        (already rounded to the cache's window dtype).
      page_numbers: int32 ``[pages]``, each page's index within its sequence.
      config: the cache configuration (codecs, sparse rows, sink tokens).
    Returns:
      One :class:`~jflashloop.cache._layout.LoopTiles` per loop, each holding ``pages`` tiles.
    """
    return pack_pages_with_saturations(keys, values, page_numbers, config, implementation)[0]


def pack_pages_with_saturations(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    config: CacheConfig,
    implementation: str | _dispatch.Implementation | None = None,
) -> tuple[tuple[LoopTiles, ...], jax.Array]:
    """:func:`pack_pages`, and int32 ``[pages]``: each page's :func:`input_saturations`
    summed over every loop's K and V."""
    implementation = _dispatch.resolve(implementation)
    page_size = config.page_size
    positions_in_sequence = page_numbers[:, None] * page_size + jnp.arange(page_size)[None, :]
    eligible = positions_in_sequence >= config.sink_tokens
    saturated = jnp.zeros(page_numbers.shape, jnp.int32)

    def encode_step(loop, target, predecessor):
        nonlocal saturated
        storage = config.loops[loop]
        key_rows, value_rows = (mask_sink_rows(x, page_numbers, config.sink_tokens) for x in target)
        if predecessor is not None:
            predecessor = predicted(storage, predecessor)
            key_rows = key_rows - predecessor[0]
            value_rows = value_rows - predecessor[1]
        row_positions = None
        if storage.sparse_rows_per_page == 0:  # a predicted loop with no rows: nothing stored
            return loop, NO_TILES
        if storage.is_sparse:
            energy = jnp.sum(key_rows**2, axis=-1) + jnp.sum(value_rows**2, axis=-1)
            positions = _select_rows(energy, eligible, storage.sparse_rows_per_page)  # [pages, heads, rows]
            key_rows = jax.vmap(_chains.take_rows)(key_rows, positions)
            value_rows = jax.vmap(_chains.take_rows)(value_rows, positions)
            row_positions = jnp.where(positions < page_size, positions, -1).astype(jnp.int8)
            row_positions = row_positions.transpose(1, 0, 2)  # [heads, pages, rows]
        saturated = (saturated + input_saturations(key_rows, storage.key_spec)
                     + input_saturations(value_rows, storage.value_spec))
        if predecessor is None:  # a chain's start: one kernel can read both streams in place and mask the sink rows
            key_tiles, value_tiles = encode_pages(*target, page_numbers, storage.key_spec, storage.value_spec,
                                                  config.sink_tokens, implementation)
        else:
            key_tiles = encode_tiles(key_rows, storage.key_spec, implementation)
            value_tiles = encode_tiles(value_rows, storage.value_spec, implementation)
        return loop, LoopTiles(key_tiles, value_tiles, row_positions)

    targets = [(keys[loop], values[loop]) for loop in range(config.num_loops)]
    steps = _chains.encode_loops(targets, encode_step, _loop_step(config), starts=config.chain_starts())
    return tuple(tiles for _, tiles in steps), saturated


def predicted(storage: LoopStorage, previous: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """What a residual loop stored with ``storage`` is a residual against: its predecessor's float32 K and V
    ``[..., H, D]``, through ``storage.prediction`` when it has one."""
    return previous if storage.prediction is None else storage.prediction.apply(*previous)


def _loop_step(config: CacheConfig):
    """:func:`apply_loop` for the chain algebra's ``(loop, tiles)`` steps of ``config`` (a layer's)."""
    def step(indexed, previous):
        loop, loop_tiles = indexed
        return apply_loop(loop_tiles, previous, config.loops[loop])
    return step


def apply_loop(
    loop_tiles: LoopTiles, previous: tuple[jax.Array, jax.Array] | None, storage: LoopStorage | None = None
) -> tuple[jax.Array, jax.Array]:
    """Reconstruct a loop from its predecessor's float32 K and V ``[pages, page_size, H, D]``.

    With ``previous`` None the tiles are the base and are simply decoded; ``storage`` (the loop's) applies its
    prediction to ``previous`` first (:func:`predicted`).
    """
    if previous is not None and storage is not None:
        previous = predicted(storage, previous)
    if loop_tiles.keys is None:  # no rows: the loop is its prediction
        return previous
    decoded_keys = decode_tiles(loop_tiles.keys)
    decoded_values = decode_tiles(loop_tiles.values)
    if previous is None:
        return decoded_keys, decoded_values
    keys, values = previous
    if loop_tiles.row_positions is None:
        return keys + decoded_keys, values + decoded_values
    positions = loop_tiles.row_positions.astype(jnp.int32).transpose(1, 0, 2)  # [pages, heads, rows]; -1 unused
    return (
        jax.vmap(_chains.add_rows)(keys, positions, decoded_keys),
        jax.vmap(_chains.add_rows)(values, positions, decoded_values),
    )


def unpack_pages(tiles: tuple[LoopTiles, ...], loop: int, config: CacheConfig) -> tuple[jax.Array, jax.Array]:
    """float32 K and V ``[pages, page_size, H, D]`` of loop ``loop`` (0-based); ``config`` (the layer's)
    says which loops start a chain."""
    return _chains.decode_loops(tuple(enumerate(tiles)), _loop_step(config), loop, config.chain_starts())
