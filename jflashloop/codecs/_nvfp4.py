"""NVFP4 codec, bit-exact with ``reference.nvfp4``.

E2M1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; sign in bit 3), one E4M3
scale per 16 consecutive channels, one float32 global scale per tensor. The
global scale is the decode multiplier: ``x ~ e2m1 * float32(scale) * global``.

float32 subnormal inputs are read as zeros of their sign. A given global
scale must be at least :data:`MINIMUM_GIVEN_GLOBAL_SCALE` (``2**-116``), so
that every scale product and decoded value is a float32 normal. Non-finite
elements take no part in the tensor or block amax; +-inf is stored
as +-6 (saturated) and NaN as +0. :func:`encode_nvfp4_with_statistics` counts
them and the finite elements beyond the representable range.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..ops import _dispatch
from ..ops._division import divide
from . import _floats as floats
from ._packed import Packed, pack_nibbles, unpack_nibbles
from ._spec import NVFP4_BLOCK_SIZE, CodecSpec
from ._statistics import EncodeStatistics, count, nvfp4_saturated

GLOBAL_SCALE_DIVISOR = 6.0 * 448.0
AMAX_FLOOR = 1e-12
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MINIMUM_GIVEN_GLOBAL_SCALE = 2.0**-116
"""Smallest accepted given global scale: ``2**-9 * global`` (the smallest block
denominator) and ``0.5 * 2**-9 * global`` (the smallest nonzero decoded
magnitude) stay float32 normals, whose arithmetic no backend flushes."""
SATURATION_QUOTIENT = 7.0
"""``|x| / (local * global)`` at or above this counts as saturated: halfway from
E2M1's largest magnitude 6 to the next power of two, so E2M1 with an unbounded
range would have rounded it to 8 or more."""


def global_scale_from_amax(amax: jax.Array, implementation: str | None = None) -> jax.Array:
    """Default global scale ``max(amax, 1e-12) / (6 * 448)`` as float32 ``[]``.

    Use it to fix the global scale of a streamed cache from a calibrated amax.
    """
    implementation = _dispatch.resolve(implementation)
    amax = jnp.maximum(jnp.asarray(amax, jnp.float32), jnp.float32(AMAX_FLOOR))
    return divide(amax, jnp.float32(GLOBAL_SCALE_DIVISOR), implementation)


def e2m1_code(magnitude: jax.Array) -> jax.Array:
    """3-bit E2M1 code of float32 magnitudes >= 0: nearest, ties to even, saturating.

    The thresholds are the midpoints between neighbouring magnitudes; at a
    midpoint the even code wins, hence the alternation of ``>`` and ``>=``.
    """
    return (
        (magnitude > 0.25).astype(jnp.uint8)
        + (magnitude >= 0.75)
        + (magnitude > 1.25)
        + (magnitude >= 1.75)
        + (magnitude > 2.5)
        + (magnitude >= 3.5)
        + (magnitude > 5.0)
    ).astype(jnp.uint8)


def _blocks(x: jax.Array) -> jax.Array:
    """``[T, H, C]`` -> ``[T, H, ceil(C/16), 16]``, zero padded."""
    channels = x.shape[-1]
    padded = math.ceil(channels / NVFP4_BLOCK_SIZE) * NVFP4_BLOCK_SIZE
    x = jnp.pad(x, [(0, 0), (0, 0), (0, padded - channels)])
    return x.reshape(*x.shape[:2], -1, NVFP4_BLOCK_SIZE)


def block_scales(block_amax: jax.Array, global_scale: jax.Array, implementation: str) -> jax.Array:
    """float32 E4M3 values ``clamp(amax16 / (6 * global), 2**-9, 448)`` rounded RNE."""
    six_global = jnp.float32(6.0) * global_scale
    local = divide(block_amax, six_global, implementation)
    local = jnp.clip(local, floats.E4M3_MIN_SUBNORMAL, floats.E4M3_MAX)
    return floats.round_to_e4m3(local)


def finite_magnitudes(x: jax.Array) -> jax.Array:
    """``|x|`` with non-finite elements replaced by 0 (they take no part in any amax)."""
    return jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.float32(0.0))


def _encode(x: jax.Array, spec: CodecSpec, implementation: str, global_scale: jax.Array | None):
    x = floats.flush_subnormals(x.astype(jnp.float32))
    origin = "given" if global_scale is not None else "tensor_amax"
    if global_scale is None:
        global_scale = global_scale_from_amax(jnp.max(finite_magnitudes(x)), implementation)
    global_scale = jnp.asarray(global_scale, jnp.float32).reshape(())
    blocks = _blocks(x)
    magnitudes = jnp.abs(blocks)
    scale = block_scales(finite_magnitudes(blocks).max(axis=-1), global_scale, implementation)
    denominator = scale * global_scale
    quotient = divide(magnitudes, denominator[..., None], implementation)
    # NaN: all E2M1 thresholds compare False (code 0), and its sign bit is ignored.
    sign = (jnp.signbit(blocks) & ~jnp.isnan(blocks)).astype(jnp.uint8) << 3
    codes = (e2m1_code(quotient) | sign).reshape(*x.shape[:2], -1)[..., : x.shape[2]]
    packed = Packed(
        payload=pack_nibbles(codes),
        scale=scale.astype(jnp.float8_e4m3fn),
        minimum=None,
        global_scale=global_scale,
        spec=spec,
        shape=tuple(x.shape),
        global_scale_origin=origin,
    )
    return packed, blocks, quotient


def _statistics(blocks: jax.Array, quotient: jax.Array, global_scale: jax.Array, channels: int) -> EncodeStatistics:
    """Counts over zero-padded blocks of ``channels`` real channels (padding counts nowhere).

    A non-finite global scale (only a traced one gets past the argument
    check) decodes every element to NaN or inf: every finite element counts
    as saturated.
    """
    finite = jnp.isfinite(blocks)
    real = (jnp.arange(blocks.shape[-2] * blocks.shape[-1]) < channels).reshape(blocks.shape[-2:])
    saturated = finite & real & ((quotient >= SATURATION_QUOTIENT) | nvfp4_saturated(global_scale))
    return EncodeStatistics(nonfinite=count(~finite), saturated=count(saturated))


def encode_nvfp4(
    x: jax.Array, spec: CodecSpec, implementation: str, global_scale: jax.Array | None = None
) -> Packed:
    """Encode ``x`` ``[T, H, C]`` (float32/bfloat16/float16) as NVFP4.

    Args:
      global_scale: float32 ``[]`` decode multiplier; None derives it from this
        tensor's finite amax (see :func:`global_scale_from_amax`).
    """
    return _encode(x, spec, implementation, global_scale)[0]


def encode_nvfp4_with_statistics(
    x: jax.Array, spec: CodecSpec, implementation: str, global_scale: jax.Array | None = None
) -> tuple[Packed, EncodeStatistics]:
    """:func:`encode_nvfp4` and its :class:`EncodeStatistics`."""
    packed, blocks, quotient = _encode(x, spec, implementation, global_scale)
    return packed, _statistics(blocks, quotient, packed.global_scale, x.shape[2])


def e2m1_values(codes: jax.Array) -> jax.Array:
    """float32 values of 4-bit E2M1 codes (sign in bit 3)."""
    table = jnp.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), jnp.float32)
    return table[codes.astype(jnp.int32)]


def _split_power_of_two(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x = mantissa * power`` exactly, ``mantissa`` in [1, 2), ``power`` a power of two.

    For positive normal float32 ``x`` (integer arithmetic on the bits).
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    exponent_bits = bits & jnp.uint32(0x7F800000)
    mantissa = jax.lax.bitcast_convert_type((bits & jnp.uint32(0x807FFFFF)) | jnp.uint32(0x3F800000), jnp.float32)
    power = jax.lax.bitcast_convert_type(exponent_bits, jnp.float32)
    return mantissa, power


def decode_nvfp4(packed: Packed) -> jax.Array:
    """float32 ``[T, H, C]``: ``(e2m1 * float32(scale)) * global_scale``.

    The global multiply is done as ``((e2m1 * scale) * mantissa) * 2**k`` with
    ``global_scale = mantissa * 2**k``: the same value (scaling by a power of
    two is exact), but the last product is exact, so a compiler that fuses it
    with a consumer's addition (XLA on CPU contracts ``a * b + c`` into one
    fused multiply-add) cannot change the sum.
    """
    shape = packed.shape
    values = e2m1_values(unpack_nibbles(packed.payload, shape[2]))
    values = _blocks(values)
    local = packed.scale.astype(jnp.float32)[..., None]
    mantissa, power = _split_power_of_two(packed.global_scale)
    decoded = ((values * local) * mantissa) * power
    return decoded.reshape(*shape[:2], -1)[..., : shape[2]]
