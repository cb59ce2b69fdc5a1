"""`Packed` (an encoded tensor and its metadata, as a pytree) and nibble packing."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from ._spec import CodecSpec

GlobalScaleOrigin = Literal["tensor_amax", "given"]


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed ``[tokens, kv_heads, channels]`` tensor.

    Array leaves (they may carry extra leading axes under ``vmap``):

    * ``payload``: uint8 ``[tokens, kv_heads, ceil(channels / 2)]``; byte
      ``c // 2`` holds channel ``c`` (even) in its low nibble and ``c + 1`` in
      its high nibble; an odd channel count leaves the last high nibble zero.
    * ``scale``: INT4: float16 ``spec.metadata_shape(shape)``; NVFP4:
      float8_e4m3fn ``[tokens, kv_heads, ceil(channels / 16)]``.
    * ``minimum``: INT4 only, float16, same shape as ``scale``; None for NVFP4.
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
