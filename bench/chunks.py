"""Many query tokens over the packed cache (GPU): speculative verification, chunked prefill, append_tokens.

Usage:
  python bench/chunks.py            # the table of bench/RESULTS.md
  python bench/chunks.py --quick    # tiny shapes (runs on a CPU too: a smoke test of the script)

Rows (INT4 FlashLoop policy, loop 1, 64-token pages, head_dim 128):

* speculative verification: chunk 4 and 8, B8 Hq32 Hkv8, 32K cached tokens;
* chunked prefill: chunk 512, B1 Hq32 Hkv8, 32K cached tokens;

each against cuDNN BF16 attention of the same queries over the same
positions (the cached tokens and the chunk, causal within the chunk), in the
same run, with the explicit mask and (a lower bound of cuDNN's time)
without it. Then ``paged_cache.append_tokens`` of a 512-token chunk (8 KV
heads, one loop) against the chunk-attention call. Device time: 12 calls
inside one jitted function (``kernel_formulations.device_ms``).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import jflashloop
from jflashloop import paged_cache

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode as bench
from kernel_formulations import device_ms

HEAD_DIM = 128


def cudnn_chunk(queries, keys, values):
    """queries [B, C, Hq, D] at the last C of T + C positions; keys/values [B, T + C, Hkv, D]; causal."""
    chunk, total = queries.shape[1], keys.shape[1]
    mask = jnp.arange(total)[None, :] <= (total - chunk + jnp.arange(chunk))[:, None]
    return jax.nn.dot_product_attention(queries, keys, values, mask=mask[None, None], implementation="cudnn")


def cudnn_unmasked(queries, keys, values):
    """The same without a mask: a lower bound of cuDNN's time for these positions (no mask tensor read)."""
    return jax.nn.dot_product_attention(queries, keys, values, implementation="cudnn")


def _timed(fn, queries, operands) -> str:
    try:
        return f"{device_ms(fn, queries, operands):.3f}"
    except Exception as failure:  # report and go on
        return f"failed: {type(failure).__name__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tokens = 256 if args.quick else 32768
    shapes = [("speculative", 8, 32, 8, 4), ("speculative", 8, 32, 8, 8), ("chunked prefill", 1, 32, 8, 512)]
    if args.quick:
        shapes = [(name, 2, 4, 2, min(chunk, 16)) for name, _, _, _, chunk in shapes]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {tokens} cached tokens, head_dim {HEAD_DIM}")
    print("| case | B Hq Hkv | chunk | cuDNN BF16 ms (mask) | cuDNN BF16 ms (no mask) | chunk_attention ms "
          "| x cuDNN (mask) | x cuDNN (no mask) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, sequences, q_heads, kv_heads, chunk in shapes:
        config = bench.make_config(sequences, kv_heads, tokens + chunk, 1, head_dim=HEAD_DIM)
        cache = bench.random_cache(config, tokens, 0)
        key = jax.random.key(1)
        kq, kk, kv = jax.random.split(key, 3)
        queries = jax.random.normal(kq, (sequences, chunk, q_heads, HEAD_DIM), jnp.bfloat16)
        own_k = jax.random.normal(kk, (sequences, chunk, kv_heads, HEAD_DIM), jnp.bfloat16)
        own_v = jax.random.normal(kv, (sequences, chunk, kv_heads, HEAD_DIM), jnp.bfloat16)
        counts = jnp.full((sequences,), chunk, jnp.int32)
        dense_k = jax.random.normal(kk, (sequences, tokens + chunk, kv_heads, HEAD_DIM), jnp.bfloat16)
        dense_v = jax.random.normal(kv, (sequences, tokens + chunk, kv_heads, HEAD_DIM), jnp.bfloat16)
        cudnn = _timed(cudnn_chunk, queries, [(dense_k, dense_v)])
        unmasked = _timed(cudnn_unmasked, queries, [(dense_k, dense_v)])
        timed = {}
        for implementation in ("xla", "gluon", "dense"):
            try:
                ours_ms = device_ms(
                    lambda q, c, k, v, n, i=implementation: jflashloop.chunk_attention(
                        q, c, 0, 0, k, v, n, implementation=i), queries, [(cache, own_k, own_v, counts)])
            except NotImplementedError as reason:
                print(f"| {name} | {sequences} {q_heads} {kv_heads} | {chunk} | {cudnn} | {unmasked} | "
                      f"{implementation}: {str(reason)[:120]} | | |", flush=True)
                continue
            timed[implementation] = ours_ms
            ratios = [f"{float(t) / ours_ms:.2f}x" if not t.startswith("failed") else "" for t in (cudnn, unmasked)]
            print(f"| {name} | {sequences} {q_heads} {kv_heads} | {chunk} | {cudnn} | {unmasked} | {implementation} "
                  f"{ours_ms:.3f} | {' | '.join(ratios)} |", flush=True)
        if name == "chunked prefill":
            keys = jnp.broadcast_to(own_k[None, None], (1, 1, *own_k.shape))
            values = jnp.broadcast_to(own_v[None, None], (1, 1, *own_v.shape))
            def appended(q, c, k, v, n):  # one element of every leaf: no part of the new cache is dead code
                leaves = jax.tree.leaves(paged_cache.append_tokens(c, k + q[0, 0, 0, 0], v, n))
                return sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves)

            append_ms = device_ms(appended, queries, [(cache, keys, values, counts)])
            print(f"\nappend_tokens of a {chunk}-token chunk ({kv_heads} KV heads, one loop): {append_ms:.3f} ms "
                  f"(chunk attention of it: {', '.join(f'{k} {v:.3f} ms' for k, v in timed.items())})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
