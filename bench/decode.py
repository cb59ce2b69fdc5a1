"""Decode-attention benchmark: the fused jflashloop kernel against the peers a user
would pick instead, all measured in the same run.

Usage (GPU):
  python bench/decode.py                 # the full table (bench/RESULTS.md)
  python bench/decode.py --quick         # two shapes, for a smoke test
  python bench/decode.py --sweep         # kernel launch parameters at two shapes
  python bench/decode.py --sweep --sweep-loops 2,4   # ... for residual chains
  python bench/decode.py --trace DIR     # also write a jax.profiler trace
  python bench/decode.py --check         # also compare the kernel with the reference path

Each row: median milliseconds per call (batches of back-to-back calls, one
device sync per batch, median over batches), with inputs rotated among enough
copies to exceed the L2 cache. Effective bandwidth counts the bytes a call
must read: every packed page of loops 1..r (payload, metadata, sparse row
positions), the unquantized windows, and for BF16 baselines the K/V arrays.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop import CacheConfig, paged_cache, storage
from jflashloop.cache._pages import pack_pages, unpack_pages
from jflashloop.ops import arg_specs
from jflashloop.ops._decode_attention import predicted_source
from jflashloop.paged_cache import LoopTiles
from jflashloop_pallas_kernels.decode_attention import KernelConfig

L2_BYTES = 60 * 2**20

HEAD_DIM = 128
# name, sequences, q_heads, kv_heads, tokens, head_dim (jflashloop/ops/arg_specs.py)
SHAPES = list(arg_specs.DECODE_SHAPES)


@functools.lru_cache(maxsize=4)
def stand_in_predictions(layers: int, loops: int, kv_heads: int, head_dim: int):
    """Random maps near the identity (0.9 I plus small noise; for speed only the shapes matter), ``loops`` per
    layer, as :meth:`CacheConfig.predicted_loops` takes them."""
    rng = np.random.default_rng(0)

    def one():
        matrices = [0.9 * np.eye(head_dim) + 0.02 * rng.standard_normal((kv_heads, head_dim, head_dim))
                    for _ in range(2)]
        return jflashloop.LoopPrediction.from_arrays(matrices[0], 0.01 * rng.standard_normal((kv_heads, head_dim)),
                                                     matrices[1], 0.01 * rng.standard_normal((kv_heads, head_dim)))
    return tuple(tuple(one() for _ in range(loops)) for _ in range(layers))


def make_config(sequences, kv_heads, tokens, loops, value_format="int4", head_dim=HEAD_DIM, direct_loop=False,
                row_format=None, row_counts=None, predicted=False, page_size=64):
    """``value_format``: "int4" (FlashLoop policy), "nvfp4" or "int4_rotated" (every stream, the sparse
    rows too); ``direct_loop``: loop 2 stored on its own (``CacheConfig.flashloop(direct_loop=True)``);
    ``row_format`` ("int4" or "int2", affine, grouped like the dense values) and ``row_counts`` (rows of
    loops 3 and 4 per page): the sparse loops' rows instead of the policy's; ``predicted``: loops 3 and 4
    predicted from the loop before with no rows (``CacheConfig.predicted_loops``, :func:`stand_in_predictions`;
    INT4 only); ``page_size``: tokens a page (a sequence holds ``tokens // page_size`` pages; channel-axis key
    groups of a page, as the fused kernels read them)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = tokens // page_size
    if predicted and loops > 2:
        return CacheConfig.predicted_loops(
            predictions=stand_in_predictions(1, loops - 2, kv_heads, head_dim), num_layers=1, num_kv_heads=kv_heads,
            head_dim=head_dim, num_pages=sequences * pages, max_sequences=sequences, max_pages_per_sequence=pages,
            page_size=page_size)
    direct_loop = direct_loop or predicted
    config = CacheConfig.flashloop(
        num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, num_pages=sequences * pages,
        max_sequences=sequences, max_pages_per_sequence=pages, num_loops=loops, page_size=page_size,
        direct_loop=direct_loop,
    )
    # channel-axis key groups of a page, as the fused kernels read them (the policy's 64 at 64-token pages)
    config = dataclasses.replace(config, loops=tuple(
        dataclasses.replace(loop, key_spec=dataclasses.replace(loop.key_spec, group_size=page_size))
        if loop.key_spec.axis == "channel" else loop for loop in config.loops))
    codecs = {"nvfp4": (jflashloop.NVFP4, jflashloop.NVFP4),
              "int4_rotated": (jflashloop.int4_rotated(head_dim, 0), jflashloop.int4_rotated(head_dim, 1))}
    if value_format in codecs:  # every stream, sparse rows included; the loops' kinds (direct, sparse) kept
        keys, values = codecs[value_format]
        config = dataclasses.replace(config, loops=tuple(
            dataclasses.replace(loop, key_spec=keys, value_spec=values) for loop in config.loops))
    if row_format is not None or row_counts is not None:
        rows = jflashloop.CodecSpec(row_format or "int4", "token", config.loops[0].value_spec.group_size)
        counts = iter(row_counts or (None, None))
        config = dataclasses.replace(config, loops=tuple(
            dataclasses.replace(loop, key_spec=rows, value_spec=rows,
                                sparse_rows_per_page=next(counts) or loop.sparse_rows_per_page) if loop.is_sparse else loop
            for loop in config.loops))
    return config


def random_stream(key, stream, pages):
    """Random but well-formed tiles for a PagedStream-shaped pool."""
    keys = jax.random.split(key, 4)
    payload = jax.random.bits(keys[0], stream.payload.shape, jnp.uint32)
    if stream.spec.format == "int4_rotated":
        scale = jax.random.uniform(keys[1], stream.scale.shape, minval=0.01, maxval=0.1)
        bits = (jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFFFFFFF0)) | jnp.uint32(7)
        return dataclasses.replace(stream, payload=payload, scale=jax.lax.bitcast_convert_type(bits, jnp.float32))
    if stream.spec.format in ("int4", "int2"):
        scale = jax.random.uniform(keys[1], stream.scale.shape, minval=0.01, maxval=0.1).astype(jnp.float16)
        minimum = jax.random.uniform(keys[2], stream.minimum.shape, minval=-0.8, maxval=-0.1).astype(jnp.float16)
        return dataclasses.replace(stream, payload=payload, scale=scale, minimum=minimum)
    scale = jax.random.uniform(keys[1], stream.scale.shape, minval=0.5, maxval=8.0).astype(jnp.float8_e4m3fn)
    global_scale = jax.random.uniform(keys[3], stream.global_scale.shape, minval=1e-3, maxval=2e-3)
    return dataclasses.replace(stream, payload=payload, scale=scale, global_scale=global_scale)


def random_cache(config: CacheConfig, tokens: int, seed: int, *, shared: bool = False) -> paged_cache.PagedKVCache:
    """A cache whose every sequence holds ``tokens`` tokens of random, valid data.

    ``shared``: every sequence holds the same pages (as after ``paged_cache.fork`` of one prompt).
    Every array is made once (the empty cache is only traced), so the peak memory is the cache's own.
    """
    key = jax.random.key(seed)
    cache = jax.eval_shape(lambda: paged_cache.create(config))
    pages_per_sequence = tokens // config.page_size
    key, permutation_key = jax.random.split(key)
    order = jax.random.permutation(permutation_key, config.num_pages).astype(jnp.int32)
    used = order[: config.max_sequences * pages_per_sequence].reshape(config.max_sequences, -1)
    if shared:
        used = jnp.broadcast_to(used[:1], used.shape)
    # Room beyond ``tokens`` (a config for tokens + chunk) stays unallocated: -1 columns, free pages.
    block_tables = jnp.full((config.max_sequences, config.max_pages_per_sequence), -1, jnp.int32)
    block_tables = block_tables.at[:, :pages_per_sequence].set(used)
    page_refs = jnp.zeros((config.num_pages,), jnp.int32).at[used.reshape(-1)].add(1)
    layers = []
    for layer in cache.layers:
        loops = []
        for tiles in layer.loops:
            if tiles.keys is None:  # a predicted loop that stores nothing
                loops.append(tiles)
                continue
            key, k1, k2, k3 = jax.random.split(key, 4)
            keys = random_stream(k1, tiles.keys, config.num_pages)
            values = random_stream(k2, tiles.values, config.num_pages)
            row_positions = None
            if tiles.row_positions is not None:
                heads, pages, rows = tiles.row_positions.shape
                scores = jax.random.uniform(k3, (heads, pages, config.page_size))
                chosen = jnp.sort(jnp.argsort(scores, axis=-1)[..., :rows], axis=-1)
                row_positions = chosen.astype(jnp.int8)
            loops.append(LoopTiles(keys, values, row_positions))
        key, k1, k2, k3, k4 = jax.random.split(key, 5)
        dtype = layer.ring_keys.dtype
        layers.append(dataclasses.replace(
            layer, loops=tuple(loops),
            sink_keys=jax.random.normal(k1, layer.sink_keys.shape, dtype),
            sink_values=jax.random.normal(k2, layer.sink_values.shape, dtype),
            ring_keys=jax.random.normal(k3, layer.ring_keys.shape, dtype),
            ring_values=jax.random.normal(k4, layer.ring_values.shape, dtype),
        ))
    return dataclasses.replace(
        cache, layers=tuple(layers), block_tables=block_tables,
        lengths=jnp.full((config.max_sequences,), tokens, jnp.int32),
        active=jnp.ones((config.max_sequences,), bool),
        page_refs=page_refs,
        error_flags=jnp.zeros((config.max_sequences,), jnp.int32),
        nonfinite_counts=jnp.zeros((config.max_sequences,), jnp.int32),
        saturation_counts=jnp.zeros((config.max_sequences,), jnp.int32),
    )


def kernel_bytes(config: CacheConfig, tokens: int, loop: int) -> int:
    """Bytes one decode call must read for loop ``loop`` (0-based)."""
    visible = tokens + 1
    packed_end = min(visible - config.recent_tokens, (tokens // config.page_size) * config.page_size)
    packed_pages = math.ceil(packed_end / config.page_size)
    per_page = storage.page_bytes(config)
    source = predicted_source(config, loop)[0]  # a predicted loop reads the chain of the loop it is predicted from
    pages = packed_pages * sum(per_page.loops[config.chain_start(source): source + 1])
    windows = (config.sink_tokens + config.window_tokens) * config.num_kv_heads * config.head_dim * 2 * 2
    tables = packed_pages * 4
    return config.max_sequences * (pages + windows + tables)


def median_ms(function, argument_sets, *, calls=20, batches=7) -> float:
    for arguments in argument_sets:
        jax.block_until_ready(function(*arguments))
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = function(*argument_sets[i % len(argument_sets)])
        jax.block_until_ready(out)
        samples.append(1e3 * (time.perf_counter() - start) / calls)
    return statistics.median(samples)


def copies_for(bytes_per_set: int) -> int:
    return max(1, min(6, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))))


def copy_bandwidth() -> float:
    """TB/s of an XLA elementwise pass over 2 GiB of float32 (read + write)."""
    x = jnp.ones((2**29,), jnp.float32)
    step = jax.jit(lambda x: x * jnp.float32(1.0001))
    ms = median_ms(step, [(x,)], calls=10, batches=5)
    return 2 * x.nbytes / (ms * 1e-3) / 1e12


def bf16_inputs(sequences, q_heads, kv_heads, tokens, seed, head_dim=HEAD_DIM):
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (sequences, q_heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (sequences, tokens, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (sequences, tokens, kv_heads, head_dim), jnp.bfloat16)
    return q, k, v


@jax.jit
def cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0]


def pallas_gqa(q, k, v):
    from jax.experimental.pallas.ops.gpu import decode_attention

    return decode_attention.gqa(q, k, v)


def int8_paged_inputs(sequences, q_heads, kv_heads, tokens, seed, page_size=16, head_dim=HEAD_DIM):
    key = jax.random.key(seed)
    k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
    pages = sequences * tokens // page_size
    shape = (kv_heads, pages, page_size, head_dim)
    k_pages = jax.random.randint(k1, shape, -127, 128, jnp.int8)
    v_pages = jax.random.randint(k2, shape, -127, 128, jnp.int8)
    k_scales = jax.random.uniform(k3, shape[:3], minval=0.005, maxval=0.02)
    v_scales = jax.random.uniform(k4, shape[:3], minval=0.005, maxval=0.02)
    tables = jax.random.permutation(k5, pages).astype(jnp.int32).reshape(sequences, -1)
    q = jax.random.normal(k6, (sequences, q_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((sequences,), tokens, jnp.int32)
    return q, k_pages, v_pages, tables, lengths, k_scales, v_scales


def pallas_paged_int8(q, k_pages, v_pages, tables, lengths, k_scales, v_scales):
    from jax.experimental.pallas.ops.gpu import paged_attention

    return paged_attention.paged_attention(
        q, k_pages, v_pages, tables, lengths, k_scales, v_scales,
        pages_per_compute_block=8, k_splits=16,
    )


def dequantize_then_attend(loop):
    """XLA: decode every page of loops 1..r to bfloat16, then cuDNN attention."""

    @jax.jit
    def run(queries, cache):
        c = cache.config
        layer = cache.layers[0]
        pages = cache.block_tables.reshape(-1)
        tiles = tuple(t.take(pages) for t in layer.loops)
        keys, values = unpack_pages(tiles, loop, c.layer(0))
        shape = (c.max_sequences, c.max_pages_per_sequence * c.page_size, c.num_kv_heads, c.head_dim)
        keys = keys.astype(jnp.bfloat16).reshape(shape)
        values = values.astype(jnp.bfloat16).reshape(shape)
        return cudnn_attention(queries.astype(jnp.bfloat16), keys, values)

    return run


def ours(loop, kernel_config=None, implementation="pallas"):
    @jax.jit
    def run(queries, cache):
        return jflashloop.decode_attention(
            queries, cache, 0, loop, include_pending=True, implementation=implementation,
            kernel_config=kernel_config,
        )

    return run


def gluon_reads(queries, cache, loop) -> bool:
    from jflashloop.ops._decode_attention import gluon_unsupported_reason

    return gluon_unsupported_reason(queries, cache, loop) is None


COPY_TB_PER_S = [None]  # the plain-copy bandwidth of this run (main() measures it first)


def row(name, variant, ms, bytes_read, reference_ms=None):
    bandwidth = bytes_read / (ms * 1e-3) / 1e12
    ratio = f"{reference_ms / ms:5.2f}x" if reference_ms else "     "
    copy = COPY_TB_PER_S[0]
    return {"shape": name, "variant": variant, "ms": ms, "tb_per_s": bandwidth, "ratio_vs_cudnn": ratio,
            "percent_of_copy": 100 * bandwidth / copy if copy else None,
            "times_byte_floor": ms / (bytes_read / (copy * 1e12) * 1e3) if copy else None}


def print_row(r):
    copy = f"{r['percent_of_copy']:.0f}%" if r.get("percent_of_copy") is not None else ""
    floor = f"{r['times_byte_floor']:.2f}x" if r.get("times_byte_floor") is not None else ""
    print(f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['tb_per_s']:.2f} | {copy} | {floor} | "
          f"{r['ratio_vs_cudnn']} |", flush=True)


def benchmark_shape(name, sequences, q_heads, kv_heads, tokens, head_dim, args, results):
    seed = 0
    bf16_bytes = 2 * sequences * tokens * kv_heads * head_dim * 2
    sets = [bf16_inputs(sequences, q_heads, kv_heads, tokens, seed + i, head_dim)
            for i in range(copies_for(bf16_bytes))]
    cudnn_ms = median_ms(cudnn_attention, sets)
    results.append(row(name, "cuDNN BF16", cudnn_ms, bf16_bytes, cudnn_ms))
    print_row(results[-1])
    if not args.quick:
        gqa_ms = median_ms(jax.jit(pallas_gqa), sets[:2])
        results.append(row(name, "JAX Pallas gqa BF16", gqa_ms, bf16_bytes, cudnn_ms))
        print_row(results[-1])
    del sets
    if not args.quick:
        int8_bytes = 2 * sequences * tokens * kv_heads * (head_dim + 4)
        int8_sets = [int8_paged_inputs(sequences, q_heads, kv_heads, tokens, seed + i, head_dim=head_dim)
                     for i in range(copies_for(int8_bytes))]
        try:
            int8_ms = median_ms(jax.jit(pallas_paged_int8), int8_sets)
            results.append(row(name, "JAX Pallas paged int8", int8_ms, int8_bytes, cudnn_ms))
        except Exception as error:
            print(f"| {name} | JAX Pallas paged int8 | failed: {type(error).__name__}: {str(error)[:80]} | | |")
        else:
            print_row(results[-1])
        del int8_sets
    loop_counts = [1] if args.quick else [1, 2, 4]
    formats = ["int4"] if args.quick else ["int4", "nvfp4", "int4_rotated"]
    for value_format in formats:
        for loops in loop_counts:
            if value_format != "int4" and loops != 1:
                continue
            config = make_config(sequences, kv_heads, tokens, loops, value_format, head_dim)
            bytes_read = kernel_bytes(config, tokens, loops - 1)
            caches = [random_cache(config, tokens, seed + i) for i in range(copies_for(bytes_read))]
            queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, head_dim), jnp.bfloat16)
            label = f"jflashloop {value_format.upper()} loop {loops}"
            ms = median_ms(ours(loops - 1), [(queries, c) for c in caches])
            results.append(row(name, label + " (Pallas)", ms, bytes_read, cudnn_ms))
            print_row(results[-1])
            if gluon_reads(queries, caches[0], loops - 1):
                ms = median_ms(ours(loops - 1, implementation="gluon"), [(queries, c) for c in caches])
                from jflashloop.ops._decode_attention import gluon_is_default

                default = "default" if gluon_is_default(caches[0].config, loops - 1) else "opt-in"
                results.append(row(name, label + f" (Gluon, {default})", ms, bytes_read, cudnn_ms))
                print_row(results[-1])
            if loops == 1 and value_format == "int4" and not args.quick:
                f32_ms = median_ms(ours(0, KernelConfig(products="float32")), [(queries, c) for c in caches])
                results.append(row(name, label + " (float32 products)", f32_ms, bytes_read, cudnn_ms))
                print_row(results[-1])
            if args.check:
                expected = jflashloop.decode_attention_reference(queries, caches[0], 0, loops - 1)
                actual = ours(loops - 1)(queries, caches[0])
                error = float(jnp.max(jnp.linalg.norm(actual - expected, axis=(1, 2))
                                      / jnp.linalg.norm(expected, axis=(1, 2))))
                print(f"|   check: max relative error vs reference = {error:.2e} |", flush=True)
            if not args.quick and value_format == "int4" and tokens <= 32768:
                baseline_ms = median_ms(dequantize_then_attend(loops - 1), [(queries, c) for c in caches[:1]],
                                        calls=5, batches=3)
                results.append(row(name, f"XLA dequantize + cuDNN, loop {loops}", baseline_ms, bytes_read, cudnn_ms))
                print_row(results[-1])
            del caches


def sweep(args):
    """Launch parameters: one loop at two shapes, then chains at B8 Hq32 Hkv8 T32K."""
    loop_counts = [int(n) for n in args.sweep_loops.split(",")]
    for loops in loop_counts:
        if loops == 1:
            configs = [
                KernelConfig(num_warps=w, num_stages=s) for w in (1, 2, 4) for s in (1, 3, 5)
            ] + [KernelConfig(target_programs=t) for t in (512, 2048)]
            shapes = [SHAPES[1], SHAPES[4]]
        else:
            configs = [KernelConfig(num_warps=w, num_stages=s) for w in (1, 2, 4) for s in (2, 3, 4, 5)]
            shapes = [SHAPES[1]]
        for name, sequences, q_heads, kv_heads, tokens, head_dim in shapes:
            config = make_config(sequences, kv_heads, tokens, loops, head_dim=head_dim)
            bytes_read = kernel_bytes(config, tokens, loops - 1)
            caches = [random_cache(config, tokens, i) for i in range(copies_for(bytes_read))]
            queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, head_dim), jnp.bfloat16)
            for kernel_config in configs:
                try:
                    ms = median_ms(ours(loops - 1, kernel_config), [(queries, c) for c in caches],
                                   calls=10, batches=5)
                except Exception as error:
                    print(f"{name} loops={loops} {kernel_config}: failed {type(error).__name__}: "
                          f"{str(error)[:120]}", flush=True)
                    continue
                print(f"{name} loops={loops} warps={kernel_config.num_warps} "
                      f"stages={kernel_config.num_stages} programs={kernel_config.target_programs}: "
                      f"{ms:.3f} ms {bytes_read / (ms * 1e-3) / 1e12:.2f} TB/s", flush=True)
            del caches


def append_benchmark(results):
    """Packing full pages (quantize-on-write, every loop, all heads of one layer)."""
    for sequences, loops in ((1, 1), (8, 1), (1, 4), (8, 4)):
        config = make_config(sequences, 8, 4096, loops)
        key = jax.random.key(3)
        shape = (loops, sequences, config.page_size, 8, HEAD_DIM)
        keys = jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
        values = jax.random.normal(jax.random.split(key)[0], shape, jnp.float32)
        pack = jax.jit(functools.partial(pack_pages, config=config, implementation="pallas"))
        pages = jnp.arange(sequences, dtype=jnp.int32) + 3
        ms = median_ms(pack, [(keys, values, pages)])
        label = f"pack {sequences} page(s) of 64 tokens x 8 heads, {loops} loop(s)"
        results.append({"shape": "append", "variant": label, "ms": ms, "tb_per_s": 0.0, "ratio_vs_cudnn": ""})
        print(f"| append | {label} | {ms:.3f} | | |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-loops", default="1", help="loop counts to sweep, e.g. 1,2,4")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        print("bench/decode.py needs a CUDA GPU (cuDNN and compiled Triton kernels)", file=sys.stderr)
        return 2
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    if args.sweep:
        sweep(args)
        return 0
    bandwidth = copy_bandwidth()
    COPY_TB_PER_S[0] = bandwidth
    print(f"plain copy (XLA, 2 GiB f32 read + write): {bandwidth:.2f} TB/s", flush=True)
    results = [{"shape": "copy", "variant": "XLA elementwise 2 GiB", "tb_per_s": bandwidth}]
    print("| shape | variant | ms | TB/s read | % of copy | x byte floor | speed-up vs cuDNN BF16 |")
    print("|---|---|---|---|---|---|---|")
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.quick:
        shapes = [SHAPES[1], SHAPES[4]]
    for shape in shapes:
        benchmark_shape(*shape, args, results)
    append_benchmark(results)
    if args.trace:
        _name, sequences, q_heads, kv_heads, tokens, head_dim = SHAPES[1]
        config = make_config(sequences, kv_heads, tokens, 4, head_dim=head_dim)
        cache = random_cache(config, tokens, 0)
        queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, head_dim), jnp.bfloat16)
        functions = {loop: ours(loop) for loop in range(4)}
        for loop in range(4):
            jax.block_until_ready(functions[loop](queries, cache))
        with jax.profiler.trace(args.trace):
            for loop in range(4):
                for _ in range(3):
                    jax.block_until_ready(functions[loop](queries, cache))
        print(f"trace written to {args.trace}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
