"""Scalar oracles for the fitted formats: ``int_mixed`` (keys) and ``int4_scaled`` (values).

Logical tensor: ``[tokens, kv_heads, channels]`` float32, as :mod:`reference.int4`.

``int_mixed`` (``axis="channel"`` only): :mod:`reference.int4`'s affine rule per (group of
``group_size`` tokens, kv_head, channel) with top code ``2**b - 1``, ``b = widths[head, channel]``
(1..8): ``scale = span / (2**b - 1)`` (``1`` below ``2**-121``), ``code = clamp(rne((x - min) / scale),
0, 2**b - 1)``, float16 min and scale, every edge rule of INT4. Packing: a little-endian bit stream along
the channels of each (token, head) row, channel ``c`` at bits ``sum(b[:c]) .. sum(b[:c + 1]) - 1`` (least
significant first), bit ``i`` of the row being bit ``i % 8`` of byte ``i // 8``; a row takes
``ceil(max_h sum(b[h]) / 8)`` bytes and the bits past its head's width are zero.

``int4_scaled`` (``axis="token"`` only): ``y = x / s`` per element in float32 (correctly rounded; ``s =
scales[head, channel]``; subnormal inputs read as zeros first), then :func:`reference.int4.encode_int4` of ``y`` (subnormal quotients read as
zeros, as INT4 reads subnormal inputs). Decoding: ``code * float32(scale16 * s) + float32(min16 * s)``; the
divisors have at most 9 significant bits, so both products are exact and the decode rounds once (as a fused
multiply-add would).
"""

from __future__ import annotations

import numpy as np

from . import floats
from .int4 import decode_affine, encode_affine, encode_int4, flush_subnormals, unpack_nibbles


def pack_widths(codes: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Pack codes ``[T, H, C]`` of widths ``[H, C]`` into bytes ``[T, H, ceil(max row bits / 8)]``, bit by bit."""
    widths = np.asarray(widths)
    tokens, heads, channels = codes.shape
    packed = np.zeros((tokens, heads, (int(widths.sum(axis=1).max()) + 7) // 8), dtype=np.uint8)
    for t in range(tokens):
        for h in range(heads):
            position = 0
            for c in range(channels):
                code = int(codes[t, h, c])
                assert 0 <= code < 1 << int(widths[h, c]), code
                for bit in range(int(widths[h, c])):
                    if code >> bit & 1:
                        packed[t, h, position // 8] |= 1 << (position % 8)
                    position += 1
    return packed


def unpack_widths(packed: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_widths`: bytes ``[T, H, B]`` to codes ``[T, H, C]``."""
    widths = np.asarray(widths)
    tokens, heads, _ = packed.shape
    codes = np.zeros((tokens, heads, widths.shape[1]), dtype=np.uint8)
    for t in range(tokens):
        for h in range(heads):
            position = 0
            for c in range(widths.shape[1]):
                code = 0
                for bit in range(int(widths[h, c])):
                    code |= (int(packed[t, h, position // 8]) >> (position % 8) & 1) << bit
                    position += 1
                codes[t, h, c] = code
    return codes


def encode_int_mixed(x: np.ndarray, group_size: int, widths):
    """Encode ``x`` (float32 ``[T, H, C]``) with per-(head, channel) widths ``[H, C]``.

    Returns the dict of :func:`reference.int4.encode_int4` (payload uint8 ``[T, H, ceil(row bits / 8)]``,
    float16 ``minimum`` and ``scale`` ``[ceil(T / G), H, C]``, the counts).
    """
    widths = np.asarray(widths)
    assert widths.shape == np.shape(x)[1:] and widths.min() >= 1 and widths.max() <= 8
    top = (1 << widths) - 1
    return encode_affine(x, "channel", group_size, top, lambda codes: pack_widths(codes, widths))


def decode_int_mixed(payload, minimum, scale, group_size: int, widths, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16) + float32(min16)``."""
    return decode_affine(unpack_widths(np.asarray(payload), widths), minimum, scale, "channel", group_size, shape)


def scaled_input(x: np.ndarray, scales) -> np.ndarray:
    """float32 ``x / s`` per element (``s`` ``[H, C]`` broadcast over tokens), correctly rounded; subnormal ``x``
    read as zeros first."""
    x = flush_subnormals(np.asarray(x, dtype=np.float32))
    scales = np.asarray(scales, dtype=np.float32)
    out = np.zeros(x.shape, dtype=np.float32)
    for index in np.ndindex(*x.shape):
        out[index] = floats.divide_float32(x[index], scales[index[1], index[2]])
    return out


def encode_int4_scaled(x: np.ndarray, group_size: int, scales):
    """Encode ``x`` (float32 ``[T, H, C]``): :func:`reference.int4.encode_int4` of ``x / s`` per token over groups
    of ``group_size`` channels (the counts are those of the quotient)."""
    return encode_int4(scaled_input(x, scales), "token", group_size)


def decode_int4_scaled(payload, minimum, scale, group_size: int, scales, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16 * s) + float32(min16 * s)`` (both products exact for
    divisors of at most 9 significant bits; asserted)."""
    codes = unpack_nibbles(np.asarray(payload), shape[2])
    scales = np.asarray(scales, dtype=np.float32)
    out = np.zeros(shape, dtype=np.float32)
    for t, h, c in np.ndindex(*shape):
        s = scales[h, c]
        step = np.float32(np.float32(scale[t, h, c // group_size]) * s)
        low = np.float32(np.float32(minimum[t, h, c // group_size]) * s)
        assert float(step) == float(scale[t, h, c // group_size]) * float(s), "inexact: more than 9-bit divisors?"
        with np.errstate(over="ignore", invalid="ignore"):
            out[t, h, c] = np.float32(np.float32(np.float32(codes[t, h, c]) * step) + low)
    return out
