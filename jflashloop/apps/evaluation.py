"""``jflashloop eval``: cache policies compared on SmolLM2-135M's real K/V.

For each :func:`jflashloop.apps.quality.standard_policies` policy, on the shipped
English evaluation text (``jflashloop/models/data/eval_text.txt``):

* reconstruction relative error of K and V (per layer and KV head, averaged),
* attention-output relative error against float64 attention on the
  unquantized K/V, with the model's own queries at the last 32 positions
  (mean over layers and query heads, and the worst layer),
* end to end, teacher forced: the first ``--prefix`` tokens are prefilled, the
  rest decoded one token at a time through the cache (pages are packed as
  they fill); perplexity and its change against an unquantized BF16 cache run
  the same way, mean logit KL(BF16 || policy) and next-token agreement.

Usage: ``jflashloop eval [--tokens 512] [--prefix 128] [--markdown bench/QUALITY.md]``
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from ..models import cached_decoding, gguf_loader, llama
from . import quality
from .float64_metrics import kl_divergence, negative_log_likelihoods, next_token_agreement
from .progress import bar as _bar


def teacher_forced(decoder, text_ids, prefix: int, description: str) -> np.ndarray:
    """:func:`quality.teacher_forced_logits` of ``decoder = (decode, state)``, with a progress bar."""
    decode, state = decoder
    bar = _bar(len(text_ids) - prefix - 1, description)
    logits, _ = quality.teacher_forced_logits(decode, text_ids, prefix, state,
                                              progress=bar.update if bar else None)
    if bar:
        bar.close()
    return logits


def evaluate(tokens: int, prefix: int, policies=None) -> tuple[list[dict], dict]:
    """Run every policy; returns (rows, context) for :func:`markdown_table`."""
    params, config, tokenizer = gguf_loader.load_smollm2()
    text_ids = tokenizer.encode(gguf_loader.read_data_text("eval_text.txt")).ids[:tokens]
    _, keys, values, queries = llama.prefill(params, config, np.asarray(text_ids, np.int32))
    model = cached_decoding.CachedModel(params, config, max_tokens=len(text_ids))
    targets = text_ids[prefix + 1:]
    reference = teacher_forced(model.dense(text_ids, prefix), text_ids, prefix, "BF16")
    reference_nll = float(negative_log_likelihoods(reference, targets).mean())
    rows = []
    for policy in policies or quality.standard_policies():
        errors = quality.kv_errors(policy, keys, values, queries)
        logits = teacher_forced(model.paged(policy, text_ids, prefix), text_ids, prefix,
                                 policy.name[:30])
        nll = float(negative_log_likelihoods(logits, targets).mean())
        rows.append({
            "policy": policy.name,
            "bits": policy.bits_per_element(config.num_key_value_heads, config.head_dim),
            "key_error": float(errors["key_error"].mean()),
            "value_error": float(errors["value_error"].mean()),
            "attention_error": float(errors["attention_error"].mean()),
            "attention_error_worst_layer": float(errors["attention_error"].mean(axis=1).max()),
            "perplexity": float(np.exp(nll)),
            "perplexity_change": float(np.exp(nll) - np.exp(reference_nll)),
            "kl": float(kl_divergence(reference, logits).mean()),
            "agreement": next_token_agreement(reference, logits),
        })
        print(f"{policy.name}: attention error {rows[-1]['attention_error']:.4f}, "
              f"perplexity {rows[-1]['perplexity']:.3f}, KL {rows[-1]['kl']:.5f}", flush=True)
    context = {"tokens": len(text_ids), "prefix": prefix, "reference_perplexity": float(np.exp(reference_nll)),
               "backend": jax.default_backend()}
    return rows, context


def markdown_table(rows: list[dict], context: dict) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, {context['tokens']} tokens of `eval_text.txt`; {context['prefix']} prefilled, "
        f"the rest decoded one token at a time; backend {context['backend']}. "
        f"BF16-cache perplexity over the decoded tokens: {context['reference_perplexity']:.3f}.",
        "",
        "| policy | bits/elem | K rec. err | V rec. err | attn-out err (mean) | attn-out err (worst layer) "
        "| perplexity | Δ vs BF16 | mean KL | next-token agreement |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['bits']:.2f} | {r['key_error']:.4f} | {r['value_error']:.4f} | "
            f"{r['attention_error']:.4f} | {r['attention_error_worst_layer']:.4f} | {r['perplexity']:.3f} | "
            f"{r['perplexity_change']:+.3f} | {r['kl']:.5f} | {r['agreement']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jflashloop eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--family", action="store_true",
                        help="also evaluate the rotated and lattice formats (int4_rotated, int2, e8)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    policies = quality.standard_policies()
    if args.family:
        policies += quality.codec_family_policies(64)
    rows, context = evaluate(args.tokens, args.prefix, policies)
    table = markdown_table(rows, context)
    print()
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
