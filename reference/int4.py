"""Scalar oracle for the INT4 affine codec (FlashLoop-compatible).

Logical tensor: ``[tokens, kv_heads, channels]`` float32.

* ``axis="channel"`` (K layout): one (min, scale) per (group of ``group_size``
  consecutive tokens, kv_head, channel); metadata shape
  ``[ceil(tokens / group_size), kv_heads, channels]``.
* ``axis="token"`` (V layout): one (min, scale) per (token, kv_head, group of
  ``group_size`` consecutive channels); metadata shape
  ``[tokens, kv_heads, ceil(channels / group_size)]``.

Per group, in float32: ``min = amin(x)`` (with -0.0 counted as +0.0), ``span = amax(x) - min``,
``scale = span / 15`` if ``span > 0`` else ``1``; ``code = clamp(rne((x - min)
/ scale), 0, 15)``. Only then are min and scale rounded (RNE) to float16 for
storage; a value beyond the float16 range is stored as +-65504. Decoding is
``code * float32(scale16) + float32(min16)`` in float32.
"""

from __future__ import annotations

import math

import numpy as np

from . import floats


def group_members(axis: str, group_size: int, shape, group_index):
    """List the ``(token, head, channel)`` indices of one quantization group."""
    tokens, _, channels = shape
    first, head, last = group_index
    if axis == "channel":
        start = first * group_size
        return [(t, head, last) for t in range(start, min(start + group_size, tokens))]
    start = last * group_size
    return [(first, head, c) for c in range(start, min(start + group_size, channels))]


def metadata_shape(axis: str, group_size: int, shape):
    """Shape of the per-group min/scale arrays."""
    tokens, heads, channels = shape
    if axis == "channel":
        return (math.ceil(tokens / group_size), heads, channels)
    return (tokens, heads, math.ceil(channels / group_size))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``[..., C]`` into bytes ``[..., ceil(C / 2)]``.

    Byte ``c // 2`` holds channel ``c`` (even) in its low nibble and channel
    ``c + 1`` in its high nibble; an odd channel count leaves the last high
    nibble zero.
    """
    *lead, channels = codes.shape
    packed = np.zeros((*lead, (channels + 1) // 2), dtype=np.uint8)
    for index in np.ndindex(*lead):
        for c in range(channels):
            code = int(codes[(*index, c)])
            assert 0 <= code <= 15, code
            if c % 2 == 0:
                packed[(*index, c // 2)] |= code
            else:
                packed[(*index, c // 2)] |= code << 4
    return packed


def unpack_nibbles(packed: np.ndarray, channels: int) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., ceil(C/2)]`` to codes ``[..., C]``."""
    *lead, _ = packed.shape
    codes = np.zeros((*lead, channels), dtype=np.uint8)
    for index in np.ndindex(*lead):
        for c in range(channels):
            byte = int(packed[(*index, c // 2)])
            codes[(*index, c)] = (byte >> 4) if c % 2 else (byte & 0xF)
    return codes


def group_parameters(values):
    """float32 (min, scale) of one group's float32 values.

    -0.0 counts as +0.0 here, so a group's min never depends on the order of
    its signed zeros.
    """
    values = [np.float32(0.0) if v == 0 else np.float32(v) for v in values]
    minimum = np.float32(min(values))
    maximum = np.float32(max(values))
    with np.errstate(over="ignore", invalid="ignore"):
        span = np.float32(maximum - minimum)
    scale = floats.divide_float32(span, np.float32(15.0)) if span > 0 else np.float32(1.0)
    return minimum, scale


def encode_int4(x: np.ndarray, axis: str, group_size: int):
    """Encode ``x`` (float32 ``[tokens, kv_heads, channels]``).

    Returns a dict with ``payload`` (uint8 ``[T, H, ceil(C/2)]``), ``minimum``
    and ``scale`` (float16, :func:`metadata_shape`).
    """
    x = np.asarray(x, dtype=np.float32)
    assert x.ndim == 3 and axis in ("channel", "token") and group_size >= 1
    meta_shape = metadata_shape(axis, group_size, x.shape)
    minimum16 = np.zeros(meta_shape, dtype=np.float16)
    scale16 = np.zeros(meta_shape, dtype=np.float16)
    codes = np.zeros(x.shape, dtype=np.uint8)
    for group_index in np.ndindex(*meta_shape):
        members = group_members(axis, group_size, x.shape, group_index)
        minimum, scale = group_parameters([x[m] for m in members])
        for m in members:
            with np.errstate(over="ignore", invalid="ignore"):
                difference = np.float32(x[m] - minimum)
            quotient = floats.divide_float32(difference, scale)
            code = floats.round_half_to_even(quotient)
            # A NaN quotient (only reachable from NaN/Inf inputs or a span
            # that overflows float32) is stored as code 0.
            codes[m] = 0 if math.isnan(code) else int(min(max(code, 0.0), 15.0))
        minimum16[group_index] = floats.float16_saturating(minimum)
        scale16[group_index] = floats.float16_saturating(scale)
    return {"payload": pack_nibbles(codes), "minimum": minimum16, "scale": scale16}


def decode_int4(payload, minimum, scale, axis: str, group_size: int, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16) + float32(min16)``."""
    codes = unpack_nibbles(np.asarray(payload), shape[2])
    out = np.zeros(shape, dtype=np.float32)
    for group_index in np.ndindex(*metadata_shape(axis, group_size, shape)):
        group_scale = np.float32(scale[group_index])
        group_minimum = np.float32(minimum[group_index])
        for m in group_members(axis, group_size, shape, group_index):
            with np.errstate(over="ignore", invalid="ignore"):
                product = np.float32(np.float32(codes[m]) * group_scale)
                out[m] = np.float32(product + group_minimum)
    return out
