"""A small evaluator of the inline PTX the Gluon and Pallas kernels carry, on numpy arrays.

It runs the PTX text itself (not a transcription), so that what the CPU tests
use instead of each block (the emulation's numpy equivalents,
``jflashloop_triton_kernels.emulate``; the Pallas kernel's interpret-mode
arithmetic) can be checked against what the GPU executes. It knows the instructions those blocks use: ``mov.b32`` (immediates,
registers, packing and splitting ``{lo, hi}``), ``shl.b32``, ``shr.u32``,
``and.b32``, ``lop3.b32``, ``prmt.b32`` (default mode), ``sub.f16x2``,
``mul.rn.f16x2``, ``fma.rn.f16x2``, ``set.eq.u32.f16x2`` and
``set.eq.f16x2.f16x2``; anything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import re

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint32 -> (low, high) float16."""
    return ((x & 0xFFFF).astype(np.uint16).view(np.float16), (x >> 16).astype(np.uint16).view(np.float16))


def _pair(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """float16 (low, high) -> uint32."""
    bits = [np.asarray(h, np.float16).view(np.uint16).astype(np.uint32) for h in (low, high)]
    return bits[0] | (bits[1] << np.uint32(16))


def _f16x2(operation, *operands: np.ndarray) -> np.ndarray:
    """A float16x2 operation half by half, in float64 and rounded once to float16."""
    lows, highs = zip(*(_halves(o) for o in operands), strict=True)
    results = [operation(*(h.astype(np.float64) for h in halves)).astype(np.float16) for halves in (lows, highs)]
    return _pair(*results)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, table: int) -> np.ndarray:
    """Bit i of ``table`` is the output for (a, b, c) bits (i >> 2, i >> 1 & 1, i & 1)."""
    out = np.zeros_like(a)
    full = np.uint32(0xFFFFFFFF)
    for i in range(8):
        if table >> i & 1:
            out |= (a if i & 4 else a ^ full) & (b if i & 2 else b ^ full) & (c if i & 1 else c ^ full)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Default mode: byte j of the result is byte ``c[4j:4j+3]`` of ``{b, a}`` (its sign replicated where
    ``c``'s bit ``4j + 3`` is set)."""
    source = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros_like(a)
    for j in range(4):
        selector = (c >> np.uint32(4 * j)) & np.uint32(15)
        byte = ((source >> ((selector & 7).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(selector & 8, np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte << np.uint32(8 * j)
    return out


def _split_operands(text: str) -> list[str]:
    return [o.strip() for o in re.findall(r"\s*(\{[^}]*\}|[^,]+)", text)]


def run(asm: str, constraints: str, args: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate ``asm`` as ``inline_asm_elementwise`` would (``pack=1``), element by element.

    Args:
      asm: the PTX block (``$i``: outputs first, then inputs, in ``constraints`` order).
      constraints: e.g. ``"=h,=h,r,h"`` (``r``: uint32, ``h``: float16).
      args: the inputs, broadcast together: uint32 for ``r``, float16 for ``h``.

    Returns:
      The outputs, float16 for ``=h`` and uint32 for ``=r``.
    """
    kinds = constraints.split(",")
    outputs = [k[1:] for k in kinds if k.startswith("=")]
    inputs = kinds[len(outputs):]
    args = np.broadcast_arrays(*[np.asarray(a) for a in args])
    values: dict[str, np.ndarray] = {}
    for i, (kind, arg) in enumerate(zip(inputs, args, strict=True)):
        values[f"${len(outputs) + i}"] = (arg.astype(np.float16).view(np.uint16).astype(np.uint32) if kind == "h"
                                          else arg.astype(np.uint32))
    shape = args[0].shape

    def read(operand: str) -> np.ndarray:
        if operand.startswith("{"):
            low, high = _split_operands(operand[1:-1])
            return (read(low) & 0xFFFF) | ((read(high) & 0xFFFF) << np.uint32(16))
        if operand in values:
            return values[operand]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", operand):
            return np.full(shape, int(operand, 0) & 0xFFFFFFFF, np.uint32)
        raise KeyError(f"register {operand} read before it is written")

    def write(operand: str, value: np.ndarray) -> None:
        if operand.startswith("{"):
            low, high = _split_operands(operand[1:-1])
            values[low], values[high] = value & 0xFFFF, value >> np.uint32(16)
        else:
            values[operand] = np.asarray(value, np.uint32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        opcode, _, rest = line.partition(" ")
        ops = _split_operands(rest)
        src = [read(o) for o in ops[1:]] if opcode != "lop3.b32" else [read(o) for o in ops[1:4]]
        if opcode == "mov.b32":
            result = src[0]
        elif opcode == "cvt.u32.u16":
            result = src[0] & np.uint32(0xFFFF)
        elif opcode == "shl.b32":
            result = (src[0].astype(np.uint64) << src[1].astype(np.uint64)) & _MASK
        elif opcode == "shr.u32":
            result = src[0] >> src[1]
        elif opcode == "and.b32":
            result = src[0] & src[1]
        elif opcode == "lop3.b32":
            result = _lop3(*src, int(ops[4], 0))
        elif opcode == "prmt.b32":
            result = _prmt(*src)
        elif opcode == "sub.f16x2":
            result = _f16x2(lambda a, b: a - b, *src)
        elif opcode == "mul.rn.f16x2":
            result = _f16x2(lambda a, b: a * b, *src)
        elif opcode == "fma.rn.f16x2":
            result = _f16x2(lambda a, b, c: a * b + c, *src)
        elif opcode in ("set.eq.u32.f16x2", "set.eq.f16x2.f16x2"):
            true = 0xFFFF if opcode == "set.eq.u32.f16x2" else 0x3C00
            equal = [x == y for x, y in zip(_halves(src[0]), _halves(src[1]), strict=True)]
            result = (np.where(equal[0], np.uint32(true), np.uint32(0))
                      | (np.where(equal[1], np.uint32(true), np.uint32(0)) << np.uint32(16)))
        else:
            raise NotImplementedError(f"no evaluation of {opcode}")
        write(ops[0], np.asarray(result).astype(np.uint32))
    results = []
    for i, kind in enumerate(outputs):
        value = values[f"${i}"]
        results.append((value & 0xFFFF).astype(np.uint16).view(np.float16) if kind == "h" else value)
    return results
