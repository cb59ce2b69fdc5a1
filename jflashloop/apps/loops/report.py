"""The looped-model report as markdown: one section per measurement.

:func:`format_report` turns :func:`jflashloop.apps.loops.runner.run_report`'s
results into the report of ``bench/LOOPS.md``; :func:`describe_inputs` writes
its header lines (checkpoint, training, held-out text) and
:func:`describe_sparse_rule` the paragraph on the sparse loops' rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ... import CacheConfig
from ...models import ouro
from ...models.checkpoint import Checkpoint
from ...models.stdlib_text import HELD_OUT_EVERY
from .runner import PAGE_SIZE, ReportSettings


def describe_sparse_rule(config: CacheConfig) -> str:
    """One paragraph: which rows the sparse loops store and which tokens stay unquantized."""
    sparse = [
        f"loop {index + 1}: {config.rows(index)} of {config.page_size} rows"
        for index, loop in enumerate(config.loops) if loop.is_sparse
    ]
    return (
        "Sparse rows: for every page and KV head, a sparse loop stores the rows with the largest "
        "residual energy |K_r - rec K_(r-1)|^2 + |V_r - rec V_(r-1)|^2 (summed over channels, "
        "against the reconstructed previous loop; ties to the lower position; sink rows excluded) "
        f"({'; '.join(sparse) or 'none'}); other rows inherit the previous loop. FlashLoop always "
        "includes the last prompt token; here that is automatic, because the most recent "
        f"{config.recent_tokens} tokens (and the page being filled) are read unquantized, in "
        f"every loop, from the {config.window_dtype} ring, and the first {config.sink_tokens} "
        "tokens from the sink."
    )


def _row(cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


PAGE_SIZE_REASON = (
    "FlashLoop's 64-token K group: every K group (one channel over 64 tokens) fills exactly one "
    "page at 4.5 bits per element; 32-token pages would need 32-token K groups (5 bits per "
    "element) and would round loop 4's 10 % up to 4 of 32 rows (12.5 %)"
)


def _header_section(results: dict[str, Any], header_lines: list[str]) -> list[str]:
    settings: ReportSettings = results["settings"]
    config: CacheConfig = results["cache_config"]
    teacher_steps = settings.tokens - settings.prompt_tokens
    reason = (PAGE_SIZE_REASON if config.page_size == PAGE_SIZE
              else f"K groups of {config.loops[0].key_spec.group_size} tokens")
    packed_by_commit = results["pages_at_end"] - results["pages_after_prefill"]
    return [
        "# Looped model on the cross-loop 4-bit cache vs four BF16 caches", "", *header_lines,
        f"- run: {settings.sequences} sequences; the first {settings.prompt_tokens} bytes "
        f"prefilled (`paged_cache.prefill` of `ouro.forward` K/V), {teacher_steps} bytes decoded "
        f"teacher forced, then {settings.generate} greedy tokens chosen by the BF16 run and fed "
        "to both caches.",
        f"- cross-loop cache: `CacheConfig.flashloop`, page size {config.page_size} ({reason}); "
        f"{config.sink_tokens} sink + {config.recent_tokens} recent tokens unquantized. Pages per "
        f"sequence: {_per_sequence(results['pages_after_prefill'])} packed by prefill, "
        f"{_per_sequence(packed_by_commit)} packed by `commit` during decoding, "
        f"{_per_sequence(results['pages_at_end'])} at the end.",
        "- BF16 baseline: `ouro.DenseLoopKVCache` of bfloat16 K/V, one cache per loop "
        "(held in float32 arrays, which XLA on CPU reads faster: the logits are bit for bit "
        "those of a bfloat16 array).",
        f"- {describe_sparse_rule(config)}",
        "",
    ]


def _cosine_section(results: dict[str, Any]) -> list[str]:
    cosine = results["cosine"]
    layers, transitions = cosine["keys"].shape
    steps = [f"{loop}→{loop + 1}" for loop in range(1, transitions + 1)]
    lines = ["## 1. Successive loops: cosine similarity of K and V", "",
             f"Mean over sequences, all {results['settings'].tokens} text tokens and KV heads "
             "(real looped K/V of `ouro.forward`).", "",
             _row(["layer", *(f"K {step}" for step in steps), *(f"V {step}" for step in steps)]),
             _row(["---"] * (1 + 2 * transitions))]
    for layer in range(layers):
        lines.append(_row([layer + 1, *(f"{value:.3f}" for value in cosine["keys"][layer]),
                           *(f"{value:.3f}" for value in cosine["values"][layer])]))
    lines.append(_row(["mean", *(f"{value:.3f}" for value in cosine["keys"].mean(axis=0)),
                       *(f"{value:.3f}" for value in cosine["values"].mean(axis=0))]))
    return [*lines, ""]


def _storage_section(results: dict[str, Any]) -> list[str]:
    summary = results["storage"]
    ratio = summary["ratio"]
    return ["## 2. KV bytes per token (all layers, K and V, `jflashloop.storage`)", "",
            summary["table"], "",
            f"Full pages: {summary['bf16_bytes_per_token']:,} / "
            f"{summary['cache_bytes_per_token']:,.4f} bytes per token = exactly "
            f"{ratio.numerator}/{ratio.denominator} = {float(ratio):.4f}x smaller than four "
            "BF16 loop caches.", ""]


def _attention_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    attention = results["attention_error"]
    first_query = settings.prompt_tokens - settings.query_positions
    lines = ["## 3. Attention-output relative error per loop", "",
             f"Queries: the model's own, at the last {settings.query_positions} prompt positions "
             f"({first_query}..{settings.prompt_tokens - 1}); K/V: `paged_cache.reconstruct` of "
             "the prefilled cache (or bfloat16-rounded K/V); reference: float64 attention on the "
             "unquantized float32 K/V. Frobenius relative error, mean over layers.", "",
             _row(["loop", "four BF16 caches", "cross-loop cache"]), _row(["---"] * 3)]
    for loop in range(attention["bf16"].shape[0]):
        lines.append(_row([loop + 1, f"{attention['bf16'][loop].mean():.2e}",
                           f"{attention['cross_loop'][loop].mean():.2e}"]))
    reconstruction = results["cache_reconstruction_error"]
    if reconstruction is not None:
        per_loop = "; ".join(
            f"loop {loop + 1} K {reconstruction['keys'][loop].mean():.4f} "
            f"V {reconstruction['values'][loop].mean():.4f}"
            for loop in range(reconstruction["keys"].shape[0]))
        lines += ["", f"K/V reconstruction error of the cache at the "
                  f"{results['positions_from_pages']} prompt positions read from pages "
                  f"(mean over layers): {per_loop}."]
    return [*lines, ""]


def _logits_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    teacher_forced, generated = results["logits"]["teacher_forced"], results["logits"]["generated"]
    lines = ["## 4. Logits through the decode loop (`ouro.decode_step`)", "",
             "KL(BF16 caches ‖ cross-loop cache) in nats, mean over steps and sequences; "
             "agreement: same argmax next token.", "",
             _row(["steps", "count", "mean KL (nats)", "max KL", "next-token agreement"]),
             _row(["---"] * 5)]
    for name, metrics in (("teacher forced", teacher_forced), ("greedy generated", generated)):
        if metrics["steps"]:
            lines.append(_row([name, metrics["steps"] * settings.sequences,
                               f"{metrics['kl']:.2e}", f"{metrics['kl_max']:.2e}",
                               f"{metrics['agreement']:.2%}"]))
    if generated["steps"]:
        lines += ["", "Greedy continuation: the cross-loop cache's own greedy run repeats the "
                  f"BF16 run's first {generated['identical_greedy_tokens']:.1f} of "
                  f"{settings.generate} tokens on average (minimum "
                  f"{generated['identical_greedy_tokens_min']})."]
    lines += ["", "Against `ouro.forward` in float32 (no cache), teacher forced: KL "
              f"{teacher_forced['kl_bf16_vs_exact']:.2e} (BF16 caches) vs "
              f"{teacher_forced['kl_cross_loop_vs_exact']:.2e} (cross-loop cache) nats; "
              f"agreement {teacher_forced['agreement_bf16_vs_exact']:.2%} vs "
              f"{teacher_forced['agreement_cross_loop_vs_exact']:.2%}.", ""]
    return lines


def _bits_per_byte_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    teacher_forced = results["logits"]["teacher_forced"]
    bits = [teacher_forced[f"bits_per_byte_{name}"] for name in ("exact", "bf16", "cross_loop")]
    return ["## 5. Held-out bits per byte (teacher forced, through the decode loop)", "",
            "Cross-entropy in bits per byte (base 2; perplexity per byte = 2^bits) over the "
            f"{teacher_forced['steps'] * settings.sequences} teacher-forced predictions.", "",
            _row(["", "float32 forward (no cache)", "four BF16 caches", "cross-loop cache"]),
            _row(["---"] * 4),
            _row(["bits per byte", *(f"{value:.4f}" for value in bits)]),
            _row(["nats per byte", *(f"{value * math.log(2):.4f}" for value in bits)]),
            _row(["perplexity per byte", *(f"{2**value:.3f}" for value in bits)]), ""]


def _chain_section(results: dict[str, Any]) -> list[str]:
    chains = results["chain_errors"]
    lines = ["## 6. Closed-loop vs open-loop residual encoding", "",
             "`jflashloop.encode_chain` on the real looped K/V of each layer (first "
             f"{results['chain_tokens']} text tokens, one chain per sequence and KV head, the "
             "cache's codecs: K groups fall on page boundaries). Sparse loops keep the same rows "
             "in both modes (per page, largest exact loop-to-loop residual energy). Open loop "
             "encodes each residual against the exact previous loop, closed loop against its "
             "reconstruction (what the cache does). Relative reconstruction error, mean over "
             "layers; saved = 1 - closed / open.", "",
             _row(["loop", "K open loop", "K closed loop", "V open loop", "V closed loop",
                   "K saved", "V saved"]),
             _row(["---"] * 7)]
    for loop in range(chains["open"]["keys"].shape[1]):
        open_loop = {name: chains["open"][name][:, loop].mean() for name in ("keys", "values")}
        closed = {name: chains["closed"][name][:, loop].mean() for name in ("keys", "values")}
        lines.append(_row([loop + 1,
                           f"{open_loop['keys']:.4f}", f"{closed['keys']:.4f}",
                           f"{open_loop['values']:.4f}", f"{closed['values']:.4f}",
                           f"{1 - closed['keys'] / open_loop['keys']:.1%}",
                           f"{1 - closed['values'] / open_loop['values']:.1%}"]))
    return [*lines, ""]


def format_report(results: dict[str, Any], header_lines: list[str]) -> str:
    """The report as markdown (``header_lines`` describe the checkpoint and text)."""
    lines = [
        *_header_section(results, header_lines),
        *_cosine_section(results),
        *_storage_section(results),
        *_attention_section(results),
        *_logits_section(results),
        *_bits_per_byte_section(results),
        *_chain_section(results),
        f"Report computed in {results['seconds']:.0f} s on {jax.default_backend()}.",
    ]
    return "\n".join(lines) + "\n"


def _per_sequence(values) -> str:
    values = [int(v) for v in np.asarray(values)]
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def describe_inputs(checkpoint: Checkpoint, path: Path, corpus_description: dict[str, Any],
                    settings: ReportSettings) -> list[str]:
    """Header lines: the checkpoint, its training and the held-out text."""
    config, info = checkpoint.config, checkpoint.info
    trained = info.get("data", {})
    losses = info.get("held_out_loss_nats_per_byte_by_loops", {})
    training = ", ".join(f"{key}={value}" for key, value in info.get("arguments", {}).items()
                         if key in ("steps", "batch", "seq", "lr", "compute_dtype"))
    lines = [
        f"- checkpoint: `{path}` (arrays sha256 {checkpoint.sha256[:16]}…), "
        f"{ouro.param_count(checkpoint.params):,} parameters, {config.layers} layers x "
        f"{config.loops} loops, {config.heads} heads / {config.kv_heads} KV heads of "
        f"{config.head_dim}; trained {training or 'with unrecorded settings'} on "
        f"{info.get('backend', '?')}.",
    ]
    if losses:
        lines.append("- its recorded held-out loss by loop count (nats/byte): " + ", ".join(
            f"{loops}: {float(loss):.4f}" for loops, loss in losses.items()) + ".")
    lines.append(
        f"- text: {settings.sequences} windows of {settings.tokens} (+1 target) bytes at random "
        f"offsets (seed {settings.seed}) of the held-out split (sorted standard-library .py "
        f"files with index % {HELD_OUT_EVERY} == 0; {corpus_description['held_out_files']} files, "
        f"{corpus_description['held_out_bytes']:,} bytes, Python "
        f"{corpus_description['python_version']}).")
    recorded = trained.get("held_out_sha256")
    if recorded and recorded != corpus_description["held_out_sha256"]:
        lines.append(
            f"- WARNING: these held-out bytes differ from the checkpoint's (trained on Python "
            f"{trained.get('python_version', '?')}): some may have been training data.")
    return lines
