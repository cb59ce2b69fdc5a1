"""``jflashloop allocate``: per-layer K/V formats for SmolLM2 under a bit budget.

Calibrates on one text (``calibration_text.txt``, shipped) and reports on
another (``eval_text.txt``, the text of bench/QUALITY.md):

1. **Sensitivity**: for every candidate (a key codec x a value codec, see
   :func:`candidates`, and the codecs fitted to each layer of the calibration
   text, :func:`fitted_candidates`, unless ``--no-fitted``) the attention-output relative error of every layer,
   float64, with the model's own queries at the last 32 positions against the
   unquantized K/V (:func:`jflashloop.apps.quality.kv_errors`; layers are
   independent in the cache, so a per-layer policy's error at layer ``l`` is
   that of its layer-``l`` candidate).
2. **Allocation**: :func:`jflashloop.allocation.allocate` picks one candidate
   per layer minimizing the summed squared calibration errors (``--objective
   squares``, the default: the worst layers weigh more; ``sum``: the plain
   sum) with the mean cost at most ``--bits``, each candidate priced at the bits per element one sequence of
   ``--context`` tokens stores (windows included,
   :func:`jflashloop.allocation.candidate_bits`). The default budget is the
   uniform INT4 G64 policy's cost. It also finds the smallest budget (in steps
   of 1/64 bit) whose allocation reaches uniform INT4's calibration error.
3. **Report on the held-out text**: mean and worst-layer attention error of
   uniform INT4 G64, the allocated policy and the lean one; teacher-forced
   decoding through each cache (the first ``--prefix`` tokens prefilled, the
   rest one at a time) for the logit KL against a BF16 cache and next-token
   agreement; a PNG of the error per layer.

The allocated policy is written as JSON (:func:`jflashloop.allocation.save_policy`;
``jflashloop.allocation.load_policy(path).cache_config(...)`` makes its cache).

Usage: ``jflashloop allocate [--bits 4.53] [--context 32768] [--objective sum|squares] [--sensitivity F.npz]
[--no-fitted] [--out policy.json] [--markdown F] [--plot F]``
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import numpy as np

from .. import CodecSpec, Policy, allocation, fitting, int2_lloyd_max
from ..codecs import INT4_GROUP_ROTATED_VALUES, INT4_KEYS, INT4_VALUES, NVFP4
from ..models import cached_decoding, gguf_loader, llama
from . import quality
from .evaluation import teacher_forced
from .float64_metrics import kl_divergence, next_token_agreement
from .progress import bar as _bar

UNIFORM_NAME = "K int4/ch G64 + V int4/tok G64"


def candidates(head_dim: int) -> list[allocation.Candidate]:
    """Every pair of a key codec (INT4 per channel over 16/32/64 tokens, INT3 per channel over 32/64
    tokens, INT2 Lloyd-Max) and a value codec (INT4 per token over 16/32/64 channels, INT3 per token over
    32/64 channels, group-rotated symmetric INT4 over 32/64 channels, NVFP4, INT2 Lloyd-Max).

    The INT3 codecs are left out when ``head_dim`` is not a multiple of 32 (INT3 pages store a row's
    ``3 * head_dim / 8`` bytes in whole 32-bit words)."""
    int3 = head_dim % 32 == 0
    keys = [("K int4/ch G16", CodecSpec("int4", "channel", 16)), ("K int4/ch G32", CodecSpec("int4", "channel", 32)),
            ("K int4/ch G64", INT4_KEYS), ("K int2 LM", int2_lloyd_max(head_dim, 0))]
    values = [("V int4/tok G16", CodecSpec("int4", "token", 16)), ("V int4/tok G32", CodecSpec("int4", "token", 32)),
              ("V int4/tok G64", INT4_VALUES), ("V int4 rot G32", CodecSpec("int4_group_rotated", "token", 32)),
              ("V int4 rot G64", INT4_GROUP_ROTATED_VALUES), ("V nvfp4", NVFP4),
              ("V int2 LM", int2_lloyd_max(head_dim, 1))]
    if int3:
        keys += [("K int3/ch G32", CodecSpec("int3", "channel", 32)), ("K int3/ch G64", CodecSpec("int3", "channel", 64))]
        values += [("V int3/tok G32", CodecSpec("int3", "token", 32)), ("V int3/tok G64", CodecSpec("int3", "token", 64))]
    return [allocation.Candidate(f"{k} + {v}", key, value) for (k, key), (v, value) in itertools.product(keys, values)]


FITTED_KEY_MEANS = (3.0, 3.5, 4.0, 4.5, 5.0)
"""Mean key widths of the fitted key candidates (those whose rows fill whole 32-bit words at the head_dim)."""


def fitted_candidates(keys, values, queries, *, sink_tokens: int) -> list[allocation.Candidate]:
    """Candidates fitted to each layer of the calibration tensors (:mod:`jflashloop.fitting`): ``int_mixed`` keys
    at the mean widths of :data:`FITTED_KEY_MEANS` against the fitted ``int4_scaled`` values over 64 or 32
    channels, and INT4 G64 keys against the fitted values over 64 channels (the value scales alone).

    Args:
      keys, values: ``[layers, T, kv_heads, D]`` and queries ``[layers, T, q_heads, D]`` on the calibration text.
    """
    keys, values, queries = (np.asarray(x, np.float32) for x in (keys, values, queries))
    layers, _, _, head_dim = keys.shape
    fitted_keys = [(f"K fitted/ch G64 mean {mean:g}",
                    [fitting.fitted_keys(keys[i], queries[i], mean, sink_tokens=sink_tokens) for i in range(layers)])
                   for mean in FITTED_KEY_MEANS if (mean * head_dim) % 32 == 0]
    fitted_values = [(f"V int4 scaled G{group}",
                      [fitting.fitted_values(values[i], group_size=group, sink_tokens=sink_tokens)
                       for i in range(layers)]) for group in (64, 32)]
    pairs = [(k, kspecs, v, vspecs) for k, kspecs in fitted_keys for v, vspecs in fitted_values]
    pairs.append(("K int4/ch G64", [INT4_KEYS] * layers, *fitted_values[0]))
    return [allocation.Candidate.per_layer(f"{k} + {v}", zip(kspecs, vspecs, strict=True))
            for k, kspecs, v, vspecs in pairs]


def layer_errors(cands, keys, values, queries, *, sink_tokens: int, recent_tokens: int,
                 description: str = "candidates") -> np.ndarray:
    """float64 ``[layers, candidates]``: mean attention-output error over the query heads of each layer.

    ``keys``/``values`` ``[layers, T, kv_heads, D]`` and ``queries`` ``[layers, T, q_heads, D]``: the
    model's exact post-RoPE tensors.
    """
    bar = _bar(len(cands), description)
    columns = []
    for candidate in cands:
        policy = Policy(candidate.name, candidate.key_spec, candidate.value_spec, sink_tokens, recent_tokens,
                        layer_specs=candidate.layer_specs)
        columns.append(quality.kv_errors(policy, keys, values, queries)["attention_error"].mean(axis=1))
        if bar:
            bar.update()
    if bar:
        bar.close()
    return np.stack(columns, axis=1)


OBJECTIVES = {"sum": 1, "squares": 2}
"""``--objective``: the power of the per-layer errors whose sum the allocation minimizes (squares weigh the
worst layers more)."""


def lean_budget(errors, costs, target: float, ceiling: float, step: float = 1 / 64, power: int = 1) -> float:
    """The smallest budget (a multiple of ``step`` at most ``ceiling``) whose allocation (of ``errors **
    power``) has a mean error at most ``target`` (``ceiling`` if none below it reaches it)."""
    budget = ceiling
    candidate = np.floor(ceiling / step + 1e-9) * step
    while candidate > 0:
        try:
            choice = allocation.allocate(errors ** power, costs, candidate)
        except ValueError:  # below the cheapest assignment
            break
        if errors[np.arange(len(choice)), choice].mean() > target:
            break
        budget = candidate
        candidate -= step
    return budget


def _summary(name, errors_held, choice, costs) -> dict:
    per_layer = errors_held[np.arange(len(choice)), choice]
    return {"policy": name, "bits": float(np.mean(np.asarray(costs)[choice])), "mean": float(per_layer.mean()),
            "worst": float(per_layer.max()), "per_layer": per_layer}


def sensitivities(path, cands, tensors, *, tokens: int, sink_tokens: int, recent_tokens: int):
    """``(calibration, held_out)`` errors ``[layers, candidates]``: each candidate's columns read from the ``.npz``
    at ``path`` when it holds them for these tokens and windows, the others measured (:func:`layer_errors`) and
    added there (a candidate is known by its name)."""
    names = [c.name for c in cands]
    settings = np.array([tokens, sink_tokens, recent_tokens])
    known = {}  # name -> (calibration column, held-out column) of a stored study with these settings
    if path:
        try:
            with np.load(path) as stored:
                if np.array_equal(stored["settings"], settings):
                    known = {str(name): (stored["calibration"][:, i], stored["held_out"][:, i])
                             for i, name in enumerate(stored["names"])}
        except (OSError, KeyError, ValueError):
            pass  # absent or another study's: measure
    missing = [c for c in cands if c.name not in known]
    uniform = [c for c in missing if c.layer_specs is None]
    windows = dict(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    # The uniform candidates together; then each per-layer candidate on its own (a compilation per layer), saved
    # as it is measured and with the compiled caches dropped after it (hundreds of executables would not fit).
    for batch in ([uniform] if uniform else []) + [[c] for c in missing if c.layer_specs is not None]:
        calibration = layer_errors(batch, *tensors["calibration_text.txt"], **windows, description="calibration")
        held_out = layer_errors(batch, *tensors["eval_text.txt"], **windows, description="held-out")
        known.update({c.name: (calibration[:, i], held_out[:, i]) for i, c in enumerate(batch)})
        if batch[0].layer_specs is not None:
            jax.clear_caches()
        if path:
            every = sorted(known)
            np.savez(path, names=np.array(every), settings=settings,
                     calibration=np.stack([known[n][0] for n in every], axis=1),
                     held_out=np.stack([known[n][1] for n in every], axis=1))
    return (np.stack([known[n][0] for n in names], axis=1), np.stack([known[n][1] for n in names], axis=1))


def run(*, bits: float | None, context: int, tokens: int, prefix: int, sink_tokens: int, recent_tokens: int,
        out: str | None, plot: str | None, objective: str = "squares",
        sensitivity: str | None = None, fitted: bool = True) -> tuple[list[dict], dict]:
    """The whole study; returns (rows, summary) for :func:`markdown_table`."""
    power = OBJECTIVES[objective]
    params, config, tokenizer = gguf_loader.load_smollm2()
    texts = {name: tokenizer.encode(gguf_loader.read_data_text(name)).ids[:tokens]
             for name in ("calibration_text.txt", "eval_text.txt")}
    tensors = {name: llama.prefill(params, config, np.asarray(ids, np.int32))[1:] for name, ids in texts.items()}
    cands = candidates(config.head_dim)
    if fitted:
        cands += fitted_candidates(*tensors["calibration_text.txt"], sink_tokens=sink_tokens)
    costs = np.array([allocation.candidate_bits(c, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                                context_tokens=context, sink_tokens=sink_tokens,
                                                recent_tokens=recent_tokens) for c in cands])
    windows = dict(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    calibration, held_out = sensitivities(sensitivity, cands, tensors, tokens=tokens, **windows)
    layers = calibration.shape[0]
    uniform = next(i for i, c in enumerate(cands) if c.name == UNIFORM_NAME)
    budget = costs[uniform] if bits is None else bits
    choice = allocation.allocate(calibration ** power, costs, budget)
    target = calibration[:, uniform].mean()
    lean = lean_budget(calibration, costs, target, budget, power=power)
    lean_choice = allocation.allocate(calibration ** power, costs, lean)
    policies = {
        "uniform": (f"uniform INT4 G64, windows {sink_tokens}/{recent_tokens}", np.full(layers, uniform)),
        "allocated": (f"allocated at {budget:.3f} bits", choice),
        "lean": (f"allocated at {lean:.3f} bits (uniform INT4's calibration error)", lean_choice),
    }
    rows = [_summary(name, held_out, c, costs) for name, c in policies.values()]
    for row, (_, c) in zip(rows, policies.values(), strict=True):
        row["calibration_mean"] = float(calibration[np.arange(layers), c].mean())
    # End to end on the held-out text: teacher-forced logits through each cache against a BF16 cache.
    held_ids = texts["eval_text.txt"]
    model = cached_decoding.CachedModel(params, config, max_tokens=len(held_ids))
    reference = teacher_forced(model.dense(held_ids, prefix), held_ids, prefix, "BF16")
    for row, (name, c) in zip(rows, policies.values(), strict=True):
        policy = allocation.policy_for(name, cands, c, **windows)
        logits = teacher_forced(model.paged(policy, held_ids, prefix), held_ids, prefix, name[:30])
        row["kl"] = float(kl_divergence(reference, logits).mean())
        row["agreement"] = next_token_agreement(reference, logits)
    metadata = {
        "budget_bits_per_element": float(budget), "context_tokens": context, "model": "SmolLM2-135M-Instruct",
        "calibration_text": "calibration_text.txt", "calibration_tokens": len(texts["calibration_text.txt"]),
        "objective": f"summed attention-output relative error over layers, to the power {power} (model's "
                     "queries, last 32 positions)",
        "calibration_mean_error": rows[1]["calibration_mean"],
        "choices": [cands[c].name for c in choice],
    }
    if out:
        allocation.save_policy(out, allocation.policy_for(policies["allocated"][0], cands, choice, **windows),
                               metadata)
    if plot:
        _plot(plot, rows)
    summary = {"budget": float(budget), "lean": float(lean), "uniform_bits": float(costs[uniform]),
               "context": context, "tokens": {k: len(v) for k, v in texts.items()}, "prefix": prefix,
               "choices": [cands[c].name for c in choice], "lean_choices": [cands[c].name for c in lean_choice]}
    return rows, summary


def _plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for row, marker in zip(rows, "osd", strict=False):
        axes.plot(row["per_layer"], marker=marker, label=f"{row['policy']} (mean {row['mean']:.4f})")
    axes.set_xlabel("layer")
    axes.set_ylabel("attention-output relative error")
    axes.set_title("SmolLM2-135M, held-out text: error per layer")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown_table(rows: list[dict], summary: dict) -> str:
    lines = [
        f"SmolLM2-135M-Instruct; calibrated on {summary['tokens']['calibration_text.txt']} tokens of "
        f"`calibration_text.txt`, reported on {summary['tokens']['eval_text.txt']} tokens of `eval_text.txt` "
        f"(KL and agreement: {summary['prefix']} prefilled, the rest decoded one token at a time). Bits per element "
        f"of one sequence of {summary['context']} tokens, windows included.",
        "",
        "| policy | bits/elem | attn-out err, held-out (mean) | (worst layer) | calibration mean | mean KL | "
        "next-token agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['bits']:.3f} | {r['mean']:.4f} | {r['worst']:.4f} | "
                     f"{r['calibration_mean']:.4f} | {r['kl']:.5f} | {r['agreement']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jflashloop allocate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=float, default=None,
                        help="budget: mean bits per K/V element at --context tokens, windows included "
                             "(default: what uniform INT4 G64 costs there)")
    parser.add_argument("--context", type=int, default=32768, help="context length the budget counts the windows at")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of each text")
    parser.add_argument("--prefix", type=int, default=128, help="tokens prefilled before teacher forcing")
    parser.add_argument("--sink", type=int, default=Policy.sink_tokens)
    parser.add_argument("--recent", type=int, default=Policy.page_size,
                        help="recent tokens kept unquantized (default: one page, the library's default)")
    parser.add_argument("--out", default="jflashloop_policy.json", help="the allocated policy's JSON file")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--plot", default="jflashloop_allocation.png", help="PNG of the error per layer")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="squares",
                        help="minimize the summed per-layer errors, or their squares (the worst layers weigh more)")
    parser.add_argument("--no-fitted", dest="fitted", action="store_false",
                        help="leave out the candidates fitted to each layer (int_mixed keys, int4_scaled values)")
    parser.add_argument("--sensitivity", default=None,
                        help="an .npz caching the per-layer errors of every candidate (read if it matches, else "
                             "written): other budgets and objectives without measuring again")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows, summary = run(bits=args.bits, context=args.context, tokens=args.tokens, prefix=args.prefix,
                        sink_tokens=args.sink, recent_tokens=args.recent, out=args.out, plot=args.plot,
                        objective=args.objective, sensitivity=args.sensitivity, fitted=args.fitted)
    table = markdown_table(rows, summary)
    print(table)
    print("\nallocated:", ", ".join(f"{i}: {name}" for i, name in enumerate(summary["choices"])))
    print("lean:", ", ".join(f"{i}: {name}" for i, name in enumerate(summary["lean_choices"])))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    print(f"\npolicy written to {args.out}; done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
