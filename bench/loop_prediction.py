"""Loop 2 of the looped model predicted from loop 1: how much a scaled residual saves.

The cross-loop cache stores loop 2 as ``K2 - rec K1`` (closed loop). Successive
loops of the shipped looped checkpoint are far from equal at loop 2 (cosine
0.1-0.9 per layer, ``bench/LOOPS.md`` section 1), so the plain residual can be
larger than loop 2 itself. This script measures, on the checkpoint's real K/V,
the relative reconstruction error of loop 2 for three encodings at equal bytes:

* ``residual``: ``rec K1 + Q(K2 - rec K1)`` (today's dense residual);
* ``direct``: ``Q(K2)`` (loop 2 stored as a base of its own);
* ``scaled``: ``a * rec K1 + Q(K2 - a * rec K1)``, ``a`` one float per (KV head,
  channel) and layer, fitted by least squares on calibration windows (other
  held-out text than the measured windows; no bytes per token);
* ``linear``: ``P + Q(K2 - P)`` with ``P = [rec K1, 1] @ M``, ``M`` a
  ``[head_dim + 1, head_dim]`` matrix per (layer, KV head) fitted the same way
  (every channel of loop 1 predicts every channel of loop 2).

``Q`` is the library's codec (:func:`jflashloop.encode` / :func:`jflashloop.decode`):
K per channel over 64 tokens, V per token over 64 channels, INT4 or INT3.
Reconstruction error only; no attention or logit metric.

Usage: ``python bench/loop_prediction.py [--windows 8] [--tokens 512]``
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop.apps.float64_metrics import relative_error
from jflashloop.apps.loops.runner import DEFAULT_CHECKPOINT, _forward, held_out_windows
from jflashloop.models.checkpoint import load_checkpoint
from jflashloop.models.stdlib_text import default_root, load_corpus

SPECS = {
    ("keys", "int4"): jflashloop.CodecSpec("int4", "channel", 64),
    ("values", "int4"): jflashloop.CodecSpec("int4", "token", 64),
    ("keys", "int3"): jflashloop.CodecSpec("int3", "channel", 64),
    ("values", "int3"): jflashloop.CodecSpec("int3", "token", 64),
}


def looped_kv(params, config, held_out: np.ndarray, windows: int, tokens: int, seed: int):
    """float32 K and V ``[loops, layers, windows * tokens, kv_heads, head_dim]`` of ``ouro.forward``."""
    ids = jnp.asarray(held_out_windows(held_out, windows, tokens, seed))
    _, keys, values, _ = _forward(params, config, ids)

    def flat(x):
        x = np.asarray(x, np.float32)
        return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])

    return flat(keys), flat(values)


def round_trip(x: np.ndarray, spec) -> np.ndarray:
    """``x`` float32 ``[T, H, C]`` through the codec."""
    return np.asarray(jflashloop.decode(jflashloop.encode(jnp.asarray(x), spec)))


def fit_linear(x1: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """Least-squares ``M [H, C + 1, C]`` with ``x2[:, h] ~ [x1[:, h], 1] @ M[h]`` (``x1, x2 [T, H, C]``)."""
    ones = np.ones((x1.shape[0], 1), x1.dtype)
    return np.stack([np.linalg.lstsq(np.concatenate([x1[:, h], ones], 1), x2[:, h], rcond=None)[0]
                     for h in range(x1.shape[1])])


def predict_linear(matrix: np.ndarray, x1: np.ndarray) -> np.ndarray:
    """``[x1[:, h], 1] @ matrix[h]`` for every head: ``[T, H, C]``."""
    ones = np.ones((x1.shape[0], 1), x1.dtype)
    return np.stack([np.concatenate([x1[:, h], ones], 1) @ matrix[h] for h in range(x1.shape[1])], axis=1)


def loop2_errors(calibration: np.ndarray, measured: np.ndarray, stream: str, codec: str) -> dict[str, float]:
    """Errors of loop 2 of one layer's stream (``[loops, T, H, C]`` arrays) for the four encodings."""
    spec, base_spec = SPECS[(stream, codec)], SPECS[(stream, "int4")]
    c1 = round_trip(calibration[0], base_spec)
    scale = (calibration[1] * c1).sum(axis=0) / (c1 * c1).sum(axis=0)  # [H, C], least squares
    x1 = round_trip(measured[0], base_spec)
    x2 = measured[1]
    predicted = predict_linear(fit_linear(c1, calibration[1]), x1)
    return {
        "residual": relative_error(x1 + round_trip(x2 - x1, spec), x2),
        "direct": relative_error(round_trip(x2, spec), x2),
        "scaled": relative_error(scale * x1 + round_trip(x2 - scale * x1, spec), x2),
        "linear": relative_error(predicted + round_trip(x2 - predicted, spec), x2),
        "scale_mean": scale.mean(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="held-out windows measured (and calibrated on)")
    parser.add_argument("--tokens", type=int, default=512, help="bytes per window (a multiple of 64)")
    parser.add_argument("--seed", type=int, default=0, help="picks the measured windows")
    parser.add_argument("--calibration-seed", type=int, default=100, help="picks the calibration windows")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    checkpoint = load_checkpoint(DEFAULT_CHECKPOINT)
    corpus = load_corpus(default_root())
    measured = looped_kv(checkpoint.params, checkpoint.config, corpus.held_out, args.windows, args.tokens, args.seed)
    calibration = looped_kv(checkpoint.params, checkpoint.config, corpus.held_out, args.windows, args.tokens,
                            args.calibration_seed)
    print("| layer | stream | codec | residual | direct | scaled (mean a) | scaled vs residual | linear | "
          "linear vs residual |")
    print("|---|---|---|---|---|---|---|---|---|")
    for codec in ("int4", "int3"):
        for layer in range(checkpoint.config.layers):
            for index, stream in enumerate(("keys", "values")):
                e = loop2_errors(calibration[index][:, layer], measured[index][:, layer], stream, codec)
                print(f"| {layer + 1} | {stream} | {codec} | {e['residual']:.4f} | {e['direct']:.4f} | "
                      f"{e['scaled']:.4f} ({e['scale_mean']:.2f}) | {e['residual'] / e['scaled']:.2f}x | "
                      f"{e['linear']:.4f} | {e['residual'] / e['linear']:.2f}x |")
    print(f"\n{args.windows} windows of {args.tokens} bytes (seed {args.seed}), calibrated on seed "
          f"{args.calibration_seed}; {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
