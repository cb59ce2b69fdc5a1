"""float64 decode-attention oracle over dense (already decoded) K/V."""

from __future__ import annotations

import math

import numpy as np


def decode_attention(query, keys, values, visible: int, scale: float | None = None) -> np.ndarray:
    """Attention of one new query token over the first ``visible`` positions.

    Args:
      query: ``[q_heads, head_dim]``.
      keys, values: ``[tokens, kv_heads, head_dim]`` with ``tokens >= visible``;
        query head ``h`` reads KV head ``h // (q_heads // kv_heads)`` (GQA).
      visible: number of positions attended (0 gives zeros).
      scale: softmax scale (default ``1 / sqrt(head_dim)``).
    Returns:
      float64 ``[q_heads, head_dim]``.
    """
    query = np.asarray(query, np.float64)
    keys = np.asarray(keys, np.float64)[:visible]
    values = np.asarray(values, np.float64)[:visible]
    q_heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    assert q_heads % kv_heads == 0, (q_heads, kv_heads)
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = np.zeros((q_heads, head_dim))
    if visible == 0:
        return out
    for h in range(q_heads):
        kv = h // group
        scores = [scale * sum(query[h, c] * keys[t, kv, c] for c in range(head_dim)) for t in range(visible)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for c in range(head_dim):
            out[h, c] = sum(w * values[t, kv, c] for t, w in enumerate(weights)) / total
    return out
