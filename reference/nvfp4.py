"""Scalar oracle for NVFP4: E2M1 codes, one E4M3 scale per 16 channels, one
float32 global scale per tensor.

Logical tensor: ``[tokens, kv_heads, channels]`` float32; blocks are 16
consecutive channels of one (token, kv_head) (the last block may be partial).

* global (decode multiplier), when not given:
  ``max(amax(|x|), 1e-12) / (6 * 448)`` in float32.
* per block: ``local = clamp(amax16 / (6 * global), 2**-9, 448)`` rounded
  (RNE) to E4M3.
* code: E2M1 rounding of ``|x| / (float32(local) * global)`` (ties to the even
  code, saturating at 6), sign bit 3 set when ``x`` has its sign bit set (so
  -0.0 is code 8).
* decode: ``(e2m1 * local) * global`` in float32.

Subnormal float32 inputs (``0 < |x| < 2**-126``) are read as zeros of their
sign (so -1e-40 is code 8, like -0.0). A given global scale is expected to be
at least ``2**-116``, so every block denominator and decoded value is a float32
normal.

Non-finite inputs (the numerical edge policy): NaN and +-inf take no part in
the tensor amax nor in a block amax; +-inf is stored as +-6 (codes 7 and 15,
saturated) and NaN as +0 (code 0), whatever its sign bit.

Each encode also counts:

* ``nonfinite``: elements that are NaN or +-inf;
* ``saturated``: finite elements with ``|x| / (local * global) >= 7``, i.e.
  beyond the largest E2M1 magnitude 6 by more than E2M1's own rounding (with
  an unbounded exponent range such a value would round to 8 or more). This
  only happens when the local scale was clamped at 448, i.e. for values far
  beyond ``6 * 448 * global`` (a given global scale that is too small). With
  a non-finite global scale (the API refuses one unless it is traced under
  ``jit``) every value decodes to NaN or inf, so every finite element counts.
"""

from __future__ import annotations

import math

import numpy as np

from . import floats
from .int4 import flush_subnormals, pack_nibbles, unpack_nibbles

BLOCK_SIZE = 16
GLOBAL_SCALE_DIVISOR = 6.0 * 448.0  # 2688, exact in float32
AMAX_FLOOR = 1e-12
# |x| / (local * global) at or above this is counted as saturated: E2M1 with an
# unbounded range would round it to 8 or more (7 is the midpoint of 6 and 8).
SATURATION_QUOTIENT = 7.0


def global_scale_from_amax(amax) -> np.float32:
    """Default float32 global scale (decode multiplier) for a tensor amax."""
    floor = np.float32(AMAX_FLOOR)
    amax = np.float32(amax)
    return floats.divide_float32(amax if amax > floor else floor, np.float32(GLOBAL_SCALE_DIVISOR))


def block_scale_code(block_amax, global_scale) -> int:
    """E4M3 code of one block's local scale."""
    six_global = np.float32(np.float32(6.0) * np.float32(global_scale))
    local = floats.divide_float32(block_amax, six_global)
    local = min(max(float(local), floats.E4M3_MIN_SUBNORMAL), floats.E4M3_MAX)
    return floats.e4m3_round(local)


def finite_amax(values) -> float:
    """Largest ``|v|`` over the finite values (0.0 when there is none)."""
    return max((abs(float(v)) for v in values if math.isfinite(v)), default=0.0)


def encode_nvfp4(x: np.ndarray, global_scale=None):
    """Encode ``x`` (float32 ``[tokens, kv_heads, channels]``).

    Returns a dict: ``payload`` uint8 ``[T, H, ceil(C/2)]``, ``scale`` uint8 E4M3
    bit patterns ``[T, H, ceil(C/16)]``, ``global_scale`` float32 scalar, and
    the Python int counts ``nonfinite`` and ``saturated`` (module docstring).
    """
    x = np.asarray(x, dtype=np.float32)
    tokens, heads, channels = x.shape
    x = flush_subnormals(x)
    if global_scale is None:
        global_scale = global_scale_from_amax(finite_amax(x.flat))
    global_scale = np.float32(global_scale)
    blocks = math.ceil(channels / BLOCK_SIZE)
    scale_codes = np.zeros((tokens, heads, blocks), dtype=np.uint8)
    codes = np.zeros(x.shape, dtype=np.uint8)
    nonfinite = saturated = 0
    for t in range(tokens):
        for h in range(heads):
            for b in range(blocks):
                members = range(b * BLOCK_SIZE, min((b + 1) * BLOCK_SIZE, channels))
                block_amax = np.float32(finite_amax(x[t, h, c] for c in members))
                scale_code = block_scale_code(block_amax, global_scale)
                scale_codes[t, h, b] = scale_code
                denominator = np.float32(np.float32(floats.e4m3_value(scale_code)) * global_scale)
                for c in members:
                    value = x[t, h, c]
                    magnitude = floats.divide_float32(np.float32(abs(value)), denominator)
                    if not math.isfinite(value):
                        nonfinite += 1
                    elif magnitude >= SATURATION_QUOTIENT or not math.isfinite(global_scale):
                        saturated += 1
                    negative = not math.isnan(value) and math.copysign(1.0, float(value)) < 0
                    codes[t, h, c] = (8 if negative else 0) | floats.e2m1_round(magnitude)
    return {
        "payload": pack_nibbles(codes),
        "scale": scale_codes,
        "global_scale": global_scale,
        "nonfinite": nonfinite,
        "saturated": saturated,
    }


def decode_nvfp4(payload, scale, global_scale, shape):
    """Decode to float32 ``shape``: ``(e2m1 * local) * global``."""
    codes = unpack_nibbles(np.asarray(payload), shape[2])
    global_scale = np.float32(global_scale)
    out = np.zeros(shape, dtype=np.float32)
    for t, h, c in np.ndindex(*shape):
        code = int(codes[t, h, c])
        magnitude = floats.E2M1_MAGNITUDES[code & 7]
        signed = np.float32(-magnitude if code & 8 else magnitude)
        local = np.float32(floats.e4m3_value(int(scale[t, h, c // BLOCK_SIZE])))
        out[t, h, c] = np.float32(np.float32(signed * local) * global_scale)
    return out
