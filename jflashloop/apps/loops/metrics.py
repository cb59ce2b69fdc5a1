"""The looped-model report's measurements.

1. :func:`successive_loop_cosine`: how similar successive loops' K and V are;
2. :func:`storage_summary`: KV bytes per token of four BF16 loop caches and of
   the cross-loop cache;
3. :func:`attention_errors`: the attention-output error of stored K/V, per loop
   and layer (and :func:`packed_positions`: which positions come from pages);
4. and 5. :func:`logit_metrics`: KL, next-token agreement and bits per byte
   of the two caches' logits;
6. :func:`chain_errors`: closed-loop against open-loop residual encoding.

The float64 attention, error and logit measures are
:mod:`jflashloop.apps.float64_metrics`, shared with :mod:`jflashloop.apps.quality`.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import CacheConfig, decode_loop, encode_chain, paged_cache, storage
from ..float64_metrics import (
    causal_attention_float64,
    kl_divergence,
    negative_log_likelihoods,
    next_token_agreement,
    relative_error,
)

# --------------------------------------------------------------------------
# 1. Similarity of successive loops
# --------------------------------------------------------------------------


def successive_loop_cosine(x: jax.Array | np.ndarray) -> np.ndarray:
    """Cosine similarity between loop r and loop r + 1, per layer.

    Args:
      x: keys or values ``[loops, layers, B, T, kv_heads, head_dim]``.
    Returns:
      float64 ``[layers, loops - 1]``: the mean over sequences, tokens and heads
      of the cosine between the head vectors of consecutive loops.
    """
    x = np.asarray(x, np.float64)
    earlier, later = x[:-1], x[1:]
    norms = np.linalg.norm(earlier, axis=-1) * np.linalg.norm(later, axis=-1)
    cosine = np.sum(earlier * later, axis=-1) / np.maximum(norms, np.finfo(np.float64).tiny)
    return cosine.mean(axis=(2, 3, 4)).T


# --------------------------------------------------------------------------
# 2. Storage
# --------------------------------------------------------------------------


def storage_summary(config: CacheConfig, context_tokens: int) -> dict[str, Any]:
    """KV bytes per token of four BF16 loop caches and of ``config``, over all layers.

    Returns:
      ``bf16_bytes_per_token`` (int), ``cache_bytes_per_token`` (float, full
      pages), ``ratio`` (:class:`fractions.Fraction`, exact), ``table``
      (markdown from :func:`jflashloop.storage.storage_table`).
    """
    bf16 = storage.unquantized_bytes_per_token(config) * config.num_layers
    page_total = storage.page_bytes(config).total
    shape = storage.ModelShape("Ouro tiny", config.num_layers, config.num_kv_heads,
                               config.head_dim, config.num_loops)
    table = storage.storage_table(shape, context_tokens, page_size=config.page_size,
                                  sink_tokens=config.sink_tokens,
                                  recent_tokens=config.recent_tokens)
    return {
        "bf16_bytes_per_token": bf16,
        "cache_bytes_per_token": storage.bytes_per_token(config) * config.num_layers,
        "ratio": Fraction(bf16 * config.page_size, page_total * config.num_layers),
        "table": table,
    }


# --------------------------------------------------------------------------
# 3. Attention error of each loop
# --------------------------------------------------------------------------


def attention_errors(queries, exact_keys, exact_values, stored_keys, stored_values,
                     query_positions) -> np.ndarray:
    """Attention-output relative error of stored K/V against exact K/V, per loop and layer.

    Both outputs are float64 attention of the same ``queries``; only the K/V differ.

    Args:
      queries: ``[loops, layers, B, Q, heads, head_dim]``.
      exact_keys, exact_values, stored_keys, stored_values:
        ``[loops, layers, B, T, kv_heads, head_dim]``.
      query_positions: int ``[Q]``, the position of each query (``< T``).
    Returns:
      float64 ``[loops, layers]``: Frobenius relative error over sequences,
      query positions, heads and channels.
    """
    loops, layers = queries.shape[:2]
    errors = np.zeros((loops, layers))
    for loop in range(loops):
        for layer in range(layers):
            index = (loop, layer)
            exact = causal_attention_float64(queries[index], exact_keys[index],
                                             exact_values[index], query_positions)
            stored = causal_attention_float64(queries[index], stored_keys[index],
                                              stored_values[index], query_positions)
            errors[loop, layer] = relative_error(stored, exact)
    return errors


def packed_positions(config: CacheConfig, length: int) -> np.ndarray:
    """bool ``[length]``: positions a sequence of ``length`` committed tokens reads from pages."""
    masks = paged_cache.window_mask(config, jnp.int32(length), jnp.int32(length), length)
    return np.asarray(masks["pages"])


# --------------------------------------------------------------------------
# 4, 5. Logits through both caches
# --------------------------------------------------------------------------


def leading_agreement(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> np.ndarray:
    """int ``[B]``: steps before the first argmax disagreement (``[steps, B, vocab]`` inputs)."""
    same = np.argmax(reference_logits, -1) == np.argmax(candidate_logits, -1)  # [steps, B]
    return np.where(same.all(axis=0), same.shape[0], np.argmin(same, axis=0))


def bits_per_byte(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-byte cross-entropy in bits.

    Args:
      logits: float ``[steps, B, vocab]``.
      targets: int ``[steps, B]``.
    """
    return float(np.mean(negative_log_likelihoods(logits, targets)) / math.log(2))


def logit_metrics(comparison: dict[str, Any]) -> dict[str, dict[str, float]]:
    """KL, agreement and bits per byte from :func:`compare_caches` output.

    Returns:
      ``{"teacher_forced": {...}, "generated": {...}}``; each holds
      ``steps``, ``kl`` (mean nats, BF16 caches as reference), ``kl_max``,
      ``agreement``; teacher forced adds ``kl_bf16_vs_exact``,
      ``kl_cross_loop_vs_exact``, ``agreement_bf16_vs_exact``,
      ``agreement_cross_loop_vs_exact`` and ``bits_per_byte_exact``,
      ``bits_per_byte_bf16``, ``bits_per_byte_cross_loop``; generated adds
      ``identical_greedy_tokens`` (mean over sequences) and its minimum.
    """
    text_steps = comparison["targets"].shape[0]
    bf16, cross_loop = comparison["bf16_logits"], comparison["cross_loop_logits"]
    exact, targets = comparison["exact_logits"], comparison["targets"]
    text_part = slice(0, text_steps)
    kl_text = kl_divergence(bf16[text_part], cross_loop[text_part])
    teacher_forced = {
        "steps": text_steps,
        "kl": float(kl_text.mean()),
        "kl_max": float(kl_text.max()),
        "agreement": next_token_agreement(bf16[text_part], cross_loop[text_part]),
        "kl_bf16_vs_exact": float(kl_divergence(exact, bf16[text_part]).mean()),
        "kl_cross_loop_vs_exact": float(kl_divergence(exact, cross_loop[text_part]).mean()),
        "agreement_bf16_vs_exact": next_token_agreement(exact, bf16[text_part]),
        "agreement_cross_loop_vs_exact": next_token_agreement(exact, cross_loop[text_part]),
        "bits_per_byte_exact": bits_per_byte(exact, targets),
        "bits_per_byte_bf16": bits_per_byte(bf16[text_part], targets),
        "bits_per_byte_cross_loop": bits_per_byte(cross_loop[text_part], targets),
    }
    generate = comparison["generated"].shape[1]
    generated = {"steps": generate}
    if generate:
        generated_part = slice(text_steps, text_steps + generate)
        kl_generated = kl_divergence(bf16[generated_part], cross_loop[generated_part])
        # The greedy tokens came from the last text prediction and the first
        # generate - 1 generated steps.
        choices = slice(text_steps - 1, text_steps - 1 + generate)
        identical = leading_agreement(bf16[choices], cross_loop[choices])
        generated.update(
            kl=float(kl_generated.mean()), kl_max=float(kl_generated.max()),
            agreement=next_token_agreement(bf16[generated_part], cross_loop[generated_part]),
            identical_greedy_tokens=float(identical.mean()),
            identical_greedy_tokens_min=int(identical.min()))
    return {"teacher_forced": teacher_forced, "generated": generated}


# --------------------------------------------------------------------------
# 6. Closed-loop vs open-loop residual encoding
# --------------------------------------------------------------------------


def sparse_row_positions(energy: np.ndarray, rows: int, page_size: int) -> np.ndarray:
    """Per page, the ``rows`` positions of largest ``energy`` (ties to the lower position).

    Args:
      energy: float ``[tokens]`` with ``tokens`` a multiple of ``page_size``.
    Returns:
      int32 ``[pages * rows]``, sorted sequence positions.
    """
    pages = energy.reshape(-1, page_size)
    chosen = np.sort(np.argsort(-pages, axis=1, kind="stable")[:, :rows], axis=1)
    return (chosen + page_size * np.arange(pages.shape[0])[:, None]).reshape(-1).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("base_spec", "residual_specs", "closed_loop"))
def _chain_reconstructions(streams, positions, *, base_spec, residual_specs, closed_loop):
    """Encode and decode residual chains of many streams.

    Args:
      streams: float32 ``[N, loops, tokens, 1, head_dim]``.
      positions: per later loop, None (dense) or int32 ``[N, rows]``.
    Returns:
      float32 ``[N, loops, tokens, 1, head_dim]``: every loop's reconstruction.
    """
    def one_stream(loops, stream_positions):
        chain = encode_chain(list(loops), base_spec, residual_specs, list(stream_positions),
                             closed_loop=closed_loop)
        return jnp.stack([decode_loop(chain, loop) for loop in range(len(loops))])

    return jax.vmap(one_stream)(streams, positions)


def chain_errors(keys: jax.Array, values: jax.Array, config: CacheConfig,
                 closed_loop: bool) -> dict[str, np.ndarray]:
    """Reconstruction error of every loop when encoded as :func:`encode_chain` residual chains.

    Each (sequence, KV head) stream of each layer is one chain with the codecs
    of ``config`` (so K groups of 64 tokens align with pages). A sparse loop
    keeps, per page, the rows of largest exact loop-to-loop residual energy
    ``|K_r - K_(r-1)|^2 + |V_r - V_(r-1)|^2``: the same rows in both modes,
    so only the encoding differs.

    Args:
      keys, values: ``[loops, layers, B, T, kv_heads, head_dim]`` with ``T`` a
        multiple of ``config.page_size``.
      closed_loop: passed to :func:`encode_chain`.
    Returns:
      ``{"keys": ..., "values": ...}``: float64 ``[layers, loops]`` relative errors.
    """
    keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    loops, layers, batch, tokens, heads, head_dim = keys.shape
    errors = {"keys": np.zeros((layers, loops)), "values": np.zeros((layers, loops))}
    for layer in range(layers):
        # [B * heads, loops, T, 1, D]: one stream per (sequence, head).
        def streams(x, layer=layer):
            per_head = x[:, layer].transpose(1, 3, 0, 2, 4)  # [B, heads, loops, T, D]
            return per_head.reshape(batch * heads, loops, tokens, 1, head_dim)

        layer_keys, layer_values = streams(keys), streams(values)
        energy = (np.sum(np.diff(layer_keys, axis=1) ** 2, axis=(3, 4))
                  + np.sum(np.diff(layer_values, axis=1) ** 2, axis=(3, 4)))  # [N, loops - 1, T]
        positions = []
        for loop in range(1, loops):
            storage_of_loop = config.loops[loop]
            if not storage_of_loop.is_sparse:
                positions.append(None)
                continue
            positions.append(jnp.asarray(np.stack([
                sparse_row_positions(stream_energy, storage_of_loop.sparse_rows_per_page,
                                     config.page_size)
                for stream_energy in energy[:, loop - 1]])))
        for name, data, role in (("keys", layer_keys, "key_spec"),
                                 ("values", layer_values, "value_spec")):
            specs = [getattr(loop_storage, role) for loop_storage in config.loops]
            reconstructed = np.asarray(_chain_reconstructions(
                jnp.asarray(data), tuple(positions), base_spec=specs[0],
                residual_specs=tuple(specs[1:]), closed_loop=closed_loop))
            for loop in range(loops):
                errors[name][layer, loop] = relative_error(reconstructed[:, loop], data[:, loop])
    return errors
