"""`PagedStream`: one stream (K or V of one loop, one layer) stored page by page.

Each (kv_head, page) tile is encoded on its own, as a ``[rows, 1, head_dim]``
tensor, so every quantization group and every NVFP4 tensor scale is local to
one page and one head: a page can be freed, moved or shared alone, and KV
heads can be sharded across devices without cross-device reductions.

Layout (head-major, so one tile is contiguous in memory):

* ``payload``: uint32 ``[kv_heads, pages, rows, head_dim / 8]``: the codec's
  bytes read as little-endian words, so channel ``8w + i`` is nibble ``i`` of
  word ``w`` (kernels load 8 codes per 32-bit load; the bytes in memory are
  exactly the codec's payload)
* ``scale``: INT4 channel axis: float16 ``[kv_heads, pages, rows / group, head_dim]``;
  INT4 token axis: float16 ``[kv_heads, pages, rows, ceil(head_dim / group)]``;
  NVFP4: float8_e4m3fn ``[kv_heads, pages, rows, ceil(head_dim / 16)]``
* ``minimum``: INT4 only, like ``scale``
* ``global_scale``: NVFP4 only, float32 ``[kv_heads, pages]`` (per tile)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .codecs import CodecSpec, Packed, decode, encode
from .ops import _dispatch


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
        return jax.tree.map(lambda leaf: leaf[:, pages], self)

    def put(self, pages: jax.Array, tiles: PagedStream) -> PagedStream:
        """Write ``tiles`` (``n`` pages) at ``pages``; ids outside the pool are dropped."""
        return jax.tree.map(lambda leaf, new: leaf.at[:, pages].set(new, mode="drop"), self, tiles)


jax.tree_util.register_dataclass(
    PagedStream,
    data_fields=["payload", "scale", "minimum", "global_scale"],
    meta_fields=["spec", "rows", "head_dim"],
)


def empty_stream(spec: CodecSpec, kv_heads: int, pages: int, rows: int, head_dim: int) -> PagedStream:
    """An all-zero pool of ``pages`` tiles."""
    template = jax.eval_shape(
        lambda: encode_tiles(jnp.zeros((pages, rows, kv_heads, head_dim), jnp.float32), spec)
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)


def words_from_bytes(payload: jax.Array) -> jax.Array:
    """uint8 ``[..., 4n]`` -> uint32 ``[..., n]`` (little-endian, same memory)."""
    return jax.lax.bitcast_convert_type(payload.reshape(*payload.shape[:-1], -1, 4), jnp.uint32)


def bytes_from_words(words: jax.Array) -> jax.Array:
    """uint32 ``[..., n]`` -> uint8 ``[..., 4n]`` (little-endian, same memory)."""
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*words.shape[:-1], -1)


def _tile_packed(stream: PagedStream) -> Packed:
    """View the stream's tiles as a ``[heads, pages]`` batch of ``[rows, 1, D]`` Packed."""
    def add_head_axis(leaf):
        return None if leaf is None else leaf[:, :, :, None, :]

    return Packed(
        payload=add_head_axis(bytes_from_words(stream.payload)),
        scale=add_head_axis(stream.scale),
        minimum=add_head_axis(stream.minimum),
        global_scale=stream.global_scale,
        spec=stream.spec,
        shape=(stream.rows, 1, stream.head_dim),
        global_scale_origin="tensor_amax" if stream.spec.format == "nvfp4" else None,
    )


def _kernel_can_encode(rows: int, head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and rows >= 1


def _encode_tiles_with_kernel(x: jax.Array, spec: CodecSpec) -> PagedStream:
    """The Pallas quantize-on-write kernel (interpret mode off GPU)."""
    from jflashloop_pallas_kernels.quantize import TileFormat
    from jflashloop_pallas_kernels.quantize import encode_tiles as encode_tiles_kernel

    pages, rows, heads, head_dim = x.shape
    padded_rows = 1 << (rows - 1).bit_length()
    tiles = jnp.transpose(x, (2, 0, 1, 3)).reshape(heads * pages, rows, head_dim)
    if padded_rows != rows:  # only token-axis (sparse) streams: rows are independent
        tiles = jnp.pad(tiles, ((0, 0), (0, padded_rows - rows), (0, 0)))
    encoded = encode_tiles_kernel(
        tiles, TileFormat(spec.format, spec.axis, spec.group_size),
        interpret=jax.default_backend() != "gpu",
    )

    def per_tile(leaf, keep_rows):
        leaf = leaf.reshape(heads, pages, *leaf.shape[1:])
        return leaf[:, :, :keep_rows] if keep_rows is not None else leaf

    meta_rows = rows // spec.group_size if spec.axis == "channel" else rows
    return PagedStream(
        payload=per_tile(encoded["payload"], rows),
        scale=per_tile(encoded["scale"], meta_rows),
        minimum=per_tile(encoded["minimum"], meta_rows) if "minimum" in encoded else None,
        global_scale=encoded["global_scale"].reshape(heads, pages) if "global_scale" in encoded else None,
        spec=spec,
        rows=rows,
        head_dim=head_dim,
    )


def encode_tiles(x: jax.Array, spec: CodecSpec, implementation: str | None = None) -> PagedStream:
    """Encode pages ``x`` float32 ``[pages, rows, kv_heads, head_dim]`` tile by tile.

    Returns a :class:`PagedStream` of ``pages`` tiles (NVFP4 tensor scale from
    each tile's own amax). ``implementation``: ``"pallas"`` uses the fused
    quantize-on-write kernel (the default on GPU, where it is the bit-exact
    path), ``"xla"`` the jittable codec.
    """
    _, rows, _, head_dim = x.shape
    if head_dim % 8:
        raise ValueError(f"paged streams need head_dim divisible by 8, got {head_dim}")
    implementation = _dispatch.resolve(implementation).backend
    if implementation == "pallas" and spec.format in ("int4", "nvfp4") and _kernel_can_encode(rows, head_dim):
        return _encode_tiles_with_kernel(x, spec)
    tiles = jnp.transpose(x, (2, 0, 1, 3))[:, :, :, None, :]  # [heads, pages, rows, 1, D]

    def encode_one(tile):
        return encode(tile, spec, implementation=implementation)

    packed = jax.vmap(jax.vmap(encode_one))(tiles)

    def drop_head_axis(leaf):
        return None if leaf is None else leaf[:, :, :, 0, :]

    return PagedStream(
        payload=words_from_bytes(drop_head_axis(packed.payload)),
        scale=drop_head_axis(packed.scale),
        minimum=drop_head_axis(packed.minimum),
        global_scale=packed.global_scale,
        spec=spec,
        rows=rows,
        head_dim=head_dim,
    )


def can_encode_page_pairs(
    rows: int, head_dim: int, key_spec: CodecSpec, value_spec: CodecSpec, implementation: str | None = None
) -> bool:
    """Whether :func:`encode_page_pairs` takes the one-kernel path for these streams."""
    return (
        _dispatch.resolve(implementation).backend == "pallas"
        and key_spec.format in ("int4", "nvfp4")
        and value_spec.format in ("int4", "nvfp4")
        and _kernel_can_encode(rows, head_dim)
        and rows & (rows - 1) == 0
    )


def encode_page_pairs(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    key_spec: CodecSpec,
    value_spec: CodecSpec,
    sink_tokens: int,
) -> tuple[PagedStream, PagedStream]:
    """Encode the K and V tiles of whole pages in one fused kernel.

    Args:
      keys, values: float32 ``[pages, rows, kv_heads, head_dim]``.
      page_numbers: int32 ``[pages]``, each page's index in its sequence.
      sink_tokens: rows ``< sink_tokens`` of a sequence's page 0 are replaced
        by row ``sink_tokens`` before encoding (as ``page_chain.mask_sink_rows``).
    Returns:
      ``(key_stream, value_stream)``, the same bits as :func:`encode_tiles` of
      the masked pages. Only where :func:`can_encode_page_pairs` holds (interpret
      mode off GPU).
    """
    from jflashloop_pallas_kernels.quantize import TileFormat
    from jflashloop_pallas_kernels.quantize import encode_page_pairs as encode_page_pairs_kernel

    _, rows, _, head_dim = keys.shape
    encoded = encode_page_pairs_kernel(
        keys, values, page_numbers,
        TileFormat(key_spec.format, key_spec.axis, key_spec.group_size),
        TileFormat(value_spec.format, value_spec.axis, value_spec.group_size),
        sink_tokens=sink_tokens, interpret=jax.default_backend() != "gpu",
    )

    def stream(outputs, spec):
        return PagedStream(
            payload=outputs["payload"],
            scale=outputs["scale"],
            minimum=outputs.get("minimum"),
            global_scale=outputs.get("global_scale"),
            spec=spec,
            rows=rows,
            head_dim=head_dim,
        )

    return stream(encoded[0], key_spec), stream(encoded[1], value_spec)


def decode_tiles(stream: PagedStream) -> jax.Array:
    """Decode every tile: float32 ``[pages, rows, kv_heads, head_dim]``."""
    decoded = jax.vmap(jax.vmap(lambda p: decode(p, jnp.float32)))(_tile_packed(stream))
    return jnp.transpose(decoded[:, :, :, 0, :], (1, 2, 0, 3))
