"""Accuracy of the Gluon decode kernel on keys with outlier channels, over many random caches.

Runs the kernel's own body through the CPU emulation (``jflashloop_triton_kernels.emulate``), or
compiled on a GPU with jax_triton, against the reference path, on the data of
``tests/test_gluon_decode.py::test_gluon_kernel_outlier_channels_and_pending_token``: keys with 6
channels 10x the rest plus per-channel offsets 3x the spread, 64-token pages, three sequences of
700, 65 and 1000 tokens. Prints the relative error (Frobenius norm per sequence) over the seeds.

  python bench/gluon_accuracy.py --head-dims 64,128,256 --versions 3,5 --seeds 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jflashloop
from tests import test_gluon_decode as gluon_tests


def errors(head_dim: int, version: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    config = gluon_tests.one_loop_config(head_dim, 64, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache = jflashloop.paged_cache.create(config)
    for slot, length in enumerate([700, 65, 1000]):
        keys = rng.standard_normal((config.num_layers, 1, 1024, 2, head_dim))
        keys[..., :6] *= 10
        keys += rng.standard_normal((1, 1, 1, 2, head_dim)) * 3
        values = rng.standard_normal((config.num_layers, 1, 1024, 2, head_dim))
        cache = jflashloop.paged_cache.prefill(cache, slot, jnp.asarray(keys, jnp.float32),
                                               jnp.asarray(values, jnp.float32), length)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=True)
    actual = gluon_tests.gluon_attention(queries, cache, 0, include_pending=True, version=version)
    return gluon_tests.relative_errors(actual, expected)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--versions", default="3,5",
                        help=f"tests/test_gluon_decode.py VERSIONS keys: {gluon_tests.VERSIONS}")
    parser.add_argument("--seeds", type=int, default=100)
    args = parser.parse_args()
    print("| head_dim | kernel | caches | median | 99th percentile | max | caches above 2e-3 |")
    print("|---|---|---|---|---|---|---|")
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        for version in (int(v) for v in args.versions.split(",")):
            worst = np.array([errors(head_dim, version, seed).max() for seed in range(args.seeds)])
            print(f"| {head_dim} | {gluon_tests.VERSIONS[version] or 'default'} | {args.seeds} | "
                  f"{np.median(worst):.2e} | {np.percentile(worst, 99):.2e} | {worst.max():.2e} | "
                  f"{int((worst > 2e-3).sum())} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
