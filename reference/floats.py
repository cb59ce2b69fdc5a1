"""Scalar rounding oracles for the small float formats jflashloop stores.

Every function here works on one Python/numpy scalar at a time and is written
to be obviously right rather than fast: the E4M3 and E2M1 roundings enumerate
every representable value and pick the nearest one. Nothing here imports jax.
"""

from __future__ import annotations

import math

import numpy as np

FLOAT16_MAX = 65504.0

# float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
# infinities; 0x7F / 0xFF are NaN, so the largest finite magnitude is 448.
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# E2M1 magnitudes indexed by their 3-bit code; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def float32(value) -> np.float32:
    """Return `value` as a numpy float32 scalar (exact for f16/bf16/f32)."""
    return np.float32(value)


def divide_float32(numerator, denominator) -> np.float32:
    """IEEE-754 float32 division, correctly rounded (numpy is IEEE)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.float32(np.float32(numerator) / np.float32(denominator))


def round_half_to_even(value: np.float32) -> np.float32:
    """Round a float32 to the nearest integer, ties to even (np.rint is RNE)."""
    return np.float32(np.rint(np.float32(value)))


def float16_saturating(value: np.float32) -> np.float16:
    """Round float32 to float16 (nearest, ties to even); clamp overflow.

    A finite value whose rounding would overflow is stored as +-65504 rather
    than +-inf, so decoded tensors stay finite.
    """
    value = np.float32(value)
    with np.errstate(over="ignore"):
        rounded = np.float16(value)
    if np.isinf(rounded) and np.isfinite(value):
        rounded = np.float16(math.copysign(FLOAT16_MAX, float(value)))
    return rounded


def float16_bits(value: np.float16) -> int:
    """Raw uint16 bit pattern of a float16 scalar."""
    return int(np.array(value, dtype=np.float16).view(np.uint16))


def float32_bits(value: np.float32) -> int:
    """Raw uint32 bit pattern of a float32 scalar."""
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def bfloat16_round(value: np.float32) -> np.float32:
    """Round a finite float32 to bfloat16 (RNE) and return it as float32."""
    bits = float32_bits(np.float32(value))
    lower_half = bits & 0xFFFF
    upper = bits >> 16
    if lower_half > 0x8000 or (lower_half == 0x8000 and (upper & 1)):
        upper += 1
    return np.array([upper << 16], dtype=np.uint32).view(np.float32)[0]


def e4m3_value(code: int) -> float:
    """Value of a float8_e4m3fn bit pattern (NaN for 0x7F / 0xFF)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8.0 * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def e4m3_round(value: float) -> int:
    """Round a non-negative float to the nearest E4M3 code, ties to even.

    Enumerates the 127 non-negative finite codes; the caller clamps to
    [2**-9, 448] first, so no saturation rule is needed here.
    """
    value = float(value)
    if not value >= 0.0:
        raise ValueError(f"e4m3_round expects a non-negative number, got {value}")
    best_code, best_distance = 0, math.inf
    for code in range(0x7F):
        distance = abs(e4m3_value(code) - value)
        if distance < best_distance or (distance == best_distance and code % 2 == 0):
            best_code, best_distance = code, distance
    return best_code


def e2m1_round(magnitude: np.float32) -> int:
    """Round a non-negative float32 to the nearest E2M1 code (0-7).

    Ties go to the even code; magnitudes above 6 saturate to code 7 (6.0);
    NaN gives code 0.
    """
    magnitude = float(magnitude)
    if math.isnan(magnitude):
        return 0
    if magnitude >= E2M1_MAGNITUDES[-1]:
        return len(E2M1_MAGNITUDES) - 1
    best_code, best_distance = 0, math.inf
    for code, candidate in enumerate(E2M1_MAGNITUDES):
        distance = abs(candidate - magnitude)
        if distance < best_distance or (distance == best_distance and code % 2 == 0):
            best_code, best_distance = code, distance
    return best_code
