"""Would a few exact tokens per layer cut SmolLM2's attention error? (bench/QUALITY.md, "Exact tokens")

Uniform INT4 G64 (K per channel, V per token, windows 4/16, the allocation study's setting) with some tokens
restored to their exact K/V, chosen two ways, against INT4 G32 (the next-best uniform lever):

* ``rows``: ``r`` tokens per 64-token page and KV head, those of the largest quantization residual energy
  (``|K - K^|^2 + |V - V^|^2``, each normalised by its layer-head mean): what a sparse residual loop stores
  (here exact, an upper bound for INT4 residual rows);
* ``heavy``: the ``n`` tokens per layer and KV head (outside the sinks) that received the most attention from
  the model's own queries at positions 128 to T - 33, before the scored ones (heavy hitters, an oracle choice).

The attention-output error is ``jflashloop.apps.quality``'s: float64, the model's queries at the last 32
positions of 512 tokens, mean over the query heads, then over layers (and the worst layer).

Usage: ``python bench/token_rows_probe.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jflashloop import CodecSpec, Policy
from jflashloop.apps.quality import causal_attention_float64, reconstructed_kv, relative_error
from jflashloop.codecs import INT4_KEYS, INT4_VALUES
from jflashloop.models import gguf_loader, llama

PAGE, SCORED, TOKENS = 64, 32, 512


def attention_errors(queries, keys, values, keys_hat, values_hat) -> np.ndarray:
    """float64 ``[layers]``: the attention-output error of each layer over the last SCORED positions."""
    positions = np.arange(keys.shape[1] - SCORED, keys.shape[1])
    return np.array([
        relative_error(causal_attention_float64(queries[layer, positions], keys_hat[layer], values_hat[layer],
                                                positions),
                       causal_attention_float64(queries[layer, positions], keys[layer], values[layer], positions),
                       axis=(0, 2)).mean()
        for layer in range(keys.shape[0])])


def reconstructed(policy: Policy, keys, values):
    layers, tokens, heads, head_dim = keys.shape
    config = policy.cache_config(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, max_tokens=tokens)
    return (np.asarray(x, np.float32) for x in reconstructed_kv(config, jnp.asarray(keys), jnp.asarray(values)))


def restored(keys, values, keys_hat, values_hat, chosen):
    """``keys_hat``/``values_hat`` with the tokens ``chosen`` (int ``[layers, n, heads]``) exact."""
    keys_out, values_out = keys_hat.copy(), values_hat.copy()
    layer, _, head = np.indices(chosen.shape)
    keys_out[layer, chosen, head] = keys[layer, chosen, head]
    values_out[layer, chosen, head] = values[layer, chosen, head]
    return keys_out, values_out


def residual_rows(keys, values, keys_hat, values_hat, rows: int):
    """int ``[layers, pages * rows, heads]``: per page and head the ``rows`` tokens of largest residual energy."""
    energy = 0.0
    for exact, approx in ((keys, keys_hat), (values, values_hat)):
        e = ((exact - approx) ** 2).sum(-1)
        energy = energy + e / (e.mean(axis=1, keepdims=True) + 1e-30)
    pages = keys.shape[1] // PAGE
    per_page = energy[:, : pages * PAGE].reshape(energy.shape[0], pages, PAGE, -1)
    top = np.argsort(-per_page, axis=2)[:, :, :rows] + (PAGE * np.arange(pages))[None, :, None, None]
    return top.reshape(energy.shape[0], pages * rows, -1)


def heavy_hitters(queries, keys, count: int, sinks: int = 4):
    """int ``[layers, count, heads]``: per layer and KV head the tokens past the sinks that received the most
    attention from the queries at positions 128 .. T - SCORED - 1."""
    layers, tokens, heads, head_dim = keys.shape
    group = queries.shape[2] // heads
    positions = np.arange(128, tokens - SCORED)
    mass = np.zeros((layers, tokens, heads))
    for layer in range(layers):
        for head in range(queries.shape[2]):
            scores = queries[layer, positions, head] @ keys[layer, :, head // group].T / np.sqrt(head_dim)
            scores = np.where(np.arange(tokens)[None, :] <= positions[:, None], scores, -np.inf)
            p = np.exp(scores - scores.max(1, keepdims=True))
            mass[layer, :, head // group] += (p / p.sum(1, keepdims=True)).sum(0)
    mass[:, :sinks] = 0
    return np.argsort(-mass, axis=1)[:, :count]


def main() -> None:
    params, config, tokenizer = gguf_loader.load_smollm2()
    uniform = Policy("INT4 G64", INT4_KEYS, INT4_VALUES, 4, 16)
    g32 = Policy("INT4 G32", CodecSpec("int4", "channel", 32), CodecSpec("int4", "token", 32), 4, 16)
    print("| text | tokens restored | mean attn-out err | worst layer |")
    print("|---|---|---|---|")
    for name in ("calibration_text.txt", "eval_text.txt"):
        ids = tokenizer.encode(gguf_loader.read_data_text(name)).ids[:TOKENS]
        keys, values, queries = (np.asarray(x, np.float32)
                                 for x in llama.prefill(params, config, np.asarray(ids, np.int32))[1:])
        keys_hat, values_hat = reconstructed(uniform, keys, values)
        variants = [("none (INT4 G64)", (keys_hat, values_hat))]
        variants += [(f"rows: {rows} a page", restored(keys, values, keys_hat, values_hat,
                                                       residual_rows(keys, values, keys_hat, values_hat, rows)))
                     for rows in (1, 2, 4, 8)]
        variants += [(f"heavy: {count} a layer", restored(keys, values, keys_hat, values_hat,
                                                          heavy_hitters(queries, keys, count)))
                     for count in (8, 32)]
        variants.append(("none (INT4 G32, 5 bits)", tuple(reconstructed(g32, keys, values))))
        for label, (k_hat, v_hat) in variants:
            errors = attention_errors(queries, keys, values, k_hat, v_hat)
            print(f"| {name} | {label} | {errors.mean():.4f} | {errors.max():.4f} |", flush=True)


if __name__ == "__main__":
    main()
