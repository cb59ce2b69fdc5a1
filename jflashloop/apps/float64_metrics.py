"""How far an approximation is from its reference, measured in float64.

The quality measurements (:mod:`jflashloop.apps.quality`) and the loops report
(:mod:`jflashloop.apps.loops`) share these: causal softmax attention of given
queries over given K/V, relative errors, and the logit comparisons (KL
divergence, next-token agreement, negative log-likelihood). Every function
takes numpy or JAX arrays and computes in float64 numpy.
"""

from __future__ import annotations

import math

import numpy as np


def relative_error(estimate, exact, axis=None) -> np.ndarray:
    """``||estimate - exact|| / ||exact||`` over ``axis`` (all axes by default), in float64.

    Args:
      estimate, exact: arrays of one shape.
      axis: the axes the Frobenius norms run over; ``None`` for all of them
        (the result is then a float64 scalar).
    Returns:
      float64, the shape of ``exact`` without ``axis`` (a zero ``exact``
      counts as ``1e-300``, so an exact match gives 0, never NaN).
    """
    estimate, exact = np.asarray(estimate, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(estimate - exact, axis=axis) / np.maximum(np.linalg.norm(exact, axis=axis), 1e-300)


def causal_attention_float64(queries, keys, values, query_positions) -> np.ndarray:
    """float64 softmax attention; query ``i`` sees key positions ``<= query_positions[i]``.

    Scores are ``q . k / sqrt(D)``; query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)`` (grouped-query attention).

    Args:
      queries: ``[..., Q, q_heads, D]``.
      keys, values: ``[..., T, kv_heads, D]`` (the same leading axes as ``queries``).
      query_positions: int ``[Q]``.
    Returns:
      float64 ``[..., Q, q_heads, D]``.
    """
    queries = np.asarray(queries, np.float64)
    group = queries.shape[-2] // np.shape(keys)[-2]
    keys = np.repeat(np.asarray(keys, np.float64), group, axis=-2)
    values = np.repeat(np.asarray(values, np.float64), group, axis=-2)
    scores = np.einsum("...qhd,...thd->...hqt", queries, keys) / math.sqrt(queries.shape[-1])
    visible = np.arange(keys.shape[-3])[None, :] <= np.asarray(query_positions)[:, None]  # [Q, T]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("...hqt,...thd->...qhd", weights, values)


def log_softmax(logits) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(reference_logits, candidate_logits) -> np.ndarray:
    """``KL(softmax(reference) || softmax(candidate))`` in nats, per leading index.

    Args:
      reference_logits, candidate_logits: float ``[..., vocab]``.
    Returns:
      float64 ``[...]``.
    """
    reference, candidate = log_softmax(reference_logits), log_softmax(candidate_logits)
    return np.sum(np.exp(reference) * (reference - candidate), axis=-1)


def next_token_agreement(reference_logits, candidate_logits) -> float:
    """Fraction of positions where both argmax tokens are the same (``[..., vocab]`` inputs)."""
    return float(np.mean(np.argmax(reference_logits, -1) == np.argmax(candidate_logits, -1)))


def negative_log_likelihoods(logits, targets) -> np.ndarray:
    """Negative log-likelihood (nats) of each target token.

    Args:
      logits: float ``[..., vocab]``.
      targets: int ``[...]``.
    Returns:
      float64 ``[...]``.
    """
    picked = np.take_along_axis(log_softmax(logits), np.asarray(targets)[..., None], axis=-1)
    return -picked[..., 0]
