"""`CodecSpec`: the static descriptor of a low-bit KV format."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

Format = Literal["int4", "int3", "int2", "nvfp4", "int4_rotated", "int2_lloyd_max", "int3_lloyd_max", "e8",
                 "int4_group_rotated", "int_mixed", "int4_scaled"]
Axis = Literal["channel", "token"]

NVFP4_BLOCK_SIZE = 16
FORMATS = ("int4", "int3", "int2", "nvfp4", "int4_rotated", "int2_lloyd_max", "int3_lloyd_max", "e8",
           "int4_group_rotated", "int_mixed", "int4_scaled")
# Affine formats: float16 min and scale per group, codes 0..AFFINE_MAX_CODE[format] (int_mixed: 0..2**b - 1 for
# its channel's width b).
AFFINE_FORMATS = ("int4", "int3", "int2", "int_mixed", "int4_scaled")
AFFINE_MAX_CODE = {"int4": 15, "int3": 7, "int2": 3, "int4_scaled": 15}
# Formats fitted to a model: per (kv_head, channel) data in the spec (int_mixed: channel_bits; int4_scaled:
# channel_scale).
FITTED_FORMATS = ("int_mixed", "int4_scaled")
MAX_CHANNEL_BITS = 8
CHANNEL_SCALE_RANGE = (2.0**-64, 2.0**64)
CHANNEL_SCALE_BITS = 9  # significant bits of an int4_scaled divisor: its decode's products stay exact
# Formats whose group is the whole head, rotated by a seeded randomized Hadamard.
HEAD_ROTATED_FORMATS = ("int4_rotated", "int2_lloyd_max", "int3_lloyd_max")
# Formats rotated by a plain normalized Hadamard (over the head for e8, per group otherwise).
PLAIN_ROTATED_FORMATS = ("e8", "int4_group_rotated")
# Payload bits per element.
CODE_BITS = {"int4": 4, "int3": 3, "int2": 2, "nvfp4": 4, "int4_rotated": 4, "int2_lloyd_max": 2, "int3_lloyd_max": 3, "e8": 2,
             "int4_group_rotated": 4, "int4_scaled": 4}  # int_mixed: CodecSpec.row_bits
# Metadata bits per group.
METADATA_BITS = {"int4": 32, "int3": 32, "int2": 32, "nvfp4": 8, "int4_rotated": 32, "int2_lloyd_max": 16, "int3_lloyd_max": 16, "e8": 16,
                 "int4_group_rotated": 16, "int_mixed": 32, "int4_scaled": 32}


def _table(value, name: str, cast) -> tuple[tuple, ...]:
    """``value`` (a sequence of equal-length sequences, e.g. lists from JSON) as a tuple of tuples of ``cast``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) == 0:
        raise ValueError(f"CodecSpec.{name} must be a non-empty [kv_heads][channels] table, got {value!r}")
    rows = []
    for row in value:
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) == 0:
            raise ValueError(f"CodecSpec.{name} must be a non-empty [kv_heads][channels] table, got row {row!r}")
        rows.append(tuple(cast(item) for item in row))
    if len({len(row) for row in rows}) != 1:
        raise ValueError(f"CodecSpec.{name} rows must have one length (the channels), got "
                         f"{sorted({len(row) for row in rows})}")
    return tuple(rows)


def _width(item) -> int:
    if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
        raise ValueError(f"CodecSpec.channel_bits entries must be ints, got {item!r}")
    if not 1 <= int(item) <= MAX_CHANNEL_BITS:
        raise ValueError(f"CodecSpec.channel_bits entries must be in 1..{MAX_CHANNEL_BITS}, got {item}")
    return int(item)


def round_channel_scales(values) -> np.ndarray:
    """float32 ``values`` (any shape, positive) rounded to :data:`CHANNEL_SCALE_BITS` significant bits (nearest,
    ties to even) and clipped to :data:`CHANNEL_SCALE_RANGE`: valid ``int4_scaled`` divisors."""
    values = np.asarray(values, np.float64)
    if not np.all(np.isfinite(values) & (values > 0)):
        raise ValueError("channel scales must be finite and positive")
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    rounded = np.ldexp(np.rint(np.ldexp(mantissa, CHANNEL_SCALE_BITS)), exponent - CHANNEL_SCALE_BITS)
    return np.clip(rounded, *CHANNEL_SCALE_RANGE).astype(np.float32)


def _channel_scale(item) -> float:
    if isinstance(item, bool) or not isinstance(item, (int, float, np.integer, np.floating)):
        raise ValueError(f"CodecSpec.channel_scale entries must be numbers, got {item!r}")
    value = float(item)
    low, high = CHANNEL_SCALE_RANGE
    if not low <= value <= high:
        raise ValueError(f"CodecSpec.channel_scale entries must be numbers in [2**-64, 2**64], got {item!r}")
    if float(round_channel_scales(value)) != value:
        raise ValueError(f"CodecSpec.channel_scale entries must have at most {CHANNEL_SCALE_BITS} significant bits "
                         f"(jflashloop.codecs.round_channel_scales makes them), got {item!r}")
    return value


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
        ``group_size`` = head_dim), ``"int3_lloyd_max"`` (the same with 3-bit
        codes at the 8 Lloyd-Max levels, packed as INT3's: 3 + 16/D bits;
        for zero-centred data such as a loop's residual it has less error than
        INT3 G64 at 3.5 bits), ``"e8"`` (normalized Hadamard over the head,
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
      rotation_seed: seed of the random signs of ``int4_rotated``,
        ``int2_lloyd_max`` and ``int3_lloyd_max`` (recorded here so queries can take the same
        rotation); None for every other format.
      channel_bits: ``"int_mixed"`` only: the code width of every channel,
        ``[kv_heads][channels]`` ints in 1..8 (a tuple of tuples; lists are
        converted), every head's widths summing to the same row width. None
        for every other format.
      channel_scale: ``"int4_scaled"`` only: the divisor of every channel,
        ``[kv_heads][channels]`` numbers in ``[2**-64, 2**64]`` with at most 9
        significant bits (:func:`round_channel_scales` makes them). None for
        every other format.

    Fitted formats (:data:`FITTED_FORMATS`, made by
    :mod:`jflashloop.fitting` from a model's own keys, values and queries):

    * ``"int_mixed"`` (``axis="channel"``, the K layout): INT4's affine rule
      per (group of tokens, kv_head, channel) with codes ``0 .. 2**b - 1``,
      ``b = channel_bits[head][channel]`` (``scale = span / (2**b - 1)``).
      ``payload`` uint8 ``[T, H, ceil(row_bits / 8)]``: a little-endian bit
      stream along the channels of each (token, head) row, channel ``c`` at
      bits ``sum(b[:c]) .. sum(b[:c + 1]) - 1`` of the row (bit ``i`` of the
      row is bit ``i % 8`` of byte ``i // 8``); the bits past ``row_bits`` are
      zero. ``row_bits / C + 32 / G`` bits per element (4.5 at a mean width
      of 4 and G = 64, INT4's bytes).
    * ``"int4_scaled"`` (``axis="token"``, the V layout): INT4 of ``x / s``
      per (token, kv_head, group of channels), ``s = channel_scale[head]
      [channel]`` (float32, correctly rounded division, subnormal inputs and
      quotients read as zeros; a quotient beyond float32 is +-inf and stored as
      INT4 stores it), decoded as ``code * (scale16 * s) + min16 * s`` in
      float32: with 9-bit divisors both products are exact, so the decode
      rounds once wherever a compiler fuses a multiply and an add. INT4's
      arrays and bytes.

    A tensor of a fitted format must have exactly the table's kv_heads and
    channels (:meth:`check_shape`); :meth:`for_head` gives one head's spec.

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
    channel_bits: tuple[tuple[int, ...], ...] | None = None
    channel_scale: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"CodecSpec.format must be one of {FORMATS}, got {self.format!r}")
        self._check_fitted()
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

    def __repr__(self) -> str:
        fields = [f"format={self.format!r}", f"axis={self.axis!r}", f"group_size={self.group_size}",
                  f"rotation_seed={self.rotation_seed!r}"]
        fields += [f"{name}={getattr(self, name)!r}" for name in ("channel_bits", "channel_scale")
                   if getattr(self, name) is not None]
        return f"CodecSpec({', '.join(fields)})"

    def _check_fitted(self) -> None:
        """Validate (and normalize to tuples) the fitted formats' tables."""
        for name, fmt, axis, cast in (("channel_bits", "int_mixed", "channel", _width),
                                      ("channel_scale", "int4_scaled", "token", _channel_scale)):
            value = getattr(self, name)
            if self.format != fmt:
                if value is not None:
                    raise ValueError(f"CodecSpec.{name} applies to {fmt!r} only, not {self.format!r}")
                continue
            if value is None:
                raise ValueError(f"CodecSpec format {fmt!r} needs {name} ([kv_heads][channels])")
            if self.axis != axis:
                raise ValueError(f"CodecSpec format {fmt!r} groups per {'token' if axis == 'token' else 'channel'}: "
                                 f"use axis={axis!r}")
            object.__setattr__(self, name, _table(value, name, cast))
        if self.channel_bits is not None and len({sum(row) for row in self.channel_bits}) != 1:
            raise ValueError("CodecSpec.channel_bits: every head's widths must sum to the same row width, got "
                             f"{[sum(row) for row in self.channel_bits]}")

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict (``CodecSpec(**spec.to_json()) == spec``); a fitted format's table as
        nested lists, the other formats without the table fields."""
        fields = dataclasses.asdict(self)
        for name in ("channel_bits", "channel_scale"):
            if fields[name] is None:
                del fields[name]
            else:
                fields[name] = [list(row) for row in fields[name]]
        return fields

    @property
    def fitted_table(self) -> tuple[str, tuple[tuple, ...]] | None:
        """``(field name, table)`` of a fitted format (``channel_bits`` or ``channel_scale``); None otherwise."""
        for name in ("channel_bits", "channel_scale"):
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def fitted_shape(self) -> tuple[int, int] | None:
        """``(kv_heads, channels)`` of a fitted format's table; None for the other formats."""
        return None if self.fitted_table is None else (len(self.fitted_table[1]), len(self.fitted_table[1][0]))

    @property
    def row_bits(self) -> int:
        """``int_mixed``: the bits of one (token, head) row's codes (the sum of a head's widths)."""
        if self.channel_bits is None:
            raise ValueError(f"row_bits is defined for 'int_mixed' only, not {self.format!r}")
        return sum(self.channel_bits[0])

    def for_heads(self, start: int, stop: int) -> CodecSpec:
        """The spec of kv heads ``start .. stop - 1`` (a fitted format's table rows; any other spec unchanged)."""
        if self.fitted_table is None:
            return self
        name, table = self.fitted_table
        if not 0 <= start < stop <= len(table):
            raise ValueError(f"heads {start}..{stop - 1} are outside the spec's {len(table)} kv heads")
        return dataclasses.replace(self, **{name: table[start:stop]})

    def for_head(self, head: int) -> CodecSpec:
        """The spec of kv head ``head`` alone (:meth:`for_heads`)."""
        if self.fitted_table is not None and not 0 <= head < self.fitted_shape[0]:
            raise ValueError(f"head {head} is outside the spec's {self.fitted_shape[0]} kv heads")
        return self.for_heads(head, head + 1)

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        """Raise ``ValueError`` if a ``[tokens, kv_heads, channels]`` shape cannot use this format."""
        channels = shape[2]
        if self.fitted_shape is not None and tuple(shape[1:]) != self.fitted_shape:
            raise ValueError(f"{self.format} was fitted for [kv_heads, channels] = {list(self.fitted_shape)}, "
                             f"got a tensor with {list(shape[1:])}")
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
        if self.format == "int_mixed":
            return (self.row_bits + 7) // 8
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
            code_bits = (self.row_bits / self.fitted_shape[1] if self.format == "int_mixed"
                         else CODE_BITS[self.format])
            return code_bits + METADATA_BITS[self.format] / self.group_size
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


def int3_lloyd_max(head_dim: int, seed: int = 0) -> CodecSpec:
    """3-bit Lloyd-Max N(0,1) levels per (token, head) after a randomized Hadamard (3 + 16/D bits).

    For a float32, bfloat16 or float16 ``[T, H, head_dim]`` tensor (``head_dim`` a power of two; in a cache's pages
    a multiple of 32): ``payload`` uint8 ``[T, H, 3 * head_dim / 8]`` (INT3's packing), ``scale`` float16
    ``[T, H, 1]`` (the rotated row's RMS); ``seed`` picks the rotation's signs.
    """
    return CodecSpec("int3_lloyd_max", "token", head_dim, rotation_seed=seed)


E8_KEYS = CodecSpec("e8", "token", 64)
"""rk2v4-e8 keys: normalized Hadamard, E8 root codes (2 bits/channel), float16 scale per 64."""
INT4_GROUP_ROTATED_VALUES = CodecSpec("int4_group_rotated", "token", 64)
"""rk2v4-e8 values: per-64-group Hadamard, symmetric INT4, float16 scale per 64."""
