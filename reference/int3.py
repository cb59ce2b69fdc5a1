"""Scalar oracle for the INT3 affine codec: INT4's rule (``reference.int4``) with codes 0..7.

Logical tensor: ``[tokens, kv_heads, channels]`` float32; groups and metadata
shapes as in :mod:`reference.int4` (``axis="channel"``: per (group of tokens,
kv_head, channel); ``axis="token"``: per (token, kv_head, group of channels)).

Per group, in float32: ``min = amin(x)`` (with -0.0 counted as +0.0), ``span =
amax(x) - min``, ``scale = span / 7`` if ``span >= 2**-121`` else ``1``; ``code =
clamp(rne((x - min) / scale), 0, 7)``. Only then are min and scale rounded (RNE)
to float16 for storage, saturating at +-65504. Decoding is ``code *
float32(scale16) + float32(min16)`` in float32. Subnormal inputs, non-finite
inputs (NaN and +-inf take no part in min and max; +inf is code 7, -inf code 0,
NaN the code of 0.0) and the ``nonfinite`` / ``saturated`` counts follow
:mod:`reference.int4` exactly: both are :func:`reference.int4.encode_affine`,
with 7 in place of 15 and this module's packing.

Packing: a little-endian bit stream along the channels of each (token, head)
row. Code ``c`` occupies bits ``3c .. 3c + 2`` (least significant first), bit
``b`` of the row being bit ``b % 8`` of byte ``b // 8``; a row takes
``ceil(3 * channels / 8)`` bytes and the bits past ``3 * channels`` are zero.
"""

from __future__ import annotations

import numpy as np

from .int4 import decode_affine, encode_affine, pack_bit_stream, unpack_bit_stream

MAX_CODE = 7


def pack_triplets(codes: np.ndarray) -> np.ndarray:
    """Pack 3-bit codes ``[..., C]`` into bytes ``[..., ceil(3 * C / 8)]`` (:func:`reference.int4.pack_bit_stream`)."""
    return pack_bit_stream(codes, 3)


def unpack_triplets(packed: np.ndarray, channels: int) -> np.ndarray:
    """Inverse of :func:`pack_triplets`: bytes ``[..., ceil(3 * C / 8)]`` to codes ``[..., C]``."""
    return unpack_bit_stream(packed, channels, 3)


def encode_int3(x: np.ndarray, axis: str, group_size: int):
    """Encode ``x`` (float32 ``[tokens, kv_heads, channels]``).

    Returns a dict with ``payload`` (uint8 ``[T, H, ceil(3C/8)]``), ``minimum``
    and ``scale`` (float16, :func:`reference.int4.metadata_shape`), and the
    Python int counts ``nonfinite`` and ``saturated``.
    """
    return encode_affine(x, axis, group_size, MAX_CODE, pack_triplets)


def decode_int3(payload, minimum, scale, axis: str, group_size: int, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16) + float32(min16)``."""
    return decode_affine(unpack_triplets(np.asarray(payload), shape[2]), minimum, scale, axis, group_size, shape)
