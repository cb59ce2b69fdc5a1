"""An unquantized KV cache with one array per (loop, layer), read whole by cuDNN's flash attention.

This is the BF16 serving baseline that a jflashloop cache is measured
against. The reference caches (:class:`jflashloop.models.llama.DenseKVCache`,
:class:`jflashloop.models.ouro.DenseLoopKVCache`) stack every layer in one
array and attend in float32 at ``HIGHEST`` precision: the exact definition,
but a slow one on a GPU (every step casts the cache to float32, and a layer
is a slice of the stacked array, which a custom call cannot read in place).
:class:`DenseLayerKVCache` keeps one ``[B, max_tokens, kv_heads, head_dim]``
array per (loop, layer): a decode step writes the new token into it in place
(with buffer donation) and hands it whole to ``jax.nn.dot_product_attention``
with the sequences' lengths (cuDNN's flash attention on a GPU).

The hooks follow :mod:`jflashloop.models.cache_hooks`:
:func:`dense_attention_hook` for :func:`jflashloop.models.llama.decode_step`,
:func:`looped_dense_attention_hook` for :func:`jflashloop.models.ouro.decode_step`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ..ops._chunk_attention import DENSE_KEY_MULTIPLE, flash_attention

IMPLEMENTATIONS = (None, "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class DenseLayerKVCache:
    """One K and one V array per (loop, layer); a pytree.

    Array leaves:

    * ``keys``: ``keys[loop][layer]`` is ``[B, max_tokens, kv_heads, head_dim]``
      in the cache dtype (bfloat16 by default), post-RoPE.
    * ``values``: same structure, shapes and dtype.
    * ``lengths``: int32 ``[B]``, tokens held per sequence. Slots at or past
      ``lengths[b]`` are ignored.

    A decode step writes the new token of every (loop, layer) at slot
    ``lengths[b]`` and increments ``lengths`` after the last (loop, layer);
    the caller keeps ``lengths < max_tokens`` (a token beyond the capacity
    is dropped, not stored).
    """

    keys: tuple[tuple[jax.Array, ...], ...]
    values: tuple[tuple[jax.Array, ...], ...]
    lengths: jax.Array

    @property
    def loops(self) -> int:
        """Loops the cache holds (1 for an ordinary model)."""
        return len(self.keys)

    @property
    def layers(self) -> int:
        """Layers per loop."""
        return len(self.keys[0])

    @property
    def max_tokens(self) -> int:
        """Slots per sequence."""
        return self.keys[0][0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of every array of the cache."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(self))

    @classmethod
    def create(
        cls,
        *,
        batch: int,
        max_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_loops: int = 1,
        dtype: Any = jnp.bfloat16,
    ) -> DenseLayerKVCache:
        """An empty cache (zeros, all lengths zero).

        ``max_tokens`` is rounded up to a multiple of
        :data:`jflashloop.ops._chunk_attention.DENSE_KEY_MULTIPLE` (128), which
        cuDNN's flash attention needs; the extra slots are never attended.
        """
        max_tokens = padded_capacity(max_tokens)
        shape = (batch, max_tokens, num_kv_heads, head_dim)

        def arrays():
            return tuple(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)) for _ in range(num_loops))

        return cls(keys=arrays(), values=arrays(), lengths=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def from_prefill(
        cls, keys: jax.Array, values: jax.Array, lengths: jax.Array, max_tokens: int, dtype: Any = jnp.bfloat16
    ) -> DenseLayerKVCache:
        """A cache holding prefilled keys and values.

        Args:
          keys, values: ``[loops, layers, B, T, kv_heads, head_dim]`` (a
            one-loop model's ``[layers, ...]`` with a leading axis of 1),
            ``T <= max_tokens``.
          lengths: int ``[B]``, the valid prefix of each sequence (``<= T``).
          max_tokens: slots per sequence (rounded up as in :meth:`create`).
          dtype: storage dtype.
        """
        if keys.shape != values.shape or keys.ndim != 6:
            raise ValueError(f"keys and values must both be [loops, layers, B, T, kv_heads, head_dim], got "
                             f"{keys.shape} and {values.shape}")
        tokens = keys.shape[3]
        max_tokens = padded_capacity(max_tokens)
        if tokens > max_tokens:
            raise ValueError(f"prefill has {tokens} tokens but max_tokens={max_tokens}")
        padding = ((0, 0), (0, max_tokens - tokens), (0, 0), (0, 0))

        def arrays(x):
            return tuple(tuple(jnp.pad(x[loop, layer].astype(dtype), padding) for layer in range(x.shape[1]))
                         for loop in range(x.shape[0]))

        return cls(keys=arrays(keys), values=arrays(values), lengths=jnp.asarray(lengths, jnp.int32))


jax.tree_util.register_dataclass(DenseLayerKVCache, data_fields=["keys", "values", "lengths"], meta_fields=[])


def padded_capacity(max_tokens: int) -> int:
    """``max_tokens`` rounded up to a multiple of 128 (what cuDNN's flash attention reads)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return -(-max_tokens // DENSE_KEY_MULTIPLE) * DENSE_KEY_MULTIPLE


def attend(
    queries: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array, *, implementation: str | None = None
) -> jax.Array:
    """One query token per sequence over its first ``lengths[b]`` cached positions.

    Args:
      queries: ``[B, q_heads, head_dim]`` (any float dtype; cast to the cache
        dtype); query head ``h`` reads KV head ``h // (q_heads / kv_heads)``.
      keys, values: ``[B, max_tokens, kv_heads, head_dim]``, the cache dtype.
      lengths: int32 ``[B]``, positions attended per sequence (``>= 1``).
      implementation: None (cuDNN's flash attention on a GPU where it takes
        the call, else jax's choice), ``"cudnn"`` (cuDNN or an error) or
        ``"xla"`` (jax's XLA attention: scores in float32, probabilities and
        the value product in the cache dtype).

    Returns:
      float32 ``[B, q_heads, head_dim]``; softmax scale ``1 / sqrt(head_dim)``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    arguments = (queries[:, None].astype(keys.dtype), keys, values)
    options = dict(key_value_seq_lengths=lengths.astype(jnp.int32), scale=1.0 / math.sqrt(queries.shape[-1]))
    if implementation is None:
        out = flash_attention(*arguments, **options)
    else:
        out = jax.nn.dot_product_attention(*arguments, implementation=implementation, **options)
    return out[:, 0].astype(jnp.float32)


def _write(array: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """``array`` ``[B, S, H, D]`` with ``new`` ``[B, H, D]`` at ``[b, slots[b]]`` (slots past ``S`` dropped)."""
    rows = jnp.arange(array.shape[0])
    return array.at[rows, slots].set(new.astype(array.dtype), mode="drop")


def write_token(
    cache: DenseLayerKVCache, loop: int, layer: int, new_keys: jax.Array, new_values: jax.Array
) -> DenseLayerKVCache:
    """Store the new token of (``loop``, ``layer``) at slot ``lengths[b]``; after the last (loop,
    layer) ``lengths`` grows by one.

    Args:
      loop, layer: Python ints.
      new_keys, new_values: ``[B, kv_heads, head_dim]`` (rounded to the cache dtype).
    """
    keys = [list(row) for row in cache.keys]
    values = [list(row) for row in cache.values]
    keys[loop][layer] = _write(keys[loop][layer], cache.lengths, new_keys)
    values[loop][layer] = _write(values[loop][layer], cache.lengths, new_values)
    is_last = loop == cache.loops - 1 and layer == cache.layers - 1
    return DenseLayerKVCache(
        keys=tuple(tuple(row) for row in keys), values=tuple(tuple(row) for row in values),
        lengths=cache.lengths + 1 if is_last else cache.lengths,
    )


def write_and_attend(
    cache: DenseLayerKVCache, loop: int, layer: int, queries: jax.Array, new_keys: jax.Array,
    new_values: jax.Array, *, implementation: str | None = None,
) -> tuple[jax.Array, DenseLayerKVCache]:
    """:func:`write_token`, then :func:`attend` over the ``lengths + 1`` positions that include it.

    Args:
      loop, layer: Python ints.
      queries: ``[B, q_heads, head_dim]``.
      new_keys, new_values: ``[B, kv_heads, head_dim]``.

    Returns:
      ``(out, cache)``: float32 ``[B, q_heads, head_dim]`` and the updated cache.
    """
    visible = jnp.minimum(cache.lengths + 1, cache.max_tokens)
    cache = write_token(cache, loop, layer, new_keys, new_values)
    out = attend(queries, cache.keys[loop][layer], cache.values[loop][layer], visible, implementation=implementation)
    return out, cache


@functools.cache
def dense_attention_hook(implementation: str | None = None):
    """A hook ``(layer, q, k_new, v_new, cache) -> (out, cache)`` for
    :func:`jflashloop.models.llama.decode_step` over a one-loop :class:`DenseLayerKVCache`.

    The same function object is returned for the same argument (a static
    argument under ``jit`` compiles once).
    """

    def hook(layer_index, queries, new_keys, new_values, cache: DenseLayerKVCache):
        return write_and_attend(cache, 0, layer_index, queries, new_keys, new_values, implementation=implementation)

    return hook


@functools.cache
def looped_dense_attention_hook(implementation: str | None = None):
    """A hook ``(loop, layer, q, k_new, v_new, cache) -> (out, cache)`` for
    :func:`jflashloop.models.ouro.decode_step` over a :class:`DenseLayerKVCache` of every loop."""

    def hook(loop_index, layer_index, queries, new_keys, new_values, cache: DenseLayerKVCache):
        return write_and_attend(cache, loop_index, layer_index, queries, new_keys, new_values,
                                implementation=implementation)

    return hook
