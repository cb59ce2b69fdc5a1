"""Attention hooks that run a model's decode step on a :class:`~jflashloop.PagedKVCache`.

The models in :mod:`jflashloop.models` delegate attention to a hook called
once per layer (per (loop, layer) for looped models) during a decode step
(:func:`jflashloop.models.llama.decode_step`,
:func:`jflashloop.models.ouro.decode_step`); these hooks give that
signature a paged cache, so they live beside the models they serve.
These hooks write the new token's K/V into the cache's unquantized ring
(``write_token``), attend with :func:`jflashloop.decode_attention` (the fused
kernel on GPU, the reference path elsewhere) and, after the last call of the
step, ``commit`` the token (which packs pages that became full).
"""

from __future__ import annotations

import functools

import jax

from .. import chunk_attention, decode_attention, paged_cache
from ..paged_cache import PagedKVCache


@functools.cache
def paged_attention_hook(num_layers: int, implementation: str | None = None, kernel_config=None):
    """A hook ``(layer, q, k_new, v_new, cache) -> (out, cache)`` for one-loop models.

    The same function object is returned for the same arguments, so a jitted
    decode step that takes the hook as a static argument compiles once.

    Args:
      num_layers: the model's layer count (the token is committed after the last).
      implementation: passed to :func:`jflashloop.decode_attention`.
      kernel_config: passed to :func:`jflashloop.decode_attention`.
    """

    def hook(layer_index, queries, new_keys, new_values, cache: PagedKVCache):
        # queries [B, q_heads, D]; new_keys, new_values [B, kv_heads, D]
        cache = paged_cache.write_token(cache, layer_index, 0, new_keys, new_values)
        out = decode_attention(
            queries, cache, layer_index, 0, include_pending=True,
            implementation=implementation, kernel_config=kernel_config,
        )
        if layer_index == num_layers - 1:
            cache = paged_cache.commit(cache)
        return out, cache

    return hook


@functools.cache
def looped_paged_attention_hook(
    num_layers: int, num_loops: int, implementation: str | None = None, kernel_config=None
):
    """A hook ``(loop, layer, q, k_new, v_new, cache) -> (out, cache)`` for looped models.

    Loop ``r`` of layer ``l`` attends over the cache's loop-``r`` K/V (base plus
    residuals); the token is committed after the last (loop, layer) call.
    """

    def hook(loop_index, layer_index, queries, new_keys, new_values, cache: PagedKVCache):
        cache = paged_cache.write_token(cache, layer_index, loop_index, new_keys, new_values)
        out = decode_attention(
            queries, cache, layer_index, loop_index, include_pending=True,
            implementation=implementation, kernel_config=kernel_config,
        )
        if loop_index == num_loops - 1 and layer_index == num_layers - 1:
            cache = paged_cache.commit(cache)
        return out, cache

    return hook


@functools.cache
def paged_chunk_attention_hook(implementation: str | None = None):
    """A chunk hook ``(layer, q, k, v, (cache, counts)) -> out`` for one-loop models
    (:func:`jflashloop.models.llama.chunk_step`): :func:`jflashloop.chunk_attention`
    over the cache and the chunk; the cache is not changed (append the kept
    tokens afterwards, :func:`append_chunk_one_loop`)."""

    def hook(layer_index, queries, keys, values, state):
        cache, counts = state
        return chunk_attention(queries, cache, layer_index, 0, keys, values, counts, implementation=implementation)

    return hook


def append_chunk_one_loop(cache: PagedKVCache, keys: jax.Array, values: jax.Array, counts, *,
                          implementation=None) -> PagedKVCache:
    """Append a one-loop model's chunk: keys/values ``[layers, B, C, kv_heads, D]``, ``counts`` int ``[B]``."""
    return paged_cache.append_tokens(cache, keys[:, None], values[:, None], counts, implementation=implementation)


def prefill_one_loop(
    cache: PagedKVCache, slot, keys: jax.Array, values: jax.Array, length=None, *, implementation=None
) -> PagedKVCache:
    """Prefill a one-loop model's prompt: keys/values ``[layers, tokens, kv_heads, D]``."""
    return paged_cache.prefill(
        cache, slot, keys[:, None], values[:, None], length, implementation=implementation
    )
