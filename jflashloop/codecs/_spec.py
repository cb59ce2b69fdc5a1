"""`CodecSpec`: the static descriptor of a low-bit KV format."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Format = Literal["int4", "int3", "int2", "nvfp4", "int4_rotated", "int2_lloyd_max", "e8", "int4_group_rotated"]
Axis = Literal["channel", "token"]

NVFP4_BLOCK_SIZE = 16
FORMATS = ("int4", "int3", "int2", "nvfp4", "int4_rotated", "int2_lloyd_max", "e8", "int4_group_rotated")
# Affine formats: float16 min and scale per group, codes 0..AFFINE_MAX_CODE[format].
AFFINE_FORMATS = ("int4", "int3", "int2")
AFFINE_MAX_CODE = {"int4": 15, "int3": 7, "int2": 3}
# Formats whose group is the whole head, rotated by a seeded randomized Hadamard.
HEAD_ROTATED_FORMATS = ("int4_rotated", "int2_lloyd_max")
# Formats rotated by a plain normalized Hadamard (over the head for e8, per group otherwise).
PLAIN_ROTATED_FORMATS = ("e8", "int4_group_rotated")
# Payload bits per element.
CODE_BITS = {"int4": 4, "int3": 3, "int2": 2, "nvfp4": 4, "int4_rotated": 4, "int2_lloyd_max": 2, "e8": 2, "int4_group_rotated": 4}
# Metadata bits per group.
METADATA_BITS = {"int4": 32, "int3": 32, "int2": 32, "nvfp4": 8, "int4_rotated": 32, "int2_lloyd_max": 16, "e8": 16,
                 "int4_group_rotated": 16}


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """How one logical ``[tokens, kv_heads, channels]`` tensor is stored.

    Frozen and hashable, so it is a static argument under ``jax.jit``.

    Attributes:
      format: ``"int4"`` (affine: 4-bit codes, float16 min and scale per group),
        ``"int3"`` and ``"int2"`` (the same affine rule with codes 0..7 and
        0..3, see below) or ``"nvfp4"`` (E2M1 codes, one E4M3 scale per 16 channels, one float32
        global scale per tensor); or one of the rotated formats (all
        ``axis="token"``, see :mod:`jflashloop.codecs._rotated`):
        ``"int4_rotated"`` (randomized Hadamard over the head, asymmetric 4-bit
        per (token, head), float32 scale carrying the zero point;
        ``group_size`` = head_dim), ``"int2_lloyd_max"`` (same rotation, 2-bit
        Lloyd-Max levels of N(0,1), float16 RMS per (token, head);
        ``group_size`` = head_dim), ``"e8"`` (normalized Hadamard over the head,
        E8 root codes at 2 bits per channel, float16 scale per ``group_size``
        channels) and ``"int4_group_rotated"`` (normalized Hadamard per
        ``group_size`` channels, symmetric 4-bit, float16 scale per group).
      axis: ``"channel"``: one set of parameters per (kv_head, channel) over
        groups of ``group_size`` consecutive tokens (the K layout, KIVI-style);
        ``"token"``: per (token, kv_head) over groups of ``group_size``
        consecutive channels (the V layout). NVFP4 is ``"token"`` only.
      group_size: elements per quantization group (64 by default for INT4;
        NVFP4's block is always 16). The last group may be partial (the
        affine formats and NVFP4 only).
      rotation_seed: seed of the random signs of ``int4_rotated`` and
        ``int2_lloyd_max`` (recorded here so queries can take the same
        rotation); None for every other format.

    INT3 (``"int3"``, either axis, any ``group_size``): per group, in float32,
    ``min = amin(x)``, ``scale = (amax(x) - min) / 7`` (``1`` for a span below
    ``2**-121``), ``code = clamp(rne((x - min) / scale), 0, 7)``; min and scale
    are then stored as float16 (RNE, saturating at +-65504) and decoded as
    ``code * float32(scale16) + float32(min16)``: INT4's rule (subnormal,
    NaN and +-inf handling included) with 7 in place of 15. Arrays of a
    ``[T, H, C]`` tensor: ``payload`` uint8 ``[T, H, ceil(3 * C / 8)]``;
    ``minimum`` and ``scale`` float16 :meth:`metadata_shape`. Packing is a
    little-endian bit stream along the channels of each (token, head) row:
    channel ``c`` holds bits ``3c .. 3c + 2`` of the row, bit ``b`` being bit
    ``b % 8`` of byte ``b // 8`` (so every 8 channels fill 3 bytes, channel
    ``8j + i`` at bits ``3i .. 3i + 2`` of the little-endian 24-bit word in
    bytes ``3j .. 3j + 2``); the bits past ``3 * C`` in the last byte are zero.
    3 + 32 / G bits per element (3.5 at G = 64).

    INT2 (``"int2"``, either axis, any ``group_size``): the same rule with 3 in
    place of 7 (codes 0..3; not the rotated ``"int2_lloyd_max"``). ``payload``
    uint8 ``[T, H, ceil(C / 4)]``: byte ``c // 4`` holds channel ``c`` at bits
    ``2 (c % 4) .. 2 (c % 4) + 1`` (the same little-endian bit stream at 2 bits a
    code); the bits past ``2 * C`` in the last byte are zero. 2 + 32 / G bits
    per element (2.5 at G = 64).

    Example:
      >>> CodecSpec("int4", "channel", 64)          # FlashLoop keys
      CodecSpec(format='int4', axis='channel', group_size=64, rotation_seed=None)
      >>> CodecSpec("nvfp4", "token", 16).bits_per_element()
      4.5
      >>> CodecSpec("int3", "token", 64).payload_bytes_per_row(64), CodecSpec("int3", "token", 64).bits_per_element()
      (24, 3.5)
      >>> CodecSpec("int2", "token", 64).payload_bytes_per_row(64), CodecSpec("int2", "token", 64).bits_per_element()
      (16, 2.5)
    """

    format: Format = "int4"
    axis: Axis = "token"
    group_size: int = 64
    rotation_seed: int | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"CodecSpec.format must be one of {FORMATS}, got {self.format!r}")
        if self.axis not in ("channel", "token"):
            raise ValueError(f"CodecSpec.axis must be 'channel' or 'token', got {self.axis!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(
                f"CodecSpec.group_size must be a Python int, got {type(self.group_size).__name__}"
            )
        if self.group_size < 1:
            raise ValueError(f"CodecSpec.group_size must be >= 1, got {self.group_size}")
        if self.format == "nvfp4" and (self.axis, self.group_size) != ("token", NVFP4_BLOCK_SIZE):
            raise ValueError(
                "NVFP4 stores one E4M3 scale per 16 consecutive channels: use "
                f"CodecSpec('nvfp4', 'token', 16), got axis={self.axis!r}, "
                f"group_size={self.group_size}"
            )
        rotated = self.format in HEAD_ROTATED_FORMATS + PLAIN_ROTATED_FORMATS
        if rotated and self.axis != "token":
            raise ValueError(f"CodecSpec format {self.format!r} groups per token: use axis='token'")
        if rotated and (self.group_size < 8 or self.group_size & (self.group_size - 1)):
            raise ValueError(
                f"CodecSpec format {self.format!r} needs a power-of-two group_size >= 8 "
                f"(a Hadamard transform length), got {self.group_size}"
            )
        if self.format in HEAD_ROTATED_FORMATS:
            if not isinstance(self.rotation_seed, int) or isinstance(self.rotation_seed, bool):
                raise ValueError(f"CodecSpec format {self.format!r} needs an int rotation_seed")
        elif self.rotation_seed is not None:
            raise ValueError(f"CodecSpec.rotation_seed applies to {HEAD_ROTATED_FORMATS} only")

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        """Raise ``ValueError`` if a ``[tokens, kv_heads, channels]`` shape cannot use this format."""
        channels = shape[2]
        if self.format in HEAD_ROTATED_FORMATS and channels != self.group_size:
            raise ValueError(
                f"{self.format} groups a whole head: group_size must equal the channel count "
                f"{channels}, got {self.group_size}"
            )
        if self.format in PLAIN_ROTATED_FORMATS and channels % self.group_size:
            raise ValueError(
                f"{self.format} needs channels ({channels}) divisible by group_size {self.group_size}"
            )
        if self.format == "e8" and channels & (channels - 1):
            raise ValueError(f"e8 rotates the whole head: channels must be a power of two, got {channels}")

    def metadata_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """Shape of the per-group scale (and the affine formats' minimum) array for a logical shape."""
        tokens, heads, channels = shape
        if self.format in HEAD_ROTATED_FORMATS:
            return (tokens, heads, 1)
        if self.axis == "channel":
            return (math.ceil(tokens / self.group_size), heads, channels)
        return (tokens, heads, math.ceil(channels / self.group_size))

    def payload_bytes_per_row(self, channels: int) -> int:
        """Payload bytes of one (token, head) row of ``channels`` elements."""
        return (channels * CODE_BITS[self.format] + 7) // 8

    def nbytes(self, shape: tuple[int, int, int]) -> int:
        """Exact bytes stored for a logical ``[tokens, kv_heads, channels]`` tensor."""
        tokens, heads, channels = shape
        payload = tokens * heads * self.payload_bytes_per_row(channels)
        groups = math.prod(self.metadata_shape(shape))
        metadata = groups * METADATA_BITS[self.format] // 8
        if self.format == "nvfp4":
            metadata += 4  # the float32 tensor scale
        return payload + metadata

    def bits_per_element(self, shape: tuple[int, int, int] | None = None) -> float:
        """Storage bits per element; without a shape, the asymptotic figure for full groups."""
        if shape is None:
            return CODE_BITS[self.format] + METADATA_BITS[self.format] / self.group_size
        return 8.0 * self.nbytes(shape) / math.prod(shape)


INT4_KEYS = CodecSpec("int4", "channel", 64)
"""FlashLoop's key format: INT4, per channel over 64-token groups."""
INT4_VALUES = CodecSpec("int4", "token", 64)
"""FlashLoop's value format: INT4, per token over 64-channel groups."""
NVFP4 = CodecSpec("nvfp4", "token", NVFP4_BLOCK_SIZE)
"""NVFP4: E2M1 codes, E4M3 scale per 16 channels, float32 tensor scale."""


def int4_rotated(head_dim: int, seed: int = 0) -> CodecSpec:
    """vLLM-style INT4 per (token, head) after a randomized Hadamard rotation (4 + 32/D bits)."""
    return CodecSpec("int4_rotated", "token", head_dim, rotation_seed=seed)


def int2_lloyd_max(head_dim: int, seed: int = 0) -> CodecSpec:
    """2-bit Lloyd-Max N(0,1) levels per (token, head) after a randomized Hadamard (2 + 16/D bits)."""
    return CodecSpec("int2_lloyd_max", "token", head_dim, rotation_seed=seed)


E8_KEYS = CodecSpec("e8", "token", 64)
"""rk2v4-e8 keys: normalized Hadamard, E8 root codes (2 bits/channel), float16 scale per 64."""
INT4_GROUP_ROTATED_VALUES = CodecSpec("int4_group_rotated", "token", 64)
"""rk2v4-e8 values: per-64-group Hadamard, symmetric INT4, float16 scale per 64."""
