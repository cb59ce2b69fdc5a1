"""INT4 affine codec (FlashLoop-compatible), bit-exact with ``reference.int4``.

Per group in float32: ``min = amin(x)`` (-0.0 counted as +0.0), ``span = amax(x) - min``,
``scale = span / 15`` (``1`` when ``span == 0``), ``code = clamp(rne((x - min) /
scale), 0, 15)``; min and scale are then stored as float16 (RNE, saturating at
+-65504). Decode: ``code * float32(scale16) + float32(min16)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import numerics
from .codec_spec import CodecSpec
from .nibbles import pack_nibbles, unpack_nibbles
from .packed import Packed


def _grouped(x: jax.Array, spec: CodecSpec) -> jax.Array:
    """View ``[T, H, C]`` as groups; partial groups are padded with edge values.

    Returns ``[T/G, G, H, C]`` for the channel axis and ``[T, H, C/G, G]`` for
    the token axis (sizes rounded up). Edge padding repeats a member of the
    group, so it changes neither its min nor its max.
    """
    tokens, _, channels = x.shape
    group = spec.group_size
    if spec.axis == "channel":
        padded = math.ceil(tokens / group) * group
        x = jnp.pad(x, [(0, padded - tokens), (0, 0), (0, 0)], mode="edge")
        return x.reshape(padded // group, group, *x.shape[1:])
    padded = math.ceil(channels / group) * group
    x = jnp.pad(x, [(0, 0), (0, 0), (0, padded - channels)], mode="edge")
    return x.reshape(*x.shape[:2], padded // group, group)


def _ungrouped(grouped: jax.Array, spec: CodecSpec, shape) -> jax.Array:
    """Inverse of :func:`_grouped` (drops the padding)."""
    tokens, heads, channels = shape
    if spec.axis == "channel":
        return grouped.reshape(-1, heads, channels)[:tokens]
    return grouped.reshape(tokens, heads, -1)[..., :channels]


def _expand(metadata: jax.Array, spec: CodecSpec) -> jax.Array:
    """Insert the within-group axis so metadata broadcasts against groups."""
    return metadata[:, None] if spec.axis == "channel" else metadata[..., None]


def group_parameters(x: jax.Array, spec: CodecSpec, implementation: str):
    """float32 per-group ``(minimum, scale)`` of ``x`` float32 ``[T, H, C]``.

    Both are shaped ``spec.metadata_shape(x.shape)``.
    """
    groups = _grouped(x, spec)
    # -0.0 counts as +0.0, so the result never depends on reduction order.
    groups = jnp.where(groups == 0, jnp.float32(0.0), groups)
    reduce_axis = 1 if spec.axis == "channel" else -1
    minimum = groups.min(axis=reduce_axis)
    span = groups.max(axis=reduce_axis) - minimum
    scale = jnp.where(
        span > 0, numerics.divide(span, jnp.float32(15.0), implementation), jnp.float32(1.0)
    )
    return minimum, scale


def codes_from_parameters(x, minimum, scale, spec: CodecSpec, implementation: str) -> jax.Array:
    """uint8 codes ``[T, H, C]`` of float32 ``x`` given float32 group parameters."""
    groups = _grouped(x, spec)
    quotient = numerics.divide(
        groups - _expand(minimum, spec), _expand(scale, spec), implementation
    )
    codes = jnp.clip(numerics.round_half_to_even(quotient), 0.0, 15.0)
    codes = jnp.where(jnp.isnan(codes), 0.0, codes)
    return _ungrouped(codes, spec, x.shape).astype(jnp.uint8)


def encode_int4(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    """Encode ``x`` ``[T, H, C]`` (float32/bfloat16/float16) with an INT4 ``spec``."""
    x = x.astype(jnp.float32)
    minimum, scale = group_parameters(x, spec, implementation)
    codes = codes_from_parameters(x, minimum, scale, spec, implementation)
    return Packed(
        payload=pack_nibbles(codes),
        scale=numerics.round_to_float16(scale).astype(jnp.float16),
        minimum=numerics.round_to_float16(minimum).astype(jnp.float16),
        global_scale=None,
        spec=spec,
        shape=tuple(x.shape),
    )


def decode_int4(packed: Packed) -> jax.Array:
    """float32 ``[T, H, C]``: ``code * float32(scale16) + float32(min16)``."""
    spec, shape = packed.spec, packed.shape
    codes = unpack_nibbles(packed.payload, shape[2]).astype(jnp.float32)
    groups = _grouped(codes, spec)
    scale = _expand(packed.scale.astype(jnp.float32), spec)
    minimum = _expand(packed.minimum.astype(jnp.float32), spec)
    return _ungrouped(groups * scale + minimum, spec, shape)
