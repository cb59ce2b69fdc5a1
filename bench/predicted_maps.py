"""The XLA work around a predicted loop's fused kernel, formulation by formulation (GPU).

A predicted loop (``CacheConfig.predicted_loops``) is read through its source loop's stream: the query goes
in as ``M q``, the loop's own sink and recent windows go in moved to ``(k - b) M^-1`` and ``(v - b) M_v^-1``,
and the kernel's output comes back as ``out M_v + b_v``
(:func:`jflashloop.ops._decode_attention.predicted_inputs`, :func:`~jflashloop.ops._decode_attention.predicted_output`).
This times those maps alone (no kernel: the output map reads the query map's result) at one layer of the
looped model's end-to-end step, 48 calls in one jitted function with one ring token written per call (as a
decode step writes it), and reports the GPU's kernels per call from a ``jax.profiler`` trace, with each
formulation's largest difference from float64 maps.

Usage:
  python bench/predicted_maps.py [--sequences 8] [--kv-heads 16] [--q-heads 16] [--recent 16] [--sink 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop.ops import _decode_attention as ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode as decode_bench
import kernel_formulations

HIGHEST = jax.lax.Precision.HIGHEST
REPEATS = 48


def tables_of(plan):
    key_table, value_table = (np.asarray(t, np.float64) for t in plan.prediction.tables())
    inverses = [np.linalg.inv(t[:, :-1]) for t in (key_table, value_table)]
    shifts = [np.einsum("hd,hde->he", t[:, -1], inv) for t, inv in zip((key_table, value_table), inverses, strict=True)]
    return key_table, value_table, inverses, shifts


def maps_library(plan):
    """The library's own formulation (:func:`jflashloop.ops._decode_attention.predicted_inputs`): since call 69 the
    fastest one there, all four windows in one product (sink and ring joined along the tokens, keys and values
    stacked) against the two split inverses; call 68's was ``shifted-highest``, call 69's library row ``split-high``."""
    def run(queries, windows, bounds):
        q, moved, _ = ops.predicted_inputs(queries, windows, 0, plan)
        return q, moved, ops.predicted_output(q, {"bounds": bounds}, plan)
    return run


WINDOWS = ("sink_keys", "ring_keys", "sink_values", "ring_values")


def query_and_output_maps(plan, precision):
    """``(query map, output map)`` at ``precision``: ``M q`` and ``out M_v + b_v`` (the bias where a sequence
    sees a token)."""
    key_table, value_table, _, _ = tables_of(plan)
    heads = plan.prediction.num_kv_heads

    def query_map(queries):
        sequences, q_heads, head_dim = queries.shape
        grouped = queries.astype(jnp.float32).reshape(sequences, heads, q_heads // heads, head_dim)
        return jnp.einsum("hde,shge->shgd", jnp.asarray(key_table[:, :-1], jnp.float32), grouped,
                          precision=precision).reshape(sequences, q_heads, head_dim)

    def output_map(output, bounds):
        sequences, q_heads, head_dim = output.shape
        out = jnp.einsum("shgd,hde->shge", output.reshape(sequences, heads, q_heads // heads, head_dim),
                         jnp.asarray(value_table[:, :-1], jnp.float32), precision=precision)
        bias = jnp.asarray(value_table[:, -1], jnp.float32)[None, :, None]
        out = out + jnp.where((bounds[:, 0] > 0)[:, None, None, None], bias, 0.0)
        return out.reshape(sequences, q_heads, head_dim)

    return query_map, output_map


def moved_window(array, inverse, bias, how, precision):
    """One window ``[1, S, H, T, D]`` moved: ``(x - b) M^-1``, by ``how``: ``"shifted"`` (shift, then one float32
    product at ``precision``), ``"folded"`` (``x M^-1 - b M^-1``, the product at ``precision``), ``"split"`` /
    ``"split-bf16"`` (folded; one product of bfloat16 values against the inverse split in two bfloat16 halves, float32
    operands / bfloat16 ones with float32 sums) or ``"reduce"`` (folded; a broadcast product and sum, no matrix unit)."""
    head_dim, shift = array.shape[-1], np.einsum("hd,hde->he", bias, inverse)
    if how == "shifted":
        shifted = array.astype(jnp.float32) - jnp.asarray(bias, jnp.float32)[:, None]
        return jnp.einsum("lshtd,hde->lshte", shifted, jnp.asarray(inverse, jnp.float32), precision=precision)
    if how == "reduce":
        product = jnp.sum(array.astype(jnp.float32)[..., None] * jnp.asarray(inverse, jnp.float32)[:, None], axis=-2)
    elif how == "split-bf16":
        both = jnp.einsum("lshtd,hde->lshte", array, ops._split_bfloat16(inverse), preferred_element_type=jnp.float32)
        product = both[..., :head_dim] + both[..., head_dim:]
    elif how == "split":
        both = jnp.einsum("lshtd,hde->lshte", array.astype(jnp.float32), ops._split_bfloat16(inverse).astype(jnp.float32))
        product = both[..., :head_dim] + both[..., head_dim:]
    else:
        product = jnp.einsum("lshtd,hde->lshte", array.astype(jnp.float32), jnp.asarray(inverse, jnp.float32),
                             precision=precision)
    return product - jnp.asarray(shift, jnp.float32)[:, None]


def maps_each(plan, how, window_precision, query_precision):
    """Each window moved on its own (:func:`moved_window`), the query and output maps at ``query_precision``."""
    key_table, value_table, inverses, _ = tables_of(plan)
    biases = (key_table[:, -1], value_table[:, -1])
    query_map, output_map = query_and_output_maps(plan, query_precision)

    def run(queries, windows, bounds):
        q = query_map(queries)
        moved = {name: moved_window(windows[name], inverses[name.endswith("values")],
                                    biases[name.endswith("values")], how, window_precision) for name in WINDOWS}
        return q, moved, output_map(q, bounds)
    return run


def formulations(plan):
    high = jax.lax.Precision.HIGH
    return {
        "library": maps_library(plan),
        "shifted-highest": maps_each(plan, "shifted", HIGHEST, HIGHEST),  # the first shipped maps
        "folded-highest": maps_each(plan, "folded", HIGHEST, HIGHEST),
        "folded-high": maps_each(plan, "folded", high, high),
        "split-high": maps_each(plan, "split", None, high),
        "split-highest": maps_each(plan, "split", None, HIGHEST),
        "split-bf16-high": maps_each(plan, "split-bf16", None, high),
        "reduce-high": maps_each(plan, "reduce", None, high),
    }


def many(run):
    """``REPEATS`` calls of ``run`` in one jitted loop, a ring token written (from the last output) per call."""
    @jax.jit
    def go(queries, windows, bounds):
        def body(i, carry):
            queries, windows, total = carry
            q, moved, out = run(queries, windows, bounds)
            ring = windows["ring_keys"]
            token = out.reshape(*ring.shape[1:3], -1, ring.shape[-1])[:, :, :1].astype(ring.dtype)[None]
            ring = jax.lax.dynamic_update_slice_in_dim(ring, token, i % ring.shape[3], axis=3)
            total = total + sum(jnp.sum(m[..., :1]) for m in moved.values()) + jnp.sum(q[..., :1])
            return out.astype(queries.dtype), dict(windows, ring_keys=ring), total
        return jax.lax.fori_loop(0, REPEATS, body, (queries, windows, jnp.float32(0)))
    return go


def exact(plan, queries, windows, bounds):
    """float64 numpy maps: ``(query, moved windows, output of the mapped query)``."""
    key_table, value_table, inverses, _ = tables_of(plan)
    heads = plan.prediction.num_kv_heads
    q64 = np.asarray(queries, np.float64)
    sequences, q_heads, head_dim = q64.shape
    q = np.einsum("hde,shge->shgd", key_table[:, :-1], q64.reshape(sequences, heads, -1, head_dim))
    moved = {}
    for name, table, inverse in (("sink_keys", key_table, inverses[0]), ("ring_keys", key_table, inverses[0]),
                                 ("sink_values", value_table, inverses[1]), ("ring_values", value_table, inverses[1])):
        moved[name] = np.einsum("lshtd,hde->lshte", np.asarray(windows[name], np.float64) - table[:, -1][:, None],
                                inverse)
    out = np.einsum("shgd,hde->shge", q, value_table[:, :-1]) + value_table[:, -1][None, :, None]
    return q.reshape(sequences, q_heads, head_dim), moved, out.reshape(sequences, q_heads, head_dim)


def largest_error(plan, run, queries, windows, bounds):
    got = jax.jit(run)(queries, windows, bounds)
    want = exact(plan, queries, windows, bounds)
    errors = [np.max(np.abs(np.asarray(got[0], np.float64) - want[0])) / np.max(np.abs(want[0])),
              np.max(np.abs(np.asarray(got[2], np.float64) - want[2])) / np.max(np.abs(want[2]))]
    errors += [np.max(np.abs(np.asarray(got[1][n], np.float64) - want[1][n])) / np.max(np.abs(want[1][n]))
               for n in want[1]]
    return max(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=16)
    parser.add_argument("--names", default=None, help="comma-separated formulations (default: all)")
    parser.add_argument("--timeline", default=None, help="trace folder (default: a temporary one)")
    args = parser.parse_args(argv)
    predictions = decode_bench.stand_in_predictions(1, 2, args.kv_heads, args.head_dim)
    config = jflashloop.CacheConfig.predicted_loops(
        predictions=predictions, num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_pages=8,
        max_sequences=args.sequences, max_pages_per_sequence=1, page_size=64, sink_tokens=args.sink,
        recent_tokens=args.recent)
    plan = ops.kernel_plan(config.layer(0), 3)  # loop 4: two maps composed
    rng = np.random.default_rng(0)
    shape = (1, args.sequences, args.kv_heads)
    windows = {name: jnp.asarray(rng.standard_normal((*shape, tokens, args.head_dim)), jnp.bfloat16)
               for name, tokens in (("sink_keys", args.sink), ("ring_keys", args.recent),
                                    ("sink_values", args.sink), ("ring_values", args.recent))}
    queries = jnp.asarray(rng.standard_normal((args.sequences, args.q_heads, args.head_dim)), jnp.bfloat16)
    bounds = jnp.ones((args.sequences, 2), jnp.int32)
    chosen = formulations(plan)
    names = args.names.split(",") if args.names else list(chosen)
    directory = args.timeline or tempfile.mkdtemp()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B{args.sequences} Hq{args.q_heads} "
          f"Hkv{args.kv_heads} D{args.head_dim}, windows {args.sink} + {args.recent}, {REPEATS} calls a function")
    print("| formulation | kernels a call | GPU busy us a call | span us a call | largest relative error | "
          "largest kernels (us a call) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        run = chosen[name]
        error = largest_error(plan, run, queries, windows, bounds)
        go = many(run)
        jax.block_until_ready(go(queries, windows, bounds))
        timeline = kernel_formulations.gpu_timeline(lambda go=go: go(queries, windows, bounds), directory, REPEATS)
        if timeline is None:
            print(f"| {name} | | | | {error:.1e} | no GPU kernels traced |")
            continue
        top = ", ".join(f"{k.split('.')[0][:28]} {t:.1f}" for k, t in timeline.kernels[:4])
        print(f"| {name} | {timeline.count:.1f} | {timeline.busy:.1f} | {timeline.span:.1f} | {error:.1e} | {top} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
