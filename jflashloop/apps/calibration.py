"""Learned calibration of codec parameters with optax (straight-through estimator).

Two calibrations, each fitted on the model's own K/V and queries of one text
and evaluated on held-out text:

* **INT4 key clipping**: one factor ``alpha`` in (0, 1] per (layer, KV head,
  channel) shrinks every 64-token group's range about its centre,
  ``[mid - alpha * half, mid + alpha * half]``; values outside saturate. A
  handful of outlier tokens then no longer set the step size of the whole
  group.
* **NVFP4 tensor scale**: one factor ``gamma`` per (layer, K or V) multiplies
  the amax-derived global scale (``gamma < 1`` clips the largest values and
  refines every E4M3 block scale).

The loss is the attention-output error (float32 causal attention with the
model's queries over the fake-quantized K/V, against the unquantized K/V);
rounding steps pass gradients straight through (``x + stop_gradient(round(x) - x)``).

``python -m jflashloop.apps.calibration`` runs both on SmolLM2-135M and prints
the held-out gain over the plain min/max (``alpha = 1``, ``gamma = 1``) codecs.
The fits need optax (``pip install 'jflashloop[calibration]'``).
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..models import gguf_loader, llama


def _optax():
    """The optax module; a clear error naming the extra when it is not installed."""
    try:
        import optax
    except ImportError as error:
        raise ImportError(
            "learned calibration needs optax: pip install 'jflashloop[calibration]'") from error
    return optax


def _round_straight_through(x: jax.Array) -> jax.Array:
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def _float16_straight_through(x: jax.Array) -> jax.Array:
    rounded = jnp.clip(x, -65504.0, 65504.0).astype(jnp.float16).astype(jnp.float32)
    return x + jax.lax.stop_gradient(rounded - x)


def fake_int4_channel(x: jax.Array, alpha: jax.Array, group: int = 64) -> jax.Array:
    """INT4 per channel over ``group``-token groups with clipped ranges (differentiable).

    Args:
      x: float32 ``[T, H, D]`` with ``T`` a multiple of ``group``.
      alpha: float32 ``[H, D]`` in (0, 1]; ``alpha = 1`` is the plain codec.
    Returns:
      float32 ``[T, H, D]``: the reconstruction.
    """
    tokens, heads, dim = x.shape
    groups = x.reshape(tokens // group, group, heads, dim)
    low, high = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    middle, half = (low + high) / 2, (high - low) / 2
    low = _float16_straight_through(middle - alpha * half)
    scale = _float16_straight_through(jnp.maximum(2 * alpha * half / 15, 1e-8))
    codes = jnp.clip(_round_straight_through((groups - low) / scale), 0.0, 15.0)
    return (codes * scale + low).reshape(tokens, heads, dim)


def _e2m1_straight_through(magnitude: jax.Array) -> jax.Array:
    levels = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    nearest = levels[jnp.argmin(jnp.abs(magnitude[..., None] - levels), axis=-1)]
    return magnitude + jax.lax.stop_gradient(nearest - magnitude)


def _e4m3_straight_through(x: jax.Array) -> jax.Array:
    rounded = jnp.clip(x, 2.0**-9, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return x + jax.lax.stop_gradient(rounded - x)


def fake_nvfp4(x: jax.Array, gamma: jax.Array) -> jax.Array:
    """NVFP4 with the global scale ``gamma * amax / 2688`` (differentiable; saturates at 6).

    Args:
      x: float32 ``[T, H, D]`` (``D`` a multiple of 16).
      gamma: float32 scalar > 0; 1 is the plain codec.
    """
    tokens, heads, dim = x.shape
    global_scale = gamma * jax.lax.stop_gradient(jnp.max(jnp.abs(x))) / (6 * 448)
    blocks = x.reshape(tokens, heads, dim // 16, 16)
    # The E4M3 block scales are constants for the gradient (passing it straight
    # through them would cancel the global scale's effect on the step size).
    local = jax.lax.stop_gradient(_e4m3_straight_through(
        jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / (6 * global_scale)))
    step = local * global_scale
    magnitude = jnp.minimum(jnp.abs(blocks) / step, 6.0)
    return (jnp.sign(blocks) * _e2m1_straight_through(magnitude) * step).reshape(tokens, heads, dim)


def causal_attention(queries, keys, values, positions):
    """float32 attention of queries ``[Q, q_heads, D]`` at ``positions`` over keys ``[T, kv_heads, D]``."""
    group = queries.shape[1] // keys.shape[1]
    keys, values = jnp.repeat(keys, group, axis=1), jnp.repeat(values, group, axis=1)
    scores = jnp.einsum("qhd,thd->qht", queries, keys, precision=jax.lax.Precision.HIGHEST)
    scores = scores / math.sqrt(queries.shape[-1])
    allowed = jnp.arange(keys.shape[0])[None, None, :] <= positions[:, None, None]
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("qht,thd->qhd", weights, values, precision=jax.lax.Precision.HIGHEST)


def attention_error(queries, keys, values, keys_hat, values_hat, positions) -> jax.Array:
    """Relative error of the attention output (Frobenius norm over queries, heads, channels)."""
    exact = causal_attention(queries, keys, values, positions)
    approx = causal_attention(queries, keys_hat, values_hat, positions)
    return jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact)


def _query_positions(tokens: int, count: int) -> np.ndarray:
    return np.linspace(tokens // 4, tokens - 1, count).astype(np.int32)


def calibrate_key_clipping(keys, values, queries, *, steps: int = 150, learning_rate: float = 0.02,
                           query_count: int = 64, per_channel: bool = False) -> np.ndarray:
    """Fit ``alpha`` ``[layers, H, D]`` for INT4 per-channel keys (values left exact).

    Args:
      keys, values: float32 ``[layers, T, H, D]`` calibration K/V (``T`` a multiple of 64).
      queries: float32 ``[layers, T, q_heads, D]``.
      per_channel: fit one factor per channel (overfits a few hundred
        calibration tokens, measured); by default one per (layer, KV head),
        broadcast over its channels.
    """
    optax = _optax()
    positions = _query_positions(keys.shape[1], query_count)

    def loss(logits, layer_keys, layer_values, layer_queries):
        alpha = jnp.broadcast_to(jax.nn.sigmoid(logits), layer_keys.shape[1:])
        keys_hat = fake_int4_channel(layer_keys, alpha)
        return attention_error(layer_queries[positions], layer_keys, layer_values, keys_hat, layer_values,
                               positions)

    optimizer = optax.adam(learning_rate)

    @jax.jit
    def fit(layer_keys, layer_values, layer_queries):
        shape = layer_keys.shape[1:] if per_channel else (layer_keys.shape[1], 1)
        logits = jnp.full(shape, 4.0)  # alpha ~ 0.98

        def step(carry, _):
            logits, state = carry
            value, gradient = jax.value_and_grad(loss)(logits, layer_keys, layer_values, layer_queries)
            updates, state = optimizer.update(gradient, state, logits)
            return (optax.apply_updates(logits, updates), state), value

        (logits, _), _ = jax.lax.scan(step, (logits, optimizer.init(logits)), None, length=steps)
        return jnp.broadcast_to(jax.nn.sigmoid(logits), layer_keys.shape[1:])

    return np.stack([np.asarray(fit(keys[i], values[i], queries[i])) for i in range(keys.shape[0])])


def calibrate_nvfp4_scale(keys, values, queries, *, steps: int = 100, learning_rate: float = 0.05,
                          query_count: int = 64) -> np.ndarray:
    """Fit ``gamma`` ``[layers, 2]`` (keys, values) multiplying NVFP4's amax-derived global scale."""
    optax = _optax()
    positions = _query_positions(keys.shape[1], query_count)

    def loss(log_gamma, layer_keys, layer_values, layer_queries):
        gamma = jnp.exp(log_gamma)
        keys_hat = fake_nvfp4(layer_keys, gamma[0])
        values_hat = fake_nvfp4(layer_values, gamma[1])
        return attention_error(layer_queries[positions], layer_keys, layer_values, keys_hat, values_hat, positions)

    optimizer = optax.adam(learning_rate)

    @jax.jit
    def fit(layer_keys, layer_values, layer_queries):
        log_gamma = jnp.zeros((2,))

        def step(carry, _):
            log_gamma, state = carry
            gradient = jax.grad(loss)(log_gamma, layer_keys, layer_values, layer_queries)
            updates, state = optimizer.update(gradient, state, log_gamma)
            return (jnp.minimum(optax.apply_updates(log_gamma, updates), 0.0), state), None

        (log_gamma, _), _ = jax.lax.scan(step, (log_gamma, optimizer.init(log_gamma)), None, length=steps)
        return jnp.exp(log_gamma)

    return np.stack([np.asarray(fit(keys[i], values[i], queries[i])) for i in range(keys.shape[0])])


def held_out_errors(keys, values, queries, alpha=None, gamma=None, query_count: int = 64) -> np.ndarray:
    """Per-layer attention-output error on held-out K/V: INT4 keys with ``alpha`` or NVFP4 K/V with ``gamma``."""
    positions = _query_positions(keys.shape[1], query_count)
    errors = []
    for layer in range(keys.shape[0]):
        if alpha is not None:
            keys_hat = fake_int4_channel(keys[layer], alpha[layer])
            values_hat = values[layer]
        else:
            keys_hat = fake_nvfp4(keys[layer], gamma[layer, 0])
            values_hat = fake_nvfp4(values[layer], gamma[layer, 1])
        errors.append(float(attention_error(queries[layer, positions], keys[layer], values[layer], keys_hat,
                                            values_hat, positions)))
    return np.asarray(errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jflashloop.apps.calibration", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=320, help="tokens per text (a multiple of 64)")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    params, config, tokenizer = gguf_loader.load_smollm2()
    text = tokenizer.encode(gguf_loader.read_data_text("eval_text.txt")).ids
    calibration_ids, held_out_ids = text[: args.tokens], text[args.tokens : 2 * args.tokens]
    if len(held_out_ids) < args.tokens:
        raise ValueError(f"eval_text.txt holds {len(text)} tokens: use --tokens <= {len(text) // 2}")

    def kv(ids):
        _, keys, values, queries = llama.prefill(params, config, np.asarray(ids, np.int32))
        return keys, values, queries

    calibration, held_out = kv(calibration_ids), kv(held_out_ids)
    rows = []
    for label, per_channel, rate in (("per (layer, head)", False, 0.05), ("per channel", True, 0.01)):
        alpha = calibrate_key_clipping(*calibration, steps=args.steps, learning_rate=rate, per_channel=per_channel)
        plain = np.ones_like(alpha)
        rows.append((f"INT4 G64 per-channel keys, clipping {label} (values exact)",
                     held_out_errors(*calibration, alpha=plain).mean(), held_out_errors(*calibration, alpha=alpha).mean(),
                     held_out_errors(*held_out, alpha=plain).mean(), held_out_errors(*held_out, alpha=alpha).mean(),
                     f"alpha mean {alpha.mean():.3f}, min {alpha.min():.3f}"))
    gamma = calibrate_nvfp4_scale(*calibration, steps=args.steps)
    plain = np.ones_like(gamma)
    rows.append(("NVFP4 keys and values, tensor-scale factor per (layer, K/V)",
                 held_out_errors(*calibration, gamma=plain).mean(), held_out_errors(*calibration, gamma=gamma).mean(),
                 held_out_errors(*held_out, gamma=plain).mean(), held_out_errors(*held_out, gamma=gamma).mean(),
                 f"gamma K mean {gamma[:, 0].mean():.3f}, V mean {gamma[:, 1].mean():.3f}"))
    print(f"SmolLM2-135M: fitted on tokens 0-{args.tokens - 1} of eval_text.txt, held out: tokens "
          f"{args.tokens}-{2 * args.tokens - 1}; attention-output relative error, mean over "
          f"{config.num_layers} layers (64 query positions each); {args.steps} Adam steps")
    print("| calibration | fit text: plain | fit text: calibrated | held out: plain | held out: calibrated "
          "| held-out change | fitted |")
    print("|---|---|---|---|---|---|---|")
    for name, fit_plain, fit_calibrated, plain_error, calibrated_error, fitted in rows:
        print(f"| {name} | {fit_plain:.4f} | {fit_calibrated:.4f} | {plain_error:.4f} | {calibrated_error:.4f} | "
              f"{calibrated_error / plain_error - 1:+.1%} | {fitted} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
