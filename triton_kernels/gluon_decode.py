"""Gluon decode attention over packed INT4 pages, with the matrix units' operand
layouts chosen by hand so that no decoded tile goes through shared memory.

One program (one warp) handles one (sequence, KV head, split) and walks its
pages. Per page:

* **Keys** (INT4, one (scale, min) per channel over the page): the words of
  the ``[page, D/8]`` tile are loaded so that each thread receives exactly the
  words its ``mma.sync`` B fragment needs (16 contiguous bytes per token and
  thread); one ``lop3`` + ``sub.f16x2`` per two codes gives float16 codes in
  place. The page's scales are folded into the query (KIVI algebra):
  ``s = (q * scale) . codes + q . min``.
* **Scores** ``S^T [16, page]`` come from ``mma.sync.m16n8k16`` with the query
  as operand A (rows 8-15 zero); rows 0-7 are the GQA group.
* **Probabilities** stay in registers: the accumulator layout of ``S^T`` is
  the B-operand layout of the value product (the FlashAttention-2 register
  reuse), so ``P^T`` feeds ``O^T [D, 8] += V^T [D, page] . P^T [page, 8]``
  directly.
* **Values** (INT4, one (scale, min) per token and ``group`` channels): a
  thread loads 8 to 16 contiguous bytes of two tokens, ``prmt`` pairs the two
  tokens' nibbles, and one ``fma.rn.f16x2`` dequantizes two values: the A
  fragment of ``V^T`` is produced in registers.

Channel orders: the kernel works in a *logical* channel order (a fixed
permutation of the physical channels, :func:`key_channel_order` and
:func:`value_channel_order`); the query is read and the output written through
those permutations, so callers see natural order.

Outputs are the split partials of an online softmax in base 2 (``out [rows,
D]``, ``sum [rows]``, ``max [rows]``), the same contract as the Pallas page
kernel, so the same window kernel and merge complete the call.
"""

from __future__ import annotations

import numpy as np
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import launch
from .launch import MERGE_REGISTERS

ROWS = 8  # query rows per (sequence, KV head): the GQA group padded to 8
MASK_VALUE = gl.constexpr(-1e30)
# The page kernel rescales its running softmax state only when a row's maximum grows by more than this
# (base-2 logits): float16 probabilities then stay below 2**8.
RESCALE_LOG2 = gl.constexpr(8.0)


@gluon.constexpr_function
def _log2(n: int) -> int:
    assert n & (n - 1) == 0 and n > 0, n
    return n.bit_length() - 1


# --------------------------------------------------------------------------- channel orders


def key_channel_order(head_dim: int) -> np.ndarray:
    """int32 ``[D]``: the physical channel at logical key channel ``k``.

    ``k = i2 + 2 wt0 + 4 wt1 + 8 i0 + 16 i1 + 32 wl``, where the physical
    channel is ``8 w + i`` (nibble ``i = i0 + 2 i1 + 4 i2`` of word ``w``) and
    ``w = wl + (W/4) (wt0 + 2 wt1)`` (``W = D/8`` words).
    """
    words = head_dim // 8
    k = np.arange(head_dim)
    i2, wt0, wt1, i0, i1, wl = k & 1, (k >> 1) & 1, (k >> 2) & 1, (k >> 3) & 1, (k >> 4) & 1, k >> 5
    w = wl + (words // 4) * (wt0 + 2 * wt1)
    return (8 * w + i0 + 2 * i1 + 4 * i2).astype(np.int32)


def value_channel_order(head_dim: int) -> np.ndarray:
    """int32 ``[D]``: the physical channel at logical value channel ``m``.

    ``m = wt + 8 (wl + (W/8) i)`` with ``w = wt (W/8) + wl``.
    """
    words = head_dim // 8
    m = np.arange(head_dim)
    wt, wl, i = m & 7, (m >> 3) % (words // 8), m // words
    return (8 * (wt * (words // 8) + wl) + i).astype(np.int32)


# --------------------------------------------------------------------------- layouts


@gluon.constexpr_function
def _mma():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _key_words_layout(page: int, words: int):
    """``[page, W]`` uint32: thread (g, t) holds words ``t W/4 ..`` of tokens ``g + 8 j``."""
    low = _log2(words) - 2
    regs = [[0, 1 << b] for b in range(low)] + [[1 << b, 0] for b in range(3, _log2(page))]
    lanes = [[0, words // 4], [0, words // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [page, words])


@gluon.constexpr_function
def _value_words_layout(half_page: int, words: int):
    """``[page/2, W]`` uint32 (one token of each pair): thread (g, t) holds words
    ``g W/8 ..`` of token pairs ``t + 4 j``."""
    low = _log2(words) - 3
    regs = [[0, 1 << b] for b in range(low)] + [[1 << b, 0] for b in range(2, _log2(half_page))]
    lanes = [[1, 0], [2, 0], [0, words // 8], [0, words // 4], [0, words // 2]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [half_page, words])


@gluon.constexpr_function
def _query_layout(head_dim: int):
    """``[8, D]`` in physical channel order: thread (g, t) holds row ``g`` and
    channels ``t D/4 .. (t+1) D/4 - 1`` (the channels of its key words)."""
    regs = [[0, 1 << b] for b in range(_log2(head_dim) - 2)]
    lanes = [[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [ROWS, head_dim])


# --------------------------------------------------------------------------- unpacking

_KEY_CODES_ASM = gl.constexpr("""{
.reg .b32 a, b, c, d, t, k;
mov.b32 k, 0x64006400;
lop3.b32 a, $8, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 4;
lop3.b32 b, t, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 8;
lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;
shr.u32 t, $8, 12;
lop3.b32 d, t, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 a, a, k;
sub.f16x2 b, b, k;
sub.f16x2 c, c, k;
sub.f16x2 d, d, k;
mov.b32 {$0, $4}, a;
mov.b32 {$1, $5}, b;
mov.b32 {$2, $6}, c;
mov.b32 {$3, $7}, d;
}""")


def _value_pair_asm() -> str:
    """Two tokens' words -> 8 dequantized float16 pairs (nibble i of each token)."""
    lines = [
        "{", ".reg .b32 x, y, t, a, s, m, k;", "mov.b32 k, 0x64006400;",
        "prmt.b32 x, $16, $17, 0x5410;", "prmt.b32 y, $16, $17, 0x7632;",
        "mov.b32 s, {$18, $19};", "mov.b32 m, {$20, $21};",
    ]
    for nibble in range(8):
        source, shift = ("x", 4 * nibble) if nibble < 4 else ("y", 4 * (nibble - 4))
        if shift:
            lines.append(f"shr.u32 t, {source}, {shift};")
            source = "t"
        lines += [
            f"lop3.b32 a, {source}, 0x000F000F, 0x64006400, 0xEA;",
            "sub.f16x2 a, a, k;",
            "fma.rn.f16x2 a, a, s, m;",
            f"mov.b32 {{${2 * nibble}, ${2 * nibble + 1}}}, a;",
        ]
    lines.append("}")
    return "\n".join(lines)


_VALUE_PAIR_ASM = gl.constexpr(_value_pair_asm())


@gluon.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """8 tensors ``[...]`` -> ``[..., 2, 2, 2]`` with ``x[..., a, b, c] = c_{a + 2b + 4c}``."""
    return gl.join(gl.join(gl.join(c0, c1), gl.join(c2, c3)), gl.join(gl.join(c4, c5), gl.join(c6, c7)))


@gluon.jit
def _key_tile(words, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, B_LAYOUT: gl.constexpr):
    """uint32 ``[PAGE, W]`` -> float16 codes ``[D, PAGE]`` (logical key channels) in ``B_LAYOUT``."""
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _KEY_CODES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    x = _join8(c0, c1, c2, c3, c4, c5, c6, c7)  # [PAGE, W, i0, i1, i2]
    x = gl.reshape(x, [PAGE, 2, 2, W // 4, 2, 2, 2])  # (tau, wt1, wt0, wl, i0, i1, i2)
    x = gl.permute(x, [3, 5, 4, 1, 2, 6, 0])  # (wl, i1, i0, wt1, wt0, i2, tau)
    return gl.convert_layout(gl.reshape(x, [D, PAGE]), B_LAYOUT, assert_trivial=True)


@gluon.jit
def _value_tile(even, odd, s_even, s_odd, m_even, m_odd, PAGE: gl.constexpr, W: gl.constexpr,
                D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Two tokens' words ``[PAGE/2, W]`` and their float16 scale/min -> ``V^T [D, PAGE]`` in ``A_LAYOUT``."""
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _VALUE_PAIR_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,h,h,h",
        [even, odd, s_even, s_odd, m_even, m_odd], dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _to_key_order(x, D: gl.constexpr, W: gl.constexpr):
    """``[8, D]`` in physical channel order -> logical key order."""
    x = gl.reshape(x, [8, 2, 2, W // 4, 2, 2, 2])  # (r, wt1, wt0, wl, i2, i1, i0)
    x = gl.permute(x, [0, 3, 5, 6, 1, 2, 4])  # (r, wl, i1, i0, wt1, wt0, i2)
    return gl.reshape(x, [8, D])


@gluon.jit
def _pad_rows(x, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """``[8, D]`` -> ``[16, D]`` (rows 8-15 zero) in ``A_LAYOUT``."""
    return _stack_rows(x, gl.zeros_like(x), D, A_LAYOUT)


@gluon.jit
def _top_rows(s, PAGE: gl.constexpr):
    """``[16, PAGE]`` -> rows 0-7 ``[8, PAGE]`` (register-only split)."""
    lo, _hi = gl.split(gl.permute(gl.reshape(s, [2, 8, PAGE]), [1, 2, 0]))
    return lo


@gluon.jit
def _rescale(sums, mins, acc, run_max, row_max, MMA: gl.constexpr, SCALED: gl.constexpr):
    """The online softmax's running state moved to ``max(run_max, row_max)``: (sums, mins, acc, run_max)
    (``mins``, like ``sums``, only where the probabilities carry the value scales: ``SCALED``)."""
    new_max = gl.maximum(run_max, row_max)
    correction = gl.exp2(run_max - new_max)
    sums_correction = gl.expand_dims(gl.convert_layout(correction, gl.SliceLayout(1, sums.type.layout)), 1)
    sums = sums * sums_correction
    if SCALED:
        mins = mins * sums_correction
    acc = acc * gl.expand_dims(gl.convert_layout(correction, gl.SliceLayout(0, MMA)), 0)
    return sums, mins, acc, new_max


@gluon.jit
def _lane_sums(x, N: gl.constexpr):
    """``[8, N]`` in an accumulator's row layout -> ``[8, 8]``: each row's sums over the columns a
    thread holds (``c + 8 j`` summed over ``j``: register-only); summing the 8 columns finishes
    the row sums."""
    return gl.sum(gl.reshape(x, [8, N // 8, 8]), axis=1)


@gluon.jit
def _split_rows(x, N: gl.constexpr):
    """``[16, N]`` -> (rows 0-7, rows 8-15), each ``[8, N]`` (register-only: a thread of an
    ``mma`` operand or accumulator holds rows ``g`` and ``g + 8`` alike)."""
    return gl.split(gl.permute(gl.reshape(x, [2, 8, N]), [1, 2, 0]))


@gluon.jit
def _stack_rows(top, bottom, N: gl.constexpr, LAYOUT: gl.constexpr):
    """Two ``[8, N]`` -> ``[16, N]`` (``top`` in rows 0-7) in ``LAYOUT`` (register-only)."""
    x = gl.permute(gl.join(top, bottom), [2, 0, 1])
    return gl.convert_layout(gl.reshape(x, [16, N]), LAYOUT, assert_trivial=True)


@gluon.jit
def _stack_cols(left, right, M: gl.constexpr, N: gl.constexpr, LAYOUT: gl.constexpr):
    """Two ``[M, N]`` -> ``[M, 2 N]`` (``left`` in columns ``0 .. N``) in ``LAYOUT`` (register-only)."""
    x = gl.permute(gl.join(left, right), [0, 2, 1])
    return gl.convert_layout(gl.reshape(x, [M, 2 * N]), LAYOUT, assert_trivial=True)


@gluon.jit
def _fold_rows(s, N: gl.constexpr):
    """``[16, N]`` scores of a query held as float16 high (rows 0-7) and low (rows 8-15)
    halves -> the scores of the query ``[8, N]``: the two halves' rows summed (register-only)."""
    hi, lo = _split_rows(s, N)
    return hi + lo


@gluon.jit
def _mask_chunk(scores, start_token, tokens, live, packed_end, SINK: gl.constexpr, CHUNK: gl.constexpr):
    """``scores [8, CHUNK]`` of tokens ``start_token + tokens`` with those outside the packed
    region (the sink's tokens, those past ``packed_end``, a lost page: ``not live``) at
    ``2 MASK_VALUE``, below the running maximum's start, so their weights are exactly 0. Masks
    only where the chunk holds such a token: a uniform branch."""
    if (start_token < SINK) | (start_token + CHUNK > packed_end) | (not live):
        valid = gl.expand_dims((start_token + tokens >= SINK) & (start_token + tokens < packed_end) & live, 0)
        scores = gl.where(valid, scores, 2 * MASK_VALUE)
    return scores


@gluon.jit
def _chunk_weights(scores, sums, mins, acc, run_max, TO_SCORES: gl.constexpr, CHUNK: gl.constexpr,
                   MMA: gl.constexpr, LAZY: gl.constexpr, SCALED: gl.constexpr):
    """One chunk's online softmax: ``scores [8, CHUNK]`` (x ``TO_SCORES``, base-2 logits) ->
    (weights float32 ``[8, CHUNK]``, sums, mins, acc, run_max) with the running state moved to the
    new maximum (``SCALED``: weights, sums and mins x ``2**SCALED_HEADROOM_LOG2``). ``LAZY``: the running maximum moves only when a row's maximum grows by more
    than ``RESCALE_LOG2`` (weights then stay below ``2**RESCALE_LOG2``; sums, outputs and the
    partials' maximum all refer to the same running maximum, so the result is the same up to
    rounding)."""
    row_max = gl.max(scores, axis=1) * TO_SCORES
    if LAZY:
        if gl.max(row_max - run_max, axis=0) > RESCALE_LOG2:
            sums, mins, acc, run_max = _rescale(sums, mins, acc, run_max, row_max, MMA, SCALED)
    else:
        sums, mins, acc, run_max = _rescale(sums, mins, acc, run_max, row_max, MMA, SCALED)
    if SCALED:  # x 2**SCALED_HEADROOM_LOG2 (restored after the page loop)
        weights = gl.exp2(scores * TO_SCORES - gl.expand_dims(run_max - SCALED_HEADROOM_LOG2, 1))
    else:
        weights = gl.exp2(scores * TO_SCORES - gl.expand_dims(run_max, 1))
    sums = sums + _lane_sums(weights, CHUNK)
    return weights, sums, mins, acc, run_max


@gluon.jit
def int4_pages_kernel(
    q_ptr,  # float32 [S, H, 8, D], pre-scaled by softmax scale * log2(e)
    table_ptr,  # int32 [S, max_pages]
    bounds_ptr,  # int32 [S, 2]: visible tokens, end of the packed region
    kw_ptr,  # uint32 [H, pool, PAGE, D/8]
    ks_ptr,  # float16 [H, pool, 1, D]
    km_ptr,  # float16 [H, pool, 1, D]
    vw_ptr,  # uint32 [H, pool, PAGE, D/8]
    vs_ptr,  # float16 [H, pool, PAGE, D/GV]
    vm_ptr,  # float16 [H, pool, PAGE, D/GV]
    kv_heads, pool_pages, max_pages, pages_per_split, slots,  # int32 scalars
    out_ptr,  # float32 [S, H, slots, 8, D] (outputs follow the inputs, as jax_triton passes them)
    sum_ptr,  # float32 [S, H, slots, 8]
    max_ptr,  # float32 [S, H, slots, 8]
    D: gl.constexpr, PAGE: gl.constexpr, GV: gl.constexpr, SINK: gl.constexpr,
):
    W: gl.constexpr = D // 8
    NG: gl.constexpr = D // GV
    MMA: gl.constexpr = _mma()
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    KW: gl.constexpr = _key_words_layout(PAGE, W)
    VW: gl.constexpr = _value_words_layout(PAGE // 2, W)
    QL: gl.constexpr = _query_layout(D)

    seq = gl.program_id(0)
    head = gl.program_id(1)
    split = gl.program_id(2)
    program = (seq * kv_heads + head).to(gl.int64)

    # Query rows in physical channel order (read once).
    q_rows = gl.arange(0, 8, layout=gl.SliceLayout(1, QL))
    q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    q_offsets = gl.expand_dims(q_rows, 1) * D + gl.expand_dims(q_cols, 0)
    query = gl.load(q_ptr + program * (8 * D) + q_offsets)  # [8, D] fp32
    meta_offsets = gl.expand_dims(q_rows * 0, 1) + gl.expand_dims(q_cols, 0)  # the page's key metadata, per row

    # Word offsets inside one page tile.
    k_tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, KW))
    k_word = gl.arange(0, W, layout=gl.SliceLayout(0, KW))
    k_offsets = gl.expand_dims(k_tok, 1) * W + gl.expand_dims(k_word, 0)
    v_pair = gl.arange(0, PAGE // 2, layout=gl.SliceLayout(1, VW))
    v_word = gl.arange(0, W, layout=gl.SliceLayout(0, VW))
    v_even = gl.expand_dims(2 * v_pair, 1) * W + gl.expand_dims(v_word, 0)
    vs_even = gl.expand_dims(2 * v_pair, 1) * NG + gl.expand_dims((8 * v_word) // GV, 0)

    packed_end = gl.load(bounds_ptr + seq * 2 + 1)
    packed_pages = gl.where(packed_end > SINK, gl.cdiv(packed_end, PAGE), 0)
    first = split * pages_per_split
    count = gl.minimum(gl.maximum(packed_pages - first, 0), pages_per_split)

    acc = gl.zeros([D, 8], gl.float32, layout=MMA)
    zero_scores = gl.zeros([16, PAGE], gl.float32, layout=MMA)
    run_max = gl.max(_top_rows(zero_scores, PAGE), axis=1) + MASK_VALUE  # [8]
    sums = _top_rows(zero_scores, PAGE)  # [8, PAGE], lazily reduced
    tokens = gl.arange(0, PAGE, layout=gl.SliceLayout(0, sums.type.layout))

    for step in range(count):
        page_index = first + step
        page = gl.maximum(gl.load(table_ptr + seq * max_pages + page_index), 0)
        tile = head.to(gl.int64) * pool_pages + page
        key_words = gl.load(kw_ptr + tile * (PAGE * W) + k_offsets)
        even = gl.load(vw_ptr + tile * (PAGE * W) + v_even)
        odd = gl.load(vw_ptr + tile * (PAGE * W) + v_even + W)
        s_even = gl.load(vs_ptr + tile * (PAGE * NG) + vs_even)
        s_odd = gl.load(vs_ptr + tile * (PAGE * NG) + vs_even + NG)
        m_even = gl.load(vm_ptr + tile * (PAGE * NG) + vs_even)
        m_odd = gl.load(vm_ptr + tile * (PAGE * NG) + vs_even + NG)
        k_scale = gl.load(ks_ptr + tile * D + meta_offsets).to(gl.float32)
        k_min = gl.load(km_ptr + tile * D + meta_offsets).to(gl.float32)

        scaled = _pad_rows(_to_key_order((query * k_scale).to(gl.float16), D, W), D, A_OP)
        offset = gl.sum(query * k_min, axis=1)  # [8]
        codes = _key_tile(key_words, PAGE, W, D, B_OP)
        scores = _top_rows(mma_v2(scaled, codes, zero_scores), PAGE)  # [8, PAGE]
        scores = scores + gl.expand_dims(gl.convert_layout(offset, gl.SliceLayout(1, scores.type.layout)), 1)
        token = page_index * PAGE + tokens
        valid = gl.expand_dims((token >= SINK) & (token < packed_end), 0)
        scores = gl.where(valid, scores, MASK_VALUE)
        new_max = gl.maximum(run_max, gl.max(scores, axis=1))
        correction = gl.exp2(run_max - new_max)
        weights = gl.where(valid, gl.exp2(scores - gl.expand_dims(new_max, 1)), 0.0)
        sums = sums * gl.expand_dims(correction, 1) + weights
        run_max = new_max
        p_t = gl.convert_layout(gl.permute(weights.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
        values = _value_tile(even, odd, s_even, s_odd, m_even, m_odd, PAGE, W, D, A_OP)
        acc_correction = gl.convert_layout(correction, gl.SliceLayout(0, MMA))
        acc = mma_v2(values, p_t, acc * gl.expand_dims(acc_correction, 0))

    # Partials: out [8, D] (physical order), sum [8], max [8].
    slot = program * slots + split
    o_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    o_chan = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    o_chan = _value_physical(o_chan, W)
    o_offsets = gl.expand_dims(o_rows, 0) * D + gl.expand_dims(o_chan, 1)
    gl.store(out_ptr + slot * (8 * D) + o_offsets, acc)
    total = gl.sum(sums, axis=1)
    r = gl.arange(0, 8, layout=total.type.layout)
    gl.store(sum_ptr + slot * 8 + r, total)
    gl.store(max_ptr + slot * 8 + gl.arange(0, 8, layout=run_max.type.layout), run_max)


@gluon.jit
def _value_physical(m, W: gl.constexpr):
    """Logical value channel -> physical channel (see :func:`value_channel_order`)."""
    WL: gl.constexpr = W // 8
    wt = m & 7
    wl = (m >> 3) % WL
    i = m // W
    return 8 * (wt * WL + wl) + i


# =========================================================================== v2: pipelined
#
# Same algorithm, restructured for memory-level parallelism and fewer
# instructions (bench/KERNEL_NOTES.md):
# * every array of a page (key and value words, key scale/min, value
#   scale/min) is copied to shared memory with cp.async, STAGES - 1 pages
#   ahead of the page being computed (no registers held by loads in flight);
#   value rows are padded by 16 bytes so that the fragment reads from shared
#   memory are free of bank conflicts;
# * key nibbles become float16 subnormals in place (``code * 2**-24``, x 16 for
#   nibbles 1, 3, 5, 7): 5 integer instructions per key word, the factors joining
#   the page's key scales and the scores;
# * the query stays float16 in its operand layout; the page's key scales are
#   applied by a float16 multiply and the key minimums by a matrix product
#   (`q . min` on the tensor cores), which starts the score accumulator.

# INT4 keys as float16 subnormals: a nibble masked in place at bits 0-3 of a half is ``code * 2**-24``
# exactly, at bits 4-7 ``16 code * 2**-24`` (the mantissa field is linear through the first normal
# binade): 5 integer instructions per word, no float16 arithmetic (:func:`_key_tile_v2`). The x 16 of
# nibbles 1, 3, 5, 7 joins the page's key scales (:func:`_scaled_query`), the 2**-24 the scores.
KEY_UNIT = gl.constexpr(2.0**-24)


def _token_pair_asm(registers: str, setup: list[str], decode) -> str:
    """PTX for two tokens' value words (``$16`` even, ``$17`` odd) -> 8 float16 pairs, outputs ``$2i``,
    ``$2i+1`` for nibble ``i`` of each token: the words' halves paired by ``prmt``, nibbles 2-3 of each
    half shifted down by 8, and ``decode(source, odd)`` the lines that make pair ``a`` from the register
    holding the nibble at bits 0-3 (even ``i``) or 4-7 (odd ``i``) of each half. ``registers``: more
    ``.reg`` names; ``setup``: lines before the pairing."""
    lines = ["{", f".reg .b32 x, y, t, a{registers};", *setup,
             "prmt.b32 x, $16, $17, 0x5410;", "prmt.b32 y, $16, $17, 0x7632;"]
    for nibble in range(8):
        source = "x" if nibble < 4 else "y"
        local = nibble % 4
        if local == 2:
            lines.append(f"shr.u32 t, {source}, 8;")
        if local >= 2:
            source = "t"
        lines += [*decode(source, local % 2 == 1), f"mov.b32 {{${2 * nibble}, ${2 * nibble + 1}}}, a;"]
    lines.append("}")
    return "\n".join(lines)


def _magic_code(source: str, odd: bool, subtract: str, scale_odd: str, offset_odd: str) -> list[str]:
    """A nibble pair as ``1024 + code`` (``1024 + 16 code`` for odd nibbles) by ``lop3``, less ``subtract``
    (even) or times ``scale_odd`` plus ``offset_odd`` (odd)."""
    if odd:
        return [f"lop3.b32 a, {source}, 0x00F000F0, 0x64006400, 0xEA;", f"fma.rn.f16x2 a, a, {scale_odd}, {offset_odd};"]
    return [f"lop3.b32 a, {source}, 0x000F000F, 0x64006400, 0xEA;", f"sub.f16x2 a, a, {subtract};"]


def _value_pair_asm_v2() -> str:
    """Two tokens' words and their float16 (scale, min) -> 8 float16 pairs ``code * scale + min``."""
    return _token_pair_asm(
        ", s, m, k, e, o", ["mov.b32 k, 0x64006400;", "mov.b32 e, 0x2C002C00;", "mov.b32 o, 0xD400D400;",
                           "mov.b32 s, {$18, $19};", "mov.b32 m, {$20, $21};"],
        lambda source, odd: [*_magic_code(source, odd, "k", "e", "o"), "fma.rn.f16x2 a, a, s, m;"])


_VALUE_PAIR_ASM_V2 = gl.constexpr(_value_pair_asm_v2())


def _value_codes_asm() -> str:
    """Two tokens' words -> 8 float16 pairs (nibble ``i`` of each token) as subnormal codes: the
    nibbles masked in place, ``code * 2**-24`` for even ``i``, ``16 code * 2**-24`` for odd ``i``
    (:func:`_codes_to_values` restores the units; the scales and minimums join the probabilities)."""
    return _token_pair_asm("", [], lambda source, odd: [
        f"and.b32 a, {source}, {'0x00F000F0' if odd else '0x000F000F'};"])


_VALUE_CODES_ASM = gl.constexpr(_value_codes_asm())


def _int2_value_codes_asm() -> str:
    """Two tokens' affine INT2 halfwords (``$16`` even, ``$17`` odd) -> the 8 float16 pairs
    :func:`_value_codes_asm` gives for INT4 words of the same codes: code ``i`` (bits ``2i``) of each token
    shifted to bits 0-1 (even ``i``) or 4-5 (odd ``i``) of its half, by one shift and one ``and``."""
    lines = ["{", ".reg .b32 x, e, o, a;", "cvt.u32.u16 e, $16;", "cvt.u32.u16 o, $17;",
             "prmt.b32 x, e, o, 0x5410;"]
    for code in range(8):
        shift = 2 * code - 4 * (code % 2)  # right by this much (left where negative)
        mask = "0x00300030" if code % 2 else "0x00030003"
        if shift > 0:
            lines.append(f"shr.u32 a, x, {shift};")
        elif shift < 0:
            lines.append(f"shl.b32 a, x, {-shift};")
        lines += [f"and.b32 a, {'x' if shift == 0 else 'a'}, {mask};", f"mov.b32 {{${2 * code}, ${2 * code + 1}}}, a;"]
    lines.append("}")
    return "\n".join(lines)


_INT2_VALUE_CODES_ASM = gl.constexpr(_int2_value_codes_asm())

# NVFP4: an E2M1 nibble (sign in bit 3) placed in a float16's high byte as
# ``sign << 7 | magnitude << 1`` (low byte 0) is the value / 2**14 (0.5 as the
# subnormal 2**-15); x the E4M3 scale gives ``e2m1 * scale / 2**14`` (rounded only
# below float16's normal range, 2**-11 of a tile scale at most); the 2**14 joins the
# tile's float32 scale (NVFP4_UNIT), which multiplies each product. The tiles hold
# their bytes in page order (``jflashloop_pallas_kernels.nvfp4_pages``:
# ``s_e m_o2 m_o1 m_o0 m_e2 m_e1 m_e0 s_o``), so the high bytes of four nibbles are
# made at once, byte by byte (``_E2M1_BYTES``: the even nibbles of a word's bytes in
# one ``and``, the odd ones in 4 instructions), and one ``prmt`` against zero places
# two of them in a float16 pair.
NVFP4_UNIT = gl.constexpr(16384.0)
_E2M1_BYTES = """and.b32 u, {src}, 0x8E8E8E8E;
shr.u32 a, {src}, 3;
shl.b32 b, {src}, 7;
and.b32 a, a, 0x0E0E0E0E;
lop3.b32 h, a, b, 0x80808080, 0xF8;"""


def _e2m1_placed(nibbles: list[tuple[int, int]], scales: bool = True, scale: str = "l", store=None,
                 onto=None) -> list[str]:
    """``_E2M1_BYTES`` made (``u``: bytes' even nibbles, ``h``: odd ones) -> float16 pairs (x the scales
    ``scale`` with ``scales``): ``(output low, output high)`` for the pair of bytes 0 and 2, then of bytes 1
    and 3, of ``u`` then of ``h``. ``store``: four registers that take the pairs instead of the outputs;
    ``onto``: four registers of pairs each product is added to (one ``fma``)."""
    lines = []
    for i, ((low, high), (source, selector)) in enumerate(zip(nibbles, [("u", "0x2404"), ("u", "0x3414"),
                                                                         ("h", "0x2404"), ("h", "0x3414")],
                                                              strict=True)):
        lines.append(f"prmt.b32 a, {source}, z, {selector};")
        if onto is not None:
            lines.append(f"fma.rn.f16x2 a, a, {scale}, {onto[i]};")
        elif scales:
            lines.append(f"mul.rn.f16x2 a, a, {scale};")
        lines.append(f"mov.b32 {store[i]}, a;" if store is not None else f"mov.b32 {{${low}, ${high}}}, a;")
    return lines


def _e2m1_key_asm() -> str:
    """One word and its E4M3 scale (float16) -> 8 float16 ``e2m1 * scale / 2**14`` (nibble order of the key
    codes)."""
    lines = ["{", ".reg .b32 u, h, a, b, l, z;", "mov.b32 l, {$9, $9};", "mov.b32 z, 0;",
             _E2M1_BYTES.format(src="$8")]
    # u: nibbles 0, 2, 4, 6 (bytes 0-3); h: 1, 3, 5, 7
    lines += _e2m1_placed([(0, 4), (2, 6), (1, 5), (3, 7)])
    lines.append("}")
    return "\n".join(lines)


def _value_nibbles(first: int) -> list[tuple[int, int]]:
    """The output pairs of nibbles ``first .. first + 3`` of two tokens (even, odd), in ``_e2m1_placed``'s order."""
    return [(2 * (first + i), 2 * (first + i) + 1) for i in (0, 2, 1, 3)]


def _e2m1_value_pair_asm(scales: bool = True) -> str:
    """Two tokens' words and their E4M3 scales (float16) -> 8 float16 pairs ``e2m1 * scale / 2**14`` (nibble i
    of each token); without ``scales`` (the words alone) ``e2m1 / 2**14`` (exact)."""
    lines = ["{", ".reg .b32 x, y, u, h, a, b, l, z;", *(["mov.b32 l, {$18, $19};"] if scales else []),
             "mov.b32 z, 0;", "prmt.b32 x, $16, $17, 0x5410;", "prmt.b32 y, $16, $17, 0x7632;"]
    for first, source in ((0, "x"), (4, "y")):  # x: nibbles 0-3 of each token (even at bits 0-15), y: 4-7
        lines.append(_E2M1_BYTES.format(src=source))
        lines += _e2m1_placed(_value_nibbles(first), scales)
    lines.append("}")
    return "\n".join(lines)


def _e2m1_value_pair_sum_asm() -> str:
    """Two streams' words of two tokens (``$16``, ``$17`` and ``$18``, ``$19``) and their E4M3 scales (``$20``,
    ``$21`` and ``$22``, ``$23``) -> 8 float16 pairs, the first stream's ``e2m1 * scale / 2**14`` plus the
    second's (one ``fma`` each)."""
    lines = ["{", ".reg .b32 x, y, u, h, a, b, l, m, z, " + ", ".join(f"p{i}" for i in range(8)) + ";",
             "mov.b32 l, {$20, $21};", "mov.b32 m, {$22, $23};", "mov.b32 z, 0;"]
    for even, odd, scale, second in (("$16", "$17", "l", False), ("$18", "$19", "m", True)):
        lines += [f"prmt.b32 x, {even}, {odd}, 0x5410;", f"prmt.b32 y, {even}, {odd}, 0x7632;"]
        for k, (first, source) in enumerate(((0, "x"), (4, "y"))):
            held = [f"p{4 * k + j}" for j in range(4)]
            lines.append(_E2M1_BYTES.format(src=source))
            lines += (_e2m1_placed(_value_nibbles(first), scale=scale, onto=held) if second
                      else _e2m1_placed(_value_nibbles(first), scale=scale, store=held))
    lines.append("}")
    return "\n".join(lines)


_E2M1_KEY_ASM = gl.constexpr(_e2m1_key_asm())
_E2M1_VALUE_PAIR_ASM = gl.constexpr(_e2m1_value_pair_asm())
_E2M1_VALUE_PAIR_SUM_ASM = gl.constexpr(_e2m1_value_pair_sum_asm())
_E2M1_VALUE_CODES_ASM = gl.constexpr(_e2m1_value_pair_asm(scales=False))
INT4 = gl.constexpr(0)
NVFP4 = gl.constexpr(1)
ROTATED = gl.constexpr(2)  # int4_rotated: per-token float32 scale, zero point in its 4 low mantissa bits
INT2 = gl.constexpr(3)  # sparse rows only: affine INT2 (scale and minimum like INT4 rows), a halfword per INT4 word

# Affine INT2 rows: a halfword's 8 two-bit codes (channel i at bits 2i) -> an INT4 word of the same codes
# (channel i at bits 4i): bytes to halfwords (prmt), nibbles to bytes and crumbs to nibbles ((x | x << k) & mask).
_INT2_ROW_WORD_ASM = gl.constexpr("""{
.reg .b32 x, y;
cvt.u32.u16 x, $1;
mov.b32 y, 0;
prmt.b32 x, x, y, 0x4140;
shl.b32 y, x, 4;
lop3.b32 x, x, y, 0x0F0F0F0F, 0xA8;
shl.b32 y, x, 2;
lop3.b32 $0, x, y, 0x33333333, 0xA8;
}""")

# int4_rotated keys: a word and its token's (1024 + zp, -64 - zp) -> 8 float16 ``code - zp`` (exact).
_ROTATED_KEY_ASM = gl.constexpr("""{
.reg .b32 a, b, c, d, t, k, s, o;
mov.b32 k, {$9, $9};
mov.b32 s, 0x2C002C00;
mov.b32 o, {$10, $10};
lop3.b32 a, $8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b, $8, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $8, 8;
lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 a, a, k;
fma.rn.f16x2 b, b, s, o;
sub.f16x2 c, c, k;
fma.rn.f16x2 d, d, s, o;
mov.b32 {$0, $4}, a;
mov.b32 {$1, $5}, b;
mov.b32 {$2, $6}, c;
mov.b32 {$3, $7}, d;
}""")


def _rotated_value_pair_asm() -> str:
    """Two tokens' words and their (1024 + zp, -64 - zp) -> 8 float16 pairs ``code - zp`` (exact)."""
    return _token_pair_asm(", k, e, o", ["mov.b32 k, {$18, $19};", "mov.b32 e, 0x2C002C00;", "mov.b32 o, {$20, $21};"],
                           lambda source, odd: _magic_code(source, odd, "k", "e", "o"))


_ROTATED_VALUE_PAIR_ASM = gl.constexpr(_rotated_value_pair_asm())

def _row_key_asm(registers: str, codes: list[str]) -> str:
    """PTX for a token-axis key row's codes and its row's (scale, min) (``$9``, ``$10``) -> 8 dequantized
    float16 ``code * scale + min``: ``codes`` leaves the pairs of codes ``(i, i + 4)`` as float16 in registers
    ``a, b, c, d`` (``i`` = 0..3); outputs ``$i`` and ``$i+4``. ``registers``: more ``.reg`` names."""
    lines = ["{", f".reg .b32 a, b, c, d, s, m, {registers};", "mov.b32 s, {$9, $9};", "mov.b32 m, {$10, $10};",
             *codes]
    lines += [f"fma.rn.f16x2 {r}, {r}, s, m;" for r in "abcd"]
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, {r};" for i, r in enumerate("abcd")]
    return "\n".join([*lines, "}"])


# Token-axis INT4 key rows (sparse residuals): a word -> its nibble pairs (i, i + 4) as 1024 + code by lop3
# (1024 + 16 code for odd i), less 1024 (for odd i: x 1/16, less 64).
_ROW_KEY_ASM = gl.constexpr(_row_key_asm("t, k, e, o", [
    "mov.b32 k, 0x64006400;", "mov.b32 e, 0x2C002C00;", "mov.b32 o, 0xD400D400;",
    "lop3.b32 a, $8, 0x000F000F, 0x64006400, 0xEA;", "lop3.b32 b, $8, 0x00F000F0, 0x64006400, 0xEA;",
    "shr.u32 t, $8, 8;",
    "lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;", "lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;",
    "sub.f16x2 a, a, k;", "fma.rn.f16x2 b, b, e, o;", "sub.f16x2 c, c, k;", "fma.rn.f16x2 d, d, e, o;"]))

# Token-axis affine INT2 key rows: a halfword (8 two-bit codes) -> the same 8 dequantized float16 as
# _ROW_KEY_ASM gives for an INT4 word of those codes. Its two bytes to the word's halves (prmt), then the codes
# (c_i, c_i+4) at 4**i: 1024 + 4**i c as float16 (exact), less 1024 times 4**-i.
_ROW_KEY_INT2_ASM = gl.constexpr(_row_key_asm("x, z, k, e, f, g, o, p, q", [
    "cvt.u32.u16 x, $8;", "mov.b32 z, 0;", "prmt.b32 x, x, z, 0x4140;",
    "mov.b32 k, 0x64006400;", "mov.b32 e, 0x34003400;", "mov.b32 o, 0xDC00DC00;", "mov.b32 f, 0x2C002C00;",
    "mov.b32 p, 0xD400D400;", "mov.b32 g, 0x24002400;", "mov.b32 q, 0xCC00CC00;",
    "lop3.b32 a, x, 0x00030003, 0x64006400, 0xEA;", "lop3.b32 b, x, 0x000C000C, 0x64006400, 0xEA;",
    "lop3.b32 c, x, 0x00300030, 0x64006400, 0xEA;", "lop3.b32 d, x, 0x00C000C0, 0x64006400, 0xEA;",
    "sub.f16x2 a, a, k;", "fma.rn.f16x2 b, b, e, o;", "fma.rn.f16x2 c, c, f, p;", "fma.rn.f16x2 d, d, g, q;"]))


@gluon.constexpr_function
def _copy_layout(rows: int, cols: int, itemsize: int):
    """Blocked ``[rows, cols]``: 16-byte pieces per thread, one warp."""
    vector = max(1, min(16 // itemsize, cols))
    across = min(32, cols // vector)
    return gl.BlockedLayout([1, vector], [32 // across, across], [1, 1], [1, 0])


@gluon.constexpr_function
def _value_tile_layout(page: int, words: int):
    """``[page, W]``: thread (g, t) holds words ``g W/8 ..`` of tokens ``{0,1} + 2 t + 8 j``."""
    low = _log2(words) - 3
    regs = [[0, 1 << b] for b in range(low)] + [[1, 0]] + [[1 << b, 0] for b in range(3, _log2(page))]
    lanes = [[2, 0], [4, 0], [0, words // 8], [0, words // 4], [0, words // 2]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [page, words])


@gluon.constexpr_function
def _value_meta_layout(page: int, groups: int, head_dim: int, value_group: int):
    """``[page, NG]`` float16 value scales: thread (g, t) holds, for its tokens, the groups of its words.

    The group of word ``w`` is ``w >> (log2 GV - 3)``: a word bit held in a
    register (the low ``log2(W) - 3`` bits) or on lane bits 2-4 (the top
    three) becomes a register or lane basis of the group index.
    """
    shift = _log2(value_group) - 3
    low = _log2(head_dim // 8) - 3

    def group_basis(word_bit):
        bit = word_bit - shift
        return [0, 1 << bit] if 0 <= bit < _log2(groups) else None

    regs = [[1, 0]] + [[1 << b, 0] for b in range(3, _log2(page))]
    regs += [basis for basis in (group_basis(b) for b in range(low)) if basis is not None]
    lanes = [[2, 0], [4, 0]] + [group_basis(low + bit) or [0, 0] for bit in range(3)]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [page, groups])


@gluon.constexpr_function
def _key_meta_layout(head_dim: int):
    """``[D]`` float16 key scales, physical order: thread t holds channels ``t D/4 ..``, all g alike."""
    regs = [[1 << b] for b in range(_log2(head_dim) - 2)]
    lanes = [[head_dim // 4], [head_dim // 2], [0], [0], [0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [head_dim])


@gluon.constexpr_function
def _padded_rows(page: int, words: int):
    """One stage ``[page, W]`` of words, each token row followed by 4 words of padding."""
    shape = [page, words]
    bases = [[1 << b if d == dim else 0 for d in range(2)] for dim in (1, 0) for b in range(_log2(shape[dim]))]
    return gl.PaddedSharedLayout([[words, 4]], bases, [], shape)


@gluon.constexpr_function
def _value_shared(page: int, words: int):
    """One stage ``[page, W]`` of value words, rows XOR-spread over the banks.

    The fragment reads of :func:`_value_tile_layout` touch tokens ``t`` (lanes
    0-1) and word groups (lanes 2-4) at once; in a plain row-major tile the
    tokens of one read share banks. Offset bits (words) map to (token, word)
    so that token bits 1 and 2 also flip the two bank bits a read does not
    otherwise vary: every read is conflict-free. (Offsets -> coordinates.)
    """
    lw, lp = _log2(words), _log2(page)
    word_bases = [[0, 1 << b] for b in range(lw)]
    if lw == 3:  # 32-byte rows; a read covers 32 lanes x 4 bytes
        token_bases = [[1, 0], [2, 0], [5, 0]]
    elif lw == 4:  # 64-byte rows; 16 lanes x 8 bytes
        token_bases = [[1, 0], [3, 0], [4, 8]]
    else:  # 128-byte rows (D = 256); 8 lanes x 16 bytes
        token_bases = [[1, 0], [2, 8], [4, 16]]
    token_bases = token_bases[:lp] + [[1 << b, 0] for b in range(3, lp)]
    return gl.SharedLinearLayout(word_bases + token_bases)


_padded_sparse_rows = gluon.constexpr_function(launch.padded_sparse_rows)


@gluon.constexpr_function
def _query_columns(scaled: bool, groups: int) -> int:
    """Columns of a value product per scale group: ``8 / groups`` with ``SCALED``, else all 8."""
    return 8 // groups if scaled else 8


@gluon.constexpr_function
def _scale_groups(format: int, head_dim: int, value_group: int) -> int:
    """Value scales per token: one for int4_rotated, ``D / 16`` for NVFP4, ``NG`` for INT4."""
    return {0: head_dim // value_group, 1: head_dim // 16, 2: 1}[format]


@gluon.constexpr_function
def _staggered(stagger: bool, stages: int) -> bool:
    """Whether the page loop copies keys and values as two groups (one stage only)."""
    return bool(stagger) and stages == 1


@gluon.constexpr_function
def _paired_nvfp4(format: int, streams: int) -> bool:
    """Whether the page loop reads two dense NVFP4 streams as one key accumulator and one value tile
    (:func:`_nvfp4_pair_terms`)."""
    return format == 1 and streams == 2


@gluon.constexpr_function
def _prologue_pages(stagger: bool, stages: int) -> int:
    """Pages the page loop copies before it starts: ``stages - 1``, or the first page when staggered."""
    return 1 if _staggered(stagger, stages) else stages - 1


@gluon.constexpr_function
def _product_k(rows: int) -> int:
    """The k of the products that take a sparse tile's rows on their k axis (m16n8k16: at least 16;
    a tile of 8 rows is padded with zeros in registers)."""
    return max(16, rows)


@gluon.constexpr_function
def _narrowed(layout, dim: int, size: int):
    """``layout`` (a linear layout) cut to ``size`` along ``dim``: register bases beyond it dropped
    (the registers a zero-padded half would hold)."""
    if layout is None or layout.shape[dim] == size:  # (the CPU emulation has no layouts)
        return layout
    assert all(b[dim] < size for b in list(layout.lane_bases) + list(layout.warp_bases)), layout
    regs = [list(b) for b in layout.reg_bases if b[dim] < size]
    shape = list(layout.shape)
    shape[dim] = size
    return gl.DistributedLinearLayout(regs, [list(b) for b in layout.lane_bases], [list(b) for b in layout.warp_bases],
                                      [], shape)


@gluon.constexpr_function
def _transposed(layout):
    """A 2-D linear layout with its axes swapped (``None``, the CPU emulation's, stays ``None``)."""
    if layout is None:
        return layout

    def swap(bases):
        return [[b[1], b[0]] for b in bases]

    return gl.DistributedLinearLayout(swap(layout.reg_bases), swap(layout.lane_bases), swap(layout.warp_bases), [],
                                      [layout.shape[1], layout.shape[0]])


@gluon.constexpr_function
def _plain_shared(rank: int):
    return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))


@gluon.jit
def _key_order_1d(x, D: gl.constexpr, W: gl.constexpr):
    """``[D]`` physical -> logical key order."""
    x = gl.reshape(x, [2, 2, W // 4, 2, 2, 2])  # (wt1, wt0, wl, i2, i1, i0)
    return gl.reshape(gl.permute(x, [2, 4, 5, 0, 1, 3]), [D])  # (wl, i1, i0, wt1, wt0, i2)


@gluon.jit
def _tile_columns(x, PAGE: gl.constexpr):
    """``[16, 8]`` -> ``[16, PAGE]`` repeating the 8 columns (register-only)."""
    for _ in gl.static_range(_log2(PAGE // 8)):
        x = gl.reshape(gl.permute(gl.join(x, x), [0, 2, 1]), [16, 2 * x.shape[1]])
    return x


@gluon.jit
def _table_entry(step, first, seq, table_ptr, max_pages):
    """Block-table entry of page ``first + step`` of sequence ``seq`` (-1 past the table). Its load
    needs no sequence length, so the first one is issued beside the length's."""
    return gl.load(table_ptr + seq * max_pages + first + step, mask=first + step < max_pages, other=-1)


@gluon.jit
def _entry_tile(entry, step, count, head, pool_pages):
    """(tile index of the page ``entry`` names in this program's head, whether it is read).

    A page is read when ``step < count`` and its block-table entry holds a
    page: a lost page (-1) is skipped, and since the cache stores no page
    after a lost one, that ends the sequence's pages where the reference's
    regions end them.
    """
    return head.to(gl.int64) * pool_pages + gl.maximum(entry, 0), (step < count) & (entry >= 0)


@gluon.jit
def _page_tile(step, count, first, seq, head, table_ptr, pool_pages, max_pages):
    """(tile index of page ``first + step`` of this program's head, whether it is read): :func:`_entry_tile`
    of its block-table entry (loaded only for ``step < count``)."""
    entry = gl.load(table_ptr + seq * max_pages + first + step, mask=step < count, other=-1)
    return _entry_tile(entry, step, count, head, pool_pages)


@gluon.jit
def _copy_page(streams, stage, tile, live, KEYS: gl.constexpr, STREAMS: gl.constexpr, SPARSE: gl.constexpr,
               R3: gl.constexpr, RP3: gl.constexpr, R4: gl.constexpr, RP4: gl.constexpr, PAGE: gl.constexpr,
               W: gl.constexpr, D: gl.constexpr, NG: gl.constexpr, FORMAT: gl.constexpr, ROWS: gl.constexpr = 0):
    """cp.async the key (``KEYS``) or value tiles of page ``tile`` of every stream the kernel reads (no
    commit). ``streams``: (buffers, pointers) of the dense streams' ``(words, scale, minimum)`` and of the
    sparse loops' rows (in format ``ROWS``). Metadata per tile: INT4 key scale/min ``[D]`` and value scale/min
    ``[PAGE, NG]`` (float16), NVFP4 E4M3 scale bytes ``[PAGE, D/16]``, int4_rotated row scales ``[PAGE]`` (float32)."""
    buffers, pointers = streams
    if FORMAT == ROTATED:
        META: gl.constexpr = PAGE
    elif FORMAT == NVFP4:
        META: gl.constexpr = PAGE * (D // 16)
    elif KEYS:
        META: gl.constexpr = D
    else:
        META: gl.constexpr = PAGE * NG
    _copy_tile(buffers[0], buffers[1], buffers[2], stage, tile, live, pointers[0], pointers[1], pointers[2], PAGE, W,
               META, FORMAT)
    if STREAMS == 2:
        _copy_tile(buffers[3], buffers[4], buffers[5], stage, tile, live, pointers[3], pointers[4], pointers[5],
                   PAGE, W, META, FORMAT)
    if SPARSE >= 1:
        _copy_rows(buffers[6], stage, tile, live, pointers[6], R3, RP3, W, ROWS)
    if SPARSE >= 2:
        _copy_rows(buffers[7], stage, tile, live, pointers[7], R4, RP4, W, ROWS)


@gluon.jit
def _copy_tile(w_s, s_s, m_s, stage, tile, live, w_ptr, s_ptr, m_ptr, PAGE: gl.constexpr, W: gl.constexpr,
               META: gl.constexpr, FORMAT: gl.constexpr):
    """cp.async one stream's key or value tile: its words ``[PAGE, W]`` and ``META`` elements of each
    metadata array (INT4: scale and minimum; NVFP4 and int4_rotated: the scales)."""
    WORDS: gl.constexpr = _copy_layout(PAGE, W, 4)
    w_rows = gl.arange(0, PAGE, layout=gl.SliceLayout(1, WORDS))
    w_cols = gl.arange(0, W, layout=gl.SliceLayout(0, WORDS))
    w_offsets = gl.expand_dims(w_rows, 1) * W + gl.expand_dims(w_cols, 0)
    async_copy.async_copy_global_to_shared(w_s.index(stage), w_ptr + tile * (PAGE * W) + w_offsets, mask=live)
    VECTOR: gl.constexpr = 4 if FORMAT == ROTATED else (16 if FORMAT == NVFP4 else 8)  # 16 bytes a thread
    offsets = gl.arange(0, META, layout=gl.BlockedLayout([VECTOR], [32], [1], [0]))
    async_copy.async_copy_global_to_shared(s_s.index(stage), s_ptr + tile * META + offsets, mask=live)
    if FORMAT == INT4:
        async_copy.async_copy_global_to_shared(m_s.index(stage), m_ptr + tile * META + offsets, mask=live)


@gluon.jit
def _stream_buffers(STAGES: gl.constexpr, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, NG: gl.constexpr,
                    FORMAT: gl.constexpr):
    """Shared memory of one stream: STAGES page tiles of key/value words and their metadata."""
    kw_s = gl.allocate_shared_memory(gl.uint32, [STAGES, PAGE, W], _plain_shared(2))
    vw_s = gl.allocate_shared_memory(gl.uint32, [STAGES, PAGE, W], _value_shared(PAGE, W))
    if FORMAT == ROTATED:
        ks_s = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE], _plain_shared(1))
        vs_s = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE], _plain_shared(1))
        km_s = ks_s  # unused: no minimums
        vm_s = vs_s
    elif FORMAT == NVFP4:
        ks_s = gl.allocate_shared_memory(gl.uint8, [STAGES, PAGE * (D // 16)], _plain_shared(1))
        vs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, PAGE * (D // 16)], _plain_shared(1))
        km_s = ks_s  # unused: the tile scales are read from memory
        vm_s = vs_s
    else:
        ks_s = gl.allocate_shared_memory(gl.float16, [STAGES, D], _plain_shared(1))
        km_s = gl.allocate_shared_memory(gl.float16, [STAGES, D], _plain_shared(1))
        vs_s = gl.allocate_shared_memory(gl.float16, [STAGES, PAGE * NG], _plain_shared(1))
        vm_s = gl.allocate_shared_memory(gl.float16, [STAGES, PAGE * NG], _plain_shared(1))
    return kw_s, vw_s, ks_s, km_s, vs_s, vm_s


@gluon.jit
def _key_offset(query, km_s, stage, zeros_b8, zeros_c8, D: gl.constexpr, W: gl.constexpr, B8: gl.constexpr,
                KM: gl.constexpr):
    """``q . min`` of one INT4 key stream's page in every column of a ``[16, 8]`` accumulator (the
    query halves' rows, to be folded with the scores)."""
    k_min = _key_order_1d(km_s.index(stage).load(KM), D, W)
    k_min = gl.convert_layout(k_min, gl.SliceLayout(1, B8), assert_trivial=True)
    minimum = gl.broadcast(gl.expand_dims(k_min, 1), zeros_b8)[0]
    return mma_v2(query[0], minimum, zeros_c8)


@gluon.jit
def _scaled_query(query, ks_s, stage, D: gl.constexpr, W: gl.constexpr, A_OP: gl.constexpr, KM: gl.constexpr,
                  PRECISE: gl.constexpr):
    """The query scaled by one INT4 key stream's page channel scales: the A operand (float16, the
    product's high half in rows 0-7 and its low half in rows 8-15)."""
    _, hi, lo = query
    # Odd nibbles' codes enter the product x 16 (:func:`_key_tile_v2`): their channels' scales / 16.
    channel = gl.arange(0, D, layout=KM)
    k_scale = ks_s.index(stage).load(KM) * gl.where((channel & 1) == 1, 0.0625, 1.0).to(gl.float16)
    k_scale = _key_order_1d(k_scale, D, W)
    scale = gl.expand_dims(gl.convert_layout(k_scale, gl.SliceLayout(0, hi.type.layout), assert_trivial=True), 0)
    # (hi + lo) * s as a float16 pair: hi * s rounded, then its exact rounding remainder plus lo * s.
    scaled_hi = hi * scale
    if PRECISE:
        scaled_lo = gl.fma(lo, scale, gl.fma(hi, scale, -scaled_hi))
    else:
        scaled_lo = gl.zeros_like(scaled_hi)
    return _stack_rows(scaled_hi, scaled_lo, D, A_OP)


@gluon.jit
def _key_terms(query, ks_s, km_s, stage, zeros_b8, zeros_c8, D: gl.constexpr, W: gl.constexpr,
               A_OP: gl.constexpr, B8: gl.constexpr, KM: gl.constexpr, PRECISE: gl.constexpr):
    """One INT4 key stream's page terms: (:func:`_scaled_query`, :func:`_key_offset`)."""
    return (_scaled_query(query, ks_s, stage, D, W, A_OP, KM, PRECISE),
            _key_offset(query, km_s, stage, zeros_b8, zeros_c8, D, W, B8, KM))


@gluon.jit
def _q_dot(query, b, acc):
    """``acc + q . b`` for the query operand (``query[0]``: float16 ``[16, D]``, its high half in
    rows 0-7 and its low half in rows 8-15; fold the result's rows with :func:`_fold_rows`)."""
    return mma_v2(query[0], b, acc)


_HALVES_ASM = gl.constexpr("mov.b32 {$0, $1}, $2;")


@gluon.jit
def _halves(x):
    """uint32 -> its (low, high) halves as float16 bits."""
    return gl.inline_asm_elementwise(_HALVES_ASM, "=h,=h,r", [x], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=1)


@gluon.jit
def _key_tile_v2(words, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, B_LAYOUT: gl.constexpr):
    """uint32 ``[PAGE, W]`` -> ``[D, PAGE]`` (logical key order) float16 subnormal codes in ``B_LAYOUT``:
    ``code * KEY_UNIT``, times 16 in the channels of odd nibbles (whose scales :func:`_scaled_query`
    divides by 16)."""
    high = words >> 8
    c0, c4 = _halves(words & 0x000F000F)
    c1, c5 = _halves(words & 0x00F000F0)
    c2, c6 = _halves(high & 0x000F000F)
    c3, c7 = _halves(high & 0x00F000F0)
    x = _join8(c0, c1, c2, c3, c4, c5, c6, c7)
    x = gl.reshape(x, [PAGE, 2, 2, W // 4, 2, 2, 2])
    x = gl.permute(x, [3, 5, 4, 1, 2, 6, 0])
    return gl.convert_layout(gl.reshape(x, [D, PAGE]), B_LAYOUT, assert_trivial=True)


@gluon.jit
def _value_tile_v2(tile, scale, minimum, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
                   NG: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Value words ``[PAGE, W]`` and their scale/min ``[PAGE, NG]`` -> ``V^T [D, PAGE]`` in ``A_LAYOUT``."""
    even, odd = gl.split(gl.permute(gl.reshape(tile, [PAGE // 2, 2, W]), [0, 2, 1]))
    s_even, s_odd = gl.split(gl.permute(gl.reshape(scale, [PAGE // 2, 2, NG]), [0, 2, 1]))
    m_even, m_odd = gl.split(gl.permute(gl.reshape(minimum, [PAGE // 2, 2, NG]), [0, 2, 1]))
    even = gl.reshape(even, [PAGE // 2, NG, W // NG])
    odd = gl.reshape(odd, [PAGE // 2, NG, W // NG])
    L3: gl.constexpr = even.type.layout
    S2: gl.constexpr = gl.SliceLayout(2, L3)
    s_even = gl.expand_dims(gl.convert_layout(s_even, S2, assert_trivial=True), 2)
    s_odd = gl.expand_dims(gl.convert_layout(s_odd, S2, assert_trivial=True), 2)
    m_even = gl.expand_dims(gl.convert_layout(m_even, S2, assert_trivial=True), 2)
    m_odd = gl.expand_dims(gl.convert_layout(m_odd, S2, assert_trivial=True), 2)
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _VALUE_PAIR_ASM_V2, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,h,h,h",
        [even, odd, s_even, s_odd, m_even, m_odd], dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _e4m3_to_float16(bits, multiplier):
    """float16 values of E4M3 bit patterns (uint8, non-negative, not NaN) times ``multiplier / 256``
    (``multiplier`` 256.0: exact).

    The bits moved up by 7 are the float16 of ``value / 256`` (E4M3's bias is 8 below float16's;
    E4M3 subnormals land on float16 subnormals), and x 256 is exact. Two dense NVFP4 streams pass
    ``256 x`` the ratio of their tile scales (:func:`_nvfp4_pair_terms`)."""
    scaled = (bits.to(gl.int16) << 7).to(gl.float16, bitcast=True)
    return scaled * multiplier


# Two E4M3 scale bytes (one 16-bit register: a token's two neighbouring 16-channel blocks) -> their float16
# pair over 256: each byte to the low byte of its half (prmt), moved up by 7 (the float16 of value / 256, as
# _e4m3_to_float16); the multiplier follows as a float16 multiply: 3 instructions a pair.
_E4M3_PAIR_ASM = gl.constexpr("""{
.reg .b32 w, z;
mov.b32 z, 0;
cvt.u32.u16 w, $1;
prmt.b32 w, w, z, 0x4140;
shl.b32 $0, w, 7;
}""")


@gluon.jit
def _e4m3_pairs_to_float16(bits, multiplier):
    """:func:`_e4m3_to_float16` of uint8 ``[..., 2n]`` whose threads hold neighbouring pairs along the last
    axis (loaded as one 16-bit word), by :data:`_E4M3_PAIR_ASM`."""
    pairs = gl.inline_asm_elementwise(_E4M3_PAIR_ASM, "=r,h", [bits], dtype=gl.float16, is_pure=True, pack=2)
    return pairs * multiplier


@gluon.jit
def _nvfp4_key_tile(words, scale_bytes, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
                    B_LAYOUT: gl.constexpr, multiplier=256.0):
    """NVFP4 key words ``[PAGE, W]`` and E4M3 scales ``[PAGE, D/16]`` -> ``e2m1 * scale / NVFP4_UNIT``
    ``[D, PAGE]`` (float16, logical key order) in ``B_LAYOUT`` (times ``multiplier / 256``:
    :func:`_e4m3_to_float16`)."""
    words = gl.reshape(words, [PAGE, W // 2, 2])  # a scale per two words (16 channels)
    local = gl.convert_layout(_e4m3_pairs_to_float16(scale_bytes, multiplier), gl.SliceLayout(2, words.type.layout))
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _E2M1_KEY_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, gl.expand_dims(local, 2)],
        dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return _planes_to_key_tile(gl.reshape(c0, [PAGE, W]), gl.reshape(c1, [PAGE, W]), gl.reshape(c2, [PAGE, W]),
                               gl.reshape(c3, [PAGE, W]), gl.reshape(c4, [PAGE, W]), gl.reshape(c5, [PAGE, W]),
                               gl.reshape(c6, [PAGE, W]), gl.reshape(c7, [PAGE, W]), PAGE, W, D, B_LAYOUT)


@gluon.jit
def _nvfp4_value_words(tile, scale_bytes, multiplier, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr):
    """NVFP4 value words ``[PAGE, W]`` and E4M3 scales ``[PAGE, D/16]`` as the value asm blocks take them:
    ``(even, odd)`` tokens' words ``[PAGE/2, D/16, W/(D/16)]`` and their scales (float16, x ``multiplier /
    256``) ``[PAGE/2, D/16, 1]``."""
    NG: gl.constexpr = D // 16
    even, odd = gl.split(gl.permute(gl.reshape(tile, [PAGE // 2, 2, W]), [0, 2, 1]))
    local = _e4m3_to_float16(scale_bytes, multiplier)
    s_even, s_odd = gl.split(gl.permute(gl.reshape(local, [PAGE // 2, 2, NG]), [0, 2, 1]))
    even = gl.reshape(even, [PAGE // 2, NG, W // NG])
    odd = gl.reshape(odd, [PAGE // 2, NG, W // NG])
    S2: gl.constexpr = gl.SliceLayout(2, even.type.layout)
    s_even = gl.expand_dims(gl.convert_layout(s_even, S2, assert_trivial=True), 2)
    s_odd = gl.expand_dims(gl.convert_layout(s_odd, S2, assert_trivial=True), 2)
    return even, odd, s_even, s_odd


@gluon.jit
def _nvfp4_value_tile(tile, scale_bytes, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
                      A_LAYOUT: gl.constexpr, multiplier=256.0):
    """NVFP4 value words ``[PAGE, W]`` and E4M3 scales ``[PAGE, D/16]`` -> ``V^T [D, PAGE]``
    (``e2m1 * scale / NVFP4_UNIT``, float16) in ``A_LAYOUT`` (times ``multiplier / 256``:
    :func:`_e4m3_to_float16`)."""
    even, odd, s_even, s_odd = _nvfp4_value_words(tile, scale_bytes, multiplier, PAGE, W, D)
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _E2M1_VALUE_PAIR_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,h",
        [even, odd, s_even, s_odd], dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _nvfp4_value_pair_tile(tile, scale_bytes, multiplier, tile2, scale_bytes2, multiplier2, PAGE: gl.constexpr,
                           W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Two NVFP4 value streams' tiles (:func:`_nvfp4_value_tile`, each with its multiplier) as one: the
    second's values added to the first's in float16 (one rounding each, ``fma``), for one product."""
    even, odd, s_even, s_odd = _nvfp4_value_words(tile, scale_bytes, multiplier, PAGE, W, D)
    even2, odd2, s_even2, s_odd2 = _nvfp4_value_words(tile2, scale_bytes2, multiplier2, PAGE, W, D)
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _E2M1_VALUE_PAIR_SUM_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,h,h,h,h",
        [even, odd, even2, odd2, s_even, s_odd, s_even2, s_odd2], dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _e2m1_value_codes(words, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """NVFP4 value words uint32 ``[PAGE, W]`` -> ``V^T [D, PAGE]`` float16 ``e2m1 / 2**14`` (exact; their
    scales on the probabilities) in ``A_LAYOUT``."""
    even, odd = gl.split(gl.permute(gl.reshape(words, [PAGE // 2, 2, W]), [0, 2, 1]))
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _E2M1_VALUE_CODES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.constexpr_function
def _window_key_layout(head_dim: int):
    """``[16, D]`` window rows, physical order: thread (g, t) holds rows ``g, g + 8`` and
    channels ``t D/4 ..`` (one 16-byte load per 8 channels)."""
    regs = [[0, 1 << b] for b in range(_log2(head_dim) - 2)] + [[8, 0]]
    lanes = [[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [16, head_dim])


@gluon.constexpr_function
def _window_value_layout(head_dim: int):
    """``[16, D]`` window rows, physical order: thread (g, t) holds rows ``{0, 1, 8, 9} + 2 t`` and
    the ``D/8`` channels of its value words."""
    regs = [[0, 1 << b] for b in range(_log2(head_dim) - 3)] + [[1, 0], [8, 0]]
    lanes = [[2, 0], [4, 0], [0, head_dim // 8], [0, head_dim // 4], [0, head_dim // 2]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [16, head_dim])


@gluon.constexpr_function
def tokens_w_layout(mma):
    """Layout of the ``[8, 16]`` window scores (rows 0-7 of a ``[16, 16]`` accumulator)."""
    return gl.DistributedLinearLayout([[0, 1], [0, 8]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [], [], [8, 16])


@gluon.jit
def _load_window_rows(ptr, first, count, LAYOUT: gl.constexpr, D: gl.constexpr):
    """float16 ``[16, D]`` rows ``first ..`` of a ``[count, D]`` window (0 past ``count``; clamped to +-65504)."""
    rows = first + gl.arange(0, 16, layout=gl.SliceLayout(1, LAYOUT))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LAYOUT))
    mask = gl.expand_dims(rows < count, 1)
    x = gl.load(ptr + gl.expand_dims(rows, 1) * D + gl.expand_dims(cols, 0), mask=mask, other=0.0)
    return gl.minimum(gl.maximum(x.to(gl.float32), -65504.0), 65504.0).to(gl.float16)


@gluon.jit
def _window_chunk(query, k_ptr, v_ptr, first, count, valid, total, run_max, acc,
                  D: gl.constexpr, W: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, MMA: gl.constexpr):
    """One 16-slot chunk of an unquantized window into the online-softmax state."""
    keys = _load_window_rows(k_ptr, first, count, _window_key_layout(D), D)
    keys = gl.reshape(keys, [16, 2, 2, W // 4, 2, 2, 2])  # (row, wt1, wt0, wl, i2, i1, i0)
    keys = gl.reshape(gl.permute(keys, [3, 5, 6, 1, 2, 4, 0]), [D, 16])  # logical key order
    keys = gl.convert_layout(keys, B_OP, assert_trivial=True)
    values = _load_window_rows(v_ptr, first, count, _window_value_layout(D), D)
    values = gl.reshape(values, [16, 8, W // 8, 2, 2, 2])  # (row, wt, wl, i2, i1, i0)
    values = gl.reshape(gl.permute(values, [3, 4, 5, 2, 1, 0]), [D, 16])  # (i2, i1, i0, wl, wt; row)
    values = gl.convert_layout(values, A_OP, assert_trivial=True)
    scores = _fold_rows(_q_dot(query, keys, gl.zeros([16, 16], gl.float32, layout=MMA)), 16)  # [8, 16]
    scores = gl.convert_layout(scores, tokens_w_layout(MMA), assert_trivial=True)
    mask = gl.expand_dims(valid, 0)
    scores = gl.where(mask, scores, MASK_VALUE)
    row_max = gl.convert_layout(run_max, gl.SliceLayout(1, tokens_w_layout(MMA)))
    new_max = gl.maximum(row_max, gl.max(scores, axis=1))
    correction = gl.exp2(row_max - new_max)
    weights = gl.where(mask, gl.exp2(scores - gl.expand_dims(new_max, 1)), 0.0)
    total = total * gl.convert_layout(correction, total.type.layout) + gl.convert_layout(
        gl.sum(weights, axis=1), total.type.layout)
    p_t = gl.convert_layout(gl.permute(weights.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
    acc_correction = gl.convert_layout(correction, gl.SliceLayout(0, MMA))
    acc = mma_v2(values, p_t, acc * gl.expand_dims(acc_correction, 0))
    return total, gl.convert_layout(new_max, run_max.type.layout), acc


@gluon.jit
def _zero_point(scale):
    """float32 zero points in the 4 low mantissa bits of int4_rotated scales (float32)."""
    return (scale.to(gl.uint32, bitcast=True) & 15).to(gl.float32)


@gluon.jit
def _rotated_key_tile(words, zp, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, B_LAYOUT: gl.constexpr):
    """int4_rotated key words uint32 ``[PAGE, W]`` and their tokens' zero points float32 ``[PAGE]`` (in
    ``SliceLayout(1, words' layout)``) -> ``code - zp`` ``[D, PAGE]`` (float16, exact; logical key order) in
    ``B_LAYOUT``."""
    (c0, c1, c2, c3, c4, c5, c6, c7) = gl.inline_asm_elementwise(
        _ROTATED_KEY_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
        [words, gl.expand_dims((zp + 1024.0).to(gl.float16), 1), gl.expand_dims((-64.0 - zp).to(gl.float16), 1)],
        dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return _planes_to_key_tile(c0, c1, c2, c3, c4, c5, c6, c7, PAGE, W, D, B_LAYOUT)


@gluon.jit
def _rotated_value_tile(words, zp, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """int4_rotated value words uint32 ``[PAGE, W]`` and their tokens' zero points float32 ``[PAGE]`` (in
    ``SliceLayout(1, words' layout)``) -> ``V^T [D, PAGE]`` of ``code - zp`` (float16, exact) in ``A_LAYOUT``."""
    even, odd = gl.split(gl.permute(gl.reshape(words, [PAGE // 2, 2, W]), [0, 2, 1]))
    VE: gl.constexpr = gl.SliceLayout(1, even.type.layout)
    zp_even, zp_odd = gl.split(gl.reshape(zp, [PAGE // 2, 2]))
    zp_even = gl.expand_dims(gl.convert_layout(zp_even, VE), 1)
    zp_odd = gl.expand_dims(gl.convert_layout(zp_odd, VE), 1)
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _ROTATED_VALUE_PAIR_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,h,h,h",
        [even, odd, (zp_even + 1024.0).to(gl.float16), (zp_odd + 1024.0).to(gl.float16),
         (-64.0 - zp_even).to(gl.float16), (-64.0 - zp_odd).to(gl.float16)],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _planes_to_key_tile(c0, c1, c2, c3, c4, c5, c6, c7, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
                        B_LAYOUT: gl.constexpr):
    """8 planes ``[PAGE, W]`` (nibble ``i`` of every key word) -> ``[D, PAGE]`` logical key order."""
    x = gl.reshape(_join8(c0, c1, c2, c3, c4, c5, c6, c7), [PAGE, 2, 2, W // 4, 2, 2, 2])
    x = gl.permute(x, [3, 5, 4, 1, 2, 6, 0])
    return gl.convert_layout(gl.reshape(x, [D, PAGE]), B_LAYOUT, assert_trivial=True)


@gluon.jit
def _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE: gl.constexpr,
                         W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """16 planes (nibble ``i`` of the even / odd token of each pair) -> ``V^T [D, PAGE]``."""
    x = _join8(gl.join(e0, o0), gl.join(e1, o1), gl.join(e2, o2), gl.join(e3, o3),
               gl.join(e4, o4), gl.join(e5, o5), gl.join(e6, o6), gl.join(e7, o7))
    x = gl.reshape(x, [PAGE // 2, 8, W // 8, 2, 2, 2, 2])  # (u, wt, wl, e, i0, i1, i2)
    x = gl.permute(x, [6, 5, 4, 2, 1, 0, 3])  # (i2, i1, i0, wl, wt, u, e)
    return gl.convert_layout(gl.reshape(x, [D, PAGE]), A_LAYOUT, assert_trivial=True)


# Values as subnormal codes, their scales and minimums on the probabilities (``SCALED``). A value is
# ``scale * code + min`` with one (scale, min) per token and group of ``GV`` channels. The product
# ``V^T [D, K] . P^T [K, 8]`` takes its tokens on k, so a scale can join the probabilities only where a
# product's rows share a group: the 8 columns (query rows) are cut into ``NG`` blocks of ``GP = 8 / NG``,
# block ``g`` holding the probabilities times group ``g``'s scales (the query's rows are repeated in each
# block: the GQA group has at most ``GP`` rows). Each row of the accumulator keeps the block of its
# channel's group; the minimums' terms ``sum_t p_t min_{t,g}`` are per-thread sums beside the softmax's
# (``mins``), added per column after the page loop. The codes enter the product as float16 subnormals,
# one ``and`` per pair (``_VALUE_CODES_ASM``), their units restored per row after the loop.
# Precision: each ``p * scale`` is rounded to float16 once. The probabilities are at most 1 (no lazy
# rescaling) and a value scale at most 8734 (a float16 minimum and scale bound a group's values to
# +-65504), so ``p * scale * 2**2`` cannot overflow: the probabilities carry that factor
# (``SCALED_HEADROOM_LOG2``), and products keep float16's 11 bits down to ``p * scale = 2**-16`` (below
# it, an absolute 2**-27 per token, times its code: values whose scales are under about 1e-4 lose
# relative precision, not absolute; values of 1e-3 stay within 7e-5 of the reference, as at 1).
SCALED_HEADROOM_LOG2 = gl.constexpr(2)


@gluon.jit
def _value_codes(words, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Value words uint32 ``[PAGE, W]`` -> ``V^T [D, PAGE]`` float16 subnormal codes in ``A_LAYOUT``:
    ``code * 2**-24`` in the rows of even nibbles, ``16 code * 2**-24`` in those of odd ones."""
    even, odd = gl.split(gl.permute(gl.reshape(words, [PAGE // 2, 2, W]), [0, 2, 1]))
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _VALUE_CODES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _int2_value_codes(halfwords, PAGE: gl.constexpr, W: gl.constexpr, D: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Affine INT2 value rows' halfwords uint16 ``[PAGE, W]`` (one per INT4 word) -> what :func:`_value_codes`
    gives for INT4 words of the same codes."""
    even, odd = gl.split(gl.permute(gl.reshape(halfwords, [PAGE // 2, 2, W]), [0, 2, 1]))
    (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = gl.inline_asm_elementwise(
        _INT2_VALUE_CODES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,h,h", [even, odd],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    return _pairs_to_value_tile(e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7, PAGE, W, D, A_LAYOUT)


@gluon.jit
def _scaled_weights(weights, scale, NG: gl.constexpr, K: gl.constexpr):
    """float32 ``weights [8, K]`` (row ``n``: query row ``n % GP`` of scale group ``n // GP``) times the K
    tokens' ``scale [NG, K]`` (float16, in the slice layout of ``weights`` reshaped ``[NG, GP, K]``):
    float32 ``[NG, GP, K]``."""
    return gl.reshape(weights, [NG, 8 // NG, K]) * gl.expand_dims(scale.to(gl.float32), 1)


@gluon.jit
def _scaled_probabilities(weights, scale, minimum, NG: gl.constexpr, K: gl.constexpr):
    """float32 ``weights [8, K]`` (row ``n``: query row ``n % GP`` of value group ``n // GP``) and the K
    tokens' value ``scale``, ``minimum`` ``[NG, K]`` (float16, in the slice layout of ``weights``
    reshaped ``[NG, GP, K]``) -> (``weights * scale`` float16 ``[8, K]``, per-thread partial sums of
    ``weights * min`` ``[8, 8]`` as :func:`_lane_sums` gives them)."""
    scaled = gl.reshape(_scaled_weights(weights, scale, NG, K), [8, K]).to(gl.float16)
    w = gl.reshape(weights, [NG, 8 // NG, K])
    return scaled, _lane_sums(gl.reshape(w * gl.expand_dims(minimum.to(gl.float32), 1), [8, K]), K)


@gluon.jit
def _codes_to_values(acc, mins, D: gl.constexpr, W: gl.constexpr, MMA: gl.constexpr, FORMAT: gl.constexpr):
    """``acc [D, 8]`` of subnormal codes times scaled probabilities and the minimums' per-thread sums
    ``[8, 8]`` -> ``acc`` in values: each row's units restored (x 2**24, or 2**20 for odd nibbles:
    logical row ``m`` holds nibble ``m // W``; both over the probabilities' ``2**SCALED_HEADROOM_LOG2``),
    each column's minimum term added. NVFP4's products are in values already (their pages' tile scales
    restore the E2M1 unit): only the probabilities' factor is taken out."""
    HEADROOM: gl.constexpr = 1.0 / (1 << SCALED_HEADROOM_LOG2)  # the probabilities' factor (_chunk_weights)
    if FORMAT == NVFP4:
        return acc * HEADROOM
    m = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    units = (1.0 + 15.0 * (((m // W) & 1) == 0).to(gl.float32)) * (1048576.0 * HEADROOM)
    column_mins = gl.convert_layout(gl.sum(mins, axis=1), gl.SliceLayout(0, MMA)) * HEADROOM
    return acc * gl.expand_dims(units, 1) + gl.expand_dims(column_mins, 0)


@gluon.jit
def _sparse_buffers(STAGES: gl.constexpr, RP: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr = 0):
    """Shared memory of a sparse stream: STAGES tiles of ``RP`` (padded) key and value rows: ``W`` uint32
    words a row, or for ``INT2`` rows ``W`` uint16 halfwords (one per INT4 word: :func:`_int2_row_words`)."""
    if ROWS == INT2:
        kw_s = gl.allocate_shared_memory(gl.uint16, [STAGES, RP, W], _plain_shared(2))
        vw_s = gl.allocate_shared_memory(gl.uint16, [STAGES, RP, W], _plain_shared(2))
    else:
        kw_s = gl.allocate_shared_memory(gl.uint32, [STAGES, RP, W], _plain_shared(2))
        vw_s = gl.allocate_shared_memory(gl.uint32, [STAGES, RP, W], _value_shared(RP, W))
    return kw_s, vw_s


@gluon.jit
def _int2_row_words(halfwords):
    """uint16 halfwords of affine INT2 rows -> uint32 INT4 words of the same codes (0..3), same shape and
    layout: halfword ``w`` of a row holds channels ``8 w .. 8 w + 7`` (2 bits each), INT4 word ``w`` the
    same channels (4 bits each), so every INT4 row path reads INT2 rows unchanged."""
    return gl.inline_asm_elementwise(_INT2_ROW_WORD_ASM, "=r,h", [halfwords], dtype=gl.uint32, is_pure=True,
                                     pack=1)


@gluon.jit
def _copy_rows(w_s, stage, tile, live, w_ptr, R: gl.constexpr, RP: gl.constexpr, W: gl.constexpr,
               ROWS: gl.constexpr = 0):
    """cp.async the ``R`` stored rows (keys or values) of a sparse tile (rows ``R .. RP`` zero-filled):
    ``W`` uint32 words a row, or ``W`` uint16 halfwords of ``INT2`` rows."""
    WORDS: gl.constexpr = _copy_layout(RP, W, 2 if ROWS == INT2 else 4)
    rows = gl.arange(0, RP, layout=gl.SliceLayout(1, WORDS))
    offsets = gl.expand_dims(rows, 1) * W + gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(0, WORDS)), 0)
    mask = live & gl.expand_dims(rows < R, 1)
    async_copy.async_copy_global_to_shared(w_s.index(stage), w_ptr + tile * (R * W) + offsets, mask=mask)


@gluon.constexpr_function
def _pair_layout(operand):
    """The layout of ``[K/2, N]`` uint32 words that hold a ``[K, N]`` float16 B operand's
    ``(k, k + 1)`` pairs, from the operand's linear layout (``gl.to_linear_layout``): its first
    register basis is k bit 0, the pair's two halves; every other basis moves to ``k / 2``."""
    if operand is None:  # the CPU emulation has no layouts
        return None
    assert list(operand.reg_bases[0]) == [1, 0], operand
    regs = [[k >> 1, n] for k, n in operand.reg_bases[1:]]
    lanes = [[k >> 1, n] for k, n in operand.lane_bases]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [operand.shape[0] // 2, operand.shape[1]])


# One-hot pairs by one comparison of two float16 pairs: a sparse row's page position against a
# token, both as float16 bits (positions < 1024: subnormals, exact; a padding row's -1 is 0xFFFF,
# a NaN, equal to nothing). Scatter: KEY_UNIT (bits 0x0001) where equal; gather: 1.0.
_SCATTER_ONE_HOT_ASM = gl.constexpr("""{
.reg .b32 t;
set.eq.u32.f16x2 t, $2, $3;
and.b32 t, t, 0x00010001;
mov.b32 {$0, $1}, t;
}""")
_GATHER_ONE_HOT_ASM = gl.constexpr("""{
.reg .b32 t;
set.eq.f16x2.f16x2 t, $2, $3;
mov.b32 {$0, $1}, t;
}""")


@gluon.jit
def _one_hot(pairs_a, pairs_b, ASM: gl.constexpr, K: gl.constexpr, N: gl.constexpr, LAYOUT: gl.constexpr):
    """``[K, N]`` float16 one-hot (a B operand's values, in ``LAYOUT``: its linear form) from
    ``[K/2, 1]`` and ``[1, N]`` uint32 float16 pairs in ``_pair_layout(LAYOUT)``'s slices: each pair
    compared at once (``ASM``), the halves placed at ``k, k + 1`` (register-only)."""
    lo, hi = gl.inline_asm_elementwise(ASM, "=h,=h,r,r", [pairs_a, pairs_b], dtype=(gl.float16, gl.float16),
                                       is_pure=True, pack=1)
    x = gl.reshape(gl.permute(gl.join(lo, hi), [0, 2, 1]), [K, N])
    return gl.convert_layout(x, LAYOUT, assert_trivial=True)


@gluon.jit
def _sparse_meta(tile, ks_ptr, km_ptr, vs_ptr, vm_ptr, pos_ptr, R: gl.constexpr, RP: gl.constexpr,
                 NG: gl.constexpr, KS: gl.constexpr, VS: gl.constexpr, SB: gl.constexpr, GB: gl.constexpr,
                 SCALED: gl.constexpr, ROWS: gl.constexpr = 0, KWR: gl.constexpr = None, VTR: gl.constexpr = None,
                 COLS: gl.constexpr = None, VCOLS: gl.constexpr = None):
    """A sparse tile's row metadata, read straight from memory: ``(key meta, value meta, pairs, gathered)``.

    The key and value meta by the rows' format ``ROWS``: INT4 (scale, min) ``[RP, NG]`` (0 past ``R``; the
    values' ``[NG, RP]`` with ``SCALED``, in ``VS``); NVFP4 (E4M3 scale bytes ``[RP, NG]``, ``NG = D / 16``,
    in ``KS`` / ``VS``, and the tile's float32 scale x ``NVFP4_UNIT``); int4_rotated the rows' float32
    scales ``[RP]`` twice, in ``SliceLayout(1, KWR)`` (keys) or ``(1, VTR)`` (values) for the zero points
    and in ``COLS`` (the key product's columns ``[RP]``) or ``VCOLS`` (the gathered probabilities') for
    the scales. Then the rows' page positions as
    float16 bits (0xFFFF, a NaN, past ``R``): rows ``(2 i, 2 i + 1)`` paired ``[RP / 2]`` for the
    scatter's one-hot operand (``SB``, ``[RP, CHUNK]``) and each row twice ``[RP]`` for the gather's
    (``GB``, ``[CHUNK, RP]``)."""
    SP: gl.constexpr = _pair_layout(SB)
    GP: gl.constexpr = _pair_layout(GB)
    even_rows = 2 * gl.arange(0, RP // 2, layout=gl.SliceLayout(1, SP))
    gather_rows = gl.arange(0, RP, layout=gl.SliceLayout(0, GP))
    positions = pos_ptr + tile * R
    even = gl.load(positions + even_rows, mask=even_rows < R, other=-1).to(gl.int32) & 0xFFFF
    odd = gl.load(positions + even_rows + 1, mask=even_rows + 1 < R, other=-1).to(gl.int32) & 0xFFFF
    gathered = gl.load(positions + gather_rows, mask=gather_rows < R, other=-1).to(gl.int32) & 0xFFFF
    pairs = (even | (odd << 16)).to(gl.uint32)
    gathered = (gathered * 0x10001).to(gl.uint32)
    if ROWS == ROTATED:
        k_rows = gl.arange(0, RP, layout=gl.SliceLayout(1, KWR))
        v_rows = gl.arange(0, RP, layout=gl.SliceLayout(1, VTR))
        c_rows = gl.arange(0, RP, layout=COLS)
        g_rows = gl.arange(0, RP, layout=VCOLS)
        rows = ks_ptr + tile * R
        values = vs_ptr + tile * R
        key_meta = (gl.load(rows + k_rows, mask=k_rows < R, other=0.0),
                    gl.load(rows + c_rows, mask=c_rows < R, other=0.0))
        value_meta = (gl.load(values + v_rows, mask=v_rows < R, other=0.0),
                      gl.load(values + g_rows, mask=g_rows < R, other=0.0))
    else:
        k_rows = gl.arange(0, RP, layout=gl.SliceLayout(1, KS))
        k_offsets = gl.expand_dims(k_rows, 1) * NG + gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, KS)), 0)
        k_mask = gl.expand_dims(k_rows < R, 1)
        if SCALED:  # [NG, RP]
            v_rows = gl.arange(0, RP, layout=gl.SliceLayout(0, VS))
            v_offsets = (gl.expand_dims(v_rows, 0) * NG
                         + gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(1, VS)), 1))
            v_mask = gl.expand_dims(v_rows < R, 0)
        else:
            v_rows = gl.arange(0, RP, layout=gl.SliceLayout(1, VS))
            v_offsets = (gl.expand_dims(v_rows, 1) * NG
                         + gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, VS)), 0))
            v_mask = gl.expand_dims(v_rows < R, 1)
        base = tile * (R * NG)
        if ROWS == NVFP4:
            key_meta = (gl.load(ks_ptr + base + k_offsets, mask=k_mask, other=0),
                        gl.load(km_ptr + tile) * NVFP4_UNIT)
            value_meta = (gl.load(vs_ptr + base + v_offsets, mask=v_mask, other=0),
                          gl.load(vm_ptr + tile) * NVFP4_UNIT)
        else:
            key_meta = (gl.load(ks_ptr + base + k_offsets, mask=k_mask, other=0.0),
                        gl.load(km_ptr + base + k_offsets, mask=k_mask, other=0.0))
            value_meta = (gl.load(vs_ptr + base + v_offsets, mask=v_mask, other=0.0),
                          gl.load(vm_ptr + base + v_offsets, mask=v_mask, other=0.0))
    return key_meta, value_meta, pairs, gathered


@gluon.jit
def _add_sparse_scores(scores, query, kw_s, stage, meta, c, RP: gl.constexpr, CHUNK: gl.constexpr,
                       W: gl.constexpr, D: gl.constexpr, NG: gl.constexpr, MMA: gl.constexpr,
                       A_OP: gl.constexpr, B_OP: gl.constexpr, KWR: gl.constexpr, SB: gl.constexpr,
                       ROWS: gl.constexpr = 0, FORMAT: gl.constexpr = 0):
    """``scores [16, CHUNK]`` plus a sparse key stream's residual scores at its rows' tokens:
    ``q . d`` for every stored row (one product, ``n = RP``), scattered to the chunk's tokens by a
    one-hot product (``k = RP``; 8 rows padded to 16 with zeros in registers). ``SB``: the one-hot
    operand's layout ``[RP, CHUNK]``; ``ROWS``: the rows' format (:func:`_sparse_meta`); ``FORMAT``:
    the dense streams' (INT4's scores are in units of ``KEY_UNIT``, the others' in scores)."""
    words = kw_s.index(stage).load(KWR)  # INT2 rows: halfwords, decoded as INT4 words of the same codes
    zeros = gl.zeros([16, RP], gl.float32, layout=MMA)
    if ROWS == NVFP4:  # e2m1 * scale / NVFP4_UNIT, the tile scale on the product
        scale_bytes, tile_scale = meta[0]
        rows = _q_dot(query, _nvfp4_key_tile(words, scale_bytes, RP, W, D, B_OP), zeros) * tile_scale
    elif ROWS == ROTATED:  # code - zp, each row's scale on its column of the product
        zp_scale, column_scale = meta[0]
        keys = _rotated_key_tile(words, _zero_point(zp_scale), RP, W, D, B_OP)
        rows = _q_dot(query, keys, zeros) * gl.expand_dims(column_scale, 0)
    else:
        scale, minimum = meta[0]
        words = gl.reshape(words, [RP, NG, W // NG])
        S2: gl.constexpr = gl.SliceLayout(2, words.type.layout)
        (c0, c1, c2, c3, c4, c5, c6, c7) = gl.inline_asm_elementwise(
            _ROW_KEY_INT2_ASM if ROWS == INT2 else _ROW_KEY_ASM,
            "=h,=h,=h,=h,=h,=h,=h,=h," + ("h" if ROWS == INT2 else "r") + ",h,h",
            [words, gl.expand_dims(gl.convert_layout(scale, S2), 2), gl.expand_dims(gl.convert_layout(minimum, S2), 2)],
            dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        keys = _planes_to_key_tile(gl.reshape(c0, [RP, W]), gl.reshape(c1, [RP, W]), gl.reshape(c2, [RP, W]),
                                   gl.reshape(c3, [RP, W]), gl.reshape(c4, [RP, W]), gl.reshape(c5, [RP, W]),
                                   gl.reshape(c6, [RP, W]), gl.reshape(c7, [RP, W]), RP, W, D, B_OP)
        rows = _q_dot(query, keys, zeros)
    rows = rows.to(gl.float16)  # [16, RP]
    positions = meta[2]
    token = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, _pair_layout(SB)))
    # [RP, CHUNK] one-hot: KEY_UNIT at a row's token where the dense streams' scores are in units of
    # KEY_UNIT (INT4), 1.0 where they are scores
    one_hot = _one_hot(gl.expand_dims(positions, 1), gl.expand_dims((token * 0x10001).to(gl.uint32), 0),
                       _SCATTER_ONE_HOT_ASM if FORMAT == INT4 else _GATHER_ONE_HOT_ASM, RP, CHUNK, SB)
    if RP < 16:
        rows = _stack_cols(rows, gl.zeros_like(rows), 16, RP, A_OP)
        one_hot = _stack_rows(one_hot, gl.zeros_like(one_hot), CHUNK, B_OP)
    else:
        rows = gl.convert_layout(rows, A_OP, assert_trivial=True)
        one_hot = gl.convert_layout(one_hot, B_OP, assert_trivial=True)
    return mma_v2(rows, one_hot, scores)


@gluon.jit
def _add_sparse_values(acc, mins, weights, vw_s, stage, meta, c, RP: gl.constexpr, CHUNK: gl.constexpr,
                       W: gl.constexpr, D: gl.constexpr, NG: gl.constexpr, MMA: gl.constexpr,
                       A_OP: gl.constexpr, B_OP: gl.constexpr, VTR: gl.constexpr, GB: gl.constexpr,
                       VA: gl.constexpr, SCALED: gl.constexpr, ROWS: gl.constexpr = 0):
    """``(acc [D, 8], mins)`` plus a sparse value stream's residual rows weighted by their tokens'
    probabilities (gathered by a one-hot product, ``n = RP``; then ``k = RP``, 8 rows padded to 16
    with zeros in registers). ``GB``: the one-hot operand's layout ``[CHUNK, RP]``; ``VA``: the
    rows' ``[D, RP]``; ``SCALED`` (INT4 rows): the rows' codes against the gathered probabilities times
    their scales (the metadata ``[NG, RP]``), the minimums' terms into ``mins``; ``ROWS``: the rows'
    format (:func:`_sparse_meta`; NVFP4 and int4_rotated rows add values, not codes)."""
    positions = meta[3]
    probabilities = _pad_rows(weights.to(gl.float16), CHUNK, A_OP)  # [16, CHUNK]
    token = c * CHUNK + 2 * gl.arange(0, CHUNK // 2, layout=gl.SliceLayout(1, _pair_layout(GB)))  # (t, t + 1)
    one_hot = _one_hot(gl.expand_dims((token | ((token + 1) << 16)).to(gl.uint32), 1), gl.expand_dims(positions, 0),
                       _GATHER_ONE_HOT_ASM, CHUNK, RP, GB)  # [CHUNK, RP]
    one_hot = gl.convert_layout(one_hot, B_OP, assert_trivial=True)
    gathered = _top_rows(mma_v2(probabilities, one_hot, gl.zeros([16, RP], gl.float32, layout=MMA)), RP)
    words = vw_s.index(stage).load(VTR)
    if ROWS == INT2 and not SCALED:  # as INT4 words of the same codes (scaled: codes straight from halfwords)
        words = _int2_row_words(words)
    if ROWS == NVFP4:  # e2m1 * scale / NVFP4_UNIT; the tile's scale on the product
        scale_bytes, unit = meta[1]
        p_rows = gl.permute(gathered.to(gl.float16), [1, 0])  # [RP, 8]
        values = _nvfp4_value_tile(words, scale_bytes, RP, W, D, VA)
    elif ROWS == ROTATED:  # code - zp; each row's scale on its gathered probabilities
        zp_scale, row_scale = meta[1]
        p_rows = gl.permute((gathered * gl.expand_dims(row_scale, 0)).to(gl.float16), [1, 0])  # [RP, 8]
        values = _rotated_value_tile(words, _zero_point(zp_scale), RP, W, D, VA)
    elif SCALED:
        scale, minimum = meta[1]
        scaled, row_mins = _scaled_probabilities(gathered, scale, minimum, NG, RP)
        mins = mins + gl.convert_layout(row_mins, mins.type.layout, assert_trivial=True)
        p_rows = gl.permute(scaled, [1, 0])  # [RP, 8]
        if ROWS == INT2:
            values = _int2_value_codes(words, RP, W, D, VA)
        else:
            values = _value_codes(words, RP, W, D, VA)
    else:
        scale, minimum = meta[1]
        p_rows = gl.permute(gathered.to(gl.float16), [1, 0])  # [RP, 8]
        values = _value_tile_v2(words, scale, minimum, RP, W, D, NG, VA)
    if RP < 16:
        p_rows = _stack_rows(p_rows, gl.zeros_like(p_rows), 8, B_OP)
        values = _stack_cols(values, gl.zeros_like(values), D, RP, A_OP)
    else:
        p_rows = gl.convert_layout(p_rows, B_OP, assert_trivial=True)
        values = gl.convert_layout(values, A_OP, assert_trivial=True)
    if ROWS == NVFP4:
        acc = acc + unit * mma_v2(values, p_rows, gl.zeros_like(acc))
    else:
        acc = mma_v2(values, p_rows, acc)
    return acc, mins


@gluon.jit
def _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, tile, stage, zeros_b8, zeros_c8, D: gl.constexpr,
                W: gl.constexpr, A_OP: gl.constexpr, B8: gl.constexpr, KM: gl.constexpr, FORMAT: gl.constexpr,
                PRECISE: gl.constexpr):
    """Per-page terms of one stream: INT4 ``(scaled query, q . min)``; NVFP4 the tile's
    float32 key and value scales (read straight from memory)."""
    if FORMAT == NVFP4:  # the tiles hold e2m1 * scale / NVFP4_UNIT
        terms = (gl.load(km_ptr + tile) * NVFP4_UNIT, gl.load(vm_ptr + tile) * NVFP4_UNIT)
    elif FORMAT == INT4:
        terms = _key_terms(query, ks_s, km_s, stage, zeros_b8, zeros_c8, D, W, A_OP, B8, KM, PRECISE)
    else:  # ROTATED: the scales are per token, read with the tiles
        terms = (0.0, 0.0)
    return terms


@gluon.jit
def _add_key_scores(scores, query, terms, kw_s, ks_s, stage, c, zero_scores, PAGE: gl.constexpr,
                    CHUNK: gl.constexpr, W: gl.constexpr, D: gl.constexpr, B_OP: gl.constexpr, KW: gl.constexpr,
                    FORMAT: gl.constexpr):
    """``scores [16, CHUNK]`` plus one key stream's ``q . k`` for chunk ``c`` of the page in ``stage``."""
    words = kw_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(KW)
    if FORMAT == ROTATED:
        row_scale = ks_s.index(stage).slice(c * CHUNK, CHUNK, 0)
        keys = _rotated_key_tile(words, _zero_point(row_scale.load(gl.SliceLayout(1, KW))), CHUNK, W, D, B_OP)
        column_scale = row_scale.load(gl.SliceLayout(0, zero_scores.type.layout))
        scores = scores + _q_dot(query, keys, zero_scores) * gl.expand_dims(column_scale, 0)
    elif FORMAT == NVFP4:
        keys = _nvfp4_key_tile(words, _nvfp4_chunk_key_scales(words, ks_s, stage, c, PAGE, CHUNK, W, D), CHUNK, W, D,
                               B_OP)
        scores = scores + terms[0] * _q_dot(query, keys, zero_scores)
    else:
        scores = mma_v2(terms[0], _key_tile_v2(words, CHUNK, W, D, B_OP), scores)
    return scores


@gluon.jit
def _nvfp4_chunk_key_scales(words, ks_s, stage, c, PAGE: gl.constexpr, CHUNK: gl.constexpr, W: gl.constexpr,
                            D: gl.constexpr):
    """The E4M3 scale bytes ``[CHUNK, D/16]`` of chunk ``c`` of the page in ``stage`` (keys), in the layout
    :func:`_nvfp4_key_tile` takes beside the chunk's ``words``."""
    SB: gl.constexpr = gl.SliceLayout(2, gl.reshape(words, [CHUNK, W // 2, 2]).type.layout)
    return ks_s.index(stage).reshape([PAGE, D // 16]).slice(c * CHUNK, CHUNK, 0).load(SB)


@gluon.jit
def _nvfp4_chunk_value_scales(vs_s, stage, c, PAGE: gl.constexpr, CHUNK: gl.constexpr, D: gl.constexpr):
    """The E4M3 scale bytes ``[CHUNK, D/16]`` of chunk ``c`` of the page in ``stage`` (values), in the layout
    :func:`_nvfp4_value_tile` takes."""
    VB: gl.constexpr = _value_meta_layout(CHUNK, D // 16, D, 16)
    return vs_s.index(stage).reshape([PAGE, D // 16]).slice(c * CHUNK, CHUNK, 0).load(VB)


@gluon.jit
def _common_scale(first, second):
    """One float32 scale for two tiles with float32 scales ``first`` and ``second`` (>= 0): ``(common, 256 first /
    common, 256 second / common)``, the two multipliers float16 (:func:`_e4m3_to_float16`). ``common`` is the
    larger scale, so the larger tile keeps its exact bits (multiplier 256) and only the smaller one's scales are
    rounded with their ratio (2**-11 of that tile at most); zero scales give zero multipliers."""
    common = gl.maximum(gl.maximum(first, second), 1.1754944e-38)
    return common, (256.0 * (first / common)).to(gl.float16), (256.0 * (second / common)).to(gl.float16)


@gluon.jit
def _nvfp4_pair_terms(terms, terms2):
    """Two dense NVFP4 streams' page terms (:func:`_page_terms`: float32 key and value tile scales x
    ``NVFP4_UNIT``) -> ``(key scale, value scale, key multipliers, value multipliers)`` (:func:`_common_scale`):
    each stream's tile scale over the pair's enters its tile as its E4M3 scales' multiplier, so the two key
    products share one float32 accumulator and the two value tiles add into one float16 tile (one product), each
    with one float32 scale (:func:`_add_nvfp4_pair_scores`, :func:`_add_nvfp4_pair_values`)."""
    key_scale, key_first, key_second = _common_scale(terms[0], terms2[0])
    value_scale, value_first, value_second = _common_scale(terms[1], terms2[1])
    return key_scale, value_scale, (key_first, key_second), (value_first, value_second)


@gluon.jit
def _add_nvfp4_pair_scores(scores, query, pair, kw_s, ks_s, kw2_s, ks2_s, stage, c, zero_scores, PAGE: gl.constexpr,
                           CHUNK: gl.constexpr, W: gl.constexpr, D: gl.constexpr, B_OP: gl.constexpr,
                           KW: gl.constexpr):
    """``scores [16, CHUNK]`` plus two dense NVFP4 key streams' ``q . k`` for chunk ``c`` of the page in
    ``stage``: both products in one float32 accumulator, the pair's key scale once (:func:`_nvfp4_pair_terms`).
    The keys stay two tiles: each is exact in float16 (a 2-bit E2M1 value times a 4-bit E4M3 scale), their sum
    would not be, and a key's rounding moves every score by its share of the logit."""
    words = kw_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(KW)
    keys = _nvfp4_key_tile(words, _nvfp4_chunk_key_scales(words, ks_s, stage, c, PAGE, CHUNK, W, D), CHUNK, W, D,
                           B_OP, pair[2][0])
    both = _q_dot(query, keys, zero_scores)
    words = kw2_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(KW)
    keys = _nvfp4_key_tile(words, _nvfp4_chunk_key_scales(words, ks2_s, stage, c, PAGE, CHUNK, W, D), CHUNK, W, D,
                           B_OP, pair[2][1])
    return scores + pair[0] * _q_dot(query, keys, both)


@gluon.jit
def _add_nvfp4_pair_values(acc, p_t, pair, vw_s, vs_s, vw2_s, vs2_s, stage, c, PAGE: gl.constexpr,
                           CHUNK: gl.constexpr, W: gl.constexpr, D: gl.constexpr, A_OP: gl.constexpr,
                           VT: gl.constexpr):
    """``acc [D, 8]`` plus two dense NVFP4 value streams' ``V^T . P^T`` for chunk ``c`` of the page in
    ``stage``: one tile of both (:func:`_nvfp4_value_pair_tile`), one product, the pair's value scale once."""
    words = vw_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(VT)
    words2 = vw2_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(VT)
    values = _nvfp4_value_pair_tile(words, _nvfp4_chunk_value_scales(vs_s, stage, c, PAGE, CHUNK, D), pair[3][0],
                                    words2, _nvfp4_chunk_value_scales(vs2_s, stage, c, PAGE, CHUNK, D), pair[3][1],
                                    CHUNK, W, D, A_OP)
    return acc + pair[1] * mma_v2(values, p_t, gl.zeros_like(acc))


@gluon.jit
def _page_scores(query, terms, kw_s, ks_s, stage, zero_scores, PAGE: gl.constexpr, W: gl.constexpr,
                 D: gl.constexpr, B_OP: gl.constexpr, KW: gl.constexpr, MMA: gl.constexpr, FORMAT: gl.constexpr):
    """One stream's scores ``[8, PAGE]`` of the whole page in ``stage`` (INT4: in units of
    ``KEY_UNIT``, ``q . min`` included)."""
    if FORMAT == INT4:  # q . min starts the score accumulator, in the key codes' units
        start = gl.convert_layout(_tile_columns(terms[1] * KEY_UNIT, PAGE), MMA, assert_trivial=True)
    else:
        start = zero_scores
    both = _add_key_scores(start, query, terms, kw_s, ks_s, stage, 0, zero_scores, PAGE, PAGE, W, D, B_OP, KW,
                           FORMAT)
    return _fold_rows(both, PAGE)


@gluon.jit
def _add_values(acc, mins, p_t, weights, terms, vw_s, vs_s, vm_s, stage, c, PAGE: gl.constexpr,
                CHUNK: gl.constexpr, W: gl.constexpr, D: gl.constexpr, NG: gl.constexpr, A_OP: gl.constexpr,
                B_OP: gl.constexpr, VT: gl.constexpr, VS: gl.constexpr, FORMAT: gl.constexpr, SCALED: gl.constexpr):
    """``(acc [D, 8], mins)`` plus one value stream's ``V^T . P^T`` for chunk ``c`` of the page in ``stage``
    (``p_t``: the probabilities as the B operand; ``weights``: the same, float32 ``[8, CHUNK]``;
    ``SCALED``: the codes' product with the probabilities times the scales, the minimums' terms into
    ``mins``)."""
    words = vw_s.index(stage).slice(c * CHUNK, CHUNK, 0).load(VT)
    if SCALED & (FORMAT == INT4):  # the chunk's value (scale, min) [CHUNK, NG], transposed in registers to [NG, CHUNK]
        GL: gl.constexpr = gl.SliceLayout(1, gl.reshape(weights, [NG, 8 // NG, CHUNK]).type.layout)
        GT: gl.constexpr = _transposed(gl.to_linear_layout(GL, [NG, CHUNK]))
        scale = vs_s.index(stage).reshape([PAGE, NG]).slice(c * CHUNK, CHUNK, 0).load(GT)
        minimum = vm_s.index(stage).reshape([PAGE, NG]).slice(c * CHUNK, CHUNK, 0).load(GT)
        scale = gl.convert_layout(gl.permute(scale, [1, 0]), GL, assert_trivial=True)
        minimum = gl.convert_layout(gl.permute(minimum, [1, 0]), GL, assert_trivial=True)
        scaled, chunk_mins = _scaled_probabilities(weights, scale, minimum, NG, CHUNK)
        p_scaled = gl.convert_layout(gl.permute(scaled, [1, 0]), B_OP, assert_trivial=True)
        acc = mma_v2(_value_codes(words, CHUNK, W, D, A_OP), p_scaled, acc)
        mins = mins + chunk_mins
    elif FORMAT == ROTATED:  # codes - zp enter the product; the per-token scale multiplies the probabilities
        row_scale = vs_s.index(stage).slice(c * CHUNK, CHUNK, 0)
        token_scale = row_scale.load(gl.SliceLayout(0, weights.type.layout))
        scaled = (weights * gl.expand_dims(token_scale, 0)).to(gl.float16)
        p_scaled = gl.convert_layout(gl.permute(scaled, [1, 0]), B_OP, assert_trivial=True)
        if SCALED:  # the codes as subnormals; - zp x (the same float16 p x scale) into mins
            zero_points = gl.expand_dims(_zero_point(token_scale), 0)
            mins = mins - _lane_sums(scaled.to(gl.float32) * zero_points, CHUNK)
            acc = mma_v2(_value_codes(words, CHUNK, W, D, A_OP), p_scaled, acc)
        else:
            values = _rotated_value_tile(words, _zero_point(row_scale.load(gl.SliceLayout(1, VT))), CHUNK, W, D, A_OP)
            acc = mma_v2(values, p_scaled, acc)
    elif FORMAT == NVFP4:
        SG: gl.constexpr = D // 16
        if SCALED:  # the chunk's E4M3 scales [CHUNK, SG], transposed in registers to [SG, CHUNK], on the weights
            GL: gl.constexpr = gl.SliceLayout(1, gl.reshape(weights, [SG, 8 // SG, CHUNK]).type.layout)
            GT: gl.constexpr = _transposed(gl.to_linear_layout(GL, [SG, CHUNK]))
            scale_bytes = vs_s.index(stage).reshape([PAGE, SG]).slice(c * CHUNK, CHUNK, 0).load(GT)
            scale = gl.convert_layout(gl.permute(_e4m3_to_float16(scale_bytes, 256.0), [1, 0]), GL,
                                      assert_trivial=True)
            scaled = gl.reshape(_scaled_weights(weights, scale, SG, CHUNK), [8, CHUNK]).to(gl.float16)
            p_scaled = gl.convert_layout(gl.permute(scaled, [1, 0]), B_OP, assert_trivial=True)
            acc = acc + terms[1] * mma_v2(_e2m1_value_codes(words, CHUNK, W, D, A_OP), p_scaled, gl.zeros_like(acc))
        else:
            values = _nvfp4_value_tile(words, _nvfp4_chunk_value_scales(vs_s, stage, c, PAGE, CHUNK, D), CHUNK, W, D,
                                       A_OP)
            acc = acc + terms[1] * mma_v2(values, p_t, gl.zeros_like(acc))
    else:
        scale = vs_s.index(stage).reshape([PAGE, NG]).slice(c * CHUNK, CHUNK, 0).load(VS)
        minimum = vm_s.index(stage).reshape([PAGE, NG]).slice(c * CHUNK, CHUNK, 0).load(VS)
        acc = mma_v2(_value_tile_v2(words, scale, minimum, CHUNK, W, D, NG, A_OP), p_t, acc)
    return acc, mins


@gluon.constexpr_function
def _window_columns(ring: int, page: int) -> int:
    """Block-table columns the window program checks for a lost page: those of the pages the ring overlaps."""
    return 1 << (-(-ring // page) + 1).bit_length()


@gluon.jit
def _partials_block(out_ptr, sum_ptr, max_ptr, base, first, slots, b_slots, rows, row_ok, cols, D: gl.constexpr):
    """Slots ``first + b_slots`` of the partials at ``base`` (rows ``rows``, channels ``cols``): ``(keep``
    ``[SB, rows]``, their maxima (``MASK_VALUE`` where not kept), sums ``[SB, rows]`` and outputs ``[SB,
    rows, len(cols)])``."""
    slot = first + b_slots
    meta = (base + gl.expand_dims(slot, 1)) * 8 + gl.expand_dims(rows, 0)
    keep = gl.expand_dims(slot < slots, 1) & row_ok
    maxima = gl.load(max_ptr + meta, mask=keep, other=MASK_VALUE)
    sums = gl.load(sum_ptr + meta, mask=keep, other=0.0)
    offsets = gl.expand_dims(meta, 2) * D + gl.expand_dims(gl.expand_dims(cols, 0), 1)
    parts = gl.load(out_ptr + offsets, mask=gl.expand_dims(keep, 2), other=0.0)
    return keep, maxima, sums, parts


@gluon.jit
def _weighted_sums(keep, maxima, sums, parts, best):
    """A block of partials (:func:`_partials_block`) weighted by ``2 ** (max - best)`` (``best`` per row):
    their sums ``[1, rows, 1]`` and outputs ``[1, rows, channels]``."""
    weight = gl.where(keep, gl.exp2(maxima - gl.expand_dims(best, 0)), 0.0)
    return (gl.expand_dims(gl.sum(gl.expand_dims(sums * weight, 2), axis=0), 0),
            gl.expand_dims(gl.sum(parts * gl.expand_dims(weight, 2), axis=0), 0))


@gluon.jit
def _weighted_partials(out_ptr, sum_ptr, max_ptr, base, first, slots, best, b_slots, rows, row_ok, cols,
                       D: gl.constexpr):
    """Slots ``first + b_slots`` of the partials at ``base`` (their ``[SB, 8]`` rows, channels ``cols``)
    weighted by ``2 ** (max - best)``: their sums ``[1, 8, 1]`` and outputs ``[1, 8, len(cols)]``."""
    keep, maxima, sums, parts = _partials_block(out_ptr, sum_ptr, max_ptr, base, first, slots, b_slots, rows,
                                                row_ok, cols, D)
    return _weighted_sums(keep, maxima, sums, parts, best)


@gluon.jit
def _store_merged(final_ptr, program, total, combined, rows, cols, D: gl.constexpr, GROUP: gl.constexpr):
    """``combined / total`` (zeros where nothing was visible) into the ``GROUP`` rows of ``program`` in
    ``final [S, H * GROUP, D]``, channels ``cols``."""
    result = gl.where(total > 0, combined / gl.where(total > 0, total, 1.0), 0.0)
    r3 = gl.expand_dims(gl.expand_dims(rows, 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(cols, 0), 1)
    gl.store(final_ptr + (program * GROUP + r3) * D + c3, result, mask=(r3 < GROUP) & (c3 < D))


@gluon.constexpr_function
def _merge_rows(group: int) -> int:
    """Rows the in-kernel merge reads per slot: the group padded to a power of two (<= 8)."""
    return 1 << (group - 1).bit_length()


@gluon.constexpr_function
def _merge_slots(head_dim: int, group: int, registers: int) -> int:
    """Slots per round trip of the in-kernel merge (:func:`merge_layout`, one warp): ``512 / D`` (the
    ``[SB, 8, D]`` float32 of a full group, 128 registers a thread), or as many as ``registers`` hold
    when the group has fewer rows or ``registers`` exceed 128 (32 slots at most). 64 (the kernel's
    default, ``launch.MERGE_REGISTERS``) keeps the kernel's registers at its page loop's (ptxas,
    head_dim 64); at head_dim 128, 128 registers raise them from 200 to 238 (still 8 warps per SM)
    and halve the round trips."""
    lanes_c = min(head_dim // 4, 32)
    rows_per_thread = max(1, _merge_rows(group) // (32 // lanes_c))
    return min(32, max(512 // head_dim, registers // (rows_per_thread * (head_dim // lanes_c))))


@gluon.jit
def _merge_partials(out_ptr, sum_ptr, max_ptr, final_ptr, program, slots, D: gl.constexpr, GROUP: gl.constexpr,
                    REGISTERS: gl.constexpr):
    """Stable log-sum-exp merge of the ``slots`` partials of ``program`` (a (sequence, KV head))
    into its ``GROUP`` rows of ``final [S, H * GROUP, D]`` (zeros where nothing was visible).

    One warp: the rows' maximum from 32 slots per load, then the weighted sums
    ``SB`` slots at a time (their loads independent: one round trip per block). Only the group's
    rows are held, so a group of one or two rows takes more slots per round trip (head_dim 128: 16
    and 8 against 4)."""
    RG: gl.constexpr = _merge_rows(GROUP)
    SB: gl.constexpr = _merge_slots(D, GROUP, REGISTERS)
    L3: gl.constexpr = merge_layout(SB, D, 1)
    LS: gl.constexpr = gl.SliceLayout(2, L3)  # [SB, RG]
    LM: gl.constexpr = gl.BlockedLayout([1, RG], [32, 1], [1, 1], [1, 0])  # [32, RG]: a slot per lane
    base = program * slots
    m_slots = gl.arange(0, 32, layout=gl.SliceLayout(1, LM))
    m_rows = gl.arange(0, RG, layout=gl.SliceLayout(0, LM))
    best = gl.full([RG], MASK_VALUE, gl.float32, layout=gl.SliceLayout(0, LM))
    for first in range(0, slots, 32):
        slot = first + m_slots
        keep = gl.expand_dims(slot < slots, 1) & gl.expand_dims(m_rows < GROUP, 0)
        meta = (base + gl.expand_dims(slot, 1)) * 8 + gl.expand_dims(m_rows, 0)
        best = gl.maximum(best, gl.max(gl.load(max_ptr + meta, mask=keep, other=MASK_VALUE), axis=0))
    best = gl.convert_layout(best, gl.SliceLayout(0, LS))
    b_slots = gl.arange(0, SB, layout=gl.SliceLayout(1, LS))
    rows = gl.arange(0, RG, layout=gl.SliceLayout(0, LS))
    row_ok = gl.expand_dims(rows < GROUP, 0)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    total = gl.zeros([1, RG, 1], gl.float32, layout=L3)
    combined = gl.zeros([1, RG, D], gl.float32, layout=L3)
    for first in range(0, slots, SB):
        sums, parts = _weighted_partials(out_ptr, sum_ptr, max_ptr, base, first, slots, best, b_slots, rows,
                                         row_ok, cols, D)
        total += sums
        combined += parts
    _store_merged(final_ptr, program, total, combined, rows, cols, D, GROUP)


@gluon.constexpr_function
def merge_layout(slot_block: int, channels: int, warps: int):
    """``[slot_block, 8, channels]`` partials of the merge kernel: channels on lanes in 16-byte pieces,
    rows on the remaining lanes, slots on the warps."""
    lanes_c = min(channels // 4, 32)
    return gl.BlockedLayout([1, 1, 4], [1, 32 // lanes_c, lanes_c], [warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def merge_rows_layout(slot_block: int, rows: int, channels: int, warps: int):
    """``[slot_block, rows, channels]`` partials of the merge kernel: channels on lanes in 16-byte pieces,
    the rows (the GQA group padded to a power of two) on lanes next, the lanes left over and the warps on
    slots."""
    lanes_c = min(channels // 4, 32)
    lanes_r = min(rows, 32 // lanes_c)
    return gl.BlockedLayout([1, 1, 4], [32 // (lanes_c * lanes_r), lanes_r, lanes_c], [warps, 1, 1], [2, 1, 0])


@gluon.jit
def merge_kernel(out_ptr, sum_ptr, max_ptr, final_ptr, D: gl.constexpr, GROUP: gl.constexpr,
                 SLOTS: gl.constexpr, SB: gl.constexpr, DB: gl.constexpr, WARPS: gl.constexpr):
    """Merge the split partials of one (sequence, KV head) and ``DB`` channels (stable log-sum-exp).

    Grid ``(S * H, D / DB)``. ``out`` float32 ``[S, H, SLOTS, 8, D]``, ``sum``
    and ``max`` ``[S, H, SLOTS, 8]`` (rows below ``GROUP`` are read) ->
    ``final`` float32 ``[S, H * GROUP, D]`` (zeros where nothing was visible).
    One pass over the slots in blocks of ``SB``: each block's maxima, sums and
    partials are loaded together (every block's loads are independent:
    unrolled, one round trip to memory), and the running sums are rescaled
    when a block raises a row's maximum (online softmax). Only the group's
    rows, padded to a power of two, are held.
    """
    RG: gl.constexpr = _merge_rows(GROUP)
    L3: gl.constexpr = merge_rows_layout(SB, RG, DB, WARPS)
    LS: gl.constexpr = gl.SliceLayout(2, L3)  # [SB, RG]
    program = gl.program_id(0).to(gl.int64)
    block = gl.program_id(1)
    b_slots = gl.arange(0, SB, layout=gl.SliceLayout(1, LS))
    rows = gl.arange(0, RG, layout=gl.SliceLayout(0, LS))
    row_ok = gl.expand_dims(rows < GROUP, 0)
    cols = block * DB + gl.arange(0, DB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    best = gl.full([RG], MASK_VALUE, gl.float32, layout=gl.SliceLayout(0, LS))
    total = gl.zeros([1, RG, 1], gl.float32, layout=L3)
    combined = gl.zeros([1, RG, DB], gl.float32, layout=L3)
    BLOCKS: gl.constexpr = (SLOTS + SB - 1) // SB
    for b in gl.static_range(BLOCKS):
        keep, maxima, sums, parts = _partials_block(out_ptr, sum_ptr, max_ptr, program * SLOTS, b * SB, SLOTS,
                                                    b_slots, rows, row_ok, cols, D)
        raised = gl.maximum(best, gl.max(maxima, axis=0))
        rescale = gl.expand_dims(gl.expand_dims(gl.exp2(best - raised), 0), 2)  # [1, RG, 1]
        block_total, block_combined = _weighted_sums(keep, maxima, sums, parts, raised)
        total = total * rescale + block_total
        combined = combined * rescale + block_combined
        best = raised
    _store_merged(final_ptr, program, total, combined, rows, cols, D, GROUP)


@gluon.jit
def _item_ids(item, row_programs, slots):
    """(sequence, row program, slot) of a persistent program's ``item`` (the grid's order: slots fastest)."""
    split = item % slots
    virtual = (item // slots) % row_programs
    return item // (slots * row_programs), virtual, split


@gluon.jit
def _query_rows(q_ptr, seq, virtual, kv_heads, RB: gl.constexpr, GROUP: gl.constexpr, GP: gl.constexpr,
                D: gl.constexpr, QL: gl.constexpr):
    """The 8 query rows ``[8, D]`` (the caller's dtype, ``QL``) of row program ``virtual``: rows past
    ``GROUP`` zero; SCALED (``GP`` < 8) the rows repeated in each value group's block of GP rows."""
    program = (seq * kv_heads + virtual // RB).to(gl.int64)
    q_rows = (virtual % RB) * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, QL)) % GP
    q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    return gl.load(q_ptr + program * (GROUP * D) + gl.expand_dims(q_rows, 1) * D + gl.expand_dims(q_cols, 0),
                   mask=gl.expand_dims(q_rows < GROUP, 1), other=0.0)


@gluon.jit
def _split_pages(length, active, first, pages_per_split, PENDING: gl.constexpr, CAPACITY: gl.constexpr,
                 RECENT: gl.constexpr, PAGE: gl.constexpr, SINK: gl.constexpr):
    """A sequence's regions (``jflashloop.cache._regions``) and one split's pages: ``(visible`` tokens,
    ``packed_end`` (pages hold the tokens before it), ``count`` pages of the split from page ``first``)."""
    visible = gl.where(active, gl.minimum(length + PENDING, CAPACITY), 0)
    packed_end = gl.maximum(gl.minimum(visible - RECENT, (length // PAGE) * PAGE), 0)
    packed_pages = gl.where(packed_end > SINK, gl.cdiv(packed_end, PAGE), 0)
    return visible, packed_end, gl.minimum(gl.maximum(packed_pages - first, 0), pages_per_split)


@gluon.jit
def int4_pages_kernel_v2(
    q_ptr, table_ptr,
    lengths_ptr,  # int32 [S]: committed tokens
    active_ptr,  # bool [S]: slots holding a sequence
    kw_ptr, ks_ptr, km_ptr, vw_ptr, vs_ptr, vm_ptr,
    kw2_ptr, ks2_ptr, km2_ptr, vw2_ptr, vs2_ptr, vm2_ptr,  # the dense residual of loop 2 (STREAMS == 2)
    kw3_ptr, ks3_ptr, km3_ptr, vw3_ptr, vs3_ptr, vm3_ptr, pos3_ptr,  # sparse loop 3 (SPARSE >= 1)
    kw4_ptr, ks4_ptr, km4_ptr, vw4_ptr, vs4_ptr, vm4_ptr, pos4_ptr,  # sparse loop 4 (SPARSE == 2)
    sink_k_ptr,  # [window_loops, S, H, SINK, D] window dtype (any valid pointer when SINK == 0)
    sink_v_ptr,
    ring_k_ptr,  # [window_loops, S, H, RING, D] window dtype
    ring_v_ptr,
    kv_heads, pool_pages, max_pages, pages_per_split, slots, sequences, window_loop, window_split,
    out_ptr, sum_ptr, max_ptr,
    final_ptr,  # float32 [S, H * GROUP, D] (MERGE): the merged attention output
    counter_ptr,  # int32 [S, H] (MERGE), zero at launch: programs of each (sequence, head) done
    D: gl.constexpr, PAGE: gl.constexpr, GV: gl.constexpr, SINK: gl.constexpr, STAGES: gl.constexpr,
    RING: gl.constexpr, WINDOWS: gl.constexpr, CHUNK: gl.constexpr, STREAMS: gl.constexpr,
    FORMAT: gl.constexpr = 0, SPARSE: gl.constexpr = 0, R3: gl.constexpr = 16, R4: gl.constexpr = 16,
    MERGE: gl.constexpr = False, GROUP: gl.constexpr = 8, PRECISE: gl.constexpr = True,
    QSCALE: gl.constexpr = 1.0, PENDING: gl.constexpr = 1, CAPACITY: gl.constexpr = 1 << 30,
    RECENT: gl.constexpr = 0, RB: gl.constexpr = 1, LAZY: gl.constexpr = False, OVERLAP: gl.constexpr = False,
    MERGE_REGS: gl.constexpr = MERGE_REGISTERS, STAGGER: gl.constexpr = False, SCALED: gl.constexpr = False,
    PERSIST: gl.constexpr = 0, ROWS_FORMAT: gl.constexpr = 0,
):
    """Same contract as :func:`int4_pages_kernel`; with ``WINDOWS`` the program
    of split ``window_split`` also attends over the sink and ring windows, so
    the partials need no window slot. ``STREAMS`` = 2 reads loop 2 of a dense
    residual chain: keys and values are the sums of the two streams' tiles
    (``q . (k1 + d2)``: two score products into one accumulator; two value
    products with the same probabilities). ``FORMAT`` = ``NVFP4`` reads NVFP4
    streams (the pointer slots of the key/value scale take the E4M3 bytes
    ``[H, pool, PAGE, D/16]`` and those of the minimums the float32 tile
    scales ``[H, pool]``; keys are decoded to ``e2m1 * scale`` (exact in
    float16) and the tile scale multiplies each product). ``SPARSE`` = 1 or 2
    adds loops 3 (and 4) of a FlashLoop chain after two dense INT4 loops:
    compact token-axis residual rows (``R3``, ``R4`` per tile) at the
    tokens their positions name (int8 ``[H, pool, R]``), in ``ROWS_FORMAT``:
    INT4 rows grouped like the dense values (after INT4 or NVFP4 streams;
    their pointer slots as an INT4 stream's), affine ``INT2`` rows grouped
    the same way (their words as uint16 ``[H, pool, R, D/8]``, two bytes per
    INT4 word), or rows of the dense streams'
    own format, NVFP4 or int4_rotated (their slots as those streams'). With ``MERGE`` the
    last program of each (sequence, KV head) to finish (an atomic counter)
    merges every split's partials and writes the ``GROUP`` output rows of
    its query heads: no separate merge. ``PRECISE`` holds the query and the
    page's scaled query as float16 pairs, the low halves in the padding rows
    8-15 of the m16 products (no extra product): about 10x less error on keys
    with outlier channels and large per-channel offsets. ``LAZY`` rescales the
    running softmax state only when a row's maximum grows by more than
    ``RESCALE_LOG2``. ``MERGE_REGS``: registers a thread gives the merge's
    partials per round trip (:func:`_merge_slots`). ``OVERLAP`` (one dense stream, ``CHUNK == PAGE``,
    ``STAGES`` >= 3 to keep a page in flight) makes page ``step + 1``'s
    scores before page ``step``'s softmax, so that their products overlap
    the softmax's dependent chain (one basic block per page). ``STAGGER``
    with one stage copies a page's keys and its values as two groups: the
    next page's keys while this page's softmax and values are made, its
    values while the next page's scores are (the same shared memory as one
    plain stage, which waits for each page's whole copy before any work).
    ``SCALED`` (INT4 with ``GROUP * NG <= 8``, NVFP4 with ``GROUP * D / 16
    <= 8``, or int4_rotated; the last two without sparse loops; no ``LAZY``,
    one row block) puts the value scales (and minimums or zero points) on
    the probabilities and the value codes into the products as float16
    subnormals (see :func:`_value_codes`; NVFP4's as ``e2m1 / 2**14``).
    ``PERSIST`` > 0 (the plain loop of two stages): a grid of ``PERSIST``
    programs takes the ``(sequence, row program, slot)`` items in turn
    (program ``p`` items ``p, p + PERSIST, ...``); each item's block-table
    entry, length and query are loaded, and its first page copied, during
    the item before it, so only a program's first item waits for them.

    The query ``q_ptr`` here is the caller's ``[S, H * GROUP, D]`` (float32,
    bfloat16 or float16, natural channel order, not padded): the kernel
    scales it by ``QSCALE`` (softmax scale * log2(e)) in float32 and pads
    the group to 8 rows itself. With ``RB`` > 1 (``GROUP`` up to ``8 RB``
    query rows per KV head, e.g. a chunk of queries times the GQA group) the
    grid's second axis is ``H * RB``: program ``h * RB + b`` reads KV head
    ``h`` for rows ``8 b .. 8 b + 7`` and writes partials ``[S, H * RB,
    slots, 8, D]``."""
    W: gl.constexpr = D // 8
    NG: gl.constexpr = D // GV
    SG: gl.constexpr = _scale_groups(FORMAT, D, GV)  # value scales per token
    GP: gl.constexpr = _query_columns(SCALED, SG)  # columns of the value products per scale group
    gl.static_assert((not SCALED) | (((FORMAT == INT4) | (SPARSE == 0) | ((FORMAT == NVFP4) & (ROWS_FORMAT == NVFP4)))
                                     & (GROUP <= GP) & (not LAZY) & (RB == 1)),
                     "SCALED reads INT4 values, NVFP4 values with NVFP4 rows or none, or int4_rotated values "
                     "without sparse loops; GROUP * SG <= 8 query rows (SG value scales a token); no LAZY, one "
                     "row block")
    # Rows as codes against the probabilities times their scales (INT4 and INT2 rows under SCALED); NVFP4 rows
    # add values (with SCALED, every column of a row's product holds the query's probabilities).
    ROW_CODES: gl.constexpr = SCALED & ((ROWS_FORMAT == INT4) | (ROWS_FORMAT == INT2))
    TO_SCORES: gl.constexpr = 1.0 / KEY_UNIT if FORMAT == INT4 else 1.0  # a page's products -> scores
    MMA: gl.constexpr = _mma()
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    KW: gl.constexpr = _key_words_layout(CHUNK, W)
    VT: gl.constexpr = _value_tile_layout(CHUNK, W)
    VS: gl.constexpr = _value_meta_layout(CHUNK, NG, D, GV)
    KM: gl.constexpr = _key_meta_layout(D)
    QL: gl.constexpr = _query_layout(D)

    kw_s, vw_s, ks_s, km_s, vs_s, vm_s = _stream_buffers(STAGES, PAGE, W, D, NG, FORMAT)
    if STREAMS == 2:
        kw2_s, vw2_s, ks2_s, km2_s, vs2_s, vm2_s = _stream_buffers(STAGES, PAGE, W, D, NG, FORMAT)
    RP3: gl.constexpr = _padded_sparse_rows(R3)
    RP4: gl.constexpr = _padded_sparse_rows(R4)
    if SPARSE >= 1:
        kw3_s, vw3_s = _sparse_buffers(STAGES, RP3, W, ROWS_FORMAT)
        KW3: gl.constexpr = _key_words_layout(RP3, W)
        VT3: gl.constexpr = _value_tile_layout(RP3, W)
        KS3: gl.constexpr = gl.SliceLayout(2, gl.reshape(gl.zeros([RP3, W], gl.uint32, layout=KW3),
                                                         [RP3, NG, W // NG]).type.layout)
        if ROW_CODES:
            # the rows' value (scale, min) [NG, RP3] beside their gathered probabilities (_scaled_probabilities)
            VS3: gl.constexpr = gl.SliceLayout(1, gl.reshape(_top_rows(gl.zeros([16, RP3], gl.float32, layout=MMA),
                                                                          RP3), [NG, 8 // NG, RP3]).type.layout)
        else:
            VS3: gl.constexpr = _value_meta_layout(RP3, NG, D, GV)
        # the one-hot operands' layouts (the scatter's k and the values' k cut to RP3 from 16 when 8)
        GC3: gl.constexpr = gl.SliceLayout(0, _top_rows(gl.zeros([16, RP3], gl.float32, layout=MMA), RP3).type.layout)
        SB3: gl.constexpr = _narrowed(gl.to_linear_layout(B_OP, [_product_k(RP3), CHUNK]), 0, RP3)
        GB3: gl.constexpr = gl.to_linear_layout(B_OP, [CHUNK, RP3])
        VA3: gl.constexpr = _narrowed(gl.to_linear_layout(A_OP, [D, _product_k(RP3)]), 1, RP3)
    if SPARSE >= 2:
        kw4_s, vw4_s = _sparse_buffers(STAGES, RP4, W, ROWS_FORMAT)
        KW4: gl.constexpr = _key_words_layout(RP4, W)
        VT4: gl.constexpr = _value_tile_layout(RP4, W)
        KS4: gl.constexpr = gl.SliceLayout(2, gl.reshape(gl.zeros([RP4, W], gl.uint32, layout=KW4),
                                                         [RP4, NG, W // NG]).type.layout)
        if ROW_CODES:
            # the rows' value (scale, min) [NG, RP4] beside their gathered probabilities (_scaled_probabilities)
            VS4: gl.constexpr = gl.SliceLayout(1, gl.reshape(_top_rows(gl.zeros([16, RP4], gl.float32, layout=MMA),
                                                                          RP4), [NG, 8 // NG, RP4]).type.layout)
        else:
            VS4: gl.constexpr = _value_meta_layout(RP4, NG, D, GV)
        # the one-hot operands' layouts (the scatter's k and the values' k cut to RP4 from 16 when 8)
        GC4: gl.constexpr = gl.SliceLayout(0, _top_rows(gl.zeros([16, RP4], gl.float32, layout=MMA), RP4).type.layout)
        SB4: gl.constexpr = _narrowed(gl.to_linear_layout(B_OP, [_product_k(RP4), CHUNK]), 0, RP4)
        GB4: gl.constexpr = gl.to_linear_layout(B_OP, [CHUNK, RP4])
        VA4: gl.constexpr = _narrowed(gl.to_linear_layout(A_OP, [D, _product_k(RP4)]), 1, RP4)

    # Every stream's tiles for the copy helpers (a chain's absent streams hold stand-ins, never copied).
    if STREAMS == 1:
        kw2_s, vw2_s, ks2_s, km2_s, vs2_s, vm2_s = kw_s, vw_s, ks_s, km_s, vs_s, vm_s
    if SPARSE < 1:
        kw3_s, vw3_s = kw_s, vw_s
    if SPARSE < 2:
        kw4_s, vw4_s = kw_s, vw_s
    key_tiles = ((kw_s, ks_s, km_s, kw2_s, ks2_s, km2_s, kw3_s, kw4_s),
                 (kw_ptr, ks_ptr, km_ptr, kw2_ptr, ks2_ptr, km2_ptr, kw3_ptr, kw4_ptr))
    value_tiles = ((vw_s, vs_s, vm_s, vw2_s, vs2_s, vm2_s, vw3_s, vw4_s),
                   (vw_ptr, vs_ptr, vm_ptr, vw2_ptr, vs2_ptr, vm2_ptr, vw3_ptr, vw4_ptr))

    # Persistent programs (PERSIST): the items of the grid's (sequence, row program, slot) in turn, the next
    # item's block-table entry, length, activity and query loaded during this one (``n_*``, ``q_next``).
    STAGGERED: gl.constexpr = _staggered(STAGGER, STAGES)
    PAIRED: gl.constexpr = _paired_nvfp4(FORMAT, STREAMS)
    gl.static_assert((PERSIST == 0) | ((not OVERLAP) & (not STAGGERED) & (STAGES == 2)),
                     "PERSIST runs the plain loop of two stages")
    ITEM_STEP: gl.constexpr = PERSIST if PERSIST > 0 else 1
    if PERSIST > 0:
        items = sequences * (kv_heads * RB) * slots
        item_first = gl.program_id(0)
        n_seq, n_virtual, n_split = _item_ids(gl.minimum(item_first, items - 1), kv_heads * RB, slots)
        n_entry = _table_entry(0, n_split * pages_per_split, n_seq, table_ptr, max_pages)
        n_length = gl.load(lengths_ptr + n_seq)
        n_active = gl.load(active_ptr + n_seq).to(gl.int32) != 0
        q_next = _query_rows(q_ptr, n_seq, n_virtual, kv_heads, RB, GROUP, GP, D, QL)
    else:
        items = 1
        item_first = 0
    base = item_first * 0  # PERSIST: the stage of the item's first page (a tensor there)
    for item in range(item_first, items, ITEM_STEP):
        # The first page's block-table entry and the query are loaded beside the sequence's length, not
        # after it: the first page's copy then waits for one round trip, not two.
        if PERSIST > 0:
            seq, virtual, split = n_seq, n_virtual, n_split
            first_entry = n_entry
            length = n_length
            active = n_active
            q_in = q_next
            more = item + PERSIST < items
            n_seq, n_virtual, n_split = _item_ids(gl.minimum(item + PERSIST, items - 1), kv_heads * RB, slots)
            n_entry = _table_entry(0, n_split * pages_per_split, n_seq, table_ptr, max_pages)
            n_length = gl.load(lengths_ptr + n_seq)
            n_active = (gl.load(active_ptr + n_seq).to(gl.int32) != 0) & more
            q_next = _query_rows(q_ptr, n_seq, n_virtual, kv_heads, RB, GROUP, GP, D, QL)
        else:
            seq = gl.program_id(0)
            virtual = gl.program_id(1)  # KV head * RB + block of 8 query rows
            split = gl.program_id(2)
            first_entry = _table_entry(0, split * pages_per_split, seq, table_ptr, max_pages)
            length = gl.load(lengths_ptr + seq)
            active = gl.load(active_ptr + seq).to(gl.int32) != 0
            q_in = _query_rows(q_ptr, seq, virtual, kv_heads, RB, GROUP, GP, D, QL)
        head = virtual // RB
        row_block = virtual % RB
        program = (seq * kv_heads + head).to(gl.int64)  # (sequence, KV head): its query rows
        partial = (seq * (kv_heads * RB) + virtual).to(gl.int64)  # this program's partials
        first = split * pages_per_split
        query = q_in.to(gl.float32) * QSCALE
        # The query as a float16 pair in one operand: its high half in rows 0-7 and, with PRECISE, the
        # rounding remainder in rows 8-15 (the padding rows of the m16 products), so each product scores
        # both halves at once and the rows are folded after it (:func:`_fold_rows`): the large q . k of
        # offset and outlier key channels keep ~22 bits at no extra product.
        query_hi = query.to(gl.float16)
        hi8 = _to_key_order(query_hi, D, W)
        if PRECISE:
            lo8 = _to_key_order((query - query_hi.to(gl.float32)).to(gl.float16), D, W)
        else:
            lo8 = gl.zeros_like(hi8)
        operand = _stack_rows(hi8, lo8, D, A_OP)
        hi8, lo8 = _split_rows(operand, D)  # the halves in the operand's own row layout (page scales)
        query = (operand, hi8, lo8)

        # The sequence's regions (``jflashloop.cache._regions``): ``visible`` tokens, pages up to
        # ``packed_end`` (a lost page, -1, ends them earlier: ``_page_tile`` and the window program).
        visible, packed_end, count = _split_pages(length, active, first, pages_per_split, PENDING, CAPACITY,
                                                  RECENT, PAGE, SINK)
        if PERSIST > 0:  # the next item's first page (copied during this item's last page)
            n_count = _split_pages(n_length, n_active, n_split * pages_per_split, pages_per_split, PENDING,
                                   CAPACITY, RECENT, PAGE, SINK)[2]
            n_tile, n_live = _entry_tile(n_entry, 0, n_count, n_virtual // RB, pool_pages)
            if item == item_first:  # a program's first item copies its own first page
                tile, live = _entry_tile(first_entry, 0, count, head, pool_pages)
                _copy_page(key_tiles, 0, tile, live, True, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                _copy_page(value_tiles, 0, tile, live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                async_copy.commit_group()
        else:
            # Pages copied before the loop: STAGES - 1 ahead; staggered (one stage), the first page, its keys
            # and its values as two copy groups.
            for s in gl.static_range(_prologue_pages(STAGGER, STAGES)):
                if s == 0:
                    tile, live = _entry_tile(first_entry, 0, count, head, pool_pages)
                else:
                    tile, live = _page_tile(s, count, first, seq, head, table_ptr, pool_pages, max_pages)
                _copy_page(key_tiles, s, tile, live, True, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                if STAGGERED:
                    async_copy.commit_group()
                _copy_page(value_tiles, s, tile, live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                async_copy.commit_group()

        B8: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        zeros_b8 = gl.zeros([D, 8], gl.float16, layout=B8)
        zeros_c8 = gl.zeros([16, 8], gl.float32, layout=MMA)

        acc = gl.zeros([D, 8], gl.float32, layout=MMA)
        zero_scores = gl.zeros([16, CHUNK], gl.float32, layout=MMA)
        run_max = gl.max(_top_rows(zero_scores, CHUNK), axis=1) + MASK_VALUE
        tokens = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, _top_rows(zero_scores, CHUNK).type.layout))
        sums = _lane_sums(_top_rows(zero_scores, CHUNK), CHUNK)  # [8, 8]: per-thread partial row sums
        mins = gl.zeros_like(sums)  # SCALED: per-thread partial sums of p x value minimums, per column

        if OVERLAP:
            gl.static_assert((STREAMS == 1) & (SPARSE == 0) & (CHUNK == PAGE) & (STAGES >= 2),
                             "OVERLAP reads one dense stream in whole-page chunks")
            # Page 0's scores; then each step copies a page ahead, masks the scores of page ``step``,
            # waits for page ``step + 1`` and makes its scores, and finishes page ``step`` (softmax,
            # values). The last page is finished after the loop.
            following, _following_live = _page_tile(0, count, first, seq, head, table_ptr, pool_pages, max_pages)
            if FORMAT == NVFP4:
                terms = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, following, 0, zeros_b8, zeros_c8, D, W, A_OP, B8,
                                    KM, FORMAT, PRECISE)
            async_copy.wait_group(STAGES - 2)
            if FORMAT == INT4:
                terms = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, following, 0, zeros_b8, zeros_c8, D, W, A_OP, B8,
                                    KM, FORMAT, PRECISE)
            if FORMAT == ROTATED:
                terms = (0.0, 0.0)
            ahead_scores = _page_scores(query, terms, kw_s, ks_s, 0, zero_scores, PAGE, W, D, B_OP, KW, MMA, FORMAT)
            if FORMAT == NVFP4:  # the value tile scale of the page being finished
                value_term = terms[1]
            else:
                value_term = 0.0
            for step in range(count - 1):
                ahead = (step + STAGES - 1) % STAGES
                tile, live = _page_tile(step + STAGES - 1, count, first, seq, head, table_ptr, pool_pages, max_pages)
                _copy_page(key_tiles, ahead, tile, live, True, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG, FORMAT,
                           ROWS_FORMAT)
                _copy_page(value_tiles, ahead, tile, live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                async_copy.commit_group()
                current, current_live = _page_tile(step, count, first, seq, head, table_ptr, pool_pages, max_pages)
                scores = _mask_chunk(ahead_scores, (first + step) * PAGE, tokens, current_live, packed_end, SINK, PAGE)
                following, _following_live = _page_tile(step + 1, count, first, seq, head, table_ptr, pool_pages, max_pages)
                stage = step % STAGES
                next_stage = (step + 1) % STAGES
                if FORMAT == NVFP4:
                    terms = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, following, next_stage, zeros_b8, zeros_c8, D,
                                        W, A_OP, B8, KM, FORMAT, PRECISE)
                async_copy.wait_group(STAGES - 2)  # page step + 1 has landed
                if FORMAT == INT4:
                    terms = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, following, next_stage, zeros_b8, zeros_c8, D,
                                        W, A_OP, B8, KM, FORMAT, PRECISE)
                if FORMAT == ROTATED:
                    terms = (0.0, 0.0)
                ahead_scores = _page_scores(query, terms, kw_s, ks_s, next_stage, zero_scores, PAGE, W, D, B_OP, KW,
                                            MMA, FORMAT)
                weights, sums, mins, acc, run_max = _chunk_weights(scores, sums, mins, acc, run_max, TO_SCORES, PAGE, MMA,
                                                                   LAZY, SCALED)
                p_t = gl.convert_layout(gl.permute(weights.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
                acc, mins = _add_values(acc, mins, p_t, weights, (0.0, value_term), vw_s, vs_s, vm_s, stage, 0, PAGE,
                                        PAGE, W, D, NG, A_OP, B_OP, VT, VS, FORMAT, SCALED)
                if FORMAT == NVFP4:
                    value_term = terms[1]
            if count > 0:
                last = count - 1
                current, current_live = _page_tile(last, count, first, seq, head, table_ptr, pool_pages, max_pages)
                scores = _mask_chunk(ahead_scores, (first + last) * PAGE, tokens, current_live, packed_end, SINK, PAGE)
                weights, sums, mins, acc, run_max = _chunk_weights(scores, sums, mins, acc, run_max, TO_SCORES, PAGE, MMA,
                                                                   LAZY, SCALED)
                p_t = gl.convert_layout(gl.permute(weights.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
                acc, mins = _add_values(acc, mins, p_t, weights, (0.0, value_term), vw_s, vs_s, vm_s, last % STAGES, 0,
                                        PAGE, PAGE, W, D, NG, A_OP, B_OP, VT, VS, FORMAT, SCALED)
        else:
            # NVFP4's tile scales come from global memory, a page ahead: this page's were loaded during the
            # previous page's work (any tile index is in the pool, so the load past the last page is safe).
            if FORMAT == NVFP4:
                first_tile, _first_live = _entry_tile(first_entry, 0, count, head, pool_pages)
                tile_scales = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, first_tile, 0, zeros_b8, zeros_c8, D, W,
                                          A_OP, B8, KM, FORMAT, PRECISE)
                if STREAMS == 2:
                    tile_scales2 = _page_terms(query, ks2_s, km2_s, km2_ptr, vm2_ptr, first_tile, 0, zeros_b8, zeros_c8,
                                               D, W, A_OP, B8, KM, FORMAT, PRECISE)
            # Staggered (one stage): the next page's keys are copied once this page's scores are made, and its
            # values once this page's values are used: each copy flies behind the other half of a page's work.
            for step in range(count):
                if STAGGERED:
                    following, following_live = _page_tile(step + 1, count, first, seq, head, table_ptr, pool_pages,
                                                           max_pages)
                else:
                    ahead = (base + step + STAGES - 1) % STAGES
                    tile, live = _page_tile(step + STAGES - 1, count, first, seq, head, table_ptr, pool_pages,
                                            max_pages)
                    if PERSIST > 0:  # the item's last page: the next item's first page is copied
                        tile = gl.where(step + 1 < count, tile, n_tile)
                        live = gl.where(step + 1 < count, live, n_live)
                    _copy_page(key_tiles, ahead, tile, live, True, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                               FORMAT, ROWS_FORMAT)
                    _copy_page(value_tiles, ahead, tile, live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                               FORMAT, ROWS_FORMAT)
                    async_copy.commit_group()
                    if STAGES == 2:
                        following = tile
                    else:
                        following, _following_live = _page_tile(step + 1, count, first, seq, head, table_ptr,
                                                                pool_pages, max_pages)
                if FORMAT == NVFP4:
                    terms = tile_scales
                    tile_scales = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, following, 0, zeros_b8, zeros_c8, D, W,
                                              A_OP, B8, KM, FORMAT, PRECISE)
                    if STREAMS == 2:
                        terms2 = tile_scales2
                        tile_scales2 = _page_terms(query, ks2_s, km2_s, km2_ptr, vm2_ptr, following, 0, zeros_b8,
                                                   zeros_c8, D, W, A_OP, B8, KM, FORMAT, PRECISE)
                        pair = _nvfp4_pair_terms(terms, terms2)
                current, current_live = _page_tile(step, count, first, seq, head, table_ptr, pool_pages, max_pages)
                if SPARSE >= 1:  # the sparse rows' metadata, from memory (used after the dense work of the page)
                    meta3 = _sparse_meta(current, ks3_ptr, km3_ptr, vs3_ptr, vm3_ptr, pos3_ptr, R3, RP3, NG, KS3, VS3, SB3,
                                         GB3, ROW_CODES, ROWS_FORMAT, KW3, VT3, gl.SliceLayout(0, MMA), GC3)
                if SPARSE >= 2:
                    meta4 = _sparse_meta(current, ks4_ptr, km4_ptr, vs4_ptr, vm4_ptr, pos4_ptr, R4, RP4, NG, KS4, VS4, SB4,
                                         GB4, ROW_CODES, ROWS_FORMAT, KW4, VT4, gl.SliceLayout(0, MMA), GC4)
                if STAGGERED:
                    async_copy.wait_group(1)  # this page's keys have landed (its values may be in flight)
                else:
                    async_copy.wait_group(STAGES - 1)  # this page's copies have landed in shared memory
                stage = (base + step) % STAGES
                if FORMAT == ROTATED:
                    terms = (0.0, 0.0)
                    terms2 = (0.0, 0.0)
                if FORMAT == INT4:  # the key metadata is in shared memory: read it after waiting
                    terms = _page_terms(query, ks_s, km_s, km_ptr, vm_ptr, current, stage, zeros_b8, zeros_c8, D, W,
                                        A_OP, B8, KM, FORMAT, PRECISE)
                    if STREAMS == 2:  # its scaled query is made where its product needs it (fewer live registers)
                        offset2 = _key_offset(query, km2_s, stage, zeros_b8, zeros_c8, D, W, B8, KM)
                if FORMAT == INT4:  # the streams' q . min start the score accumulator
                    offset = terms[1]
                    if STREAMS == 2:
                        offset = offset + offset2
                    offset = offset * KEY_UNIT  # the key codes' products are in units of KEY_UNIT
                    start = gl.convert_layout(_tile_columns(offset, CHUNK), MMA, assert_trivial=True)
                else:
                    start = zero_scores
                for c in gl.static_range(PAGE // CHUNK):
                    if PAIRED:
                        both = _add_nvfp4_pair_scores(start, query, pair, kw_s, ks_s, kw2_s, ks2_s, stage, c, zero_scores,
                                                      PAGE, CHUNK, W, D, B_OP, KW)
                    else:
                        both = _add_key_scores(start, query, terms, kw_s, ks_s, stage, c, zero_scores, PAGE, CHUNK, W, D,
                                               B_OP, KW, FORMAT)
                    if (STREAMS == 2) and not PAIRED:
                        if FORMAT == INT4:
                            terms2 = (_scaled_query(query, ks2_s, stage, D, W, A_OP, KM, PRECISE), offset2)
                        both = _add_key_scores(both, query, terms2, kw2_s, ks2_s, stage, c, zero_scores, PAGE, CHUNK, W, D,
                                               B_OP, KW, FORMAT)
                    if SPARSE >= 1:
                        both = _add_sparse_scores(both, query, kw3_s, stage, meta3, c, RP3, CHUNK, W, D, NG, MMA, A_OP,
                                                  B_OP, KW3, SB3, ROWS_FORMAT, FORMAT)
                    if SPARSE >= 2:
                        both = _add_sparse_scores(both, query, kw4_s, stage, meta4, c, RP4, CHUNK, W, D, NG, MMA, A_OP,
                                                  B_OP, KW4, SB4, ROWS_FORMAT, FORMAT)
                    if STAGGERED:
                        if c == PAGE // CHUNK - 1:  # every key tile of the page is read
                            _copy_page(key_tiles, 0, following, following_live, True, STREAMS, SPARSE, R3, RP3, R4, RP4,
                                       PAGE, W, D, NG, FORMAT, ROWS_FORMAT)
                            async_copy.commit_group()
                    scores = _fold_rows(both, CHUNK)  # [8, CHUNK], INT4: in units of KEY_UNIT (x TO_SCORES)
                    scores = _mask_chunk(scores, (first + step) * PAGE + c * CHUNK, tokens, current_live, packed_end, SINK,
                                         CHUNK)
                    weights, sums, mins, acc, run_max = _chunk_weights(scores, sums, mins, acc, run_max, TO_SCORES, CHUNK,
                                                                       MMA, LAZY, SCALED)
                    if STAGGERED:
                        if c == 0:  # this page's values have landed (the next page's keys may be in flight)
                            if PAGE == CHUNK:
                                async_copy.wait_group(1)
                            else:
                                async_copy.wait_group(0)
                    p_t = gl.convert_layout(gl.permute(weights.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)
                    if PAIRED and not SCALED:
                        acc = _add_nvfp4_pair_values(acc, p_t, pair, vw_s, vs_s, vw2_s, vs2_s, stage, c, PAGE, CHUNK, W, D,
                                                     A_OP, VT)
                    else:
                        acc, mins = _add_values(acc, mins, p_t, weights, terms, vw_s, vs_s, vm_s, stage, c, PAGE, CHUNK, W,
                                                D, NG, A_OP, B_OP, VT, VS, FORMAT, SCALED)
                        if STREAMS == 2:
                            acc, mins = _add_values(acc, mins, p_t, weights, terms2, vw2_s, vs2_s, vm2_s, stage, c, PAGE,
                                                    CHUNK, W, D, NG, A_OP, B_OP, VT, VS, FORMAT, SCALED)
                    if SPARSE >= 1:
                        acc, mins = _add_sparse_values(acc, mins, weights, vw3_s, stage, meta3, c, RP3, CHUNK, W, D, NG,
                                                       MMA, A_OP, B_OP, VT3, GB3, VA3, ROW_CODES, ROWS_FORMAT)
                    if SPARSE >= 2:
                        acc, mins = _add_sparse_values(acc, mins, weights, vw4_s, stage, meta4, c, RP4, CHUNK, W, D, NG,
                                                       MMA, A_OP, B_OP, VT4, GB4, VA4, ROW_CODES, ROWS_FORMAT)
                if STAGGERED:  # every value tile of the page is read
                    _copy_page(value_tiles, 0, following, following_live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE,
                               W, D, NG, FORMAT, ROWS_FORMAT)
                    async_copy.commit_group()
        if PERSIST > 0:
            if count == 0:  # no page of this item copied the next item's first page
                async_copy.wait_group(0)
                _copy_page(key_tiles, base, n_tile, n_live, True, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D, NG,
                           FORMAT, ROWS_FORMAT)
                _copy_page(value_tiles, base, n_tile, n_live, False, STREAMS, SPARSE, R3, RP3, R4, RP4, PAGE, W, D,
                           NG, FORMAT, ROWS_FORMAT)
                async_copy.commit_group()
            base = (base + count) % STAGES
        else:
            async_copy.wait_group(0)
        total = gl.sum(sums, axis=1)
        if SCALED:  # before the windows, whose values are plain
            acc = _codes_to_values(acc, mins, D, W, MMA, FORMAT)
            total = total * (1.0 / (1 << SCALED_HEADROOM_LOG2))

        if WINDOWS:
            if split == window_split:
                # A lost page among the last pages before the ring ends the pages there; an earlier one
                # ends them before the ring's oldest position, so these columns decide.
                WP: gl.constexpr = _window_columns(RING, PAGE)
                near = gl.maximum(visible - RING, 0) // PAGE + gl.arange(0, WP, layout=gl.BlockedLayout([1], [32], [1], [0]))
                ends = gl.cdiv(packed_end, PAGE)
                entries = gl.load(table_ptr + seq * max_pages + near, mask=near < ends, other=0)
                lost = gl.min(gl.where((entries < 0) & (near < ends), near, ends), axis=0)
                packed_end = gl.minimum(packed_end, lost * PAGE)
                window = ((window_loop * sequences + seq) * kv_heads + head).to(gl.int64)
                if SINK > 0:
                    for chunk in range(gl.cdiv(SINK, 16)):
                        slot_index = chunk * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, tokens_w_layout(MMA)))
                        valid = (slot_index < SINK) & (slot_index < visible)
                        total, run_max, acc = _window_chunk(
                            query, sink_k_ptr + window * (SINK * D), sink_v_ptr + window * (SINK * D), chunk * 16,
                            SINK, valid, total, run_max, acc, D, W, A_OP, B_OP, MMA)
                for chunk in range(gl.cdiv(RING, 16)):
                    slot_index = chunk * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, tokens_w_layout(MMA)))
                    behind = visible - 1 - slot_index
                    position = slot_index + RING * (gl.maximum(behind, 0) // RING)
                    valid = ((slot_index < RING) & (behind >= 0) & (position >= gl.maximum(packed_end, SINK))
                             & (position < visible))
                    total, run_max, acc = _window_chunk(
                        query, ring_k_ptr + window * (RING * D), ring_v_ptr + window * (RING * D), chunk * 16,
                        RING, valid, total, run_max, acc, D, W, A_OP, B_OP, MMA)

        slot = partial * slots + split
        o_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        o_chan = _value_physical(gl.arange(0, D, layout=gl.SliceLayout(1, MMA)), W)
        # The group's rows only (rows past GROUP are padding; nothing reads them); SCALED: each channel from
        # the columns of its value group.
        o_keep = gl.expand_dims(row_block * 8 + o_rows % GP < GROUP, 0)
        if SCALED:
            o_keep = o_keep & (gl.expand_dims(o_rows // GP, 0) == gl.expand_dims(o_chan // (D // SG), 1))
        gl.store(out_ptr + slot * (8 * D) + gl.expand_dims(o_rows % GP, 0) * D + gl.expand_dims(o_chan, 1), acc,
                 mask=o_keep)
        r_sum = gl.arange(0, 8, layout=total.type.layout)
        gl.store(sum_ptr + slot * 8 + r_sum, total, mask=row_block * 8 + r_sum < GROUP)
        r_max = gl.arange(0, 8, layout=run_max.type.layout)
        gl.store(max_ptr + slot * 8 + r_max, run_max, mask=row_block * 8 + r_max < GROUP)
        if MERGE:
            # Release this program's partials, count it; the last of its (sequence, head) merges them.
            done = gl.atomic_add(counter_ptr + program, 1, sem="acq_rel", scope="gpu")
            if done == slots - 1:
                _merge_partials(out_ptr, sum_ptr, max_ptr, final_ptr, program, slots, D, GROUP, MERGE_REGS)
    if PERSIST > 0:
        async_copy.wait_group(0)  # the last item's copy of a next first page (none: zero-filled)
