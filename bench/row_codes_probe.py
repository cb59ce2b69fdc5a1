"""Which code should the looped cache's sparse rows take? (bench/LOOPS.md, "Codes for the sparse rows")

Loops 3 and 4 of the cross-loop cache store, per 64-token page and KV head, the rows of largest residual
energy (``|K_r - rec K_(r-1)|^2 + |V_r - rec V_(r-1)|^2``) as a sparse residual against the loop before; the
other rows inherit it. ``bench/LOOPS.md`` found more rows at 2.25 bits (INT2 Lloyd-Max, after a randomized
Hadamard rotation per head) better than FlashLoop's INT4 rows at fewer bytes, but no fused kernel reads
rotated rows. This probe measures, on the shipped looped checkpoint's real K/V, whether an affine INT2 row
code (the ``"int2"`` format: ``reference.int4``'s rule with codes 0..3, float16 scale and minimum per token over
64 channels: 2.5 bits, no rotation: the fused kernels' row path could read it) keeps the Lloyd-Max rows' gain.

Loop 2 is stored on its own (``CacheConfig.flashloop(direct_loop=True)``: dense INT4 G64, K per channel over
the page, V per token); loops 3 and 4 are sparse residuals against it as above, rows chosen on the residual
against the reconstructed loop before (closed loop), ties to the lower position. Reported: the relative
reconstruction error of loops 3 and 4 (Frobenius over all tokens, keys and values apart, mean over layers)
and the bytes a page and KV head of loops 3 and 4's rows take (K and V codes and metadata, a byte of position a
row).
Reconstruction error only; ``jflashloop loops --policies`` gives the KL of a policy once its row code is a
library codec.

Usage: ``python bench/row_codes_probe.py [--windows 8] [--tokens 512]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from loop_prediction import looped_kv, round_trip

import jflashloop
from jflashloop.apps.float64_metrics import relative_error
from jflashloop.apps.loops.runner import DEFAULT_CHECKPOINT
from jflashloop.models.checkpoint import load_checkpoint
from jflashloop.models.stdlib_text import default_root, load_corpus

PAGE = 64
BASE_KEYS = jflashloop.CodecSpec("int4", "channel", 64)
BASE_VALUES = jflashloop.CodecSpec("int4", "token", 64)


def row_codes(head_dim: int) -> dict[str, tuple]:
    """``name: (round trip of rows [T, H, C], bytes of a row's K or V)`` for every row code (codes and metadata)."""
    def library(spec):
        return (lambda x: round_trip(x, spec)), round(spec.bits_per_element((1, 1, head_dim)) * head_dim / 8)

    return {
        "INT4 G64": library(jflashloop.CodecSpec("int4", "token", 64)),
        "INT3 G64": library(jflashloop.CodecSpec("int3", "token", 64)),
        "INT2 Lloyd-Max (rotated)": library(jflashloop.codecs.int2_lloyd_max(head_dim, 0)),
        "INT2 affine G64": library(jflashloop.CodecSpec("int2", "token", 64)),
        "INT2 affine G32": library(jflashloop.CodecSpec("int2", "token", 32)),
    }


def sparse_loop(exact_k, exact_v, previous_k, previous_v, rows: int, code):
    """The next loop's reconstruction: ``rows`` rows a page and head (largest residual energy) coded by
    ``code`` onto ``previous``; arrays ``[T, H, C]`` with T a multiple of :data:`PAGE`."""
    res_k, res_v = exact_k - previous_k, exact_v - previous_v
    tokens, heads, _ = res_k.shape
    energy = (res_k ** 2).sum(-1) + (res_v ** 2).sum(-1)  # [T, H]
    paged = energy.reshape(tokens // PAGE, PAGE, heads)
    order = np.argsort(-paged, axis=1, kind="stable")[:, :rows]  # [pages, rows, H]: ties to the lower position
    chosen = (order + (np.arange(tokens // PAGE) * PAGE)[:, None, None]).reshape(-1, heads)  # [pages * rows, H]
    out_k, out_v = previous_k.copy(), previous_v.copy()
    for h in range(heads):
        picked = chosen[:, h]
        out_k[picked, h] += code(res_k[picked, h][:, None])[:, 0]
        out_v[picked, h] += code(res_v[picked, h][:, None])[:, 0]
    return out_k, out_v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="held-out windows")
    parser.add_argument("--tokens", type=int, default=512, help="bytes per window (a multiple of 64)")
    parser.add_argument("--seed", type=int, default=0, help="picks the windows")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    checkpoint = load_checkpoint(DEFAULT_CHECKPOINT)
    keys, values = looped_kv(checkpoint.params, checkpoint.config, load_corpus(default_root()).held_out,
                             args.windows, args.tokens, args.seed)
    layers, head_dim = checkpoint.config.layers, checkpoint.config.head_dim
    base = [(round_trip(keys[1, layer], BASE_KEYS), round_trip(values[1, layer], BASE_VALUES)) for layer in range(layers)]
    print("| rows (loop 3 / loop 4 a page) | code | bytes of a row's K or V | rows' bytes a page and head (loops 3 + 4) "
          "| loop 3 K err | loop 3 V err | loop 4 K err | loop 4 V err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (code, row_bytes) in row_codes(head_dim).items():
        for rows3, rows4 in ((16, 7), (24, 10), (32, 16)):
            errors = np.zeros(4)
            for layer in range(layers):
                k3, v3 = sparse_loop(keys[2, layer], values[2, layer], *base[layer], rows3, code)
                k4, v4 = sparse_loop(keys[3, layer], values[3, layer], k3, v3, rows4, code)
                errors += [relative_error(k3, keys[2, layer]), relative_error(v3, values[2, layer]),
                           relative_error(k4, keys[3, layer]), relative_error(v4, values[3, layer])]
            errors /= layers
            print(f"| {rows3} / {rows4} | {name} | {row_bytes} | {(2 * row_bytes + 1) * (rows3 + rows4)} | "
                  + " | ".join(f"{e:.4f}" for e in errors) + " |", flush=True)
    print(f"\n{args.windows} windows of {args.tokens} bytes (seed {args.seed}); {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
