"""``jflashloop demo``: SmolLM2-135M-Instruct on BF16, INT4 and NVFP4 KV caches.

Runs the shipped prompt (an English paragraph followed by a question) through
the model with three caches, greedy-generates an answer with the BF16 cache,
and prints one table: KV bytes per token and the ratio to BF16, next-token
agreement with BF16 and mean logit KL over the generated text (teacher forced
through each cache), perplexity on the shipped paragraph, and decode
tokens/s. It also writes a PNG plot of attention-output error against bits
per element for the standard cache policies (bench/QUALITY.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from .. import NVFP4, Policy, storage
from ..models import cached_decoding, gguf_loader, llama
from . import quality
from .float64_metrics import kl_divergence, negative_log_likelihoods, next_token_agreement
from .progress import bar as _progress

QUESTION = "Through which capital cities does the Danube flow?"


def _bf16_bytes_per_token(config) -> int:
    return config.num_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def _paged_bytes_per_token(policy: Policy, config) -> float:
    cache = policy.cache_config(
        num_layers=config.num_layers, num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, max_tokens=64,
    )
    return storage.bytes_per_token(cache) * config.num_layers


def run(args) -> int:
    started = time.perf_counter()
    print(f"jflashloop demo on {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    params, config, tokenizer = gguf_loader.load_smollm2()
    paragraph = gguf_loader.read_data_text("paragraph.txt")
    paragraph_ids = tokenizer.encode(paragraph).ids
    prompt_ids = tokenizer.encode(gguf_loader.format_chat_prompt(f"{paragraph}\n\n{QUESTION}")).ids
    model = cached_decoding.CachedModel(params, config, max_tokens=len(prompt_ids) + args.generate + 8)
    caches = {
        "BF16 (unquantized)": None,
        "INT4 (jflashloop default)": quality.DEFAULT_POLICY,
        "NVFP4": Policy("NVFP4 K and V", NVFP4, NVFP4),  # the default windows, as the INT4 row
    }
    prefix = len(prompt_ids) - 1
    paragraph_prefix = 16
    steps = args.generate + (len(paragraph_ids) - 1 - paragraph_prefix)
    rows, reference_logits, answer = [], None, None
    for name, policy in caches.items():
        bar = _progress(steps, name)
        tick = bar.update if bar is not None else None

        def make(token_ids, first, policy=policy):
            if policy is None:
                return model.dense(token_ids, first)
            return model.paged(policy, token_ids, first, prefill_chunk=args.prefill_chunk or None)

        if policy is None:
            decode, state = make(prompt_ids, prefix)
            answer, reference_logits = cached_decoding.greedy_continuation(
                decode, state, prompt_ids, prefix, args.generate, progress=tick
            )
            kl, agree = 0.0, 1.0
        else:
            decode, state = make(prompt_ids + answer, prefix)
            logits, _ = quality.teacher_forced_logits(decode, prompt_ids + answer, prefix, state, progress=tick)
            logits = np.concatenate([logits, reference_logits[-1:]])[: len(answer)]
            kl = float(kl_divergence(reference_logits[:-1], logits[:-1]).mean())
            agree = next_token_agreement(reference_logits[:-1], logits[:-1])
        decode, state = make(paragraph_ids, paragraph_prefix)
        jax.block_until_ready(decode(np.asarray([paragraph_ids[paragraph_prefix]], np.int32),
                                     np.asarray([paragraph_prefix], np.int32), state))
        timer = time.perf_counter()
        logits, _ = quality.teacher_forced_logits(decode, paragraph_ids, paragraph_prefix, state, progress=tick)
        tokens_per_second = logits.shape[0] / (time.perf_counter() - timer)
        nll = negative_log_likelihoods(logits, paragraph_ids[paragraph_prefix + 1:]).mean()
        if bar is not None:
            bar.close()
        per_token = _bf16_bytes_per_token(config) if policy is None else _paged_bytes_per_token(policy, config)
        rows.append((name, per_token, kl, agree, float(np.exp(nll)), tokens_per_second))
    bf16 = rows[0][1]
    print(f"\nPrompt ({len(prompt_ids)} tokens, chat template): the shipped paragraph + {QUESTION!r}")
    print(f"BF16 answer ({args.generate} tokens): {tokenizer.decode(answer)!r}\n")
    header = ("| cache | KV bytes/token | vs BF16 | next-token agreement | mean logit KL | "
              "paragraph perplexity | decode tokens/s |")
    print(header)
    print("|---|---|---|---|---|---|---|")
    for name, per_token, kl, agree, perplexity, speed in rows:
        print(f"| {name} | {per_token:,.0f} | {bf16 / per_token:.2f}x | {agree:.1%} | {kl:.5f} | "
              f"{perplexity:.3f} | {speed:.1f} |")
    if args.prefill_chunk:
        print(f"\n(The jflashloop caches took the prompt by chunked prefill, {args.prefill_chunk} tokens per chunk.)")
    print(f"\n(KV bytes: all {config.num_layers} layers, full pages; windows of 4 sink + 64 ring tokens "
          f"per sequence are extra. Agreement and KL over the {args.generate - 1} answer tokens after the "
          f"first, teacher forced; perplexity over tokens {paragraph_prefix + 1}-{len(paragraph_ids) - 1} "
          f"of the paragraph decoded one by one.)")
    if args.plot:
        _plot(args, params, config, tokenizer)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def _plot(args, params, config, tokenizer) -> None:
    text_ids = tokenizer.encode(gguf_loader.read_data_text("eval_text.txt")).ids[: args.plot_tokens]
    _, keys, values, queries = llama.prefill(params, config, np.asarray(text_ids, np.int32))
    points = []
    policies = quality.standard_policies()
    bar = _progress(len(policies), "policies")
    for policy in policies:
        errors = quality.kv_errors(policy, keys, values, queries)
        cache_config = policy.cache_config(
            num_layers=1, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            max_tokens=len(text_ids),
        )
        # Everything the sequence holds (full pages and the unquantized windows) per element.
        stored_bits = 8 * storage.sequence_bytes(cache_config, len(text_ids)) / (
            len(text_ids) * 2 * config.num_key_value_heads * config.head_dim
        )
        points.append((policy.name, stored_bits, float(errors["attention_error"].mean())))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install 'jflashloop[demo]')")
        return
    figure, axes = plt.subplots(figsize=(9, 5.5))
    for name, bits, error in points:
        axes.scatter(bits, error)
        axes.annotate(name, (bits, error), fontsize=7, xytext=(4, 2), textcoords="offset points")
    axes.set_xlabel(f"bits per K/V element stored for the {len(text_ids)}-token sequence (pages + windows)")
    axes.set_xlim(min(p[1] for p in points) - 0.2, max(p[1] for p in points) + 1.6)
    axes.set_ylabel("attention-output relative error (mean over layers and heads)")
    axes.set_yscale("log")
    axes.set_title(f"SmolLM2-135M, {len(text_ids)} tokens of shipped English text")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generate", type=int, default=24, help="answer tokens to generate")
    parser.add_argument("--plot", default="jflashloop_demo.png", help="PNG path ('' to skip)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="put the prompt into the jflashloop caches by chunked prefill of this many "
                             "tokens per chunk (chunk_attention + append_tokens); 0: one exact prefill")
    parser.add_argument("--plot-tokens", type=int, default=512)
    parser.set_defaults(run=run)
