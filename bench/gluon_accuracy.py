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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import test_gluon_decode as gluon_tests


def errors(head_dim: int, version: int, seed: int) -> np.ndarray:
    return gluon_tests.outlier_key_errors(np.random.default_rng(seed), head_dim, version)


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
