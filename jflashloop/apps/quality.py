"""Quality of cache policies on a real model's K/V: reconstruction, attention, logits.

Three levels, each against an unquantized reference:

* :func:`kv_errors`: reconstruction relative error of K and V per layer and
  KV head, and attention-output relative error per layer and query head
  (float64 attention with the model's own queries, unquantized K/V vs the
  cache's reconstruction);
* :func:`teacher_forced_logits`: next-token logits of a model decoding a
  fixed token sequence one token at a time through a cache (quantize-on-write
  as pages fill), from which the logit measures of
  :mod:`jflashloop.apps.float64_metrics` (``kl_divergence``,
  ``next_token_agreement``, ``negative_log_likelihoods``) give the end-to-end
  effect.

A :class:`~jflashloop.cache_config.Policy` names one cache layout (codecs,
windows, page size) and makes its :class:`CacheConfig` for a model's shape;
the policies below are the ones bench/QUALITY.md compares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import CacheConfig, Policy, paged_cache
from ..codecs import (
    E8_KEYS,
    INT4_GROUP_ROTATED_VALUES,
    INT4_VALUES,
    NVFP4,
    CodecSpec,
    int2_lloyd_max,
    int4_rotated,
)
from .float64_metrics import causal_attention_float64, relative_error

DEFAULT_POLICY = Policy("INT4 G64 K/ch V/tok, windows 4/64")
"""The library's default layout, which is the recommended one: :class:`CacheConfig`'s
defaults (INT4 G64, K per channel, V per token, 64-token pages, 4 sink tokens
and a recent window of one page, 64 tokens, which costs no memory: the ring
already holds the page being filled). The "jflashloop default" of the demo."""

RECOMMENDED_POLICY = DEFAULT_POLICY
"""The same layout as :data:`DEFAULT_POLICY` (the defaults are the recommendation)."""

WINDOWS_4_16 = {"sink_tokens": 4, "recent_tokens": 16}
"""The windows the other rows of bench/QUALITY.md are measured with (the cache's first default)."""


def codec_family_policies(head_dim: int) -> list[Policy]:
    """The rotated and lattice formats (windows 4/16) for a model's ``head_dim``."""
    return [
        Policy("INT4 rotated per (token, head), vLLM-style, 4/16",
               int4_rotated(head_dim, 0), int4_rotated(head_dim, 1), **WINDOWS_4_16),
        Policy("INT2 Lloyd-Max per (token, head), rotated, 4/16",
               int2_lloyd_max(head_dim, 0), int2_lloyd_max(head_dim, 1), **WINDOWS_4_16),
        Policy("rk2v4-e8: E8 keys + group-rotated INT4 values, 4/16", E8_KEYS, INT4_GROUP_ROTATED_VALUES,
               **WINDOWS_4_16),
    ]


def standard_policies() -> list[Policy]:
    """The policies compared in bench/QUALITY.md."""
    int4_k = CodecSpec("int4", "channel", 64)
    return [
        Policy("INT4 G64, K per channel, V per token, windows 4/16", **WINDOWS_4_16),
        Policy("INT4 G32, K per channel, V per token, 4/16",
               CodecSpec("int4", "channel", 32), CodecSpec("int4", "token", 32), **WINDOWS_4_16),
        Policy("NVFP4 K and V, 4/16", NVFP4, NVFP4, **WINDOWS_4_16),
        Policy("INT4 G64, K per token, V per token, 4/16", CodecSpec("int4", "token", 64), INT4_VALUES,
               **WINDOWS_4_16),
        Policy("INT4 G64 K/ch V/tok, windows 0/0", int4_k, INT4_VALUES, 0, 0),
        DEFAULT_POLICY,
        Policy("INT4 G64 K/ch V/tok, windows 0/128", int4_k, INT4_VALUES, 0, 128),
        Policy("INT4 K (per channel) + NVFP4 V, 4/16", int4_k, NVFP4, **WINDOWS_4_16),
        Policy("NVFP4 K + INT4 V (per token), 4/16", NVFP4, INT4_VALUES, **WINDOWS_4_16),
    ]


# --------------------------------------------------------------------------
# Reconstruction and attention-output error
# --------------------------------------------------------------------------


_prefill = jax.jit(paged_cache.prefill)


@jax.jit
def _reconstruct_all_layers(cache: paged_cache.PagedKVCache) -> tuple[jax.Array, jax.Array]:
    layers = [paged_cache.reconstruct(cache, layer, 0, 0)[:2] for layer in range(cache.config.num_layers)]
    return jnp.stack([k for k, _ in layers]), jnp.stack([v for _, v in layers])


def reconstructed_kv(config: CacheConfig, keys, values) -> tuple[np.ndarray, np.ndarray]:
    """Prefill one sequence and read back every layer's K/V as attention sees it.

    Layers are independent in the cache, so each is run through a one-layer
    cache of its own policy (one compilation serves every layer stored alike).

    Args:
      config: the cache configuration (its ``num_layers`` is ignored).
      keys, values: ``[layers, T, kv_heads, D]`` (the model's exact K/V).
    Returns:
      float32 numpy ``[layers, T, kv_heads, D]`` K and V: quantized pages
      decoded, windows unquantized (the cache state after the prompt).
    """
    tokens = keys.shape[1]
    out_k, out_v = [], []
    for layer in range(keys.shape[0]):
        one_layer = dataclasses.replace(config.layer(layer), num_layers=1)
        cache = _prefill(paged_cache.create(one_layer), 0, keys[layer, None, None], values[layer, None, None], tokens)
        paged_cache.check(cache)
        layer_keys, layer_values = _reconstruct_all_layers(cache)
        out_k.append(np.asarray(layer_keys)[0, :tokens])
        out_v.append(np.asarray(layer_values)[0, :tokens])
    return np.stack(out_k), np.stack(out_v)


def kv_errors(policy: Policy, keys, values, queries, *, query_count: int = 32) -> dict[str, np.ndarray]:
    """Per-layer, per-head errors of ``policy`` on exact K/V and the model's queries.

    Args:
      keys, values: ``[layers, T, kv_heads, D]`` exact (post-RoPE) K/V.
      queries: ``[layers, T, q_heads, D]`` the model's queries.
      query_count: the last ``query_count`` positions are the queries scored.
    Returns:
      ``key_error``, ``value_error``: ``[layers, kv_heads]`` reconstruction
      relative errors over all T positions; ``attention_error``: ``[layers,
      q_heads]`` relative error of the attention output over the scored
      queries (each attending causally over the cache state after the prompt).
    """
    keys, values, queries = (np.asarray(x, np.float32) for x in (keys, values, queries))
    layers, tokens, kv_heads, head_dim = keys.shape
    config = policy.cache_config(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, max_tokens=tokens)
    keys_hat, values_hat = reconstructed_kv(config, jnp.asarray(keys), jnp.asarray(values))
    positions = np.arange(tokens - query_count, tokens)
    attention_error = []
    for layer in range(layers):
        exact = causal_attention_float64(queries[layer, positions], keys[layer], values[layer], positions)
        approx = causal_attention_float64(queries[layer, positions], keys_hat[layer], values_hat[layer], positions)
        attention_error.append(relative_error(approx, exact, axis=(0, 2)))
    return {
        "key_error": relative_error(keys_hat, keys, axis=(1, 3)),
        "value_error": relative_error(values_hat, values, axis=(1, 3)),
        "attention_error": np.stack(attention_error),
    }


# --------------------------------------------------------------------------
# End to end: teacher-forced decoding through a cache
# --------------------------------------------------------------------------


def teacher_forced_logits(
    decode: Callable, token_ids: Sequence[int], first: int, state, *, progress: Callable | None = None
) -> tuple[np.ndarray, object]:
    """Logits predicting tokens ``first + 1 .. T - 1``, feeding ``token_ids`` one at a time.

    Args:
      decode: ``decode(token [1] int32, position [1] int32, state) -> (logits [1, vocab], state)``.
      token_ids: the sequence (``T`` ids).
      first: position of the first token to feed; ``state`` holds tokens ``< first``.
      state: the cache state.
      progress: optional callable invoked after every step (a progress bar's update).
    Returns:
      ``(logits, state)``: float32 ``[T - 1 - first, vocab]`` and the final state.
    """
    rows = []
    for position in range(first, len(token_ids) - 1):
        token = jnp.asarray([token_ids[position]], jnp.int32)
        logits, state = decode(token, jnp.asarray([position], jnp.int32), state)
        rows.append(np.asarray(logits[0], np.float32))
        if progress is not None:
            progress()
    return np.stack(rows), state
