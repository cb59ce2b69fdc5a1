"""Exact-float helpers: bit-exact float32 roundings shared by the codecs.

The codecs must give the same bits on every backend. Four traps decide the
design (all measured): XLA on GPU does not round float32 division correctly;
XLA's algebraic simplifier (on every backend, CPU included) rewrites a
division by a broadcast value into a multiplication by its reciprocal;
XLA on GPU may drop a float32 -> float16 -> float32 round trip inside one jit
(excess precision); Pallas-Triton cannot lower ``round``. So:

* divisions go through the exact-division op
  (:func:`jflashloop.ops._division.divide`: a Pallas kernel with PTX
  ``div.rn.f32`` on GPU, XLA's correctly rounded CPU division behind an
  optimization barrier that hides the denominator's broadcast);
* :func:`round_to_float16` and :func:`round_to_e4m3` return the rounded value
  as float32 computed with exact integer and power-of-two operations, so a
  later elided conversion cannot change it (``lax.reduce_precision`` would
  flush float16 subnormals to zero);
* XLA on CPU flushes float32 subnormal inputs and results of arithmetic to
  zero (FTZ/DAZ) while numpy and PTX's ``div.rn.f32`` do not: the codecs read
  float32 subnormal inputs as signed zeros (:func:`flush_subnormals`) and
  avoid every subnormal intermediate that could change a stored bit (INT4's
  minimum span, the minimum given NVFP4 global scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT16_MAX = 65504.0
FLOAT32_MIN_NORMAL = 2.0**-126
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_SUBNORMAL = 2.0**-9


def round_half_to_even(x: jax.Array) -> jax.Array:
    """Round float32 values to integers, ties to even (``jnp.round`` is RNE)."""
    return jnp.round(x)


def round_mantissa(x: jax.Array, dropped_bits: int) -> jax.Array:
    """Round float32 ``x`` to ``23 - dropped_bits`` mantissa bits (RNE) via its bits."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    lowest_kept_bit = (bits >> dropped_bits) & 1
    half_minus_one = jnp.uint32((1 << (dropped_bits - 1)) - 1)
    mask = jnp.uint32((0xFFFFFFFF << dropped_bits) & 0xFFFFFFFF)
    return jax.lax.bitcast_convert_type((bits + half_minus_one + lowest_kept_bit) & mask, jnp.float32)


def _round_to_multiple_of_power_of_two(x: jax.Array, exponent: int) -> jax.Array:
    """Round to the nearest multiple of ``2**exponent``, ties to even (exact scalings)."""
    return jnp.round(x * jnp.float32(2.0**-exponent)) * jnp.float32(2.0**exponent)


def round_to_float16(x: jax.Array) -> jax.Array:
    """Round float32 to the nearest float16 value (RNE), saturating at +-65504.

    Integer arithmetic on the float32 bits for float16 normals, an exact
    power-of-two scaling for float16 subnormals (``lax.reduce_precision``
    flushes those to zero). Returns float32 holding exactly a float16 value, so
    converting the result to float16 and back is the identity on every backend.
    """
    clipped = jnp.clip(x, -FLOAT16_MAX, FLOAT16_MAX)
    normal = round_mantissa(clipped, dropped_bits=13)
    subnormal = _round_to_multiple_of_power_of_two(clipped, exponent=-24)
    return jnp.where(jnp.abs(clipped) >= 2.0**-14, normal, subnormal)


def round_to_e4m3(x: jax.Array) -> jax.Array:
    """Round float32 values in ``[2**-9, 448]`` to the nearest E4M3 value (RNE).

    Integer arithmetic on the float32 bits for normal E4M3 values and an exact
    power-of-two scaling for subnormal ones. Returns float32 holding exactly a
    ``float8_e4m3fn`` value.
    """
    normal = round_mantissa(x, dropped_bits=20)
    subnormal = _round_to_multiple_of_power_of_two(x, exponent=-9)
    return jnp.where(x >= E4M3_MIN_NORMAL, normal, subnormal)


def cast_saturating(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """float32 ``x`` rounded to ``dtype`` (RNE), saturating instead of overflowing.

    A finite value that ``dtype`` rounds to +-inf becomes ``dtype``'s largest
    finite value of the same sign (float16: +-65504); NaN and +-inf are kept.

    Returns:
      ``(values, overflow)``: ``dtype`` values and a bool mask of the finite
      elements that saturated, both of ``x``'s shape.
    """
    rounded = x.astype(dtype)
    overflow = jnp.isfinite(x) & jnp.isinf(rounded)
    largest = jnp.asarray(jnp.finfo(dtype).max, dtype)
    return jnp.where(overflow, jnp.where(x > 0, largest, -largest), rounded), overflow


def flush_subnormals(x: jax.Array) -> jax.Array:
    """float32 ``x`` with subnormal values (``0 < |x| < 2**-126``) replaced by a zero of the same sign.

    Gives the same result whether or not the backend already flushes them
    (the comparison and the sign copy are exact either way). NaN and +-inf are kept.
    """
    return jnp.where(jnp.abs(x) < FLOAT32_MIN_NORMAL, jnp.copysign(jnp.float32(0.0), x), x)
