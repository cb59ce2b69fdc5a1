"""Fused decode attention over a paged, 4-bit, cross-loop KV cache (Pallas-Triton).

One new query token per sequence attends over loop ``r`` of the cache. The
kernel reads every stream of loops ``1..r`` (the base, dense residuals, and the
compact rows of sparse residuals with their row positions) straight from the
page pool, decodes them in registers and runs an online softmax; nothing
dequantized is written to memory.

Design (the reasons are measured; ``bench/KERNEL_NOTES.md``):

* Grid ``(sequences, kv_heads, splits)``: split ``s`` covers a contiguous
  range of a sequence's packed pages (split-KV, so one long sequence fills
  the GPU); a small second kernel attends over the unquantized sink and
  recent windows. Partial results are merged with a stable log-sum-exp.
* GQA: the query heads sharing a KV head are the columns of the score tile
  ``[page_size, rows]`` (``rows`` = the group padded to at least 8), so one
  pass over a page serves all of them.
* **Channel order.** A page tile is ``[tokens, head_dim / 8]`` uint32 words;
  word ``w`` holds channels ``8w .. 8w + 7`` in its nibbles. A single PTX
  ``lop3`` turns a word into two float16 values (nibbles ``j`` and ``j + 4``)
  and one ``sub.f16x2`` removes the magic offset, so the kernel works in
  *pair order*: column ``8w + 4*j1 + 2*j0 + b`` holds channel
  ``8w + 2*j1 + j0 + 4*b`` (:func:`pair_order`). Queries, windows and the
  output are permuted once outside the kernel, and the scores do not depend
  on the channel order.
* **Keys grouped per channel** (the INT4 base): ``q . k = sum_c (q_c s_c)
  code_c + sum_c q_c m_c``: the raw codes enter the matrix product and the
  page's scales are folded into the query (KIVI algebra).
* **Token-axis streams** (values, sparse residuals): INT4 is dequantized by
  one ``fma.rn.f16x2`` per two channels; NVFP4 tiles are ``e2m1 * e4m3``
  (exact in float16) with the tile's float32 scale applied to the product;
  ``int4_rotated`` tiles are ``code - zero_point`` (exact) with the per-token
  scale applied to the scores / probabilities.
* **Sparse residuals** are handled in score space: their compact rows give
  ``[rows_stored, q_rows]`` partial scores, scattered to the page's tokens by
  a one-hot matrix product; for values the probabilities are gathered by the
  transposed one-hot product. No per-token gathers.
* The softmax denominator is accumulated lazily per (token slot, query row)
  and reduced once at the end.

Products use float16 operands by default (``KernelConfig.products``) with
float32 accumulation; ``"float32"`` keeps float32 operands (TF32 on the
matrix units, exact in interpret mode). Only portable Triton operations and
PTX available since sm_80 are used (no Hopper-only instructions), so the same
kernel targets consumer Blackwell (sm_120). In interpret mode (CPU) the PTX is
replaced by plain jnp with the same values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from . import inline_asm, launch, nvfp4_pages

MASK_VALUE = -1e30
LOG2_E = math.log2(math.e)
FUSED_FORMATS = ("int4", "nvfp4", "int4_rotated")
PRODUCTS = {"float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class StreamFormat:
    """Static description of one stored stream (one of K or V of one loop)."""

    format: str  # "int4", "nvfp4" or "int4_rotated"
    axis: str  # "channel" (groups over a page's tokens) or "token"
    group_size: int
    rows: int  # stored rows per page tile


@dataclasses.dataclass(frozen=True)
class LoopFormat:
    """Static description of one loop's stored tiles."""

    keys: StreamFormat
    values: StreamFormat
    sparse: bool


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (static).

    Attributes:
      num_splits: split-KV programs per (sequence, KV head); None chooses
        enough to give about ``target_programs`` programs in all.
      target_programs: see ``num_splits``.
      num_warps, num_stages: Triton launch parameters; None picks them from
        the number of loops read (:meth:`launch_for`): 1 warp and 3 pipeline
        stages for a single loop (fastest on an H200 at B8 Hq32 Hkv8 T32K and
        B1 Hq16 Hkv16 T64K, ``bench/KERNEL_NOTES.md``); 2 warps for residual
        chains, with 5 stages for 2 loops and 4 stages for 3 or more (the
        fastest in ``python bench/decode.py --sweep --sweep-loops 2,4``).
      products: ``"float16"`` (decoded tiles, scaled queries and
        probabilities rounded to float16 for the matrix products, float32
        accumulation; the default: codes are exact, typically 2e-4 relative
        error; decoded values must lie within +-65504) or ``"float32"``
        (float32 operands: TF32 on the GPU's matrix units, exact float32 in
        interpret mode; slower).
      capability: compute capability the kernel is compiled for (``120``
        for an RTX 50xx, ``90`` for an H200); None: the local GPU's. A
        default ``num_stages`` is lowered where the page kernel's shared
        memory would exceed that GPU's per-block limit
        (:func:`jflashloop_pallas_kernels.launch.stages_that_fit`); an
        explicit ``num_stages`` is kept.
    """

    num_splits: int | None = None
    target_programs: int = 1024
    num_warps: int | None = None
    num_stages: int | None = None
    products: str = "float16"
    capability: int | None = None

    def __post_init__(self):
        if self.products not in PRODUCTS:
            raise ValueError(f"KernelConfig.products must be one of {tuple(PRODUCTS)}, got {self.products!r}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"KernelConfig.num_splits must be None or >= 1, got {self.num_splits}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be None or a power of two <= 16, got {self.num_warps}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be None or >= 1, got {self.num_stages}")
        if self.target_programs < 1:
            raise ValueError(f"KernelConfig.target_programs must be >= 1, got {self.target_programs}")
        if self.capability is not None and self.capability < launch.MINIMUM_CAPABILITY:
            raise ValueError(f"KernelConfig.capability must be None or >= {launch.MINIMUM_CAPABILITY}, "
                             f"got {self.capability}")

    def launch_for(self, loops: tuple, *, page_bytes: int = 0, tile_bytes: int = 0,
                   capability: int | None = None) -> tuple[int, int]:
        """``(num_warps, num_stages)`` for a page kernel reading ``len(loops)`` loops.

        ``page_bytes`` (loaded per page) and ``tile_bytes`` (one decoded
        operand tile) size its shared memory for ``sm_<capability>``
        (:func:`jflashloop_pallas_kernels.launch.stages_that_fit`);
        ``capability`` None sets no limit.
        """
        warps = self.num_warps if self.num_warps is not None else (1 if len(loops) == 1 else 2)
        if self.num_stages is not None:
            return warps, self.num_stages
        if len(loops) == 1:
            stages = 3 if warps == 1 else 5
        else:
            stages = 5 if len(loops) == 2 else 4  # each pipelined stream adds shared memory
        if capability is not None:
            stages = launch.stages_that_fit(stages, capability=capability, page_bytes=page_bytes,
                                            tile_bytes=tile_bytes)
        return warps, stages

    def splits_for(self, sequences: int, kv_heads: int, max_pages: int) -> int:
        if self.num_splits is not None:
            return max(1, min(self.num_splits, max_pages))
        wanted = -(-self.target_programs // (sequences * kv_heads))
        return max(1, min(wanted, max_pages))


# --------------------------------------------------------------------------- channel order


def pair_order(head_dim: int) -> np.ndarray:
    """int32 ``[head_dim]``: the channel held by each column of a decoded tile.

    Column ``8w + 4*j1 + 2*j0 + b`` holds channel ``8w + 2*j1 + j0 + 4*b``.
    """
    columns = np.arange(head_dim)
    word, nibble = columns // 8, columns % 8
    return (8 * word + 2 * (nibble // 4) + (nibble // 2) % 2 + 4 * (nibble % 2)).astype(np.int32)


def _pair_order_in_kernel(head_dim: int) -> jax.Array:
    columns = jnp.arange(head_dim, dtype=jnp.int32)
    word, nibble = columns // 8, columns % 8
    return 8 * word + 2 * (nibble // 4) + (nibble // 2) % 2 + 4 * (nibble % 2)


def unsupported_reason(loops: tuple[LoopFormat, ...], head_dim: int, page_size: int) -> str | None:
    """Why the fused kernel cannot read these streams, or None if it can."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the fused kernel needs a power-of-two head_dim >= 16, got {head_dim}"
    for loop in loops:
        for fmt in (loop.keys, loop.values):
            if fmt.format not in FUSED_FORMATS:
                return f"the fused kernel does not read {fmt.format!r} streams"
            if fmt.format == "int4" and fmt.axis == "token":
                group = fmt.group_size
                if group < head_dim and (group < 8 or group & (group - 1)):
                    return (f"the fused kernel reads token-axis INT4 groups of a power-of-two size >= 8 "
                            f"(or the whole head), got {group}")
            if fmt.axis == "channel" and (loop.sparse or page_size % fmt.group_size):
                return "channel-axis streams must be dense and group whole fractions of a page"
    return None


# --------------------------------------------------------------------------- unpacking

# Nibble pairs (j, j + 4) of a word as float16x2 values 1024 + code, less 1024.
_UNPACK = """
lop3.b32 a, $8, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 4;
lop3.b32 b, t, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 8;
lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 12;
lop3.b32 d, t, 0x000F000F, 0x64006400, 0xEA;
mov.b32 t, 0x64006400;
sub.f16x2 a, a, t;
sub.f16x2 b, b, t;
sub.f16x2 c, c, t;
sub.f16x2 d, d, t;
"""
_SPLIT_OUTPUTS = """
mov.b32 {$0, $4}, a;
mov.b32 {$1, $5}, b;
mov.b32 {$2, $6}, c;
mov.b32 {$3, $7}, d;
"""
_CODES_ASM = "{\n.reg .b32 a, b, c, d, t;\n" + _UNPACK + _SPLIT_OUTPUTS + "}"
_DEQUANTIZE_ASM = (
    "{\n.reg .b32 a, b, c, d, t, s, m;\n" + _UNPACK
    + "mov.b32 s, {$9, $9};\nmov.b32 m, {$10, $10};\n"
    + "".join(f"fma.rn.f16x2 {r}, {r}, s, m;\n" for r in "abcd") + _SPLIT_OUTPUTS + "}"
)
# E2M1 nibbles (sign in bit 3) placed as float16 bits: the value divided by
# 2**14; multiplied by 2**14 (exact) and by the E4M3 scale (exact: at most six
# significant bits, within float16's normal range).
_E2M1_PAIR = """
shl.b32 m, {src}, 9;
shl.b32 s, {src}, 12;
and.b32 s, s, 0x80008000;
lop3.b32 {dst}, m, 0x0E000E00, s, 0xEA;
mul.rn.f16x2 {dst}, {dst}, k;
mul.rn.f16x2 {dst}, {dst}, l;
"""
_E2M1_ASM = (
    "{\n.reg .b32 a, b, c, d, t, m, s, k, l;\nmov.b32 k, 0x74007400;\nmov.b32 l, {$9, $9};\n"
    + _E2M1_PAIR.format(src="$8", dst="a")
    + "".join(f"shr.u32 t, $8, {4 * i};\n" + _E2M1_PAIR.format(src="t", dst=r) for i, r in ((1, "b"), (2, "c"), (3, "d")))
    + _SPLIT_OUTPUTS + "}"
)


def _asm_planes(asm: str, words, extra=(), extra_constraints: str = ""):
    return inline_asm.multiple_output_inline_asm(
        asm, args=[words, *extra], constraints="=h,=h,=h,=h,=h,=h,=h,=h,r" + extra_constraints,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)] * 8,
    )


def _nibble_planes(words) -> list[jax.Array]:
    """int32 planes: plane ``i`` holds the nibble ``i`` of every word."""
    return [((words >> jnp.uint32(4 * i)) & jnp.uint32(15)).astype(jnp.int32) for i in range(8)]


def _e2m1_values(codes) -> jax.Array:
    """float32 E2M1 values of int32 codes (sign in bit 3)."""
    magnitude = codes & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    normal = ((2 + mantissa) << exponent).astype(jnp.float32) * 0.25
    value = jnp.where(magnitude < 2, magnitude.astype(jnp.float32) * 0.5, normal)
    return jnp.where((codes & 8) != 0, -value, value)


def _e4m3_values(bits) -> jax.Array:
    """float32 values of float8_e4m3fn bit patterns (int32, non-negative, not NaN)."""
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0**-9)
    return jnp.where(exponent == 0, subnormal, normal)


def _join(planes: list[jax.Array]) -> jax.Array:
    """8 planes ``[n, W]`` -> ``[n, 8W]`` in pair order (register interleaving only)."""
    n, width = planes[0].shape
    pairs = {(j0, b): jnp.stack([planes[j0 + 4 * b], planes[j0 + 2 + 4 * b]], axis=-1)
             for j0 in range(2) for b in range(2)}
    quads = [jnp.stack([pairs[(0, b)], pairs[(1, b)]], axis=-1) for b in range(2)]
    return jnp.stack(quads, axis=-1).reshape(n, 8 * width)


def _codes(words, dtype, use_asm) -> jax.Array:
    """Codes 0..15 of uint32 words ``[n, W]`` as ``dtype`` ``[n, 8W]`` (pair order)."""
    if use_asm:
        return _join(_asm_planes(_CODES_ASM, words))
    return _join([plane.astype(dtype) for plane in _nibble_planes(words)])


def _dequantized(words, scale, minimum, dtype, use_asm) -> jax.Array:
    """``code * scale + minimum`` with one (scale, minimum) per word: ``[n, 8W]``."""
    if use_asm:
        return _join(_asm_planes(_DEQUANTIZE_ASM, words, (scale.astype(jnp.float16), minimum.astype(jnp.float16)), ",h,h"))
    scale, minimum = scale.astype(jnp.float32), minimum.astype(jnp.float32)
    return _join([(plane.astype(jnp.float32) * scale + minimum).astype(dtype) for plane in _nibble_planes(words)])


def _e2m1_scaled(words, local, dtype, use_asm) -> jax.Array:
    """E2M1 values times the word's E4M3 scale ``[n, W]`` (float32 values): ``[n, 8W]``."""
    if use_asm:
        return _join(_asm_planes(_E2M1_ASM, words, (local.astype(jnp.float16),), ",h"))
    return _join([(_e2m1_values(plane) * local).astype(dtype) for plane in _nibble_planes(words)])


def _per_word(metadata, words_per_row: int) -> jax.Array:
    """``[n, groups]`` -> ``[n, W]``: each word takes its group's value."""
    n, groups = metadata.shape
    if groups == 1:
        return jnp.broadcast_to(metadata, (n, words_per_row))
    return jnp.broadcast_to(metadata[:, :, None], (n, groups, words_per_row // groups)).reshape(n, words_per_row)


# --------------------------------------------------------------------------- loading tiles


def _load_rows(ref, head, page, stored: int, padded: int, other=0):
    """Rows ``[padded, last]`` of tile ``ref[head, page]`` (rows past ``stored`` read ``other``)."""
    if stored == padded:
        return ref[head, page, :, :]
    rows = jnp.arange(padded, dtype=jnp.int32)
    columns = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    view = ref.at[head, page, jnp.minimum(rows, stored - 1)[:, None], columns[None, :]]
    return pallas_triton.load(view, mask=(rows < stored)[:, None], other=other)


def _padded_rows(fmt: StreamFormat, sparse: bool) -> int:
    return max(16, pl.next_power_of_2(fmt.rows)) if sparse else fmt.rows


def page_bytes(streams, loops: tuple[LoopFormat, ...]) -> int:
    """Bytes one page program loads per page: every array of every loop's streams.

    Args:
      streams: as for :func:`paged_decode_attention` (leaves ``[kv_heads,
        pages, ...]``).
      loops: their formats; sparse loops count their rows padded as the
        kernel loads them.
    """
    total = 0
    for loop, refs in zip(loops, streams, strict=True):
        stored, padded = loop.keys.rows, _padded_rows(loop.keys, loop.sparse)
        for leaf in jax.tree.leaves(refs):
            per_page = leaf.size * leaf.dtype.itemsize // (leaf.shape[0] * leaf.shape[1])
            total += -(-per_page * padded // stored)
    return total


def _load_stream(refs, fmt: StreamFormat, head, page, sparse: bool, head_dim: int):
    """The raw arrays of one stream's tile (loads only; decoding comes later)."""
    padded = _padded_rows(fmt, sparse)
    raw = {"words": _load_rows(refs["payload"], head, page, fmt.rows, padded)}
    if fmt.axis == "channel":  # one row of float16 metadata per group, read in pair order
        order = _pair_order_in_kernel(head_dim)
        groups = fmt.rows // fmt.group_size
        raw["scale"] = [refs["scale"].at[head, page, g, order][...] for g in range(groups)]
        raw["minimum"] = [refs["minimum"].at[head, page, g, order][...] for g in range(groups)]
        return raw
    raw["scale"] = _load_rows(refs["scale"], head, page, fmt.rows, padded)
    if fmt.format == "int4":
        raw["minimum"] = _load_rows(refs["minimum"], head, page, fmt.rows, padded)
    if fmt.format == "nvfp4":
        raw["global_scale"] = refs["global_scale"][head, page]
    return raw


@dataclasses.dataclass(frozen=True)
class _Tile:
    """A decoded tile: ``values`` ``[n, D]`` in the product dtype (codes for
    channel-axis streams) and what still multiplies its products."""

    values: jax.Array
    row_scale: jax.Array | None = None  # [n] float32, per stored row
    tile_scale: jax.Array | None = None  # scalar float32
    channel_groups: tuple | None = None  # channel axis: ((scale [D], minimum [D]) float32, ...) per row group
    group_size: int = 0


def _decode_stream(raw, fmt: StreamFormat, dtype, use_asm) -> _Tile:
    words = raw["words"]
    width = words.shape[1]
    if fmt.axis == "channel":
        groups = tuple((s.astype(jnp.float32), m.astype(jnp.float32)) for s, m in zip(raw["scale"], raw["minimum"], strict=True))
        return _Tile(_codes(words, dtype, use_asm), channel_groups=groups, group_size=fmt.group_size)
    if fmt.format == "int4":
        scale, minimum = _per_word(raw["scale"], width), _per_word(raw["minimum"], width)
        return _Tile(_dequantized(words, scale, minimum, dtype, use_asm))
    if fmt.format == "nvfp4":  # the tile holds its bytes in page order (nvfp4_pages)
        local = _per_word(_e4m3_values(raw["scale"].astype(jnp.int32)), width)
        codec_words = nvfp4_pages.from_page_order(words)
        return _Tile(_e2m1_scaled(codec_words, local, dtype, use_asm), tile_scale=raw["global_scale"])
    # int4_rotated: one float32 scale per row; its 4 low mantissa bits hold the zero point.
    scale = raw["scale"]  # [n, 1] float32
    zero_point = (jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(15)).astype(jnp.float32)
    ones = jnp.ones(words.shape, jnp.float32)
    centred = _dequantized(words, ones, -_per_word(zero_point, width), dtype, use_asm)  # code - zero point, exact
    return _Tile(centred, row_scale=scale[:, 0])


# --------------------------------------------------------------------------- products


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _key_scores(tile: _Tile, query, query_c, dtype) -> jax.Array:
    """float32 ``[n, rows]``: ``k_t . q_r`` for every stored row of the tile."""
    if tile.channel_groups is not None:
        scores = None
        rows = tile.values.shape[0]
        group_of_row = jnp.arange(rows, dtype=jnp.int32) // tile.group_size
        for g, (scale, minimum) in enumerate(tile.channel_groups):
            scaled_query = (query * scale[None, :]).astype(dtype)  # [rows_q, D]
            offset = jnp.sum(query * minimum[None, :], axis=1)  # [rows_q]
            part = _dot(tile.values, scaled_query.T) + offset[None, :]
            scores = part if scores is None else jnp.where((group_of_row == g)[:, None], part, scores)
        return scores
    scores = _dot(tile.values, query_c.T)
    if tile.row_scale is not None:
        scores = scores * tile.row_scale[:, None]
    if tile.tile_scale is not None:
        scores = scores * tile.tile_scale
    return scores


def _value_update(tile: _Tile, weights, dtype) -> jax.Array:
    """float32 ``[D, rows]``: ``sum_t weights[t, r] v_t`` for the tile's rows."""
    if tile.channel_groups is not None:
        update = None
        rows = tile.values.shape[0]
        group_of_row = jnp.arange(rows, dtype=jnp.int32) // tile.group_size
        for g, (scale, minimum) in enumerate(tile.channel_groups):
            group_weights = weights if len(tile.channel_groups) == 1 else jnp.where((group_of_row == g)[:, None], weights, 0.0)
            part = _dot(tile.values.T, group_weights.astype(dtype)) * scale[:, None]
            part = part + minimum[:, None] * jnp.sum(group_weights, axis=0)[None, :]
            update = part if update is None else update + part
        return update
    if tile.row_scale is not None:
        weights = weights * tile.row_scale[:, None]
    update = _dot(tile.values.T, weights.astype(dtype))
    if tile.tile_scale is not None:
        update = update * tile.tile_scale
    return update


def _sparse_one_hot(row_positions_ref, head, page, fmt: StreamFormat, page_size: int, dtype) -> jax.Array:
    """``[page_size, padded_rows]``: 1 where compact row ``j`` updates token ``t``."""
    padded = _padded_rows(fmt, True)
    slot = jnp.arange(padded, dtype=jnp.int32)
    view = row_positions_ref.at[head, page, jnp.minimum(slot, fmt.rows - 1)]
    positions = pallas_triton.load(view, mask=slot < fmt.rows, other=-1).astype(jnp.int32)
    positions = jnp.where(slot < fmt.rows, positions, -1)
    token = jnp.arange(page_size, dtype=jnp.int32)
    return (positions[None, :] == token[:, None]).astype(dtype)


# --------------------------------------------------------------------------- the kernel


def _window_rows(ref, loop, sequence, head, slot, valid, order):
    """float32 ``[len(slot), D]`` rows ``slot`` of ``ref[loop, sequence, head]`` in pair order (0 where not valid)."""
    view = ref.at[loop, sequence, head, jnp.minimum(slot, ref.shape[3] - 1)[:, None], order[None, :]]
    return pallas_triton.load(view, mask=valid[:, None], other=0).astype(jnp.float32)


WINDOW_CHUNK = 16  # window rows per step: float32 tiles stay small in registers


def _window_state(query, bounds_ref, sink_refs, ring_refs, *, sequence, head, window_loop, sink_tokens):
    """Online-softmax state ``(accumulator [D, rows], max [rows], sum [rows])``
    over the unquantized sink and recent windows, 16 rows per step, float32
    operands."""
    rows, head_dim = query.shape
    order = _pair_order_in_kernel(head_dim)
    visible, packed_end = bounds_ref[sequence, 0], bounds_ref[sequence, 1]
    capacity = ring_refs[0].shape[3]
    chunk = jnp.arange(WINDOW_CHUNK, dtype=jnp.int32)

    def attend(state, refs, slot, valid):
        accumulator, running_max, total = state
        keys, values = (_window_rows(ref, window_loop, sequence, head, slot, valid, order) for ref in refs)
        scores = jnp.where(valid[:, None], _dot(keys, query.T), MASK_VALUE)  # [chunk, rows]
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=0))
        correction = jnp.exp2(running_max - new_max)
        weights = jnp.where(valid[:, None], jnp.exp2(scores - new_max[None, :]), 0.0)
        accumulator = accumulator * correction[None, :] + _dot(values.T, weights)
        return accumulator, new_max, total * correction + jnp.sum(weights, axis=0)

    def sink_step(step, state):
        slot = step * WINDOW_CHUNK + chunk
        return attend(state, sink_refs, slot, (slot < sink_tokens) & (slot < visible))

    def ring_step(step, state):
        slot = step * WINDOW_CHUNK + chunk
        behind = visible - 1 - slot  # the slot holds the latest position < visible congruent to it
        position = slot + capacity * (jnp.maximum(behind, 0) // capacity)
        valid = ((slot < capacity) & (behind >= 0) & (position >= jnp.maximum(packed_end, sink_tokens))
                 & (position < visible))
        return attend(state, ring_refs, slot, valid)

    state = (jnp.zeros((head_dim, rows), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if sink_refs is not None:
        state = jax.lax.fori_loop(0, pl.cdiv(sink_tokens, WINDOW_CHUNK), sink_step, state)
    return jax.lax.fori_loop(0, pl.cdiv(capacity, WINDOW_CHUNK), ring_step, state)


def _decode_kernel(
    query_ref,  # [rows, D] float32, pair order, pre-scaled by softmax scale * log2(e)
    block_table_ref,  # [sequences, max_pages] int32
    bounds_ref,  # [sequences, 2] int32: visible tokens, end of the packed region
    streams,  # per loop: {"keys": {...}, "values": {...}, "row_positions": ref | None}
    output_ref,  # [rows, D] float32, pair order
    sum_ref,  # [rows] float32
    max_ref,  # [rows] float32
    *,
    loops: tuple[LoopFormat, ...],
    page_size: int,
    sink_tokens: int,
    pages_per_split: int,
    products: str,
    use_asm: bool,
):
    sequence, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dtype = PRODUCTS[products]
    query = query_ref[...]
    rows, head_dim = query.shape
    start = (jnp.zeros((head_dim, rows), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((page_size, rows), jnp.float32))

    def pages():
        packed_end = bounds_ref[sequence, 1]
        packed_pages = jnp.where(packed_end > sink_tokens, pl.cdiv(packed_end, page_size), 0)
        first = split * pages_per_split
        count = jnp.clip(packed_pages - first, 0, pages_per_split)
        token_in_page = jnp.arange(page_size, dtype=jnp.int32)
        query_c = query.astype(dtype)

        def body(step, carry):
            accumulator, running_max, sums = carry  # [D, rows], [rows], [page_size, rows]
            page_index = first + step
            page = jnp.maximum(block_table_ref[sequence, page_index], 0)
            token = page_index * page_size + token_in_page
            valid = (token >= sink_tokens) & (token < packed_end)
            # Each stream is loaded next to its use (the pipeliner prefetches the
            # payload anyway), which keeps one stream's words live at a time.
            one_hot = [
                _sparse_one_hot(refs["row_positions"], head, page, loop.keys, page_size, dtype) if loop.sparse else None
                for loop, refs in zip(loops, streams, strict=True)
            ]
            scores = None
            for loop, refs, selector in zip(loops, streams, one_hot, strict=True):
                raw_keys = _load_stream(refs["keys"], loop.keys, head, page, loop.sparse, head_dim)
                part = _key_scores(_decode_stream(raw_keys, loop.keys, dtype, use_asm), query, query_c, dtype)
                if selector is not None:  # scatter the compact rows' scores to their tokens
                    part = _dot(selector, part.astype(dtype))
                scores = part if scores is None else scores + part
            scores = jnp.where(valid[:, None], scores, MASK_VALUE)
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=0))
            correction = jnp.exp2(running_max - new_max)
            weights = jnp.where(valid[:, None], jnp.exp2(scores - new_max[None, :]), 0.0)  # [page_size, rows]
            sums = sums * correction[None, :] + weights
            accumulator = accumulator * correction[None, :]
            for loop, refs, selector in zip(loops, streams, one_hot, strict=True):
                raw_values = _load_stream(refs["values"], loop.values, head, page, loop.sparse, head_dim)
                tile = _decode_stream(raw_values, loop.values, dtype, use_asm)
                loop_weights = weights if selector is None else _dot(selector.T, weights.astype(dtype))
                accumulator = accumulator + _value_update(tile, loop_weights, dtype)
            return accumulator, new_max, sums

        accumulator, running_max, sums = jax.lax.fori_loop(0, count, body, start)
        return accumulator.T, jnp.sum(sums, axis=0), running_max

    output, running_sum, running_max = pages()
    output_ref[...] = output
    sum_ref[...] = running_sum
    max_ref[...] = running_max


def _window_kernel(
    query_ref,  # [rows, D] float32, pair order, pre-scaled
    bounds_ref,  # [sequences, 2] int32
    sink_keys_ref,  # [window_loops, sequences, kv_heads, sink, D] window dtype, or None
    sink_values_ref,
    ring_keys_ref,  # [window_loops, sequences, kv_heads, ring, D]
    ring_values_ref,
    output_ref,  # [rows, D] float32, pair order
    sum_ref,  # [rows] float32
    max_ref,  # [rows] float32
    *,
    sink_tokens: int,
    window_loop: int,
):
    """The sink and recent windows of one (sequence, KV head).

    A kernel of its own: inside the page kernel these float32 tiles would
    raise the register count of every page program (measured: 127 -> 168
    registers at 2 warps, with spills at 2 and 4 loops).
    """
    sink_refs = None if sink_keys_ref is None else (sink_keys_ref, sink_values_ref)
    accumulator, running_max, total = _window_state(
        query_ref[...], bounds_ref, sink_refs, (ring_keys_ref, ring_values_ref), sequence=pl.program_id(0),
        head=pl.program_id(1), window_loop=window_loop, sink_tokens=sink_tokens)
    output_ref[...] = accumulator.T
    sum_ref[...] = total
    max_ref[...] = running_max


def window_partials(query, bounds, sink_keys, sink_values, ring_keys, ring_values, *, sink_tokens: int,
                    window_loop: int, interpret: bool = False):
    """The window kernel alone: online-softmax partials over the sink and ring.

    Args:
      query: float32 ``[sequences, kv_heads, rows, head_dim]`` in pair order
        (:func:`pair_order`), pre-scaled by softmax scale * log2(e).
      bounds, sink_*, ring_*, sink_tokens, window_loop: as for
        :func:`paged_decode_attention`.
    Returns:
      ``(output [S, H, 1, rows, D] (pair order), sum [S, H, 1, rows], max
      [S, H, 1, rows])``, float32, base-2 logits.
    """
    sequences, kv_heads, rows, head_dim = query.shape
    if sink_tokens == 0:
        sink_keys = sink_values = None
    full = pl.BlockSpec()
    out_shape = [
        jax.ShapeDtypeStruct((sequences, kv_heads, 1, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, 1, rows), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, 1, rows), jnp.float32),
    ]
    query_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    inputs = [query, bounds, sink_keys, sink_values, ring_keys, ring_values]
    return pl.pallas_call(
        functools.partial(_window_kernel, sink_tokens=sink_tokens, window_loop=window_loop),
        grid=(sequences, kv_heads, 1),
        in_specs=[query_spec, *jax.tree.map(lambda _: full, inputs[1:])],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, 0, 0)),
        ],
        out_shape=out_shape,
        compiler_params=pallas_triton.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="jflashloop_decode_windows",
    )(*inputs)


def _ignore_poisoned_inputs(kernel, *refs):
    """Drop the three aliased input refs (poisoned, or partials of an earlier kernel) the kernel never reads."""
    *inputs, _, _, _, output_ref, sum_ref, max_ref = refs
    return kernel(*inputs, output_ref, sum_ref, max_ref)


def merge_splits(output, running_sum, running_max):
    """Stable log-sum-exp merge over the split axis (axis 2) of the kernel's partials.

    Args:
      output: float32 ``[B, H, splits, rows, D]``; running_sum, running_max:
        ``[B, H, splits, rows]`` (base-2 logits).
    Returns:
      float32 ``[B, H, rows, D]``; zero where nothing was visible.
    """
    overall = jnp.max(running_max, axis=2, keepdims=True)
    weight = jnp.exp2(running_max - overall)
    total = jnp.sum(running_sum * weight, axis=2)
    combined = jnp.sum(output * weight[..., None], axis=2)
    return jnp.where(total[..., None] > 0, combined / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


@functools.partial(
    jax.jit,
    static_argnames=("loops", "page_size", "sink_tokens", "window_loop", "scale", "config", "interpret", "poison"),
)
def paged_decode_attention(
    queries: jax.Array,
    block_tables: jax.Array,
    bounds: jax.Array,
    streams: tuple[dict[str, Any], ...],
    sink_keys: jax.Array | None,
    sink_values: jax.Array | None,
    ring_keys: jax.Array,
    ring_values: jax.Array,
    *,
    loops: tuple[LoopFormat, ...],
    page_size: int,
    sink_tokens: int,
    window_loop: int,
    scale: float,
    config: KernelConfig = KernelConfig(),
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """Decode attention for one loop of a paged cross-loop cache.

    Args:
      queries: ``[sequences, q_heads, head_dim]``.
      block_tables: int32 ``[sequences, max_pages]`` page ids (entries past a
        sequence's packed pages are never read; -1 allowed there).
      bounds: int32 ``[sequences, 2]``: visible tokens ``n``, and the end of
        the packed region (positions ``sink_tokens <= t < end`` are read from
        pages).
      streams: per loop ``1..r`` a dict ``{"keys": S, "values": S,
        "row_positions": int8 [kv_heads, pages, rows] or None}`` where ``S`` is
        ``{"payload": uint32 [kv_heads, pages, rows, D/8], "scale", "minimum",
        "global_scale"}`` (absent entries None), laid out as
        ``jflashloop.paged_cache.PagedStream`` stores them.
      sink_keys, sink_values: ``[window_loops, sequences, kv_heads, sink_tokens,
        head_dim]`` unquantized first tokens, or None when ``sink_tokens == 0``.
      ring_keys, ring_values: ``[window_loops, sequences, kv_heads, ring,
        head_dim]`` unquantized recent tokens; slot ``i`` holds the latest
        position ``p < n`` with ``p % ring == i`` (attended when ``p >=
        max(end, sink_tokens)``).
      loops: the static formats of ``streams``.
      page_size, sink_tokens: the cache's.
      window_loop: which entry of the windows' leading axis to read.
      scale: softmax scale.
      config: launch parameters.
      interpret: run in interpret mode (CPU).
      poison: start from NaN-filled partial outputs (tests: any element the
        kernel fails to write poisons the result).
    Returns:
      float32 ``[sequences, q_heads, head_dim]``.
    Raises:
      NotImplementedError: streams the kernel does not read (see
        :func:`unsupported_reason`).
    """
    sequences, q_heads, head_dim = queries.shape
    reason = unsupported_reason(loops, head_dim, page_size)
    if reason:
        raise NotImplementedError(reason)
    kv_heads = ring_keys.shape[2]
    group = q_heads // kv_heads
    rows = max(8, pl.next_power_of_2(group))
    max_pages = block_tables.shape[1]
    splits = config.splits_for(sequences, kv_heads, max_pages)
    pages_per_split = -(-max_pages // splits)
    block_tables = block_tables.astype(jnp.int32)

    order = jnp.asarray(pair_order(head_dim))
    query = queries.astype(jnp.float32)[..., order] * (scale * LOG2_E)
    query = query.reshape(sequences, kv_heads, group, head_dim)
    query = jnp.pad(query, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    # E4M3 scales travel as raw bytes: the kernel decodes them arithmetically.
    streams = jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype == jnp.float8_e4m3fn else x,
        streams,
    )
    if sink_tokens == 0:
        sink_keys = sink_values = None

    full = pl.BlockSpec()
    capability = config.capability
    if capability is None and not interpret:
        capability = launch.local_capability()
    num_warps, num_stages = config.launch_for(
        loops, page_bytes=page_bytes(streams, loops),
        tile_bytes=page_size * head_dim * jnp.dtype(PRODUCTS[config.products]).itemsize, capability=capability)
    use_asm = not interpret and config.products == "float16" and inline_asm.AVAILABLE
    kernel = functools.partial(
        _decode_kernel,
        loops=loops,
        page_size=page_size,
        sink_tokens=sink_tokens,
        pages_per_split=pages_per_split,
        products=config.products,
        use_asm=use_asm,
    )
    # Split slots 0..splits-1 are the page programs'; slot ``splits`` is
    # written afterwards by the window kernel into the same buffers.
    out_shape = [
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows), jnp.float32),
    ]
    query_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    partial_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ]
    inputs = [query, block_tables, bounds, streams]
    in_specs = [query_spec, *jax.tree.map(lambda _: full, inputs[1:])]
    aliases = {}
    if poison:  # outputs start as NaN: an element the kernel fails to write stays NaN
        first = len(jax.tree.leaves(inputs))
        inputs = [*inputs, *(jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape)]
        in_specs = [*in_specs, full, full, full]
        aliases = {first + i: i for i in range(3)}
        kernel = functools.partial(_ignore_poisoned_inputs, kernel)
    output, running_sum, running_max = pl.pallas_call(
        kernel,
        grid=(sequences, kv_heads, splits),
        in_specs=in_specs,
        out_specs=partial_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jflashloop_decode_loops{len(loops)}_{splits=}_{rows=}_{num_warps=}_{num_stages=}_{config.products}",
    )(*inputs)
    window_inputs = [query, bounds, sink_keys, sink_values, ring_keys, ring_values]
    first_alias = len(jax.tree.leaves(window_inputs))
    window_slot = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, splits, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, splits, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, splits, 0)),
    ]
    output, running_sum, running_max = pl.pallas_call(
        functools.partial(_ignore_poisoned_inputs,
                          functools.partial(_window_kernel, sink_tokens=sink_tokens, window_loop=window_loop)),
        grid=(sequences, kv_heads, 1),
        in_specs=[query_spec, *jax.tree.map(lambda _: full, window_inputs[1:]), full, full, full],
        out_specs=window_slot,
        out_shape=out_shape,
        input_output_aliases={first_alias + i: i for i in range(3)},
        compiler_params=pallas_triton.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="jflashloop_decode_windows",
    )(*window_inputs, output, running_sum, running_max)
    merged = merge_splits(output, running_sum, running_max)  # [B, H, rows, D], pair order
    merged = merged[:, :, :group, :].reshape(sequences, q_heads, head_dim)
    return merged[..., jnp.asarray(np.argsort(pair_order(head_dim)))]
