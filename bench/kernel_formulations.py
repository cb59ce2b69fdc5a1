"""Decode-kernel formulations side by side (GPU): the decision table of
``bench/KERNEL_NOTES.md``.

Usage:
  python bench/kernel_formulations.py              # time and check every formulation
  python bench/kernel_formulations.py --profile gluon --shape 0   # one call, for ncu
  python bench/kernel_formulations.py --device-time --timeline /tmp/tl --names public
      # 48 calls per jitted function, and the GPU's own time per call from a jax.profiler trace

Formulations (INT4 loop 1, FlashLoop policy, 64-token pages):

* ``pallas``: the shipped Pallas-Triton kernel (whole public call).
* ``triton``: the Gluon kernel's algorithm in plain Triton, called through
  jax_triton (Triton chooses every layout).
* ``gluon``: the Gluon page kernel with explicit operand layouts, called
  through jax_triton; the windows and the merge as in the shipped wrapper.

Each is timed as the whole call and, for the jax_triton ones, as the page
kernel alone (``pages only``). Every whole call is compared with the
reference path on the same cache. Median ms over batches of back-to-back
calls, caches rotated beyond the L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop.ops._decode_attention import kernel_inputs, rotated_inputs, unrotated_output
from jflashloop_triton_kernels import launch as gluon_launch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tools")
import decode as bench
import trace_calls

# Indices 0-8: T32K, B1 T64K, T128K, T4K, head_dim 64, head_dim 256, B16 Hq16 Hkv16 T8K, one layer of the
# Ouro-1.4B-shaped looped model's end-to-end step at batch 8 and 16K tokens (bench/end_to_end.py), and the same
# layer at the capacity view's batch (19 sequences of 32K tokens in 80 GiB).
SHAPES = [bench.SHAPES[1], bench.SHAPES[4], bench.SHAPES[2], bench.SHAPES[0], bench.SHAPES[6], bench.SHAPES[7],
          bench.SHAPES[5], bench.SHAPES[5]._replace(name="B8 Hq16 Hkv16 T16K", sequences=8, tokens=16384),
          bench.SHAPES[5]._replace(name="B19 Hq16 Hkv16 T32K", sequences=19, tokens=32768)]


def formulation(name, loop=0, pages_only=False):
    if name == "pallas":
        return bench.ours(loop)
    if name == "public":  # jflashloop.decode_attention's own choice (the Gluon kernel where it reads the cache)
        return bench.ours(loop, implementation=None)
    from jflashloop_triton_kernels import decode_attention as gluon

    # gluon2-s<stages>[w][-c<chunk>][-p<programs>][-n<pages>][-r<maxnreg>][-k][-m|-mx|-mg][-M<regs>][-f|-x][-l][-o]
    # [-g|-ng][-v|-nv][-P<programs>]:
    # the pipelined kernel, fused windows, token chunk, target programs, least pages per split (the library's 8; twice that
    # where a wave stays full, launch.split_count; -n4 gives the split counts of that rule's absence),
    # register cap, kernel partials only (no merge), merge inside the kernel (-m), by XLA (-mx) or by the
    # Gluon merge kernel (-mg) instead of the library's default,
    # one float16 query (-f) or the precise float16 pair (-x) instead of the default, lazy rescaling (-l),
    # the next page's scores before this page's softmax (-o), registers per round trip of the in-kernel merge (-M),
    # one stage's keys and values copied as two groups (-g; -ng: the plain stage, whatever the library's default),
    # INT4 value codes against probabilities times the value scales (-v; -nv: the values decoded in registers),
    # persistent programs taking the split-KV items in turn (-P<programs>)
    stages, fused, chunk, partials, maxnreg, merge, precise = None, False, None, False, None, None, None
    programs = gluon_launch.TARGET_PROGRAMS
    lazy = merge_registers = None
    overlap = False  # a formulation overlaps pages only with -o (the library's default may)
    stagger = None  # the library's default unless -g / -ng
    scaled_values = None  # the library's default unless -v / -nv
    persistent = None  # one program per item unless -P<programs>
    min_pages = gluon_launch.MIN_PAGES_PER_SPLIT  # the library's default
    if name.startswith("gluon2-s"):
        kernel = "pipelined"
        head, *options = name.removeprefix("gluon2-s").split("-")
        fused, stages = head.endswith("w"), int(head.removesuffix("w"))
        for option in options:
            if option.startswith("c"):
                chunk = int(option[1:])
            elif option.startswith("p"):
                programs = int(option[1:])
            elif option.startswith("r"):
                maxnreg = int(option[1:])
            elif option == "k":
                partials = True
            elif option == "m":
                merge = "kernel"
            elif option == "mx":
                merge = "xla"
            elif option == "mg":
                merge = "gluon"
            elif option == "ng":
                stagger = False
            elif option == "nv":
                scaled_values = False
            elif option == "v":
                scaled_values = True
            elif option.startswith("n"):
                min_pages = int(option[1:])
            elif option == "f":
                precise = False
            elif option == "x":
                precise = True
            elif option == "l":
                lazy = True
            elif option == "o":
                overlap = True
            elif option == "g":
                stagger = True
            elif option.startswith("P"):
                persistent = int(option[1:])
            elif option.startswith("M"):
                merge_registers = int(option[1:])
    elif name == "gluon":
        kernel = "simple"
    else:
        kernel = "triton"

    @jax.jit
    def run(queries, cache):
        c = cache.config
        inputs = kernel_inputs(cache, 0, loop, True)
        queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs)
        out = gluon.paged_decode_attention(
            queries, inputs["block_tables"], inputs["bounds"], inputs["streams"], windows["sink_keys"],
            windows["sink_values"], windows["ring_keys"], windows["ring_values"], state=inputs["state"],
            limits=inputs["limits"], loops=inputs["loops"],
            page_size=c.page_size, sink_tokens=c.sink_tokens, window_loop=window_loop,
            scale=1 / math.sqrt(c.head_dim), pages_only=pages_only, kernel=kernel,
            stages=stages, fused_windows=fused and not pages_only, chunk=chunk, target_programs=programs,
            min_pages_per_split=min_pages,
            partials_only=partials, maxnreg=maxnreg, merge=merge, precise=precise, lazy=lazy,
            overlap=overlap, merge_registers=merge_registers, stagger=stagger, scaled_values=scaled_values,
            persistent_programs=persistent)
        return out if partials else unrotated_output(out, value_seed)

    return run


def use_rotation(kind):
    """Route the fused call's query and output rotations (``jflashloop.ops._decode_attention``; its four
    windows are rotated together in one product of their own, ``_moved_windows``) through ``kind``:
    ``matrix`` (the library's: one float32 product with the rotation matrix, precision HIGHEST),
    ``butterfly`` (the codecs' exact butterflies) or ``reduce`` (the product as a broadcast multiply and
    a sum)."""
    from jflashloop.codecs import _rotated
    from jflashloop.ops import _decode_attention

    if kind == "matrix":
        return

    def apply(x, seed, *, inverse=False):
        if kind == "butterfly":
            return (_rotated.unrotate if inverse else _rotated.rotate)(x, seed)
        return jnp.sum(x[..., :, None] * _rotated.rotation_matrix(seed, x.shape[-1], inverse), axis=-2)

    _decode_attention.rotate_by_product = apply


def device_ms(function, queries, argument_sets, repeats=48):
    """ms per call with Python dispatch out of the way: ``repeats`` calls (distinct queries, rotated
    argument sets) inside one jitted function, median over 5 runs."""
    return device_times(function, queries, argument_sets, repeats)[0]


QUEUED = 8  # executions of the jitted function queued back to back for ``device_times``' second figure


def device_times(function, queries, argument_sets, repeats=48, timeline=None):
    """(ms per call as :func:`device_ms`, ms per call queued, :class:`Timeline` or None).

    The first figure holds each execution's own launch and synchronization (0.4-0.7 ms on the H200,
    spread over the ``repeats`` calls). The second is what a call adds when executions are queued
    without waiting (as a serving loop dispatches its steps): ``(t(QUEUED) - t(1)) / (QUEUED - 1)``
    per execution, medians over 5 runs each, divided by ``repeats``. With ``timeline`` (a directory)
    one more run of the same jitted function under ``jax.profiler`` gives the GPU's own time per call."""
    stack = jnp.stack([queries * (1 + 1e-3 * r) for r in range(repeats)])

    @jax.jit
    def many(stack, sets):
        total = jnp.float32(0)
        for r in range(repeats):
            out = jax.tree.leaves(function(stack[r], *sets[r % len(sets)]))[0]
            total = total + out.reshape(-1)[0].astype(jnp.float32)
        return total

    sets = tuple(tuple(s) for s in argument_sets)
    jax.block_until_ready(many(stack, sets))

    def seconds(executions):
        start = time.perf_counter()
        jax.block_until_ready([many(stack, sets) for _ in range(executions)])
        return time.perf_counter() - start

    single = statistics.median(seconds(1) for _ in range(5))
    queued = statistics.median(seconds(QUEUED) for _ in range(5))
    traced = None if timeline is None else gpu_timeline(lambda: many(stack, sets), timeline, repeats)
    return 1e3 * single / repeats, 1e3 * max(queued - single, 0.0) / (QUEUED - 1) / repeats, traced


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The GPU's kernels per call, us: ``span`` from the first kernel's start to the last one's end
    (divided by the calls), ``busy`` the time some kernel ran, ``kernels`` each kernel name's time."""

    span: float
    busy: float
    count: float
    kernels: tuple[tuple[str, float], ...]

    @property
    def largest(self) -> float:
        return max((t for _, t in self.kernels), default=0.0)

    def __str__(self):
        parts = ", ".join(f"{name[:40]} {t:.1f}" for name, t in self.kernels if t >= 0.05)
        return (f"{self.span:.1f} us span, {self.busy:.1f} us busy, {self.count:.1f} kernels per call; "
                f"us per call: {parts}")


def gpu_timeline(call, directory, repeats):
    """One run of ``call`` under ``jax.profiler``: the GPU's kernels per call (of ``repeats``) as a
    :class:`Timeline`, or None where the trace holds no GPU kernels."""
    import pathlib
    import tempfile

    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    directory = pathlib.Path(tempfile.mkdtemp(dir=directory))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level, options.host_tracer_level = 0, 0
    jax.profiler.start_trace(str(directory), profiler_options=options)
    try:
        jax.block_until_ready(call())
    finally:
        jax.profiler.stop_trace()
    traces = sorted(directory.rglob("*.xplane.pb"))
    return timeline_of(traces[-1], repeats) if traces else None


def timeline_of(trace, repeats):
    """:class:`Timeline` of an ``.xplane.pb`` trace holding ``repeats`` calls; None without GPU kernels."""
    kernels = trace_calls.gpu_kernels(trace)
    if not kernels:
        return None
    busy, reach, per_name = 0.0, kernels[0][0], {}
    for start, end, name in kernels:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
        per_name[name] = per_name.get(name, 0.0) + end - start
    span = max(end for _, end, _ in kernels) - kernels[0][0]
    ranked = tuple(sorted(((name, total / repeats) for name, total in per_name.items()), key=lambda item: -item[1]))
    return Timeline(span / repeats, busy / repeats, len(kernels) / repeats, ranked)


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.linalg.norm(actual - expected, axis=(1, 2)) / np.linalg.norm(expected, axis=(1, 2))))


def cuda_runtime():
    """The CUDA runtime library already loaded by jax's plugin (for cudaProfilerStart/Stop)."""
    import ctypes
    import glob
    import site

    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    for folder in site.getsitepackages():
        names += sorted(glob.glob(f"{folder}/nvidia/cu*/lib/libcudart.so*"))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no CUDA runtime library found")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=None, help="run these formulations once each, page kernel only (for ncu), and exit")
    parser.add_argument("--whole", action="store_true",
                        help="with --profile: whole calls, profiled between cudaProfilerStart and Stop "
                             "(ncu --profile-from-start off)")
    parser.add_argument("--shape", type=int, default=0)
    parser.add_argument("--shapes", default="0,1")
    parser.add_argument("--names", default="pallas,triton,gluon,gluon2-s2,gluon2-s2w")
    parser.add_argument("--value-format", default="int4", help="int4, nvfp4 or int4_rotated (every stream)")
    parser.add_argument("--direct-loop", action="store_true",
                        help="loop 2 stored on its own, not as a residual (CacheConfig.flashloop(direct_loop=True)); "
                             "loop 1 reads the base stream either way")
    parser.add_argument("--loops", type=int, default=1, help="loop of the FlashLoop chain to read (1-4)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens a page of the cache (16-128)")
    parser.add_argument("--predicted", action="store_true",
                        help="loops 3-4 predicted from the loop before with no rows (CacheConfig.predicted_loops: "
                             "loop 2 direct; stand-in maps); the public call only (it moves the query and windows)")
    parser.add_argument("--rows", default=None,
                        help="the sparse loops' rows as FORMAT:R3/R4 (FORMAT int4 or int2, affine, grouped like the "
                             "dense values), e.g. int2:24/10; default: the policy's (INT4 16/7)")
    parser.add_argument("--shared", action="store_true",
                        help="every sequence reads the same pages (a forked prompt); bytes counted per sequence")
    parser.add_argument("--device-time", action="store_true",
                        help="time calls inside one jitted function (no Python dispatch per call)")
    parser.add_argument("--repeats", type=int, default=48,
                        help="calls per jitted function with --device-time (the function's own launch and "
                             "synchronization, 0.4-0.5 ms on the H200, are shared by them: 48 calls leave "
                             "about 10 us of it in each, 12 calls 35-40 us)")
    parser.add_argument("--timeline", default=None,
                        help="with --device-time: a directory for one profiled run per row; the GPU's time per "
                             "call (first kernel's start to last one's end, without the jitted function's own "
                             "launch), its ratio to cuDNN's and the largest kernel's time as columns, each "
                             "kernel's time under the row")
    parser.add_argument("--rotation", default="matrix", choices=("matrix", "butterfly", "reduce"),
                        help="how int4_rotated's query and output are rotated around the kernel "
                             "(use_rotation)")
    args = parser.parse_args()
    args.direct_loop = args.direct_loop and args.loops > 1  # loop 1 reads the base stream either way
    row_options = {}
    if args.rows:
        row_format, _, counts = args.rows.partition(":")
        row_options = dict(row_format=row_format,
                           row_counts=tuple(int(c) for c in counts.split("/")) if counts else None)
    use_rotation(args.rotation)
    if jax.default_backend() != "gpu":
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        name, sequences, q_heads, kv_heads, tokens, head_dim = SHAPES[args.shape]
        config = bench.make_config(sequences, kv_heads, tokens, args.loops, args.value_format, head_dim=head_dim,
                                   direct_loop=args.direct_loop, predicted=args.predicted, page_size=args.page_size,
                                   **row_options)
        cache = bench.random_cache(config, tokens, 0)
        queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, head_dim), jnp.bfloat16)
        if args.whole:  # every kernel of one whole call each, between cudaProfilerStart/Stop
            runs = [formulation(profiled, loop=args.loops - 1) for profiled in args.profile.split(",")]
            for run in runs:  # compiled and warm outside the profiled range
                jax.block_until_ready(run(queries, cache))
            runtime = cuda_runtime()
            for run in runs:
                runtime.cudaProfilerStart()
                jax.block_until_ready(run(queries, cache))
                runtime.cudaProfilerStop()
            return 0
        for profiled in args.profile.split(","):  # one launch each: ncu --launch-count <number of names>
            jax.block_until_ready(formulation(profiled, loop=args.loops - 1, pages_only=True)(queries, cache))
        return 0
    bandwidth = bench.copy_bandwidth()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; plain copy {bandwidth:.2f} TB/s; "
          f"{args.value_format} loop {args.loops}{', loop 2 direct' if args.direct_loop else ''}"
          f"{', loops 3-4 predicted' if args.predicted else ''}"
          f"{f', rows {args.rows}' if args.rows else ''}{'; every sequence on the same pages' if args.shared else ''}"
          f"{f'; {args.repeats} calls per jitted function' if args.device_time else ''}", flush=True)
    spans = args.device_time and args.timeline is not None
    queues = args.device_time
    print("| shape | formulation | ms | TB/s on bytes read | % of copy | x cuDNN BF16 | max rel. error |"
          + (f" ms queued ({QUEUED}) | % of copy (queued) | x cuDNN (queued) |" if queues else "")
          + (" GPU us per call | % of copy (GPU) | x cuDNN (GPU) | largest kernel us |" if spans else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if queues else "") + ("---|---|---|---|" if spans else ""))

    def queued_columns(queued, read, reference):
        if not queues:
            return ""
        return (f" {queued:.3f} | {100 * read / queued / 1e9 / bandwidth:.0f}% | "
                f"{reference / queued:.2f}x |") if queued > 0 else " | | |"

    def gpu_columns(traced, read, reference=None):
        if not spans:
            return ""
        if traced is None:
            return " | | | |"
        ratio = f"{reference.span / traced.span:.2f}x" if reference is not None else "1.00x"
        return (f" {traced.span:.1f} | {100 * read / traced.span / 1e6 / bandwidth:.0f}% | {ratio} | "
                f"{traced.largest:.1f} |")

    for index in (int(i) for i in args.shapes.split(",")):
        name, sequences, q_heads, kv_heads, tokens, head_dim = SHAPES[index]
        bf16_bytes = 2 * sequences * tokens * kv_heads * head_dim * 2
        sets = [bench.bf16_inputs(sequences, q_heads, kv_heads, tokens, i, head_dim)
                for i in range(bench.copies_for(bf16_bytes))]
        cudnn_trace = None
        if args.device_time:
            cudnn_ms, cudnn_queued, cudnn_trace = device_times(lambda q, k, v: bench.cudnn_attention(q, k, v), sets[0][0],
                                                 [s[1:] for s in sets], args.repeats, args.timeline)
        else:
            cudnn_ms, cudnn_queued = bench.median_ms(bench.cudnn_attention, sets), 0.0
        del sets
        if cudnn_trace is not None:
            print(f"    timeline: {cudnn_trace}", flush=True)
        print(f"| {name} | cuDNN BF16 | {cudnn_ms:.3f} | {bf16_bytes / cudnn_ms / 1e9:.2f} | "
              f"{100 * bf16_bytes / cudnn_ms / 1e9 / bandwidth:.0f}% | 1.00x | |"
              f"{queued_columns(cudnn_queued, bf16_bytes, cudnn_queued)}{gpu_columns(cudnn_trace, bf16_bytes)}",
              flush=True)
        loop = args.loops - 1
        config = bench.make_config(sequences, kv_heads, tokens, args.loops, args.value_format, head_dim=head_dim,
                                   direct_loop=args.direct_loop, predicted=args.predicted, page_size=args.page_size,
                                   **row_options)
        bytes_read = bench.kernel_bytes(config, tokens, loop)
        caches = [bench.random_cache(config, tokens, i, shared=args.shared)
                  for i in range(bench.copies_for(bytes_read))]
        queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, head_dim), jnp.bfloat16)
        expected = jflashloop.decode_attention_reference(queries, caches[0], 0, loop)
        for fname in args.names.split(","):
            variants = [(fname, False)] + ([(fname + " (pages only)", True)] if fname in ("triton", "gluon") else [])
            for label, pages_only in variants:
                try:
                    run = formulation(fname, loop=loop, pages_only=pages_only)
                    traced = None
                    if args.device_time:
                        ms, queued, traced = device_times(run, queries, [(c,) for c in caches], args.repeats, args.timeline)
                    else:
                        ms, queued = bench.median_ms(run, [(queries, c) for c in caches]), 0.0
                    error = "" if pages_only or fname.endswith("-k") else (
                        f"{relative_error(run(queries, caches[0]), expected):.2e}")
                except Exception as failure:  # report and go on: one broken variant must not hide the rest
                    print(f"| {name} | {label} | failed: {type(failure).__name__}: {str(failure)[:300]} |", flush=True)
                    continue
                tb = bytes_read / ms / 1e9
                if traced is not None:
                    print(f"    timeline: {traced}", flush=True)
                print(f"| {name} | {label} | {ms:.3f} | {tb:.2f} | {100 * tb / bandwidth:.0f}% | "
                      f"{cudnn_ms / ms:.2f}x | {error} |{queued_columns(queued, bytes_read, cudnn_queued)}"
                      f"{gpu_columns(traced, bytes_read, cudnn_trace)}", flush=True)
        floor = bytes_read / bandwidth / 1e9
        print(f"| {name} | byte floor ({bytes_read / 1e6:.0f} MB at the copy bandwidth) | {floor:.3f} | | | "
              f"{cudnn_ms / floor:.2f}x | |" + (f" {floor:.3f} | | {cudnn_queued / floor:.2f}x |" if queues else "")
              + (f" {1e3 * floor:.1f} | | | |" if spans else ""), flush=True)
        del caches
    return 0


if __name__ == "__main__":
    sys.exit(main())
