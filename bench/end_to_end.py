"""End-to-end decode: a whole model stepping over a jflashloop cache against BF16 caches, in one run.

What is measured (all in one process, on one device):

* **Decode throughput.** Tokens per second of a jitted decode step
  (``jflashloop.models.serving_loop.generate``: every layer writes its K/V
  with ``write_token`` and attends with ``jflashloop.decode_attention``, one
  ``commit`` per step, greedy sampling on the device, the state donated, no
  host round trip between tokens) at batch 1, 8, 32, 64 and context 4K, 16K,
  32K, for two models:

  - SmolLM2-135M's exact shapes (30 layers, hidden 576, 9 query heads, 3 KV
    heads, head_dim 64, vocab 49152) with **random weights** (bfloat16, products
    summed in float32; `--float32-weights` for float32) (a decode step's
    speed depends on the shapes only; the real weights' tokens are checked
    against the reference decoding path on the CPU, tests/test_end_to_end.py),
    over a one-loop INT4 cache, against one BF16 cache read by cuDNN's flash
    attention;
  - an Ouro-1.4B-shaped looped model (24 layers x 4 loops, hidden 2048, 16
    heads, 16 KV heads, head_dim 128; **random weights**, bfloat16) over the
    cross-loop cache (FlashLoop policy), against four BF16 caches (one per
    loop) read by cuDNN.

  Each timed call decodes ``--steps`` tokens (64 by default: one page, so
  every call packs one page per sequence) in one ``lax.scan``; tokens/s is
  ``batch / (median call time / steps)`` over ``--repeats`` calls after one
  warm-up call, each call ended by ``jax.block_until_ready``. Compile time
  (lowering + XLA compile) is reported apart. Caches are filled directly at
  the context length with random, finite data (no prefill through the model):
  the speed does not depend on the values. The BF16 caches are sized to the
  context (rounded up to 128 slots for cuDNN); the jflashloop pool holds the
  context plus the decoded tokens. A configuration whose cache, weights and
  a working margin exceed the device memory is reported as "does not fit"
  (computed before anything is allocated).

* **Capacity.** In a fixed KV budget (``--kv-budget-gib``, 80 GiB), how many
  sequences of ``--capacity-context`` tokens (32K) fit with each cache
  (``jflashloop.storage`` byte accounting, windows included; BF16: every
  loop's K and V), and the tokens/s of the step at that batch (capped at
  ``--max-capacity-batch``, and by the device memory; the table says so).

* **Where a step's time goes.** At one shape per model (Ouro batch 8 and
  SmolLM2 batch 32, context 16K), the step is timed twice more with a cheap
  stand-in of the same shapes: *without attention* (the hook writes and
  commits, and returns the query as its output) and *without append* (the
  hook attends over the cache as it is, and writes and commits nothing).
  Attention share = (full - without attention) / full, append share = (full
  - without append) / full, the rest (projections, MLP, norms, sampling) is
  what remains.

* **Trace.** A ``jax.profiler`` trace of one decode step of each (model,
  cache) at those shapes, packed as ``<--trace>.tar.gz`` (open it in
  TensorBoard's profile plugin or Perfetto).

Outputs: a markdown report (``--out``, default bench/E2E.md: a table per
model, the capacity table, the breakdown, the command line, the device and
the jax version), a PNG plot of tokens/s against context per cache
(``--plot``; needs matplotlib), progress on stderr (tqdm if installed) and
one line per measurement on stdout. The report is rewritten after every
measurement, so a run stopped early keeps what it measured; the work runs in
priority order (the issue's target shapes where the grid or the breakdown is
asked for, capacity, breakdown, trace, then the rest of the grid) and stops
starting new work after ``--time-budget`` seconds.

Usage:
  python bench/end_to_end.py --out bench/E2E.md --plot e2e.png --trace /tmp/trace   # GPU, ~8 min
  python bench/end_to_end.py --quick --out /tmp/E2E.md                              # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import math
import os
import pathlib
import re
import shlex
import shutil
import statistics
import sys
import tarfile
import time
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import decode as decode_bench

from jflashloop import CacheConfig, decode_attention, paged_cache, storage
from jflashloop.apps import progress
from jflashloop.models import cache_hooks, dense_layer_cache, gguf_loader, llama, ouro
from jflashloop.models import serving_loop as loop
from jflashloop.ops import _dispatch

GIB = 2**30
CACHES = ("bf16", "jflashloop")
CACHE_LABELS = {"bf16": "BF16", "jflashloop": "jflashloop INT4"}
VARIANTS = ("full", "no_attention", "no_append")


# --------------------------------------------------------------------------- the two models


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the run: its shapes, weights and the caches it is measured with."""

    name: str  # "smollm2" or "ouro"
    title: str
    config: llama.LlamaConfig | ouro.OuroConfig
    looped: bool
    focus: tuple[int, int]  # (batch, context) of the target, the breakdown and the trace
    weight_dtype: Any = jnp.bfloat16  # the Llama model's weights (the looped model's are bfloat16)
    direct_loop: bool = False  # the looped model's loop 2 stored on its own (CacheConfig.flashloop(direct_loop=True))
    compact: bool = False  # the looped model's cache as CacheConfig.compact_loops (affine INT2 rows 24/10)
    predicted: bool = False  # the looped model's cache as CacheConfig.predicted_loops (random near-identity maps)

    @property
    def layers(self) -> int:
        return self.config.layers if self.looped else self.config.num_layers

    @property
    def loops(self) -> int:
        return self.config.loops if self.looped else 1

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads if self.looped else self.config.num_key_value_heads

    @property
    def q_heads(self) -> int:
        return self.config.heads if self.looped else self.config.num_query_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def params(self, seed: int):
        """Random weights: bfloat16 (products in bfloat16 with float32 sums), or float32 for the
        Llama model with ``--float32-weights``."""
        key = jax.random.key(seed)
        if not self.looped:
            return llama.init_params(self.config, key, self.weight_dtype)
        params = ouro.init_params(self.config, key)
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)

    def param_bytes(self) -> int:
        shapes = jax.eval_shape(lambda: self.params(0))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    def paged_config(self, batch: int, tokens: int) -> CacheConfig:
        """The jflashloop cache for ``batch`` sequences of up to ``tokens`` tokens."""
        pages = math.ceil(tokens / 64)
        common = dict(num_layers=self.layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                      num_pages=batch * pages, max_sequences=batch, max_pages_per_sequence=pages)
        if self.looped and self.compact:
            return CacheConfig.compact_loops(num_loops=self.loops, **common)
        if self.looped and self.predicted and self.loops > 2:  # (with two loops there is nothing to predict)
            return CacheConfig.predicted_loops(predictions=decode_bench.stand_in_predictions(self.layers, self.loops - 2,
                                                                                self.kv_heads, self.head_dim),
                                               **common)
        if self.looped:
            return CacheConfig.flashloop(num_loops=self.loops, direct_loop=self.direct_loop or self.predicted,
                                         **common)
        return CacheConfig(**common)  # INT4: K per channel, V per token, groups of 64, 4 sink + 16 recent tokens

    def bf16_bytes_per_token(self) -> int:
        return self.layers * self.loops * 2 * self.kv_heads * self.head_dim * 2


def models(quick: bool) -> dict[str, Model]:
    if quick:
        tiny_llama = llama.LlamaConfig(num_layers=1, hidden_size=64, intermediate_size=128, num_query_heads=4,
                                       num_key_value_heads=2, head_dim=32, vocab_size=97)
        tiny_ouro = ouro.OuroConfig(vocab_size=97, hidden=64, layers=1, heads=2, kv_heads=2, head_dim=32,
                                    mlp_hidden=128, loops=2)
        return {
            "smollm2": Model("smollm2", "tiny Llama (1 layer; --quick)", tiny_llama, False, (2, 120)),
            "ouro": Model("ouro", "tiny looped model (1 layer x 2 loops; --quick)", tiny_ouro, True, (2, 120)),
        }
    return {
        "smollm2": Model("smollm2", "SmolLM2-135M shapes, random weights (30 layers, hidden 576, 9 q / 3 KV "
                         "heads, head_dim 64)", gguf_loader.SMOLLM2_135M, False, (32, 16384)),
        "ouro": Model("ouro", "Ouro-1.4B shapes, random weights (24 layers x 4 loops, hidden 2048, 16 heads, "
                      "16 KV heads, head_dim 128)", ouro.OuroConfig.ouro_1_4b(), True, (8, 16384)),
    }


# --------------------------------------------------------------------------- hooks (the stand-ins included)


@functools.cache
def paged_hook(layers: int, loops: int, variant: str):
    """A looped-signature hook over the paged cache; ``variant`` replaces attention or append by a stand-in."""
    if variant == "full":
        return cache_hooks.looped_paged_attention_hook(layers, loops, commit=False)

    def hook(loop_index, layer_index, queries, new_keys, new_values, cache):
        if variant == "no_append":
            return decode_attention(queries, cache, layer_index, loop_index), cache
        cache = paged_cache.write_token(cache, layer_index, loop_index, new_keys, new_values)
        return queries.astype(jnp.float32), cache  # no_attention: the query stands in for the output

    return hook


@functools.cache
def dense_hook(variant: str, implementation: str | None):
    """A looped-signature hook over :class:`DenseLayerKVCache`; stand-ins as for :func:`paged_hook`."""
    if variant == "full":
        return dense_layer_cache.looped_dense_attention_hook(implementation)

    def hook(loop_index, layer_index, queries, new_keys, new_values, cache):
        if variant == "no_append":
            out = dense_layer_cache.attend(queries, cache.keys[loop_index][layer_index],
                                           cache.values[loop_index][layer_index],
                                           jnp.minimum(cache.lengths + 1, cache.max_tokens),
                                           implementation=implementation)
            return out, cache
        cache = dense_layer_cache.write_token(cache, loop_index, layer_index, new_keys, new_values)
        return queries.astype(jnp.float32), cache  # no_attention: the query stands in for the output

    return hook


@functools.cache
def one_loop(hook):
    """The one-loop signature ``(layer, q, k, v, cache)`` of a looped-signature hook."""
    return lambda layer_index, *arguments: hook(0, layer_index, *arguments)


def decoder_for(model: Model, cache: str, variant: str, implementation: str | None):
    if cache == "jflashloop":
        hook = paged_hook(model.layers, model.loops, variant)
        commit = cache_hooks.commit_pending if variant != "no_append" else None
    else:
        hook, commit = dense_hook(variant, implementation), None
    if model.looped:
        return loop.OuroDecoder(model.config, hook, None, commit)
    return loop.LlamaDecoder(model.config, one_loop(hook), commit)


# --------------------------------------------------------------------------- caches at a fill level


def capacity_tokens(context: int, args) -> int:
    """Slots a cache needs: the context plus every token the warm-up and timed calls decode."""
    return context + args.steps * (args.repeats + 1) + 1


def cache_bytes(model: Model, cache: str, batch: int, context: int, args) -> int:
    """Bytes the cache allocates (exact, from its shapes)."""
    tokens = capacity_tokens(context, args)
    if cache == "bf16":
        slots = dense_layer_cache.padded_capacity(tokens)
        return batch * slots * model.bf16_bytes_per_token()
    shapes = jax.eval_shape(lambda: paged_cache.create(model.paged_config(batch, tokens)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def filled_cache(model: Model, cache: str, batch: int, context: int, args, seed: int):
    """A cache whose every sequence holds ``context`` tokens of random, finite data."""
    tokens = capacity_tokens(context, args)
    if cache == "jflashloop":
        return decode_bench.random_cache(model.paged_config(batch, tokens), context, seed)
    shape = (batch, dense_layer_cache.padded_capacity(tokens), model.kv_heads, model.head_dim)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * model.loops * model.layers))

    def arrays():
        return tuple(tuple(jax.random.normal(next(keys), shape, jnp.bfloat16) for _ in range(model.layers))
                     for _ in range(model.loops))

    return dense_layer_cache.DenseLayerKVCache(keys=arrays(), values=arrays(),
                                               lengths=jnp.full((batch,), context, jnp.int32))


def start_state(model: Model, cache, batch: int, context: int) -> loop.DecodeState:
    vocab = model.config.vocab_size
    tokens = jax.random.randint(jax.random.key(batch), (batch,), 0, vocab, jnp.int32)
    return loop.DecodeState.start(tokens, jnp.full((batch,), context, jnp.int32), cache)


# --------------------------------------------------------------------------- one measurement


@dataclasses.dataclass
class Row:
    model: str
    cache: str
    batch: int
    context: int
    part: str  # "grid", "capacity", "breakdown"
    variant: str = "full"
    kv_bytes: int = 0
    ms_per_step: float | None = None
    compile_s: float | None = None
    attention: str = ""
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.ms_per_step is None else self.batch / (self.ms_per_step * 1e-3)


def device_memory_bytes(args) -> int:
    if args.memory_gib is not None:
        return int(args.memory_gib * GIB)
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 16 * GIB))


def fits(model: Model, cache: str, batch: int, context: int, args, params_bytes: int) -> tuple[bool, int, str]:
    """Whether the cache, the weights and a working margin fit in the device memory; (fits, cache bytes, why)."""
    kv = cache_bytes(model, cache, batch, context, args)
    margin = 2 * GIB + kv // 20
    need, have = kv + params_bytes + margin, device_memory_bytes(args)
    if need > have:
        return False, kv, (f"does not fit: cache {kv / GIB:.1f} GiB + weights {params_bytes / GIB:.1f} GiB + "
                           f"margin {margin / GIB:.1f} GiB > {have / GIB:.1f} GiB")
    return True, kv, ""


def attention_label(model: Model, cache: str, implementation: str | None) -> str:
    if cache == "bf16":
        if not _dispatch.on_gpu():
            return "XLA attention (no GPU)"
        return {"cudnn": "cuDNN flash attention", "xla": "XLA attention (cuDNN refused)"}[implementation]
    if not _dispatch.on_gpu():
        return "reference path (no GPU)"
    from jflashloop.ops._decode_attention import gluon_unsupported_reason

    config = model.paged_config(1, 64)
    queries = jax.ShapeDtypeStruct((1, model.q_heads, model.head_dim), jnp.float32)
    reasons = {gluon_unsupported_reason(queries, paged_cache.create(config), loop, 0) for loop in range(model.loops)}
    reasons.discard(None)
    return "Gluon kernel" if not reasons else f"Pallas kernel (Gluon: {sorted(reasons)[0][:60]})"


def pool_copies(compiled, state) -> int:
    """Copies in the compiled step of arrays shaped like the cache's largest leaves (each would cost a pass)."""
    leaves = jax.tree.leaves(state.cache)
    largest = max(x.size * x.dtype.itemsize for x in leaves)
    shapes = {f"[{','.join(map(str, x.shape))}]" for x in leaves if x.size * x.dtype.itemsize * 4 >= largest}
    try:
        text = compiled.as_text()
    except Exception:
        return 0
    count = 0
    for line in text.splitlines():
        match = re.search(r"= \w+(\[[\d,]*\])\S* copy\(", line)
        if match and match.group(1) in shapes:
            count += 1
    return count


class Runner:
    """Compiles and times decode steps; keeps the run's rows and its time budget."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.params = {}
        self.params_bytes = {}
        self.implementation = {}  # model name -> the BF16 baseline's attention implementation
        self.compiled = {}  # (decoder, steps, the state's shapes) -> (compiled step, compile seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.time_budget

    def weights(self, model: Model):
        if model.name not in self.params:
            for name in list(self.params):  # one model's weights (and compiled steps) at a time
                del self.params[name]
            self.compiled.clear()
            gc.collect()
            self.params[model.name] = model.params(self.args.seed)
            self.params_bytes[model.name] = sum(x.nbytes for x in jax.tree.leaves(self.params[model.name]))
        return self.params[model.name]

    def compile(self, model: Model, cache: str, variant: str, state, steps: int):
        """``(compiled, seconds, implementation)``; the BF16 baseline tries cuDNN first, then XLA's attention."""
        params = self.weights(model)
        choices = [None]
        if cache == "bf16":
            known = self.implementation.get(model.name)
            choices = [known] if known else (["cudnn", "xla"] if _dispatch.on_gpu() else ["xla"])
        error = None
        signature = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        for implementation in choices:
            decoder = decoder_for(model, cache, variant, implementation)
            key = (decoder, steps, jax.tree.structure(state), tuple(jax.tree.leaves(signature)))
            if key in self.compiled:
                return (*self.compiled[key], implementation)
            begin = time.perf_counter()
            try:
                compiled = loop.generate.lower(params, state, decoder=decoder, steps=steps).compile()
            except Exception as failure:
                error = failure
                print(f"    {implementation} attention failed to compile: {type(failure).__name__}: "
                      f"{str(failure)[:200]}", flush=True)
                continue
            if cache == "bf16":
                self.implementation[model.name] = implementation
            self.compiled[key] = (compiled, time.perf_counter() - begin)
            return compiled, self.compiled[key][1], implementation
        raise error

    def measure(self, model: Model, cache: str, batch: int, context: int, *, part: str,
                variant: str = "full") -> Row:
        args = self.args
        row = Row(model.name, cache, batch, context, part, variant)
        params = self.weights(model)
        ok, row.kv_bytes, why = fits(model, cache, batch, context, args, self.params_bytes[model.name])
        if not ok:
            row.note = why
            return row
        state = start_state(model, filled_cache(model, cache, batch, context, args, args.seed + batch), batch,
                            context)
        try:
            compiled, row.compile_s, implementation = self.compile(model, cache, variant, state, args.steps)
            row.attention = attention_label(model, cache, implementation)
            copies = pool_copies(compiled, state)
            note = (f"{model.name} {cache} B{batch} T{context} {variant}: the compiled step copies {copies} "
                    "cache-sized arrays (each costs a pass over them)")
            if copies and note not in self.notes:
                self.notes.append(note)
            state, tokens = compiled(params, state)  # warm-up
            jax.block_until_ready(tokens)
            samples = []
            for _ in range(args.repeats):
                begin = time.perf_counter()
                state, tokens = compiled(params, state)
                jax.block_until_ready(tokens)
                samples.append(time.perf_counter() - begin)
            row.ms_per_step = 1e3 * statistics.median(samples) / args.steps
            if cache == "jflashloop":
                flags = int(jnp.max(state.cache.error_flags))
                if flags & ~paged_cache.ERROR_SATURATED:
                    row.note = f"cache error flags {flags}"
        except Exception as failure:
            row.note = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
        finally:
            del state
            gc.collect()
        return row

    def trace(self, model: Model, cache: str, directory: pathlib.Path) -> str:
        """One decode step of (model, cache) at the model's focus shape under ``jax.profiler``."""
        batch, context = model.focus
        params = self.weights(model)
        ok, _, why = fits(model, cache, batch, context, self.args, self.params_bytes[model.name])
        if not ok:
            return why
        state = start_state(model, filled_cache(model, cache, batch, context, self.args, 1), batch, context)
        try:
            compiled, _, _ = self.compile(model, cache, "full", state, self.args.trace_steps)
            state, tokens = compiled(params, state)
            jax.block_until_ready(tokens)
            jax.profiler.start_trace(str(directory / f"{model.name}_{cache}"), profiler_options=trace_options())
            try:
                state, tokens = compiled(params, state)
                jax.block_until_ready(tokens)
            finally:
                jax.profiler.stop_trace()
        finally:
            del state
            gc.collect()
        return "traced"


def trace_options():
    """Device and host activity only: no Python call stacks, no copy of the (large, unrolled) HLO."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    options.enable_hlo_proto = False
    return options


# --------------------------------------------------------------------------- the plan and the report


def plan(args, all_models: dict[str, Model]) -> list[tuple]:
    """The run's work in priority order: ``(kind, model, cache, batch, context[, variant])``."""
    chosen = [all_models[name] for name in args.models]
    work = []
    if {"grid", "breakdown"} & set(args.parts):  # the issue's target shapes first (the breakdown's full step)
        for model in chosen:
            for cache in CACHES:
                work.append(("grid", model, cache, *model.focus))
    if "capacity" in args.parts:
        for model in chosen:
            for cache in CACHES:
                work.append(("capacity", model, cache, None, args.capacity_context))
    if "breakdown" in args.parts:
        for model in chosen:
            for cache in CACHES:
                for variant in VARIANTS[1:]:
                    work.append(("breakdown", model, cache, *model.focus, variant))
    if "trace" in args.parts and args.trace:
        for model in chosen:
            for cache in CACHES:
                work.append(("trace", model, cache, *model.focus))
    if "grid" in args.parts:
        for model in chosen:
            for batch in args.batches:
                for context in args.contexts:
                    for cache in CACHES:
                        if (batch, context) != model.focus:
                            work.append(("grid", model, cache, batch, context))
    return work


def capacity_sequences(model: Model, cache: str, args) -> tuple[int, int]:
    """``(bytes per sequence, sequences)`` of ``--capacity-context`` tokens in ``--kv-budget-gib``."""
    context = args.capacity_context
    if cache == "bf16":
        per_sequence = context * model.bf16_bytes_per_token()
    else:
        per_sequence = storage.sequence_bytes(model.paged_config(1, context), context)
    return per_sequence, int(args.kv_budget_gib * GIB // per_sequence)


def fmt(value, pattern: str, empty: str = "") -> str:
    return empty if value is None else format(value, pattern)


def find(rows: list[Row], **where) -> Row | None:
    for row in rows:
        if all(getattr(row, key) == value for key, value in where.items()):
            return row
    return None


def report(runner: Runner, all_models: dict[str, Model], command: str) -> str:
    args, rows = runner.args, runner.rows
    device = jax.devices()[0]
    lines = [
        "# End-to-end decode: jflashloop caches against BF16 caches",
        "",
        f"Command: `{command}`  ",
        f"Device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"{runner.elapsed():.0f} s of run time.",
        "",
        "Weights are random (the models' exact shapes; a decode step's speed depends on the shapes only). "
        f"Each timed call decodes {args.steps} tokens in one compiled scan (model, cache update, greedy "
        f"sampling on the device, the state donated); ms/step is the median call time over {args.repeats} calls "
        "after one warm-up call, divided by the steps; tokens/s = batch / step time. Caches are filled "
        "with random data at the context length. KV GiB: the cache's allocated bytes. Compile: lowering + "
        "XLA compile of the scan, once per (batch, context).",
        "",
    ]
    for name in args.models:
        model = all_models[name]
        lines += [f"## {model.title}", "",
                  "| batch | context | cache | KV GiB | ms/step | tokens/s | vs BF16 | compile s | attention | note |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        grid = sorted((r for r in rows if r.model == name and r.part == "grid"),
                      key=lambda r: (r.batch, r.context, r.cache))
        for row in grid:
            baseline = find(rows, model=name, part="grid", batch=row.batch, context=row.context, cache="bf16")
            ratio = ""
            if row.cache != "bf16" and baseline and baseline.tokens_per_s and row.tokens_per_s:
                ratio = f"{row.tokens_per_s / baseline.tokens_per_s:.2f}x"
            lines.append(f"| {row.batch} | {row.context:,} | {CACHE_LABELS[row.cache]} | {row.kv_bytes / GIB:.2f} | "
                         f"{fmt(row.ms_per_step, '.3f')} | {fmt(row.tokens_per_s, ',.0f')} | {ratio} | "
                         f"{fmt(row.compile_s, '.1f')} | {row.attention} | {row.note} |")
        lines.append("")
    lines += [f"## Capacity: sequences of {args.capacity_context:,} tokens in {args.kv_budget_gib:g} GiB of KV", "",
              "| model | cache | KV bytes per sequence | sequences that fit | batch run | ms/step | tokens/s | "
              "vs BF16 | note |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        model = all_models[name]
        for cache in CACHES:
            per_sequence, sequences = capacity_sequences(model, cache, args)
            row = find(rows, model=name, part="capacity", cache=cache)
            baseline = find(rows, model=name, part="capacity", cache="bf16")
            ratio = ""
            if cache != "bf16" and row and baseline and row.tokens_per_s and baseline.tokens_per_s:
                ratio = f"{row.tokens_per_s / baseline.tokens_per_s:.2f}x"
            lines.append(f"| {name} | {CACHE_LABELS[cache]} | {per_sequence / 2**20:,.1f} MiB | {sequences} | "
                         f"{row.batch if row else ''} | {fmt(row and row.ms_per_step, '.3f')} | "
                         f"{fmt(row and row.tokens_per_s, ',.0f')} | {ratio} | {row.note if row else 'not run'} |")
    lines += ["", "## Where a step's time goes", "",
              "Stand-ins of the same shapes: *without attention*, the hook writes and commits and returns the "
              "query as its output; *without append*, the hook attends over the cache as it is and writes and "
              "commits nothing. Attention = full - without attention, append = full - without append, rest = "
              "the remainder (projections, MLP, norms, logits, sampling).", "",
              "| model | cache | batch | context | full ms | without attention ms | without append ms | "
              "attention | append | rest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        model = all_models[name]
        batch, context = model.focus
        for cache in CACHES:
            full = find(rows, model=name, part="grid", cache=cache, batch=batch, context=context)
            parts = {v: find(rows, model=name, part="breakdown", cache=cache, variant=v) for v in VARIANTS[1:]}
            if not (full and full.ms_per_step and all(p and p.ms_per_step for p in parts.values())):
                notes = [p.note for p in parts.values() if p and p.note]
                lines.append(f"| {name} | {CACHE_LABELS[cache]} | {batch} | {context:,} | "
                             f"{fmt(full and full.ms_per_step, '.3f')} | | | | | {'; '.join(notes) or 'not run'} |")
                continue
            total = full.ms_per_step
            attention = total - parts["no_attention"].ms_per_step
            append = total - parts["no_append"].ms_per_step
            rest = total - attention - append
            lines.append(f"| {name} | {CACHE_LABELS[cache]} | {batch} | {context:,} | {total:.3f} | "
                         f"{parts['no_attention'].ms_per_step:.3f} | {parts['no_append'].ms_per_step:.3f} | "
                         f"{100 * attention / total:.0f}% | {100 * append / total:.0f}% | {100 * rest / total:.0f}% |")
    lines += ["", "## Targets (issue 22)", "", "| target | measured |", "|---|---|"]
    for name, target in (("ouro", 2.5), ("smollm2", 2.0)):
        if name not in args.models:
            continue
        batch, context = all_models[name].focus
        ours = find(rows, model=name, part="grid", cache="jflashloop", batch=batch, context=context)
        base = find(rows, model=name, part="grid", cache="bf16", batch=batch, context=context)
        measured = "not measured"
        if ours and base and ours.tokens_per_s and base.tokens_per_s:
            measured = f"{ours.tokens_per_s / base.tokens_per_s:.2f}x"
        lines.append(f"| {name} B{batch} T{context:,}: jflashloop >= {target}x BF16 tokens/s | {measured} |")
    for name in args.models:
        ours, base = (find(rows, model=name, part="capacity", cache=c) for c in ("jflashloop", "bf16"))
        measured = "not measured"
        if ours and base and ours.tokens_per_s and base.tokens_per_s:
            measured = f"{ours.tokens_per_s / base.tokens_per_s:.2f}x"
        lines.append(f"| {name}, equal KV memory: jflashloop >= 2.5x BF16 tokens/s | {measured} |")
    lines += ["", "## Notes", ""]
    lines += [f"* {note}" for note in runner.notes] or ["* none"]
    return "\n".join(lines) + "\n"


def plot(runner: Runner, all_models: dict[str, Model], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if "no plot: matplotlib is not installed" not in runner.notes:
            runner.notes.append("no plot: matplotlib is not installed")
        return
    names = list(runner.args.models)
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        rows = [r for r in runner.rows if r.model == name and r.part == "grid" and r.tokens_per_s]
        for cache, style in zip(CACHES, ("--", "-"), strict=True):
            for batch in sorted({r.batch for r in rows}):
                points = sorted((r.context, r.tokens_per_s) for r in rows if r.cache == cache and r.batch == batch)
                if points:
                    axis.plot(*zip(*points, strict=True), style, marker="o", label=f"{CACHE_LABELS[cache]}, B{batch}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel("decode tokens/s")
        axis.set_title(all_models[name].title.split(" (")[0], fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"decode tokens/s, {jax.devices()[0].device_kind}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def archive(directory: pathlib.Path) -> pathlib.Path:
    """``directory`` packed as ``directory.tar.gz`` (then removed): one file to carry back."""
    target = directory.with_name(directory.name + ".tar.gz")
    with tarfile.open(target, "w:gz") as tar:
        tar.add(directory, arcname=directory.name)
    shutil.rmtree(directory)
    return target


# --------------------------------------------------------------------------- main


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and shapes (CPU, seconds): a smoke test of every part")
    parser.add_argument("--out", default="bench/E2E.md", help="the markdown report (rewritten after each measurement)")
    parser.add_argument("--plot", default=None, help="PNG of tokens/s against context per cache (needs matplotlib)")
    parser.add_argument("--trace", default=None,
                        help="directory for the jax.profiler traces; packed as DIR.tar.gz at the end")
    parser.add_argument("--models", default="ouro,smollm2", help="comma-separated: smollm2, ouro")
    parser.add_argument("--parts", default="grid,capacity,breakdown,trace",
                        help="comma-separated parts to run after the target shapes: grid, capacity, breakdown, trace")
    parser.add_argument("--batches", default=None, help="batch sizes of the grid (default 1,8,32,64)")
    parser.add_argument("--contexts", default=None, help="context lengths of the grid (default 4096,16384,32768)")
    parser.add_argument("--steps", type=int, default=None, help="tokens decoded per timed call (default 64)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls after the warm-up (default 3)")
    parser.add_argument("--kv-budget-gib", type=float, default=None, help="the capacity view's KV budget (80)")
    parser.add_argument("--capacity-context", type=int, default=None, help="the capacity view's context (32768)")
    parser.add_argument("--max-capacity-batch", type=int, default=None,
                        help="largest batch the capacity view runs (512)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="device memory for the fit check (default: the device's allocator limit)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new measurement starts (default 420; the run ends a "
                             "measurement or two later)")
    parser.add_argument("--trace-steps", type=int, default=None, help="decode steps in the traced call (1)")
    parser.add_argument("--direct-loop", action="store_true",
                        help="the looped model's loop 2 stored on its own, not as a residual against loop 1 (same "
                             "bytes; loops 2-4 then read no loop-1 stream)")
    parser.add_argument("--compact-loops", action="store_true",
                        help="the looped model's cache as CacheConfig.compact_loops (loop 2 direct, affine INT2 rows "
                             "for 24 and 10 of each page's 64 tokens)")
    parser.add_argument("--predicted-loops", action="store_true",
                        help="the looped model's cache as CacheConfig.predicted_loops (loop 2 direct, loops 3-4 "
                             "predicted from the loop before with no rows; stand-in maps near the identity)")
    parser.add_argument("--float32-weights", action="store_true",
                        help="the Llama model's weights and products in float32 (default bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # --quick: every part at one shape (the fills and compiled steps are reused), the trace of a whole call.
    quick = dict(batches="2", contexts="120", steps=8, repeats=2, kv_budget_gib=0.0005, capacity_context=120,
                 max_capacity_batch=2, time_budget=600, memory_gib=8.0, trace_steps=8)
    full = dict(batches="1,8,32,64", contexts="4096,16384,32768", steps=64, repeats=3, kv_budget_gib=80.0,
                capacity_context=32768, max_capacity_batch=512, time_budget=420, memory_gib=None, trace_steps=1)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches, args.contexts = integers(args.batches), integers(args.contexts)
    args.models = [m for m in args.models.split(",") if m]
    args.parts = {p for p in args.parts.split(",") if p}
    unknown = set(args.models) - {"smollm2", "ouro"} or args.parts - {"grid", "capacity", "breakdown", "trace"}
    if unknown:
        parser.error(f"unknown models or parts: {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python bench/end_to_end.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    all_models = models(args.quick)
    if args.float32_weights:
        all_models = {name: dataclasses.replace(model, weight_dtype=jnp.float32) for name, model in all_models.items()}
    if args.direct_loop:
        all_models = {name: dataclasses.replace(model, direct_loop=model.looped) for name, model in all_models.items()}
    if args.compact_loops:
        all_models = {name: dataclasses.replace(model, compact=model.looped) for name, model in all_models.items()}
    if args.predicted_loops:
        all_models = {name: dataclasses.replace(model, predicted=model.looped) for name, model in all_models.items()}
    runner = Runner(args)
    work = plan(args, all_models)
    trace_directory = pathlib.Path(args.trace) if args.trace else None
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {len(work)} measurements planned, "
          f"time budget {args.time_budget:.0f} s; device memory for the fit check "
          f"{device_memory_bytes(args) / GIB:.1f} GiB", flush=True)

    def write():
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(report(runner, all_models, command))
        if args.plot:
            plot(runner, all_models, args.plot)

    bar = progress.bar(len(work), "end to end")
    traced = []
    for index, (kind, model, cache, batch, context, *variant) in enumerate(work, 1):
        label = f"[{index}/{len(work)} {runner.elapsed():5.0f} s] {kind} {model.name} {cache}"
        if runner.over_budget():
            runner.notes.append(f"not run (time budget of {args.time_budget:.0f} s spent): {kind} {model.name} "
                                f"{cache} B{batch} T{context} {' '.join(variant)}".rstrip())
            print(f"{label}: skipped (time budget)", flush=True)
        elif kind == "trace":
            try:
                outcome = runner.trace(model, cache, trace_directory)
            except Exception as failure:  # a trace is worth less than the rest of the run
                outcome = f"trace failed: {type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
            traced.append(f"{model.name} {cache} B{batch} T{context}: {outcome}")
            print(f"{label}: {outcome}", flush=True)
        else:
            if kind == "grid" and find(runner.rows, model=model.name, part="grid", cache=cache, batch=batch,
                                       context=context):
                continue
            if kind == "capacity":
                _, sequences = capacity_sequences(model, cache, args)
                batch = max(1, min(sequences, args.max_capacity_batch))
            row = runner.measure(model, cache, batch, context, part=kind, variant=variant[0] if variant else "full")
            if kind == "capacity":
                _, sequences = capacity_sequences(model, cache, args)
                if batch < sequences:
                    row.note = (row.note + "; " if row.note else "") + f"batch capped at {batch} (--max-capacity-batch)"
                if row.ms_per_step is None and "does not fit" in row.note:
                    row.note += " (the KV budget exceeds what this device holds beside the weights)"
            runner.rows.append(row)
            print(f"{label} B{row.batch} T{row.context} {row.variant}: "
                  f"{fmt(row.ms_per_step, '.3f', '-')} ms/step, {fmt(row.tokens_per_s, ',.0f', '-')} tokens/s, "
                  f"compile {fmt(row.compile_s, '.1f', '-')} s, KV {row.kv_bytes / GIB:.2f} GiB {row.note}",
                  flush=True)
        if bar is not None:
            bar.update(1)
        write()
    if bar is not None:
        bar.close()
    if trace_directory is not None and trace_directory.exists():
        packed = archive(trace_directory)
        runner.notes.append(f"trace of one call of {args.trace_steps} decode step(s) each ({'; '.join(traced)}): "
                            f"{packed.name} ({packed.stat().st_size / 2**20:.1f} MiB)")
    write()
    print(pathlib.Path(args.out).read_text(), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
