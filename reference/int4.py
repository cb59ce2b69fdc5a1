"""Scalar oracle for the INT4 affine codec (FlashLoop-compatible).

Logical tensor: ``[tokens, kv_heads, channels]`` float32.

* ``axis="channel"`` (K layout): one (min, scale) per (group of ``group_size``
  consecutive tokens, kv_head, channel); metadata shape
  ``[ceil(tokens / group_size), kv_heads, channels]``.
* ``axis="token"`` (V layout): one (min, scale) per (token, kv_head, group of
  ``group_size`` consecutive channels); metadata shape
  ``[tokens, kv_heads, ceil(channels / group_size)]``.

Per group, in float32: ``min = amin(x)`` (with -0.0 counted as +0.0), ``span = amax(x) - min``,
``scale = span / 15`` if ``span >= 2**-121`` else ``1``; ``code = clamp(rne((x - min)
/ scale), 0, 15)``. Only then are min and scale rounded (RNE) to float16 for
storage; a value beyond the float16 range is stored as +-65504. Decoding is
``code * float32(scale16) + float32(min16)`` in float32.

Subnormal float32 inputs (``0 < |x| < 2**-126``) are read as zeros of their
sign, and a group whose span is below ``2**-121`` (``MINIMUM_SPAN``) gets
``scale = 1`` like a constant group: no stored bit then depends on float32
subnormal arithmetic, which some backends flush to zero (every such group
decodes to its float16 min either way).

Non-finite inputs (the numerical edge policy):

* NaN and +-inf take no part in a group's min and max (the statistics are
  those of the group's finite members; a group with no finite member is
  treated as all zeros: min 0, scale 1);
* +inf is stored as code 15 and -inf as code 0 (saturated to the group's
  range); NaN is stored as the code of 0.0 (clamped to the group's range).

Each encode also counts, in float32 terms before any rounding:

* ``nonfinite``: elements that are NaN or +-inf;
* ``saturated``: finite elements of groups whose min or scale overflows
  float16 (``|value| >= 65520``, the point where float16 rounding gives inf;
  such metadata is stored as +-65504).
"""

from __future__ import annotations

import math

import numpy as np

from . import floats

MINIMUM_SPAN = 2.0**-121
FLOAT32_MIN_NORMAL = 2.0**-126


def flush_subnormal(value) -> np.float32:
    """A float32 subnormal as a zero of the same sign; any other value unchanged."""
    with np.errstate(invalid="ignore"):  # signalling NaNs
        value = np.float32(value)
    if value != 0 and abs(float(value)) < FLOAT32_MIN_NORMAL:
        return np.float32(math.copysign(0.0, float(value)))
    return value


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """:func:`flush_subnormal` of every element of a float32 array."""
    if not x.size:
        return x
    with np.errstate(invalid="ignore"):  # signalling NaNs pass through unchanged
        return np.vectorize(flush_subnormal, otypes=[np.float32])(x)


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


def pack_bit_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-bit codes ``[..., C]`` into bytes ``[..., ceil(bits * C / 8)]``, bit by bit: code ``c``
    occupies bits ``bits * c ..`` of the row (least significant first), bit ``b`` being bit ``b % 8`` of byte
    ``b // 8``; the bits past ``bits * C`` are zero (INT3 and INT2 rows)."""
    *lead, channels = codes.shape
    packed = np.zeros((*lead, (bits * channels + 7) // 8), dtype=np.uint8)
    for index in np.ndindex(*lead):
        for c in range(channels):
            code = int(codes[(*index, c)])
            assert 0 <= code < 1 << bits, code
            for bit in range(bits):
                if code >> bit & 1:
                    position = bits * c + bit
                    packed[(*index, position // 8)] |= 1 << (position % 8)
    return packed


def unpack_bit_stream(packed: np.ndarray, channels: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bit_stream`: bytes ``[..., ceil(bits * C / 8)]`` to codes ``[..., C]``."""
    *lead, _ = packed.shape
    codes = np.zeros((*lead, channels), dtype=np.uint8)
    for index in np.ndindex(*lead):
        for c in range(channels):
            code = 0
            for bit in range(bits):
                position = bits * c + bit
                code |= (int(packed[(*index, position // 8)]) >> (position % 8) & 1) << bit
            codes[(*index, c)] = code
    return codes


def group_parameters(values, max_code: int = 15):
    """float32 (min, scale = span / max_code) of one group's float32 values.

    -0.0 counts as +0.0 here, so a group's min never depends on the order of
    its signed zeros. Non-finite values are left out; with no finite value
    the group counts as all zeros.
    """
    finite = [np.float32(0.0) if v == 0 else np.float32(v) for v in values if math.isfinite(v)]
    if not finite:
        finite = [np.float32(0.0)]
    minimum = np.float32(min(finite))
    maximum = np.float32(max(finite))
    with np.errstate(over="ignore", invalid="ignore"):
        span = np.float32(maximum - minimum)
    scale = floats.divide_float32(span, np.float32(max_code)) if span >= MINIMUM_SPAN else np.float32(1.0)
    return minimum, scale


def overflows_float16(value) -> bool:
    """True when float16 rounding of float32 ``value`` would give +-inf (or it is NaN/inf)."""
    value = float(np.float32(value))
    return not abs(value) < 65520.0


def encode_int4(x: np.ndarray, axis: str, group_size: int):
    """Encode ``x`` (float32 ``[tokens, kv_heads, channels]``).

    Returns a dict with ``payload`` (uint8 ``[T, H, ceil(C/2)]``), ``minimum``
    and ``scale`` (float16, :func:`metadata_shape`), and the Python int counts
    ``nonfinite`` and ``saturated`` (see the module docstring).
    """
    return encode_affine(x, axis, group_size, 15, pack_nibbles)


def encode_affine(x: np.ndarray, axis: str, group_size: int, max_code, pack):
    """The affine encode with codes ``0..max_code``, packed by ``pack`` (codes ``[T, H, C]`` to bytes).

    ``max_code``: an int, or (``axis="channel"`` only) ints ``[H, C]``, the top code of each (head, channel).
    """
    x = np.asarray(x, dtype=np.float32)
    assert x.ndim == 3 and axis in ("channel", "token") and group_size >= 1
    assert isinstance(max_code, int) or axis == "channel"
    x = flush_subnormals(x)
    meta_shape = metadata_shape(axis, group_size, x.shape)
    minimum16 = np.zeros(meta_shape, dtype=np.float16)
    scale16 = np.zeros(meta_shape, dtype=np.float16)
    codes = np.zeros(x.shape, dtype=np.uint8)
    nonfinite = saturated = 0
    for group_index in np.ndindex(*meta_shape):
        members = group_members(axis, group_size, x.shape, group_index)
        top = max_code if isinstance(max_code, int) else int(max_code[group_index[1], group_index[2]])
        minimum, scale = group_parameters([x[m] for m in members], top)
        finite_members = sum(1 for m in members if math.isfinite(x[m]))
        nonfinite += len(members) - finite_members
        if overflows_float16(minimum) or overflows_float16(scale):
            saturated += finite_members
        for m in members:
            value = np.float32(0.0) if math.isnan(x[m]) else x[m]
            with np.errstate(over="ignore", invalid="ignore"):
                difference = np.float32(value - minimum)
            quotient = floats.divide_float32(difference, scale)
            code = floats.round_half_to_even(quotient)
            # A NaN quotient (+-inf over a span that overflows float32) is
            # stored as code 0.
            codes[m] = 0 if math.isnan(code) else int(min(max(code, 0.0), float(top)))
        minimum16[group_index] = floats.float16_saturating(minimum)
        # A span beyond float32 makes the scale +inf; it is stored as 65504 too.
        scale16[group_index] = floats.float16_saturating(min(scale, np.float32(floats.FLOAT16_MAX)))
    return {
        "payload": pack(codes),
        "minimum": minimum16,
        "scale": scale16,
        "nonfinite": nonfinite,
        "saturated": saturated,
    }


def decode_int4(payload, minimum, scale, axis: str, group_size: int, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16) + float32(min16)``."""
    return decode_affine(unpack_nibbles(np.asarray(payload), shape[2]), minimum, scale, axis, group_size, shape)


def decode_affine(codes, minimum, scale, axis: str, group_size: int, shape):
    """float32 ``shape`` from unpacked codes ``[T, H, C]``: ``code * float32(scale16) + float32(min16)``."""
    out = np.zeros(shape, dtype=np.float32)
    for group_index in np.ndindex(*metadata_shape(axis, group_size, shape)):
        group_scale = np.float32(scale[group_index])
        group_minimum = np.float32(minimum[group_index])
        for m in group_members(axis, group_size, shape, group_index):
            with np.errstate(over="ignore", invalid="ignore"):
                product = np.float32(np.float32(codes[m]) * group_scale)
                out[m] = np.float32(product + group_minimum)
    return out
