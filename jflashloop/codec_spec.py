"""`CodecSpec`: the static descriptor of a 4-bit KV format."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Format = Literal["int4", "nvfp4"]
Axis = Literal["channel", "token"]

NVFP4_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """How one logical ``[tokens, kv_heads, channels]`` tensor is stored.

    Frozen and hashable, so it is a static argument under ``jax.jit``.

    Attributes:
      format: ``"int4"`` (affine: 4-bit codes, float16 min and scale per group)
        or ``"nvfp4"`` (E2M1 codes, one E4M3 scale per 16 channels, one float32
        global scale per tensor).
      axis: ``"channel"``: one set of parameters per (kv_head, channel) over
        groups of ``group_size`` consecutive tokens (the K layout, KIVI-style);
        ``"token"``: per (token, kv_head) over groups of ``group_size``
        consecutive channels (the V layout). NVFP4 is ``"token"`` only.
      group_size: elements per quantization group (64 by default for INT4;
        NVFP4's block is always 16). The last group may be partial.

    Example:
      >>> CodecSpec("int4", "channel", 64)          # FlashLoop keys
      CodecSpec(format='int4', axis='channel', group_size=64)
      >>> CodecSpec("nvfp4", "token", 16).bits_per_element()
      4.5
    """

    format: Format = "int4"
    axis: Axis = "token"
    group_size: int = 64

    def __post_init__(self):
        if self.format not in ("int4", "nvfp4"):
            raise ValueError(f"CodecSpec.format must be 'int4' or 'nvfp4', got {self.format!r}")
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

    def metadata_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """Shape of the per-group scale (and INT4 minimum) array for a logical shape."""
        tokens, heads, channels = shape
        if self.axis == "channel":
            return (math.ceil(tokens / self.group_size), heads, channels)
        return (tokens, heads, math.ceil(channels / self.group_size))

    def nbytes(self, shape: tuple[int, int, int]) -> int:
        """Exact bytes stored for a logical ``[tokens, kv_heads, channels]`` tensor."""
        tokens, heads, channels = shape
        payload = tokens * heads * ((channels + 1) // 2)
        groups = math.prod(self.metadata_shape(shape))
        if self.format == "int4":
            return payload + groups * 2 * 2  # float16 minimum and scale
        return payload + groups * 1 + 4  # E4M3 scale per block, float32 global scale

    def bits_per_element(self, shape: tuple[int, int, int] | None = None) -> float:
        """Storage bits per element; without a shape, the asymptotic figure for full groups."""
        if shape is None:
            per_group = 2 * 16 if self.format == "int4" else 8
            return 4.0 + per_group / self.group_size
        return 8.0 * self.nbytes(shape) / math.prod(shape)


INT4_KEYS = CodecSpec("int4", "channel", 64)
"""FlashLoop's key format: INT4, per channel over 64-token groups."""
INT4_VALUES = CodecSpec("int4", "token", 64)
"""FlashLoop's value format: INT4, per token over 64-channel groups."""
NVFP4 = CodecSpec("nvfp4", "token", NVFP4_BLOCK_SIZE)
"""NVFP4: E2M1 codes, E4M3 scale per 16 channels, float32 tensor scale."""
