"""Fused decode attention over a paged, 4-bit, cross-loop KV cache (Pallas-Triton).

One new query token per sequence attends over loop ``r`` of the cache. For each
block of pages the kernel gathers the packed words of every stream of loops
``1..r`` (the base, dense residuals, and the compact rows of sparse residuals
through their row positions), rebuilds the K and V tiles in registers
(``k = base + d_2 + d_3 + ...`` in float32, as the reference path does),
and runs an online softmax. Nothing dequantized is written to memory.

* Grid ``(sequences, kv_heads, splits + 1)``: split ``s < splits`` covers a
  contiguous range of the sequence's packed pages (split-KV, so one long
  sequence fills the GPU); split ``splits`` attends over the unquantized sink
  and recent-token windows. The partial results are merged with a stable
  log-sum-exp in plain JAX.
* GQA: the query heads sharing a KV head are the rows of the score matrix
  (padded to at least 16 rows for the matrix units).
* One page per inner step: its tiles are contiguous ``[page_size, D/8]``
  uint32 words (8 codes per load), unpacked by in-register interleaving; the
  next page's payload words are loaded while the current page computes.
  Metadata is read once per page: INT4 as float16, NVFP4 scales as raw bytes
  decoded arithmetically. Only portable Triton operations are used (no
  Hopper-only instructions, no float8 types), so the kernel also targets
  consumer Blackwell (sm_120).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

MASK_VALUE = -1e30
LOG2_E = math.log2(math.e)


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
      num_warps, num_stages: Triton launch parameters (defaults measured on an
        H200: 2 warps and 1 stage were fastest at B8 Hq32 Hkv8 T32K and
        B1 Hq16 Hkv16 T64K, bench/RESULTS.md).
      products: ``"tf32"`` (float32 operands on the matrix units' TF32 path)
        or ``"bf16"`` (K, V, queries and probabilities rounded to bfloat16
        before the two matrix products; faster, about 4x the error).
    """

    num_splits: int | None = None
    target_programs: int = 1024
    num_warps: int = 2
    num_stages: int = 1
    products: str = "tf32"

    def __post_init__(self):
        if self.products not in ("tf32", "bf16"):
            raise ValueError(f"KernelConfig.products must be 'tf32' or 'bf16', got {self.products!r}")

    def splits_for(self, sequences: int, kv_heads: int, max_pages: int) -> int:
        if self.num_splits is not None:
            return max(1, min(self.num_splits, max_pages))
        wanted = -(-self.target_programs // (sequences * kv_heads))
        return max(1, min(wanted, max_pages))


def _unpack_codes(words: jax.Array) -> jax.Array:
    """uint32 words ``[N, W]`` -> int32 codes ``[N, 8W]`` in channel order.

    Channel ``8w + i`` is nibble ``i`` of word ``w``. Three rounds of splitting
    each element in two halves and interleaving them (a join of size 2 then a
    reshape), which Triton keeps inside each thread's registers.
    """
    n = words.shape[0]
    halves = jnp.stack([words & jnp.uint32(0xFFFF), words >> jnp.uint32(16)], axis=-1)
    halves = halves.reshape(n, -1)
    quarters = jnp.stack([halves & jnp.uint32(0xFF), halves >> jnp.uint32(8)], axis=-1).reshape(n, -1)
    nibbles = jnp.stack([quarters & jnp.uint32(15), quarters >> jnp.uint32(4)], axis=-1).reshape(n, -1)
    return nibbles.astype(jnp.int32)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """float32 E2M1 values of int32 codes (sign in bit 3), by integer arithmetic."""
    magnitude = codes & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    normal = ((2 + mantissa) << exponent).astype(jnp.float32) * 0.25
    value = jnp.where(magnitude < 2, magnitude.astype(jnp.float32) * 0.5, normal)
    return jnp.where((codes & 8) != 0, -value, value)


def _e4m3_values(bits: jax.Array) -> jax.Array:
    """float32 values of float8_e4m3fn bit patterns (int32, non-negative, not NaN)."""
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0**-9)
    return jnp.where(exponent == 0, subnormal, normal)


def _load_rows(ref, head, page, rows, present):
    """``ref[head, page, :, :]`` (dense) or the compact ``rows`` of a sparse stream, masked."""
    if rows is None:
        return ref[head, page, :, :]
    columns = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    view = ref.at[head, page, rows[:, None], columns[None, :]]
    return pallas_triton.load(view, mask=present[:, None], other=0)


def _dequantize(refs, fmt: StreamFormat, head, page, words, page_size, head_dim, rows=None, present=None):
    """float32 ``[page_size, head_dim]`` of one stream's tile (0 where a sparse row is absent)."""
    codes = _unpack_codes(words)
    if fmt.format == "int4_rotated":
        # One float32 scale per row, its 4 low mantissa bits holding the zero
        # point; values stay in the rotated basis (queries were rotated too).
        scale = _load_rows(refs["scale"], head, page, rows, present)  # [P, 1]
        zero_point = (jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(15)).astype(jnp.float32)
        values = (codes.astype(jnp.float32) - zero_point) * scale
    elif fmt.format == "nvfp4":
        scale = _e4m3_values(_load_rows(refs["scale"], head, page, rows, present).astype(jnp.int32))
        global_scale = refs["global_scale"][head, page]
        blocks = head_dim // 16
        values = _e2m1_values(codes).reshape(page_size, blocks, 16) * scale[:, :, None]
        values = (values * global_scale).reshape(page_size, head_dim)
    elif fmt.axis == "channel":
        scale = refs["scale"][head, page, :, :].astype(jnp.float32)  # [P / G, D]
        minimum = refs["minimum"][head, page, :, :].astype(jnp.float32)
        groups = page_size // fmt.group_size
        if groups == 1:
            values = codes.astype(jnp.float32) * scale + minimum
        else:
            values = codes.astype(jnp.float32).reshape(groups, fmt.group_size, head_dim)
            values = (values * scale[:, None, :] + minimum[:, None, :]).reshape(page_size, head_dim)
    else:
        group = min(fmt.group_size, head_dim)
        scale = _load_rows(refs["scale"], head, page, rows, present).astype(jnp.float32)  # [P, D / G]
        minimum = _load_rows(refs["minimum"], head, page, rows, present).astype(jnp.float32)
        if group == head_dim:
            values = codes.astype(jnp.float32) * scale + minimum
        else:
            values = codes.astype(jnp.float32).reshape(page_size, head_dim // group, group)
            values = (values * scale[:, :, None] + minimum[:, :, None]).reshape(page_size, head_dim)
    if present is not None:
        values = jnp.where(present[:, None], values, 0.0)
    return values


def _sparse_rows(row_positions_ref, head, page, rows: int, page_size: int):
    """Compact row of every token of the page in a sparse stream, and whether it has one."""
    padded = pl.next_power_of_2(rows)
    slot = jnp.arange(padded, dtype=jnp.int32)
    positions = row_positions_ref[head, page, jnp.minimum(slot, rows - 1)].astype(jnp.int32)
    positions = jnp.where(slot < rows, positions, -1)  # [padded]
    token = jnp.arange(page_size, dtype=jnp.int32)
    row = jnp.max(jnp.where(positions[None, :] == token[:, None], slot[None, :], -1), axis=1)
    return jnp.maximum(row, 0), row >= 0


def _dense_words(streams, loops, head, page):
    """The payload words of every dense stream of the page (what the loop prefetches)."""
    words = []
    for loop, refs in zip(loops, streams, strict=True):
        if not loop.sparse:
            words.append(refs["keys"]["payload"][head, page, :, :])
            words.append(refs["values"]["payload"][head, page, :, :])
    return tuple(words)


def _reconstruct_page(streams, loops, head, page, dense_words, page_size, head_dim):
    """float32 K and V ``[page_size, D]`` of the last loop: base + residuals, in loop order."""
    keys = values = None
    words = iter(dense_words)
    for loop, refs in zip(loops, streams, strict=True):
        rows = present = None
        if loop.sparse:
            rows, present = _sparse_rows(refs["row_positions"], head, page, loop.keys.rows, page_size)
            key_words = _load_rows(refs["keys"]["payload"], head, page, rows, present)
            value_words = _load_rows(refs["values"]["payload"], head, page, rows, present)
        else:
            key_words, value_words = next(words), next(words)
        loop_keys = _dequantize(refs["keys"], loop.keys, head, page, key_words, page_size, head_dim, rows, present)
        loop_values = _dequantize(
            refs["values"], loop.values, head, page, value_words, page_size, head_dim, rows, present
        )
        keys = loop_keys if keys is None else keys + loop_keys
        values = loop_values if values is None else values + loop_values
    return keys, values


def _attend(carry, query, keys, values, valid, products="tf32"):
    """One online-softmax step (base-2 exponentials; ``query`` carries log2(e) * scale)."""
    accumulator, running_max, running_sum = carry
    if products == "bf16":
        query, keys, values = (x.astype(jnp.bfloat16) for x in (query, keys, values))
    scores = jnp.dot(query, keys.T, preferred_element_type=jnp.float32)  # [rows, N]
    scores = jnp.where(valid[None, :], scores, MASK_VALUE)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
    correction = jnp.exp2(running_max - new_max)
    probabilities = jnp.where(valid[None, :], jnp.exp2(scores - new_max[:, None]), 0.0)
    new_sum = running_sum * correction + jnp.sum(probabilities, axis=-1)
    weights = probabilities.astype(values.dtype)
    accumulator = accumulator * correction[:, None] + jnp.dot(
        weights, values, preferred_element_type=jnp.float32
    )
    return accumulator, new_max, new_sum


def _decode_kernel(
    query_ref,  # [rows, D] float32, pre-scaled by softmax scale * log2(e)
    block_table_ref,  # [sequences, padded_pages + 1] int32
    bounds_ref,  # [sequences, 2] int32: visible tokens, end of the packed region
    window_keys_ref,  # [window, D] window dtype
    window_values_ref,  # [window, D]
    window_positions_ref,  # [window] int32, -1 = empty
    streams,  # per loop: {"keys": {...}, "values": {...}, "row_positions": ref | None}
    output_ref,  # [rows, D] float32
    sum_ref,  # [rows] float32
    max_ref,  # [rows] float32
    *,
    loops: tuple[LoopFormat, ...],
    page_size: int,
    sink_tokens: int,
    pages_per_split: int,
    num_splits: int,
    products: str,
):
    sequence, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    query = query_ref[...]
    rows, head_dim = query.shape
    start = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )

    def windows():
        positions = window_positions_ref[...]
        keys = window_keys_ref[...].astype(jnp.float32)
        values = window_values_ref[...].astype(jnp.float32)
        return _attend(start, query, keys, values, positions >= 0, products)

    def pages():
        packed_end = bounds_ref[sequence, 1]
        packed_pages = jnp.where(packed_end > sink_tokens, pl.cdiv(packed_end, page_size), 0)
        first = split * pages_per_split
        count = jnp.clip(packed_pages - first, 0, pages_per_split)
        token_in_page = jnp.arange(page_size, dtype=jnp.int32)

        def body(step, carry):
            state, words = carry
            page_index = first + step
            page = block_table_ref[sequence, page_index]
            # Issue the next page's loads now; they complete while this page computes.
            next_words = _dense_words(streams, loops, head, block_table_ref[sequence, page_index + 1])
            keys, values = _reconstruct_page(streams, loops, head, page, words, page_size, head_dim)
            token = page_index * page_size + token_in_page
            valid = (token >= sink_tokens) & (token < packed_end)
            return _attend(state, query, keys, values, valid, products), next_words

        first_words = _dense_words(streams, loops, head, block_table_ref[sequence, first])
        state, _ = jax.lax.fori_loop(0, count, body, (start, first_words))
        return state

    accumulator, running_max, running_sum = jax.lax.cond(split == num_splits, windows, pages)
    output_ref[...] = accumulator
    sum_ref[...] = running_sum
    max_ref[...] = running_max


def _ignore_poisoned_inputs(kernel, *refs):
    """Drop the three aliased (poisoned) input refs the kernel never reads."""
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
    static_argnames=("loops", "page_size", "sink_tokens", "scale", "config", "interpret", "poison"),
)
def paged_decode_attention(
    queries: jax.Array,
    block_tables: jax.Array,
    bounds: jax.Array,
    streams: tuple[dict[str, Any], ...],
    window_keys: jax.Array,
    window_values: jax.Array,
    window_positions: jax.Array,
    *,
    loops: tuple[LoopFormat, ...],
    page_size: int,
    sink_tokens: int,
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
      bounds: int32 ``[sequences, 2]``: visible tokens, and the end of the
        packed region (positions ``sink_tokens <= t < end`` are read from pages).
      streams: per loop ``1..r`` a dict ``{"keys": S, "values": S,
        "row_positions": int8 [kv_heads, pages, rows] or None}`` where ``S`` is
        ``{"payload": uint32 [kv_heads, pages, rows, D/8], "scale", "minimum",
        "global_scale"}`` (absent entries None).
      window_keys, window_values: ``[sequences, kv_heads, window, head_dim]``
        unquantized tokens (sink and recent windows, ``window`` a power of two).
      window_positions: int32 ``[sequences, window]``; -1 marks an unused slot.
      loops: the static formats of ``streams``.
      scale: softmax scale.
      config: launch parameters.
      interpret: run in interpret mode (CPU).
      poison: start from NaN-filled partial outputs (tests: any element the
        kernel fails to write poisons the result).
    Returns:
      float32 ``[sequences, q_heads, head_dim]``.
    """
    sequences, q_heads, head_dim = queries.shape
    kv_heads = window_keys.shape[1]
    group = q_heads // kv_heads
    rows = max(16, pl.next_power_of_2(group))
    max_pages = block_tables.shape[1]
    splits = config.splits_for(sequences, kv_heads, max_pages)
    pages_per_split = -(-max_pages // splits)
    padded_pages = pages_per_split * splits
    # One spare column: the loop prefetches one page past the last it reads.
    block_tables = jnp.pad(
        jnp.maximum(block_tables, 0), ((0, 0), (0, padded_pages + 1 - max_pages))
    ).astype(jnp.int32)

    query = queries.astype(jnp.float32) * (scale * LOG2_E)
    query = query.reshape(sequences, kv_heads, group, head_dim)
    query = jnp.pad(query, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    # E4M3 scales travel as raw bytes: the kernel decodes them arithmetically.
    streams = jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype == jnp.float8_e4m3fn else x,
        streams,
    )

    window = window_keys.shape[2]
    grid = (sequences, kv_heads, splits + 1)
    full = pl.BlockSpec()
    stream_specs = jax.tree.map(lambda _: full, streams)
    kernel = functools.partial(
        _decode_kernel,
        loops=loops,
        page_size=page_size,
        sink_tokens=sink_tokens,
        pages_per_split=pages_per_split,
        num_splits=splits,
        products=config.products,
    )
    name = f"jflashloop_decode_loops{len(loops)}_{splits=}_{rows=}"
    out_shape = [
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows), jnp.float32),
        jax.ShapeDtypeStruct((sequences, kv_heads, splits + 1, rows), jnp.float32),
    ]
    inputs = [query, block_tables, bounds, window_keys, window_values, window_positions, streams]
    aliases = {}
    if poison:
        poisoned = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]
        first_poisoned = len(jax.tree.leaves(inputs))
        aliases = {first_poisoned + i: i for i in range(3)}
        inputs = [*inputs, *poisoned]
        kernel = functools.partial(_ignore_poisoned_inputs, kernel)
    output, running_sum, running_max = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            full,
            full,
            pl.BlockSpec((None, None, window, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, window, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, window), lambda b, h, s: (b, 0)),
            stream_specs,
        ] + ([full] * 3 if poison else []),
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pallas_triton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*inputs)
    merged = merge_splits(output, running_sum, running_max)  # [B, H, rows, D]
    return merged[:, :, :group, :].reshape(sequences, q_heads, head_dim)
