"""Appending a chunk of tokens per sequence at once: :func:`append_tokens`.

Chunked prefill and speculative decoding add several tokens per sequence
per step. :func:`append_tokens` gives the cache exactly the state that
``counts[s]`` single-token appends of sequence ``s``'s tokens would give
(same windows, pages, page ids, block tables, counters and flags), but packs
every page the chunk completes in one quantize-on-write call per layer.
:func:`chunk_window_values` is what the windows hold for a chunk's K/V (the
attention over a chunk reads its own tokens through it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._validation import is_concrete
from ._layout import (
    ERROR_INVALID_LENGTH,
    ERROR_NONFINITE_INPUT,
    ERROR_OUT_OF_PAGES,
    ERROR_SATURATED,
    ERROR_SEQUENCE_FULL,
    PagedKVCache,
)
from ._pages import pack_pages_with_saturations, tile_saturations
from ._regions import ring_positions, ring_slot
from ._state import _allocate, _count_per_sequence, _stored_values, check_kv_pair


def check_chunk_arrays(cache: PagedKVCache, keys, values) -> None:
    """``append_tokens``' checks of ``keys`` and ``values``: arrays
    ``[layers, loops, max_sequences, chunk, kv_heads, head_dim]`` of a float dtype, ``chunk >= 1``."""
    c = cache.config
    layout = (f"[layers={c.num_layers}, loops={c.num_loops}, max_sequences={c.max_sequences}, chunk, "
              f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]")
    check_kv_pair(keys, values, (c.num_layers, c.num_loops, c.max_sequences, None, c.num_kv_heads, c.head_dim),
                  layout)
    if keys.shape[3] == 0:
        raise ValueError("keys must hold a chunk of at least one token")


def check_counts(counts, sequences: int, chunk: int) -> jax.Array:
    """``counts`` as int32 ``[sequences]``; a ``ValueError`` or ``TypeError`` for a
    wrong shape or dtype, and for values outside ``[0, chunk]`` when concrete."""
    if not hasattr(counts, "shape") or not hasattr(counts, "dtype"):
        counts = np.asarray(counts)
    if not jnp.issubdtype(counts.dtype, jnp.integer):
        raise TypeError(f"counts must be an integer array [max_sequences={sequences}], got dtype {counts.dtype}")
    if tuple(counts.shape) != (sequences,):
        raise ValueError(f"counts must be [max_sequences={sequences}], got shape {tuple(counts.shape)}")
    if is_concrete(counts):
        values = np.asarray(counts)
        bad = np.flatnonzero((values < 0) | (values > chunk))
        if bad.size:
            raise ValueError(f"counts must be in [0, chunk={chunk}], got counts[{int(bad[0])}] = {int(values[bad[0]])}")
    return jnp.asarray(counts).astype(jnp.int32)


def chunk_window_values(cache: PagedKVCache, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the windows hold for chunk K/V ``x`` (any shape): ``(values, nonfinite, overflow)``.

    ``values`` are in the window dtype (NaN/+-inf stored as 0, values beyond
    its range as its largest finite value), exactly as ``write_token`` stores
    each token; the two bool masks mark the stored-as-0 and saturated elements.
    """
    stored, nonfinite, overflow = _stored_values(x, cache.window_dtype)
    return stored.astype(cache.window_dtype), nonfinite, overflow


def append_tokens(cache: PagedKVCache, keys: jax.Array, values: jax.Array, counts, *,
                  implementation: str | None = None) -> PagedKVCache:
    """Append the first ``counts[s]`` tokens of a chunk to each sequence ``s``.

    The result is bit-identical to ``counts[s]`` single-token appends
    (:func:`~jflashloop.paged_cache.append`) of sequence ``s``'s tokens, the
    sequences taking their ``i``-th token at step ``i`` (so page ids are
    handed out in the same order); every page the chunk fills is packed in
    one quantize-on-write call per layer. Speculative decoding appends the
    accepted counts only, so rejected draft tokens never touch the cache.

    Args:
      keys, values: ``[layers, loops, max_sequences, chunk, kv_heads,
        head_dim]``, a float dtype; token ``i`` of sequence ``s`` goes to
        position ``lengths[s] + i``.
      counts: int ``[max_sequences]`` in ``[0, chunk]`` (may be traced):
        tokens to append per sequence. Inactive slots take none; a sequence
        that reaches ``max_tokens_per_sequence`` drops the rest
        (``ERROR_SEQUENCE_FULL``), as ``append`` does.
      implementation: the page packing's backend (as for ``append``).
    Returns:
      The new cache (jittable with static ``chunk``; donate the cache to
      update it in place).
    Raises:
      TypeError, ValueError: arrays of the wrong shape or dtype, or concrete
        ``counts`` outside ``[0, chunk]``. Under ``jit`` such counts are
        clamped and the slot flagged ``ERROR_INVALID_LENGTH``.
    """
    c = cache.config
    check_chunk_arrays(cache, keys, values)
    chunk = keys.shape[3]
    requested = check_counts(counts, c.max_sequences, chunk)
    clamped = jnp.clip(requested, 0, chunk)
    room = jnp.maximum(c.max_tokens_per_sequence - cache.lengths, 0)
    stored = jnp.where(cache.active, jnp.minimum(clamped, room), 0)  # tokens each sequence takes
    errors = jnp.where(cache.active & (requested != clamped), ERROR_INVALID_LENGTH, 0)
    errors = errors | jnp.where(cache.active & (clamped > room), ERROR_SEQUENCE_FULL, 0)

    # What the windows hold for every chunk token, and the counters of the stored ones.
    window_k, nonfinite_k, overflow_k = chunk_window_values(cache, keys)
    window_v, nonfinite_v, overflow_v = chunk_window_values(cache, values)
    kept = (jnp.arange(chunk)[None, :] < stored[:, None])[None, None, :, :, None, None]
    nonfinite = _count_per_sequence(nonfinite_k & kept, 2) + _count_per_sequence(nonfinite_v & kept, 2)
    saturated = _count_per_sequence(overflow_k & kept, 2) + _count_per_sequence(overflow_v & kept, 2)

    lengths = cache.lengths
    sequences = jnp.arange(c.max_sequences)
    # Ring slot w ends up holding the latest position it holds after the chunk: a chunk token if that
    # position is >= lengths, else it keeps its token.
    ring_position, _ = ring_positions(c, (lengths + stored)[:, None])  # [S, W]
    ring_index = ring_position - lengths[:, None]
    ring_written = ring_index >= 0
    sink_index = jnp.arange(c.sink_tokens)[None, :] - lengths[:, None]  # [S, SINK]
    sink_written = (sink_index >= 0) & (sink_index < stored[:, None])

    def put_windows(old, new, index, written):
        """old [loops, S, H, tokens, D]; new [loops, S, chunk, H, D] -> rows ``index`` where ``written``."""
        rows = jnp.take_along_axis(new, jnp.clip(index, 0, chunk - 1)[None, :, :, None, None], axis=2)
        rows = rows.transpose(0, 1, 3, 2, 4)  # [loops, S, H, tokens, D]
        return jnp.where(written[None, :, None, :, None], rows, old)

    # The pages the chunk fills: page j of sequence s is its page lengths // P + j, filled at chunk step t.
    page_size = c.page_size
    most = min(chunk // page_size + 1, c.max_pages_per_sequence)
    first_page = lengths // page_size
    page_number = first_page[:, None] + jnp.arange(most)[None, :]  # [S, M]
    fills = page_number < (lengths + stored)[:, None] // page_size
    step = (page_number + 1) * page_size - 1 - lengths[:, None]  # chunk index of the page's last token
    previous = cache.block_tables[sequences, jnp.clip(first_page - 1, 0, c.max_pages_per_sequence - 1)]
    chain_broken = (first_page > 0) & (previous < 0)  # no page is stored after a lost one
    storable = fills & (page_number < c.max_pages_per_sequence)
    wanted = storable & ~chain_broken[:, None]
    # Serve the requests in the order single-token appends would: by step, then by sequence.
    order = jnp.where(wanted, jnp.clip(step, 0, chunk - 1) * c.max_sequences + sequences[:, None], chunk * c.max_sequences)
    served = jnp.zeros((chunk * c.max_sequences,), jnp.int32).at[order.reshape(-1)].set(1, mode="drop")
    rank = (jnp.cumsum(served) - 1)[jnp.clip(order, 0, chunk * c.max_sequences - 1)].reshape(-1)
    page_ids, page_refs, granted = _allocate(cache.page_refs, wanted.reshape(-1), rank)
    granted = granted.reshape(c.max_sequences, most)
    errors = errors | jnp.where(jnp.any(storable & ~granted, axis=1), ERROR_OUT_OF_PAGES, 0)

    positions = page_number[:, :, None] * page_size + jnp.arange(page_size)  # [S, M, P]
    from_chunk = positions >= lengths[:, None, None]
    chunk_row = jnp.clip(positions - lengths[:, None, None], 0, chunk - 1).reshape(c.max_sequences, -1)
    ring_row = ring_slot(c, positions).reshape(c.max_sequences, -1)

    def page_rows(new, ring):
        """new [loops, S, chunk, H, D] (window dtype), ring [loops, S, H, W, D] -> [loops, S*M, P, H, D] float32."""
        from_new = jnp.take_along_axis(new, chunk_row[None, :, :, None, None], axis=2)
        from_ring = jnp.take_along_axis(ring.transpose(0, 1, 3, 2, 4), ring_row[None, :, :, None, None], axis=2)
        rows = jnp.where(from_chunk.reshape(c.max_sequences, -1)[None, :, :, None, None], from_new, from_ring)
        return rows.astype(jnp.float32).reshape(c.num_loops, c.max_sequences * most, page_size, *rows.shape[3:])

    new_layers = []
    pack_saturated = jnp.zeros((c.max_sequences,), jnp.int32)
    for layer_index, layer in enumerate(cache.layers):
        new_k, new_v = window_k[layer_index], window_v[layer_index]  # [loops, S, chunk, H, D]
        layer_config = c.layer(layer_index)  # that layer's loop policy

        def pack(loops, new_k=new_k, new_v=new_v, layer=layer, layer_config=layer_config):
            tiles, unseen = pack_pages_with_saturations(
                page_rows(new_k, layer.ring_keys), page_rows(new_v, layer.ring_values),
                jnp.clip(page_number, 0, c.max_pages_per_sequence - 1).reshape(-1), layer_config, implementation)
            counted = jnp.where(granted.reshape(-1), tile_saturations(tiles) + unseen, 0)
            ids = jnp.where(granted.reshape(-1), page_ids, c.num_pages)
            return (tuple(pool.put(ids, t) for pool, t in zip(loops, tiles, strict=True)),
                    jnp.sum(counted.reshape(c.max_sequences, most), axis=1))

        loops, counted = jax.lax.cond(jnp.any(granted), pack,
                                      lambda loops: (loops, jnp.zeros((c.max_sequences,), jnp.int32)), layer.loops)
        pack_saturated = pack_saturated + counted
        new_layers.append(dataclasses.replace(
            layer, loops=loops,
            ring_keys=put_windows(layer.ring_keys, new_k, ring_index, ring_written),
            ring_values=put_windows(layer.ring_values, new_v, ring_index, ring_written),
            sink_keys=put_windows(layer.sink_keys, new_k, sink_index, sink_written),
            sink_values=put_windows(layer.sink_values, new_v, sink_index, sink_written),
        ))
    saturated = saturated + pack_saturated
    errors = errors | jnp.where(nonfinite > 0, ERROR_NONFINITE_INPUT, 0) | jnp.where(saturated > 0, ERROR_SATURATED, 0)
    column = jnp.where(granted, page_number, c.max_pages_per_sequence)  # out of range: dropped
    block_tables = cache.block_tables.at[sequences[:, None], column].set(
        page_ids.reshape(c.max_sequences, most), mode="drop")
    return dataclasses.replace(
        cache,
        layers=tuple(new_layers),
        block_tables=block_tables,
        lengths=lengths + stored,
        page_refs=page_refs,
        error_flags=cache.error_flags | errors,
        nonfinite_counts=cache.nonfinite_counts + nonfinite,
        saturation_counts=cache.saturation_counts + saturated,
    )
