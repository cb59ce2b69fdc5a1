"""What a paged cross-loop cache holds: its pytrees, from the whole cache down to one tile.

* :class:`PagedKVCache`: the block tables, lengths, flags and counters of
  every sequence slot, and one :class:`LayerPool` per layer;
* :class:`LayerPool`: one layer's page pool (one :class:`LoopTiles` per
  loop) and its unquantized sink and ring windows;
* :class:`LoopTiles`: one loop's K and V tiles of every page (and, for a
  sparse loop, the position of each stored row);
* :class:`PagedStream`: one stream (K or V of one loop) as a pool of
  encoded page tiles.

Each (kv_head, page) tile is encoded on its own, as a ``[rows, 1, head_dim]``
tensor, so every quantization group and every NVFP4 tensor scale is local to
one page and one head: a page can be freed, moved or shared alone, and KV
heads can be sharded across devices without cross-device reductions.

Tile layout (head-major, so one tile is contiguous in memory):

* ``payload``: uint32 ``[kv_heads, pages, rows, payload_bytes_per_row(head_dim) / 4]``
  (``head_dim / 8`` for the 4-bit formats): the codec's bytes read as
  little-endian words (:func:`words_from_bytes`), so for a 4-bit format
  channel ``8w + i`` is nibble ``i`` of word ``w`` (kernels load 8 codes per
  32-bit load). The bytes in memory are exactly the codec's payload, except
  NVFP4's: each of its bytes holds the same two codes with its bits in page
  order (``jflashloop_pallas_kernels.nvfp4_pages``: :func:`stored_words`
  writes it, :func:`codec_words` reads it back; files hold the codec's
  order, :func:`interchange_order`). INT3 rows take ``3 * head_dim / 32``
  words (its bit stream, 32 codes per 3 words), INT2 rows ``head_dim / 16``
  (16 codes a word); no kernel reads either
* ``scale``: INT4 / INT3 / INT2 channel axis: float16 ``[kv_heads, pages, rows / group, head_dim]``;
  INT4 / INT3 / INT2 token axis: float16 ``[kv_heads, pages, rows, ceil(head_dim / group)]``;
  NVFP4: float8_e4m3fn ``[kv_heads, pages, rows, ceil(head_dim / 16)]``
* ``minimum``: the affine formats (INT4, INT3, INT2) only, like ``scale``
* ``global_scale``: NVFP4 only, float32 ``[kv_heads, pages]`` (per tile)

``error_flags`` hold the ``ERROR_*`` bits below (``jflashloop.paged_cache``
describes when each is set).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jflashloop_pallas_kernels import nvfp4_pages

from ..codecs import CodecSpec, Packed
from ._config import CacheConfig

ERROR_OUT_OF_PAGES = 1
ERROR_SEQUENCE_FULL = 2
ERROR_NONFINITE_INPUT = 4
ERROR_SLOT_REPLACED = 8
ERROR_INVALID_LENGTH = 16
ERROR_SATURATED = 32
ERROR_TEXT = {
    ERROR_OUT_OF_PAGES: "the page pool ran out of free pages (a full page, and every later one, was not stored)",
    ERROR_SEQUENCE_FULL: "the sequence exceeded max_pages_per_sequence * page_size tokens",
    ERROR_NONFINITE_INPUT: "NaN or +-inf K/V were written (stored as 0; see nonfinite_counts)",
    ERROR_SLOT_REPLACED: "prefill replaced a sequence that was still active in this slot",
    ERROR_INVALID_LENGTH: "prefill's length was outside [0, tokens] and was clamped",
    ERROR_SATURATED: "values were stored at their format's limit (see saturation_counts)",
}
WARNING_BITS = ERROR_SATURATED


def _take(tiles, pages: jax.Array):
    """Every leaf's entries ``pages`` of its page axis (axis 1: the leaves are head-major)."""
    return jax.tree.map(lambda leaf: leaf[:, pages], tiles)


def _put(tiles, pages: jax.Array, new):
    """``tiles`` with ``new`` written at ``pages`` of the page axis; ids outside the pool are dropped."""
    return jax.tree.map(lambda leaf, value: leaf.at[:, pages].set(value, mode="drop"), tiles, new)


@dataclasses.dataclass(frozen=True)
class PagedStream:
    """A pool of encoded page tiles of one stream (see the module docstring)."""

    payload: jax.Array
    scale: jax.Array
    minimum: jax.Array | None
    global_scale: jax.Array | None
    spec: CodecSpec = dataclasses.field(metadata={"static": True})
    rows: int = dataclasses.field(metadata={"static": True})
    head_dim: int = dataclasses.field(metadata={"static": True})

    @property
    def nbytes(self) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def take(self, pages: jax.Array) -> PagedStream:
        """The tiles of ``pages`` (int32 ``[n]``), as a stream of ``n`` pages."""
        return _take(self, pages)

    def put(self, pages: jax.Array, tiles: PagedStream) -> PagedStream:
        """Write ``tiles`` (``n`` pages) at ``pages``; ids outside the pool are dropped."""
        return _put(self, pages, tiles)


jax.tree_util.register_dataclass(
    PagedStream,
    data_fields=["payload", "scale", "minimum", "global_scale"],
    meta_fields=["spec", "rows", "head_dim"],
)


def words_from_bytes(payload: jax.Array) -> jax.Array:
    """uint8 ``[..., 4n]`` -> uint32 ``[..., n]`` (little-endian, same memory)."""
    return jax.lax.bitcast_convert_type(payload.reshape(*payload.shape[:-1], -1, 4), jnp.uint32)


def bytes_from_words(words: jax.Array) -> jax.Array:
    """uint32 ``[..., n]`` -> uint8 ``[..., 4n]`` (little-endian, same memory)."""
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*words.shape[:-1], -1)


def stored_words(words, spec: CodecSpec):
    """The codec's payload words (uint32 ``[...]``, numpy or jax) as a tile holds them: NVFP4's in page
    order (``jflashloop_pallas_kernels.nvfp4_pages``), every other format's unchanged."""
    return nvfp4_pages.to_page_order(words) if spec.format == "nvfp4" else words


def codec_words(words, spec: CodecSpec):
    """A tile's payload words (uint32 ``[...]``) in the codec's order: the inverse of :func:`stored_words`."""
    return nvfp4_pages.from_page_order(words) if spec.format == "nvfp4" else words


def _each_stream(tree, payload_map):
    def one(node):
        if not isinstance(node, PagedStream):
            return node
        return dataclasses.replace(node, payload=payload_map(node.payload, node.spec))

    return jax.tree.map(one, tree, is_leaf=lambda node: isinstance(node, PagedStream))


def interchange_order(tree):
    """``tree`` (any pytree holding :class:`PagedStream` s, numpy or jax leaves) with every stream's payload
    in the codec's byte order, as files hold it (:func:`codec_words`)."""
    return _each_stream(tree, codec_words)


def page_order(tree):
    """The inverse of :func:`interchange_order`: every stream's payload as tiles hold it (:func:`stored_words`)."""
    return _each_stream(tree, stored_words)


def tile_packed(stream: PagedStream) -> Packed:
    """View the stream's tiles as a ``[heads, pages]`` batch of ``[rows, 1, D]`` Packed (codec byte order)."""
    def add_head_axis(leaf):
        return None if leaf is None else leaf[:, :, :, None, :]

    return Packed(
        payload=add_head_axis(bytes_from_words(codec_words(stream.payload, stream.spec))),
        scale=add_head_axis(stream.scale),
        minimum=add_head_axis(stream.minimum),
        global_scale=stream.global_scale,
        spec=stream.spec,
        shape=(stream.rows, 1, stream.head_dim),
        global_scale_origin="tensor_amax" if stream.spec.format == "nvfp4" else None,
    )


@dataclasses.dataclass(frozen=True)
class LoopTiles:
    """The stored tiles of one loop for some pages.

    Attributes:
      keys, values: :class:`PagedStream` (``rows`` per tile); None for a loop
        that stores no rows (a predicted loop with ``sparse_rows_per_page=0``).
      row_positions: sparse loops only: int8 ``[kv_heads, pages, rows]``, the
        position inside the page that each compact row updates (increasing;
        -1 marks an unused row); None for dense loops and loops with no rows.
    """

    keys: PagedStream | None
    values: PagedStream | None
    row_positions: jax.Array | None

    def take(self, pages: jax.Array) -> LoopTiles:
        """The tiles of ``pages`` (int32 ``[n]``) of both streams (and their row positions)."""
        return _take(self, pages)

    def put(self, pages: jax.Array, tiles: LoopTiles) -> LoopTiles:
        """Write ``tiles`` (``n`` pages) at ``pages``; ids outside the pool are dropped."""
        return _put(self, pages, tiles)


jax.tree_util.register_dataclass(
    LoopTiles, data_fields=["keys", "values", "row_positions"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class LayerPool:
    """One layer's storage.

    Attributes:
      loops: one :class:`LoopTiles` per loop, each with
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
      page_refs: int32 ``[num_pages]``: how many block-table entries hold
        each page (0 = free; more than 1 = shared by :func:`fork` ed
        sequences, always at the same block-table column).
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
    page_refs: jax.Array
    error_flags: jax.Array
    nonfinite_counts: jax.Array
    saturation_counts: jax.Array
    config: CacheConfig = dataclasses.field(metadata={"static": True})

    @property
    def page_free(self) -> jax.Array:
        """bool ``[num_pages]``: pages no sequence holds (``page_refs == 0``)."""
        return self.page_refs == 0

    @property
    def window_dtype(self):
        return jnp.dtype(self.config.window_dtype)


jax.tree_util.register_dataclass(
    PagedKVCache,
    data_fields=[
        "layers", "block_tables", "lengths", "active", "page_refs", "error_flags",
        "nonfinite_counts", "saturation_counts",
    ],
    meta_fields=["config"],
)


