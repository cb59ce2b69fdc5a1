"""The fitted codecs on the looped model's dense loops: attention error of loop 1 (the base) and loop 2 (stored
on its own, ``direct``) with INT4 G64 against ``int_mixed`` keys and ``int4_scaled`` values (bench/LOOPS.md,
"Codecs fitted to the model").

The tables are fitted (:mod:`jflashloop.fitting`) per layer and loop on calibration windows (seed 100) and
measured on other held-out windows (seed 0): 8 windows of 512 bytes each, as ``jflashloop loops --policies``
fits its ``fit`` codecs (``policies.fitted_specs``): keys' weights (:func:`jflashloop.fitting.key_channel_weights`)
from the model's own queries at the last 32 positions of each calibration window and the key spans of its tokens
after the sinks, averaged over the windows; values' divisors from the calibration values' RMS after the sinks. Every stream is coded on its own, pages of 64
tokens from position 0, the first 4 and the last 16 tokens exact (the report's windows). Attention error: the
model's own queries at the last 32 positions of each measured window, float64 causal attention over the window,
relative error against the exact K/V, mean over windows and layers.

Usage: ``python bench/looped_fitted_probe.py`` (about 30 s on 2 CPU cores).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop import fitting
from jflashloop.apps.float64_metrics import causal_attention_float64, relative_error
from jflashloop.apps.loops.runner import (
    DEFAULT_CHECKPOINT,
    _forward,
    held_out_windows,
    model_queries,
)
from jflashloop.models.checkpoint import load_checkpoint
from jflashloop.models.stdlib_text import default_root, load_corpus

TOKENS, WINDOWS, SINKS, RECENT, SCORED = 512, 8, 4, 16, 32
POLICIES = ("int4", "fitted 4 + scaled", "fitted 3.5 + scaled", "fitted 3 + scaled", "fitted 4 + int4",
            "int4 + scaled", "fitted 4 + scaled, principal axes", "fitted 3.5 + scaled, principal axes")
"""Key code + value code: INT4 G64, or fitted key widths at a mean of 4, 3.5 or 3 bits, or the fitted value
scales; ``, principal axes``: both coded in a fitted orthogonal basis per (layer, KV head) (:func:`principal_axes`:
scores and outputs are unchanged by it, so a kernel would rotate the query and the output instead)."""


def looped_tensors(params, config, held_out, seed: int):
    """float32 K, V ``[loops, layers, windows, T, kv_heads, D]`` and the queries of the last SCORED positions
    ``[loops, layers, windows, SCORED, heads, D]``."""
    ids = jnp.asarray(held_out_windows(held_out, WINDOWS, TOKENS, seed))
    _, keys, values, _ = _forward(params, config, ids)
    queries = model_queries(params, config, ids, SCORED)
    return tuple(np.asarray(x, np.float32) for x in (keys, values, queries))


def coded(x: np.ndarray, spec) -> np.ndarray:
    """One window ``[T, H, D]`` through ``spec``, the sink and recent tokens exact."""
    out = np.array(jflashloop.decode(jflashloop.encode(jnp.asarray(x), spec)))
    out[:SINKS] = x[:SINKS]
    out[TOKENS - RECENT:] = x[TOKENS - RECENT:]
    return out


def principal_axes(x: np.ndarray) -> np.ndarray:
    """float64 ``[H, D, D]``, orthogonal per head: the eigenvectors of ``E[x x^T]`` of ``x`` ``[N, H, D]``
    (columns by decreasing eigenvalue)."""
    x = x.astype(np.float64)
    return np.stack([np.linalg.eigh(x[:, h].T @ x[:, h])[1][:, ::-1] for h in range(x.shape[1])])


def rotated(x: np.ndarray, axes) -> np.ndarray:
    """``x`` ``[..., H, D]`` in the basis ``axes`` ``[H, D, D]`` (``x`` itself for ``None``)."""
    return x if axes is None else np.einsum("...hd,hde->...he", x, axes)


def unrotated(x: np.ndarray, axes) -> np.ndarray:
    return x if axes is None else np.einsum("...he,hde->...hd", x, axes)


def specs(policy: str, keys, values, queries):
    """``(key_spec, value_spec, key_axes, value_axes)`` of ``policy`` fitted to one layer and loop of the
    calibration windows (the axes ``None`` without a basis)."""
    policy, _, basis = policy.partition(", ")
    key_code, value_code = policy.split(" + ") if " + " in policy else (policy, policy)
    heads, head_dim = keys.shape[-2:]
    key_axes = value_axes = None
    if basis == "principal axes":
        key_axes = principal_axes(keys[:, SINKS:].reshape(-1, heads, head_dim))
        value_axes = principal_axes(values[:, SINKS:].reshape(-1, heads, head_dim))
        group = queries.shape[-2] // heads  # query head j reads KV head j // group
        keys, values = rotated(keys, key_axes), rotated(values, value_axes)
        queries = rotated(queries.reshape(*queries.shape[:-2], heads, group, head_dim).swapaxes(-2, -3),
                          key_axes).swapaxes(-2, -3).reshape(queries.shape)
    if key_code == "int4":
        key_spec = jflashloop.INT4_KEYS
    else:
        weights = np.mean([fitting.key_channel_weights(keys[w], queries[w]) for w in range(len(keys))], axis=0)
        key_spec = fitting.keys_from_weights(weights, float(key_code.split()[1]))
    value_spec = jflashloop.INT4_VALUES if value_code == "int4" else fitting.fitted_values(
        values[:, SINKS:].reshape(-1, heads, head_dim), sink_tokens=0)
    return key_spec, value_spec, key_axes, value_axes


def main() -> None:
    started = time.perf_counter()
    checkpoint = load_checkpoint(DEFAULT_CHECKPOINT)
    held_out = load_corpus(default_root()).held_out
    calibration = looped_tensors(checkpoint.params, checkpoint.config, held_out, 100)
    keys, values, queries = looped_tensors(checkpoint.params, checkpoint.config, held_out, 0)
    positions = np.arange(TOKENS - SCORED, TOKENS)
    print("| loop | keys + values | bits/elem (pages) | attn-out err |\n|---|---|---|---|")
    for loop in (0, 1):
        for policy in POLICIES:
            errors, bits = [], None
            for layer in range(checkpoint.config.layers):
                key_spec, value_spec, key_axes, value_axes = specs(policy, *(x[loop, layer] for x in calibration))
                bits = (key_spec.bits_per_element() + value_spec.bits_per_element()) / 2
                for window in range(WINDOWS):
                    k, v = keys[loop, layer, window], values[loop, layer, window]
                    q = queries[loop, layer, window]
                    exact = causal_attention_float64(q, k, v, positions)
                    approx = causal_attention_float64(q, unrotated(coded(rotated(k, key_axes), key_spec), key_axes),
                                                      unrotated(coded(rotated(v, value_axes), value_spec), value_axes),
                                                      positions)
                    errors.append(relative_error(approx, exact))
            print(f"| {loop + 1} | {policy} | {bits:g} | {np.mean(errors):.4f} |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
