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

With ``commit=False`` a hook leaves the commit to its caller, who runs
:func:`commit_pending` at the start of the next step instead, before any
attention reads the pool (:mod:`jflashloop.models.serving_loop` does). Under
``jit`` this ordering matters: when attention reads a page pool and the
commit, a conditional that may pack a page into that same pool, follows in
one computation, XLA copies the whole pool to keep the read safe (measured
on the CPU: a step's time grew with the pool's size, 1 ms to 27 ms from 1 to
144 MiB), while a commit that comes first hands the attention its result and
copies nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from .. import chunk_attention, decode_attention, paged_cache
from ..paged_cache import PagedKVCache


@functools.cache
def paged_attention_hook(num_layers: int, implementation: str | None = None, kernel_config=None, *,
                         commit: bool = True):
    """A hook ``(layer, q, k_new, v_new, cache) -> (out, cache)`` for one-loop models.

    The same function object is returned for the same arguments, so a jitted
    decode step that takes the hook as a static argument compiles once.

    Args:
      num_layers: the model's layer count (the token is committed after the last).
      implementation: passed to :func:`jflashloop.decode_attention`.
      kernel_config: passed to :func:`jflashloop.decode_attention`.
      commit: commit the token after the last layer; False leaves it pending
        (the caller runs :func:`commit_pending` before the next step).
    """

    def hook(layer_index, queries, new_keys, new_values, cache: PagedKVCache):
        # queries [B, q_heads, D]; new_keys, new_values [B, kv_heads, D]
        cache = paged_cache.write_token(cache, layer_index, 0, new_keys, new_values)
        out = decode_attention(
            queries, cache, layer_index, 0, include_pending=True,
            implementation=implementation, kernel_config=kernel_config,
        )
        if commit and layer_index == num_layers - 1:
            cache = paged_cache.commit(cache)
        return out, cache

    return hook


@functools.cache
def looped_paged_attention_hook(
    num_layers: int, num_loops: int, implementation: str | None = None, kernel_config=None, *,
    commit: bool = True,
):
    """A hook ``(loop, layer, q, k_new, v_new, cache) -> (out, cache)`` for looped models.

    Loop ``r`` of layer ``l`` attends over the cache's loop-``r`` K/V (base plus
    residuals); the token is committed after the last (loop, layer) call
    (``commit=False``: left pending, as for :func:`paged_attention_hook`).
    """

    def hook(loop_index, layer_index, queries, new_keys, new_values, cache: PagedKVCache):
        cache = paged_cache.write_token(cache, layer_index, loop_index, new_keys, new_values)
        out = decode_attention(
            queries, cache, layer_index, loop_index, include_pending=True,
            implementation=implementation, kernel_config=kernel_config,
        )
        if commit and loop_index == num_loops - 1 and layer_index == num_layers - 1:
            cache = paged_cache.commit(cache)
        return out, cache

    return hook


def commit_pending(cache: PagedKVCache, pending: jax.Array) -> PagedKVCache:
    """``paged_cache.commit(cache)`` where ``pending`` (bool scalar, may be traced) holds, else ``cache``.

    No conditional takes the pool: the commit runs on the cache with
    ``active`` masked by ``pending`` (then it counts no token and packs no
    page) and ``active`` is restored, so under ``jit`` nothing is copied.
    """
    masked = dataclasses.replace(cache, active=cache.active & pending)
    return dataclasses.replace(paged_cache.commit(masked), active=cache.active)


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
