"""Decode attention over a :class:`~jflashloop.PagedKVCache` (reference path)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import paged_cache
from .paged_cache import PagedKVCache


def decode_attention_reference(
    queries: jax.Array,
    cache: PagedKVCache,
    layer: int,
    loop: int,
    *,
    include_pending: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """One new query token per sequence attending over its loop-``loop`` K/V.

    Plain JAX: reconstructs every sequence's K/V densely (the semantic
    definition that the fused kernels match) and runs float32 softmax
    attention at ``HIGHEST`` matmul precision.

    Args:
      queries: ``[max_sequences, q_heads, head_dim]``; ``q_heads`` is a multiple
        of ``kv_heads`` and query head ``h`` reads KV head ``h // (q_heads //
        kv_heads)`` (GQA).
      cache: the cache.
      layer, loop: 0-based Python ints.
      include_pending: attend to the token written by ``write_token`` but not
        yet committed (the usual decode step), i.e. ``lengths + 1`` positions.
      scale: softmax scale, default ``1 / sqrt(head_dim)``.
    Returns:
      float32 ``[max_sequences, q_heads, head_dim]``; zeros for a sequence with
      no visible token.
    """
    c = cache.config
    sequences, q_heads, head_dim = queries.shape
    if sequences != c.max_sequences or head_dim != c.head_dim or q_heads % c.num_kv_heads:
        raise ValueError(
            f"queries must be [max_sequences={c.max_sequences}, q_heads (a multiple of "
            f"{c.num_kv_heads}), head_dim={c.head_dim}], got {tuple(queries.shape)}"
        )
    if not (0 <= layer < c.num_layers and 0 <= loop < c.num_loops):
        raise ValueError(f"layer must be in [0, {c.num_layers}) and loop in [0, {c.num_loops}), got {layer}, {loop}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // c.num_kv_heads

    def one_sequence(query, slot):
        keys, values, visible = paged_cache.reconstruct(
            cache, layer, loop, slot, include_pending=include_pending
        )
        keys = jnp.repeat(keys, group, axis=1)  # [T, q_heads, D]
        values = jnp.repeat(values, group, axis=1)
        scores = jnp.einsum(
            "hd,thd->ht", query.astype(jnp.float32), keys, precision=jax.lax.Precision.HIGHEST
        ) * scale
        valid = jnp.arange(keys.shape[0]) < visible
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        top = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.where(valid[None, :], jnp.exp(scores - jnp.where(visible > 0, top, 0.0)), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        out = jnp.einsum("ht,thd->hd", weights, values, precision=jax.lax.Precision.HIGHEST)
        return jnp.where(visible > 0, out / jnp.where(total > 0, total, 1.0), 0.0)

    return jax.vmap(one_sequence)(queries, jnp.arange(sequences))
