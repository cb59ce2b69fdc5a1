"""`Packed` (an encoded tensor and its metadata, as a pytree), nibble, 3-bit, 2-bit and mixed-width packing."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from ._spec import CodecSpec

GlobalScaleOrigin = Literal["tensor_amax", "given"]


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed ``[tokens, kv_heads, channels]`` tensor.

    Array leaves (they may carry extra leading axes under ``vmap``):

    * ``payload``: uint8 ``[tokens, kv_heads, spec.payload_bytes_per_row(channels)]``.
      4-bit formats: ``ceil(channels / 2)`` bytes; byte ``c // 2`` holds
      channel ``c`` (even) in its low nibble and ``c + 1`` in its high nibble;
      an odd channel count leaves the last high nibble zero. INT3:
      ``ceil(3 * channels / 8)`` bytes (:func:`pack_triplets`); INT2:
      ``ceil(channels / 4)`` bytes (:func:`pack_crumbs`); ``int_mixed``:
      ``ceil(row_bits / 8)`` bytes (:func:`pack_widths`); ``int4_scaled``: INT4's.
    * ``scale``: the affine formats (INT4, INT3, INT2 and the fitted ones): float16 ``spec.metadata_shape(shape)``; NVFP4:
      float8_e4m3fn ``[tokens, kv_heads, ceil(channels / 16)]``.
    * ``minimum``: the affine formats only, float16, same shape as ``scale``; None for NVFP4.
    * ``global_scale``: NVFP4 only, float32 ``[]``: the decode multiplier
      (``x ~ e2m1 * scale * global_scale``); None for INT4.

    Static (aux) data: ``spec`` (:class:`CodecSpec`), ``shape`` (the logical
    shape) and, for NVFP4, ``global_scale_origin``: ``"tensor_amax"`` when the
    global scale was ``max(amax(|x|), 1e-12) / (6 * 448)`` of this tensor,
    ``"given"`` when the caller supplied it.
    """

    payload: jax.Array
    scale: jax.Array
    minimum: jax.Array | None
    global_scale: jax.Array | None
    spec: CodecSpec = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int, int] = dataclasses.field(metadata={"static": True})
    global_scale_origin: GlobalScaleOrigin | None = dataclasses.field(
        default=None, metadata={"static": True}
    )

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the array leaves (all leading batch axes included)."""
        return sum(
            math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(self)
        )

    @property
    def bits_per_element(self) -> float:
        """Stored bits per logical element."""
        leading = math.prod(self.payload.shape[:-3])
        return 8.0 * self.nbytes / (leading * math.prod(self.shape))


jax.tree_util.register_dataclass(
    Packed,
    data_fields=["payload", "scale", "minimum", "global_scale"],
    meta_fields=["spec", "shape", "global_scale_origin"],
)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack uint8 codes ``[..., C]`` (values 0-15) into ``[..., ceil(C / 2)]`` bytes.

    Byte ``c // 2`` holds channel ``c`` (even) in bits 0-3 and channel
    ``c + 1`` in bits 4-7; an odd ``C`` leaves the last high nibble zero.
    """
    channels = codes.shape[-1]
    if channels % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array, channels: int) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: ``[..., ceil(C / 2)]`` bytes to uint8 ``[..., C]``."""
    low = packed & jnp.uint8(0x0F)
    high = packed >> jnp.uint8(4)
    codes = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :channels]


def pack_triplets(codes: jax.Array) -> jax.Array:
    """Pack uint8 codes ``[..., C]`` (values 0-7) into ``[..., ceil(3 * C / 8)]`` bytes.

    A little-endian bit stream along the last axis: code ``c`` holds bits
    ``3c .. 3c + 2``, bit ``b`` being bit ``b % 8`` of byte ``b // 8``. Every 8
    codes fill 3 bytes (code ``8j + i`` at bits ``3i .. 3i + 2`` of the
    little-endian 24-bit word in bytes ``3j .. 3j + 2``); the bits past
    ``3 * C`` are zero.
    """
    channels = codes.shape[-1]
    padded = -(-channels // 8) * 8
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, padded - channels)])
    octets = codes.reshape(*codes.shape[:-1], -1, 8).astype(jnp.uint32)
    words = jnp.zeros(octets.shape[:-1], jnp.uint32)
    for i in range(8):
        words = words | (octets[..., i] << jnp.uint32(3 * i))
    triples = jnp.stack([(words >> jnp.uint32(8 * k)) & jnp.uint32(0xFF) for k in range(3)], axis=-1)
    return triples.reshape(*codes.shape[:-1], -1)[..., : (3 * channels + 7) // 8].astype(jnp.uint8)


def unpack_triplets(packed: jax.Array, channels: int) -> jax.Array:
    """Inverse of :func:`pack_triplets`: ``[..., ceil(3 * C / 8)]`` bytes to uint8 ``[..., C]``."""
    padded = -(-channels // 8) * 3
    packed = jnp.pad(packed, [(0, 0)] * (packed.ndim - 1) + [(0, padded - packed.shape[-1])])
    triples = packed.reshape(*packed.shape[:-1], -1, 3).astype(jnp.uint32)
    words = triples[..., 0] | (triples[..., 1] << jnp.uint32(8)) | (triples[..., 2] << jnp.uint32(16))
    codes = jnp.stack([(words >> jnp.uint32(3 * i)) & jnp.uint32(7) for i in range(8)], axis=-1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :channels].astype(jnp.uint8)


def pack_crumbs(codes: jax.Array) -> jax.Array:
    """Pack uint8 codes ``[..., C]`` (values 0-3) into ``[..., ceil(C / 4)]`` bytes.

    Byte ``c // 4`` holds code ``c`` at bits ``2 (c % 4) .. 2 (c % 4) + 1`` (a little-endian bit stream at
    two bits a code); the bits past ``2 * C`` are zero.
    """
    channels = codes.shape[-1]
    padded = -(-channels // 4) * 4
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, padded - channels)])
    quads = codes.reshape(*codes.shape[:-1], -1, 4).astype(jnp.uint8)
    packed = quads[..., 0]
    for i in range(1, 4):
        packed = packed | (quads[..., i] << jnp.uint8(2 * i))
    return packed


def unpack_crumbs(packed: jax.Array, channels: int) -> jax.Array:
    """Inverse of :func:`pack_crumbs`: ``[..., ceil(C / 4)]`` bytes to uint8 ``[..., C]``."""
    codes = jnp.stack([(packed >> jnp.uint8(2 * i)) & jnp.uint8(3) for i in range(4)], axis=-1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :channels]


def _width_bits(widths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Static bit sources of a mixed-width row: for each head and row bit, ``(channel, bit of its code, used)``,
    each int/bool ``[H, 8 * ceil(row_bits / 8)]``."""
    heads, _ = widths.shape
    row_bytes = (int(widths.sum(axis=1).max()) + 7) // 8
    channel = np.zeros((heads, 8 * row_bytes), np.int32)
    bit = np.zeros((heads, 8 * row_bytes), np.int32)
    for head in range(heads):
        sources = [(c, b) for c, width in enumerate(widths[head]) for b in range(int(width))]
        channel[head, :len(sources)] = [c for c, _ in sources]
        bit[head, :len(sources)] = [b for _, b in sources]
    used = np.arange(8 * row_bytes)[None, :] < widths.sum(axis=1)[:, None]
    return channel, bit, used


def pack_widths(codes: jax.Array, widths) -> jax.Array:
    """Pack uint8 codes ``[..., H, C]`` of per-(head, channel) widths ``widths`` (int ``[H, C]``, 1-8 bits) into
    bytes ``[..., H, ceil(max_row_bits / 8)]``.

    A little-endian bit stream along each row: channel ``c`` of head ``h`` holds bits ``sum(widths[h, :c]) ..
    sum(widths[h, :c + 1]) - 1`` (least significant first), bit ``i`` being bit ``i % 8`` of byte ``i // 8``;
    the bits past the head's row width are zero. Bits of a code above its width are ignored.
    """
    channel, bit, used = _width_bits(np.asarray(widths))
    index = jnp.broadcast_to(jnp.asarray(channel), (*codes.shape[:-1], channel.shape[-1]))
    bits = (jnp.take_along_axis(codes.astype(jnp.uint8), index, axis=-1) >> jnp.asarray(bit, jnp.uint8)) & 1
    bits = jnp.where(jnp.asarray(used), bits, jnp.uint8(0))
    octets = bits.reshape(*bits.shape[:-1], -1, 8)
    return jnp.sum(octets << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_widths(packed: jax.Array, widths) -> jax.Array:
    """Inverse of :func:`pack_widths`: bytes ``[..., H, ceil(max_row_bits / 8)]`` to uint8 codes ``[..., H, C]``."""
    widths = np.asarray(widths)
    heads, channels = widths.shape
    top = int(widths.max())
    offsets = np.cumsum(widths, axis=1) - widths  # [H, C]
    index = offsets[..., None] + np.arange(top)  # [H, C, top]
    used = np.arange(top) < widths[..., None]
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)  # [..., H, 8 * bytes]
    index = np.where(used, index, 0).reshape(heads, channels * top)
    gathered = jnp.take_along_axis(bits, jnp.broadcast_to(jnp.asarray(index), (*bits.shape[:-1], index.shape[-1])),
                                   axis=-1).reshape(*bits.shape[:-1], channels, top)
    gathered = jnp.where(jnp.asarray(used), gathered, jnp.uint8(0))
    return jnp.sum(gathered << jnp.arange(top, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)
