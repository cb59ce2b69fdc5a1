"""Two 4-bit codes per byte, even channel in the low nibble."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
