"""Named shapes of the ops, shared by the tests and the benchmarks.

``bench/decode.py`` times every :data:`DECODE_SHAPES` entry; the tests run
each distinct (GQA group, head_dim) of them scaled down
(:meth:`DecodeShape.scaled`) on every decode-attention backend.
"""

from __future__ import annotations

from typing import NamedTuple


class DecodeShape(NamedTuple):
    """One decode-attention call: ``queries [sequences, q_heads, head_dim]`` over ``tokens`` per sequence."""

    name: str
    sequences: int
    q_heads: int
    kv_heads: int
    tokens: int
    head_dim: int = 128

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.q_heads // self.kv_heads

    def scaled(self, *, sequences: int, kv_heads: int, tokens: int) -> DecodeShape:
        """The same GQA group and head_dim at a size a test can afford."""
        return self._replace(name=f"{self.name} (scaled)", sequences=sequences, kv_heads=kv_heads,
                             q_heads=kv_heads * self.group, tokens=tokens)


DECODE_SHAPES = (
    DecodeShape("B8 Hq32 Hkv8 T4K", 8, 32, 8, 4096),
    DecodeShape("B8 Hq32 Hkv8 T32K", 8, 32, 8, 32768),
    DecodeShape("B8 Hq32 Hkv8 T128K", 8, 32, 8, 131072),
    DecodeShape("B1 Hq16 Hkv16 T8K", 1, 16, 16, 8192),
    DecodeShape("B1 Hq16 Hkv16 T64K", 1, 16, 16, 65536),
    DecodeShape("B16 Hq16 Hkv16 T8K", 16, 16, 16, 8192),
    DecodeShape("B8 Hq9 Hkv3 T32K D64", 8, 9, 3, 32768, 64),  # SmolLM2-like: head_dim 64, GQA 3
    DecodeShape("B8 Hq8 Hkv1 T32K D256", 8, 8, 1, 32768, 256),  # one KV head of 256 channels
)


def distinct_layouts(shapes=DECODE_SHAPES) -> tuple[DecodeShape, ...]:
    """The first shape of each distinct (GQA group, head_dim): what a kernel's logic depends on."""
    seen, layouts = set(), []
    for shape in shapes:
        if (shape.group, shape.head_dim) not in seen:
            seen.add((shape.group, shape.head_dim))
            layouts.append(shape)
    return tuple(layouts)
