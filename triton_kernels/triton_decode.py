"""The Gluon page kernel's algorithm in plain Triton: the compiler chooses every layout.

Same inputs, outputs and arithmetic as
:func:`jflashloop_triton_kernels.gluon_decode.int4_pages_kernel` (KIVI keys,
float16 products, probabilities fed to the value product, dequantized value
pairs); it exists to measure what explicit layouts are worth
(``bench/kernel_formulations.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gluon_decode import _KEY_CODES_ASM, _VALUE_PAIR_ASM

MASK_VALUE = tl.constexpr(-1e30)
KEY_ASM = tl.constexpr(_KEY_CODES_ASM.value)
VALUE_ASM = tl.constexpr(_VALUE_PAIR_ASM.value)


@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    return tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))


@triton.jit
def int4_pages_kernel(
    q_ptr, table_ptr, bounds_ptr, kw_ptr, ks_ptr, km_ptr, vw_ptr, vs_ptr, vm_ptr,
    kv_heads, pool_pages, max_pages, pages_per_split, slots, out_ptr, sum_ptr, max_ptr,
    D: tl.constexpr, PAGE: tl.constexpr, GV: tl.constexpr, SINK: tl.constexpr,
):
    W: tl.constexpr = D // 8
    NG: tl.constexpr = D // GV
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    program = (seq * kv_heads + head).to(tl.int64)
    rows = tl.arange(0, 8)
    cols = tl.arange(0, D)
    query = tl.load(q_ptr + program * (8 * D) + rows[:, None] * D + cols[None, :])
    k_offsets = tl.arange(0, PAGE)[:, None] * W + tl.arange(0, W)[None, :]
    pair = tl.arange(0, PAGE // 2)
    word = tl.arange(0, W)
    v_even = (2 * pair)[:, None] * W + word[None, :]
    vs_even = (2 * pair)[:, None] * NG + ((8 * word) // GV)[None, :]
    packed_end = tl.load(bounds_ptr + seq * 2 + 1)
    packed_pages = tl.where(packed_end > SINK, tl.cdiv(packed_end, PAGE), 0)
    first = split * pages_per_split
    count = tl.minimum(tl.maximum(packed_pages - first, 0), pages_per_split)
    acc = tl.zeros([D, 16], tl.float32)
    run_max = tl.full([8], MASK_VALUE, tl.float32)
    sums = tl.zeros([8, PAGE], tl.float32)
    tokens = tl.arange(0, PAGE)
    for step in range(count):
        page_index = first + step
        page = tl.maximum(tl.load(table_ptr + seq * max_pages + page_index), 0)
        tile = head.to(tl.int64) * pool_pages + page
        key_words = tl.load(kw_ptr + tile * (PAGE * W) + k_offsets)
        even = tl.load(vw_ptr + tile * (PAGE * W) + v_even)
        odd = tl.load(vw_ptr + tile * (PAGE * W) + v_even + W)
        s_even = tl.load(vs_ptr + tile * (PAGE * NG) + vs_even)
        s_odd = tl.load(vs_ptr + tile * (PAGE * NG) + vs_even + NG)
        m_even = tl.load(vm_ptr + tile * (PAGE * NG) + vs_even)
        m_odd = tl.load(vm_ptr + tile * (PAGE * NG) + vs_even + NG)
        k_scale = tl.load(ks_ptr + tile * D + cols).to(tl.float32)
        k_min = tl.load(km_ptr + tile * D + cols).to(tl.float32)
        scaled = (query * k_scale[None, :]).to(tl.float16)
        scaled = tl.reshape(tl.permute(tl.reshape(scaled, [8, 2, 2, W // 4, 2, 2, 2]), [0, 3, 5, 6, 1, 2, 4]), [8, D])
        scaled = tl.reshape(tl.permute(tl.join(scaled, tl.zeros_like(scaled)), [2, 0, 1]), [16, D])
        offset = tl.sum(query * k_min[None, :], axis=1)
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            KEY_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [key_words], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        codes = tl.reshape(_join8(c0, c1, c2, c3, c4, c5, c6, c7), [PAGE, 2, 2, W // 4, 2, 2, 2])
        codes = tl.reshape(tl.permute(codes, [3, 5, 4, 1, 2, 6, 0]), [D, PAGE])
        both = tl.dot(scaled, codes)  # [16, PAGE]
        scores, _ = tl.split(tl.permute(tl.reshape(both, [2, 8, PAGE]), [1, 2, 0]))
        scores = scores + offset[:, None]
        token = page_index * PAGE + tokens
        valid = ((token >= SINK) & (token < packed_end))[None, :]
        scores = tl.where(valid, scores, MASK_VALUE)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        correction = tl.exp2(run_max - new_max)
        weights = tl.where(valid, tl.exp2(scores - new_max[:, None]), 0.0)
        sums = sums * correction[:, None] + weights
        run_max = new_max
        p16 = weights.to(tl.float16)
        p_t = tl.permute(tl.reshape(tl.permute(tl.join(p16, tl.zeros_like(p16)), [2, 0, 1]), [16, PAGE]), [1, 0])
        (e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7) = tl.inline_asm_elementwise(
            VALUE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,h,h,h",
            [even, odd, s_even, s_odd, m_even, m_odd], dtype=(tl.float16,) * 16, is_pure=True, pack=1)
        values = _join8(tl.join(e0, o0), tl.join(e1, o1), tl.join(e2, o2), tl.join(e3, o3),
                        tl.join(e4, o4), tl.join(e5, o5), tl.join(e6, o6), tl.join(e7, o7))
        values = tl.reshape(values, [PAGE // 2, 8, W // 8, 2, 2, 2, 2])
        values = tl.reshape(tl.permute(values, [6, 5, 4, 2, 1, 0, 3]), [D, PAGE])
        correction16 = tl.reshape(tl.permute(tl.join(correction, tl.zeros_like(correction)), [1, 0]), [16])
        acc = tl.dot(values, p_t, acc * correction16[None, :])
    slot = program * slots + split
    WL: tl.constexpr = W // 8
    m = tl.arange(0, D)
    physical = 8 * ((m & 7) * WL + (m >> 3) % WL) + m // W
    acc8, _ = tl.split(tl.reshape(acc, [D, 2, 8]).permute(0, 2, 1))
    tl.store(out_ptr + slot * (8 * D) + rows[None, :] * D + physical[:, None], acc8)
    tl.store(sum_ptr + slot * 8 + rows, tl.sum(sums, axis=1))
    tl.store(max_ptr + slot * 8 + rows, run_max)
