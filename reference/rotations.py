"""Scalar oracles for Hadamard rotations and the rotated / lattice KV codecs.

* :func:`hadamard_transform`: the unnormalized Walsh-Hadamard transform,
  computed with the standard in-place butterflies (stage ``h = 1, 2, 4, ...``;
  ``a, b -> a + b, a - b``) in float32.
* :func:`random_signs`: the +-1 diagonal of a randomized Hadamard rotation,
  from a 64-bit seed (splitmix64 of ``seed * 2**32 + i``, bit 0 -> sign).
* rotation: ``rotate(x) = hadamard(signs * x) * float32(1 / sqrt(D))``; the
  inverse is ``signs * (hadamard(y) * float32(1 / sqrt(D)))``.

Codecs on one ``[D]`` vector (one token of one KV head):

* ``int4_rotated`` (vLLM-style): rotate, then asymmetric 4-bit codes with one
  float32 scale whose 4 low mantissa bits hold the zero point. Decoding
  transforms the integers ``code - zp`` first and scales after (the same
  value in exact arithmetic; no addition ever follows a rounded product, so
  fused multiply-adds cannot change it). Input rule
  (:func:`int4_rotated_input`): NaN and +-inf are read as 0, finite values
  beyond +-2**64 as +-2**64 (saturated), so no sum of the rotation or of its
  inverse overflows float32.
* ``int2_lloyd_max``: rotate, then 2-bit codes at the 4-level Lloyd-Max
  quantizer of N(0, 1), scaled by the vector's RMS (stored as float16).
* ``int3_lloyd_max``: the same with 3-bit codes at the 8-level quantizer.
* ``e8``: normalized Hadamard over the head (no signs), one float16 scale per
  64 channels, and per 8 channels two bytes: a first and a half-scale second
  E8 codeword (the 240 roots plus zero).
* ``int4_group_rotated``: per 64-channel group a normalized Hadamard, then
  symmetric 4-bit codes with one float16 scale.

Plain Python/numpy loops; never imports jax or jflashloop.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from .floats import divide_float32, float16_saturating, round_half_to_even

MASK64 = (1 << 64) - 1
INT4_ROTATED_INPUT_LIMIT = np.float32(2.0**64)
LLOYD_MAX_THRESHOLD = np.float32(0.9816)
LLOYD_MAX_LEVELS = (np.float32(-1.5104), np.float32(-0.4528), np.float32(0.4528), np.float32(1.5104))
LLOYD_MAX_3_THRESHOLDS = tuple(np.float32(t) for t in (-1.7479, -1.05, -0.5006, 0.0, 0.5006, 1.05, 1.7479))
LLOYD_MAX_3_LEVELS = tuple(np.float32(v) for v in (-2.1519, -1.3439, -0.756, -0.2451, 0.2451, 0.756, 1.3439, 2.1519))


def splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def random_signs(seed: int, dim: int) -> list[float]:
    """+1.0 or -1.0 for each of ``dim`` channels."""
    return [-1.0 if splitmix64(((seed & 0xFFFFFFFF) << 32) + i) & 1 else 1.0 for i in range(dim)]


def hadamard_transform(values) -> list[np.float32]:
    """Unnormalized Walsh-Hadamard transform of a power-of-two-length float32 vector."""
    x = [np.float32(v) for v in values]
    n = len(x)
    assert n & (n - 1) == 0, n
    h = 1
    while h < n:
        for start in range(0, n, 2 * h):
            for j in range(start, start + h):
                a, b = x[j], x[j + h]
                x[j], x[j + h] = np.float32(a + b), np.float32(a - b)
        h *= 2
    return x


def inverse_sqrt(dim: int) -> np.float32:
    return np.float32(1.0 / math.sqrt(dim))


def rotate(values, signs) -> list[np.float32]:
    scale = inverse_sqrt(len(values))
    signed = [np.float32(np.float32(s) * np.float32(v)) for s, v in zip(signs, values, strict=True)]
    return [np.float32(y * scale) for y in hadamard_transform(signed)]


def unrotate(values, signs) -> list[np.float32]:
    scale = inverse_sqrt(len(values))
    transformed = [np.float32(y * scale) for y in hadamard_transform(values)]
    return [np.float32(np.float32(s) * t) for s, t in zip(signs, transformed, strict=True)]


def _float32_bits(value) -> int:
    return int(np.array(value, np.float32).view(np.uint32))


def _from_bits(bits: int) -> np.float32:
    return np.array(bits, np.uint32).view(np.float32)[()]


# ---------------------------------------------------------------- int4_rotated


def int4_rotated_input(values):
    """Returns ``(float32 values [D], nonfinite, saturated)``: what ``int4_rotated`` encodes.

    NaN and +-inf are read as 0 (counted ``nonfinite``); finite values beyond
    +-2**64 are read as +-2**64 (counted ``saturated``); the rest unchanged.
    """
    out, nonfinite, saturated = [], 0, 0
    for value in values:
        value = np.float32(value)
        if not math.isfinite(value):
            nonfinite += 1
            out.append(np.float32(0.0))
        elif abs(value) > INT4_ROTATED_INPUT_LIMIT:
            saturated += 1
            out.append(np.float32(math.copysign(INT4_ROTATED_INPUT_LIMIT, value)))
        else:
            out.append(value)
    return out, nonfinite, saturated


def encode_int4_rotated_vector(values, seed: int):
    """Returns ``(codes [D] ints 0-15, stored_scale float32)``; zero point in the scale's low 4 bits."""
    y = rotate(int4_rotated_input(values)[0], random_signs(seed, len(values)))
    low = min(min(y), np.float32(0.0))
    high = max(max(y), np.float32(0.0))
    span = np.float32(high - low)
    scale = divide_float32(span, np.float32(15.0)) if span > 0 else np.float32(1.0)
    zero_point = int(min(max(round_half_to_even(divide_float32(-low, scale)), 0.0), 15.0))
    stored = _from_bits((_float32_bits(scale) & 0xFFFFFFF0) | zero_point)
    codes = []
    for v in y:
        code = round_half_to_even(divide_float32(v, stored)) + zero_point
        codes.append(int(min(max(code, 0.0), 15.0)))
    return codes, stored


def _scaled_unrotate(levels, scale, seed: int) -> list[np.float32]:
    """``signs * ((hadamard(levels) * scale) * float32(1/sqrt(D)))``: the transform first, then the scale."""
    signs = random_signs(seed, len(levels))
    transformed = hadamard_transform(levels)
    factor = inverse_sqrt(len(levels))
    return [np.float32(np.float32(s) * np.float32(np.float32(t * np.float32(scale)) * factor))
            for s, t in zip(signs, transformed, strict=True)]


def decode_int4_rotated_vector(codes, stored_scale, seed: int) -> list[np.float32]:
    """``R^-1 ((code - zp) * scale)``, evaluated as the transform of the integers, then the scales."""
    zero_point = _float32_bits(stored_scale) & 0xF
    return _scaled_unrotate([np.float32(c - zero_point) for c in codes], stored_scale, seed)


# ---------------------------------------------------------------- int2_lloyd_max


def _bfloat16(value) -> np.float32:
    bits = _float32_bits(value)
    lower, upper = bits & 0xFFFF, bits >> 16
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return _from_bits((upper << 16) & 0xFFFFFFFF)


def pairwise_sum(values) -> np.float32:
    """Sum by halving: ``s[i] = s[i] + s[i + n/2]`` until one value remains."""
    s = [np.float32(v) for v in values]
    while len(s) > 1:
        half = len(s) // 2
        s = [np.float32(s[i] + s[i + half]) for i in range(half)]
    return s[0]


def rotated_rms(y) -> np.float32:
    """The RMS of a rotated vector: squares of its bfloat16 roundings, summed pairwise; squares and the mean
    below float32's smallest normal count as zero (XLA flushes such subnormal results on some backends);
    1 for a zero vector."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    squares = [np.float32(_bfloat16(v) * _bfloat16(v)) for v in y]
    squares = [q if q >= tiny else np.float32(0.0) for q in squares]
    mean = np.float32(pairwise_sum(squares) * np.float32(1.0 / len(y)))
    mean = mean if mean >= tiny else np.float32(0.0)
    return np.float32(np.sqrt(mean)) if mean > 0 else np.float32(1.0)


def lloyd_max_code(u, thresholds) -> int:
    """How many of the increasing ``thresholds`` ``u`` exceeds (equal to one: the code below it; a subnormal
    ``u`` counts as zero)."""
    u = u if abs(u) >= np.finfo(np.float32).tiny else np.float32(0.0)
    return sum(int(u > t) for t in thresholds)


def _encode_lloyd_max_vector(values, seed: int, thresholds):
    y = rotate(values, random_signs(seed, len(values)))
    sigma = rotated_rms(y)
    return [lloyd_max_code(divide_float32(v, sigma), thresholds) for v in y], float16_saturating(sigma)


def encode_int2_lloyd_max_vector(values, seed: int):
    """Returns ``(codes [D] ints 0-3, sigma float16)``."""
    return _encode_lloyd_max_vector(values, seed, (-LLOYD_MAX_THRESHOLD, np.float32(0.0), LLOYD_MAX_THRESHOLD))


def decode_int2_lloyd_max_vector(codes, sigma16, seed: int) -> list[np.float32]:
    """``R^-1 (level[code] * sigma)``, evaluated as the transform of the levels, then the scales."""
    return _scaled_unrotate([LLOYD_MAX_LEVELS[c] for c in codes], np.float32(sigma16), seed)


def encode_int3_lloyd_max_vector(values, seed: int):
    """Returns ``(codes [D] ints 0-7, sigma float16)``."""
    return _encode_lloyd_max_vector(values, seed, LLOYD_MAX_3_THRESHOLDS)


def decode_int3_lloyd_max_vector(codes, sigma16, seed: int) -> list[np.float32]:
    """``R^-1 (level[code] * sigma)``, as :func:`decode_int2_lloyd_max_vector` with the 8 levels."""
    return _scaled_unrotate([LLOYD_MAX_3_LEVELS[c] for c in codes], np.float32(sigma16), seed)


# ---------------------------------------------------------------- e8


@functools.cache
def e8_codebook() -> tuple[tuple[float, ...], ...]:
    """The zero vector, then the 112 roots ``(+-1, +-1, 0^6)``, then the 128 roots ``(+-1/2)^8`` with an even number of minus signs."""
    book = [(0.0,) * 8]
    for i, j in itertools.combinations(range(8), 2):
        for si, sj in ((1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)):
            v = [0.0] * 8
            v[i], v[j] = si, sj
            book.append(tuple(v))
    for mask in range(256):
        if bin(mask).count("1") % 2 == 0:
            book.append(tuple(-0.5 if mask >> k & 1 else 0.5 for k in range(8)))
    assert len(book) == 241
    return tuple(book)


@functools.cache
def _e8_columns() -> tuple[np.ndarray, np.ndarray]:
    """The codebook as float32 ``[241, 8]`` and each codeword's ``|c|^2 / 2`` (float32 ``[241]``)."""
    book = e8_codebook()
    half_norms = np.array([np.float32(sum(v * v for v in c) / 2) for c in book], np.float32)
    return np.array(book, np.float32), half_norms


def nearest_e8(block) -> int:
    """Index of the codeword nearest to ``block`` (8 float32): the obvious search over all 241 codewords.

    Nearest in Euclidean distance == largest ``x . c - |c|^2 / 2``; the dot
    products are sums of exact products taken in channel order, each step
    rounded to float32 (for all codewords at once: float32 arrays round as
    float32 scalars do); ties go to the lower index; a NaN score never wins
    over an earlier one (codeword 0 keeps a NaN score of its own).
    """
    book, half_norms = _e8_columns()
    x = [np.float32(v) for v in block]
    total = x[0] * book[:, 0]
    for k in range(1, 8):
        total = total + x[k] * book[:, k]
    score = total - half_norms
    if np.isnan(score[0]):
        return 0
    return int(np.argmax(np.where(np.isnan(score), -np.inf, score)))


def encode_e8_vector(values, group_size: int = 64):
    """Returns ``(codes [D/8][2] ints 0-240, scales float16 per group)``."""
    book = e8_codebook()
    y = [np.float32(v * inverse_sqrt(len(values))) for v in hadamard_transform(values)]
    codes, scales = [], []
    for start in range(0, len(y), group_size):
        group = y[start : start + group_size]
        scale = divide_float32(max(abs(v) for v in group), np.float32(1.5))
        scale16 = float16_saturating(scale)
        used = np.float32(scale16) if np.float32(scale16) > 0 else np.float32(1.0)
        scales.append(scale16)
        for block_start in range(0, len(group), 8):
            block = [divide_float32(v, used) for v in group[block_start : block_start + 8]]
            first = nearest_e8(block)
            second = nearest_e8([np.float32(2.0) * np.float32(v - np.float32(c)) for v, c in zip(block, book[first], strict=True)])
            codes.append((first, second))
    return codes, scales


def decode_e8_vector(codes, scales, dim: int, group_size: int = 64) -> list[np.float32]:
    book = e8_codebook()
    blocks_per_group = group_size // 8
    y = []
    for index, (first, second) in enumerate(codes):
        scale16 = scales[index // blocks_per_group]
        used = np.float32(scale16) if np.float32(scale16) > 0 else np.float32(1.0)
        for k in range(8):
            v = np.float32(book[first][k] + book[second][k] * 0.5)
            y.append(np.float32(v * used))
    return [np.float32(t * inverse_sqrt(dim)) for t in hadamard_transform(y)]


# ---------------------------------------------------------------- int4_group_rotated


def encode_int4_group_rotated_vector(values, group_size: int = 64):
    """Returns ``(codes [D] ints 0-15 (value + 8), scales float16 per group)``."""
    codes, scales = [], []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        y = [np.float32(v * inverse_sqrt(len(group))) for v in hadamard_transform(group)]
        scale = divide_float32(max(abs(v) for v in y), np.float32(7.0))
        scale16 = float16_saturating(scale)
        used = np.float32(scale16) if np.float32(scale16) > 0 else np.float32(1.0)
        scales.append(scale16)
        for v in y:
            code = round_half_to_even(divide_float32(v, used))
            codes.append(int(min(max(code, -8.0), 7.0)) + 8)
    return codes, scales


def decode_int4_group_rotated_vector(codes, scales, group_size: int = 64) -> list[np.float32]:
    out = []
    for g, start in enumerate(range(0, len(codes), group_size)):
        used = np.float32(scales[g]) if np.float32(scales[g]) > 0 else np.float32(1.0)
        y = [np.float32(np.float32(c - 8) * used) for c in codes[start : start + group_size]]
        out.extend(np.float32(t * inverse_sqrt(group_size)) for t in hadamard_transform(y))
    return out
