"""Scalar oracle for the INT2 affine codec: INT4's rule (``reference.int4``) with codes 0..3.

Logical tensor: ``[tokens, kv_heads, channels]`` float32; groups and metadata
shapes as in :mod:`reference.int4`. Per group, in float32: ``min = amin(x)``
(with -0.0 counted as +0.0), ``span = amax(x) - min``, ``scale = span / 3`` if
``span >= 2**-121`` else ``1``; ``code = clamp(rne((x - min) / scale), 0, 3)``.
Only then are min and scale rounded (RNE) to float16 for storage, saturating at
+-65504. Decoding is ``code * float32(scale16) + float32(min16)`` in float32.
Subnormal and non-finite inputs and the ``nonfinite`` / ``saturated`` counts
follow :mod:`reference.int4` exactly (both are
:func:`reference.int4.encode_affine`, with 3 in place of 15). Not the rotated
``int2_lloyd_max`` format.

Packing: a little-endian bit stream along the channels of each (token, head)
row at two bits a code: code ``c`` occupies bits ``2c .. 2c + 1``, bit ``b`` of
the row being bit ``b % 8`` of byte ``b // 8`` (byte ``c // 4``, bits ``2 (c %
4) ..``); a row takes ``ceil(channels / 4)`` bytes and the bits past ``2 *
channels`` are zero.
"""

from __future__ import annotations

import numpy as np

from .int4 import decode_affine, encode_affine, pack_bit_stream, unpack_bit_stream

MAX_CODE = 3


def pack_crumbs(codes: np.ndarray) -> np.ndarray:
    """Pack 2-bit codes ``[..., C]`` into bytes ``[..., ceil(C / 4)]`` (:func:`reference.int4.pack_bit_stream`)."""
    return pack_bit_stream(codes, 2)


def unpack_crumbs(packed: np.ndarray, channels: int) -> np.ndarray:
    """Inverse of :func:`pack_crumbs`: bytes ``[..., ceil(C / 4)]`` to codes ``[..., C]``."""
    return unpack_bit_stream(packed, channels, 2)


def encode_int2(x: np.ndarray, axis: str, group_size: int):
    """Encode ``x`` (float32 ``[tokens, kv_heads, channels]``).

    Returns a dict with ``payload`` (uint8 ``[T, H, ceil(C / 4)]``), ``minimum``
    and ``scale`` (float16, :func:`reference.int4.metadata_shape`), and the
    Python int counts ``nonfinite`` and ``saturated``.
    """
    return encode_affine(x, axis, group_size, MAX_CODE, pack_crumbs)


def decode_int2(payload, minimum, scale, axis: str, group_size: int, shape):
    """Decode to float32 ``shape``: ``code * float32(scale16) + float32(min16)``."""
    return decode_affine(unpack_crumbs(np.asarray(payload), shape[2]), minimum, scale, axis, group_size, shape)
