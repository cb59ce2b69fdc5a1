"""Builders shared by the cache, kernel and property tests.

Small cache configurations, slowly drifting looped K/V, a dense record of
everything written (:class:`History`), caches built by prefill and appends
(:func:`build`, :func:`lost_page_cache`, :func:`hole_cache`) and the oracle's
view of one sequence (:func:`oracle_sequence`, :func:`assert_matches_oracle`).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

import jflashloop
import jflashloop_reference as reference
from jflashloop import CacheConfig, LoopStorage, paged_cache, persistence
from tests.bits import assert_bits_equal

LAYERS, HEADS, HEAD_DIM = 2, 2, 16


def small_config(**overrides) -> CacheConfig:
    arguments = dict(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, num_pages=64, max_sequences=3,
        max_pages_per_sequence=20, num_loops=4, page_size=16,
    )
    arguments.update(overrides)
    return CacheConfig.flashloop(**arguments)


def nvfp4_residual_config(**overrides) -> CacheConfig:
    base = small_config(**overrides)
    nvfp4 = jflashloop.NVFP4
    loops = (base.loops[0], LoopStorage(nvfp4, nvfp4), LoopStorage(nvfp4, nvfp4, 4), LoopStorage(nvfp4, nvfp4, 2))
    return dataclasses.replace(base, loops=loops)


def small_affine_config(fmt: str = "int3", **overrides) -> CacheConfig:
    """:func:`small_config` at head_dim 32 with every stream in INT3 or INT2 (``fmt``): K per channel over each
    page's tokens, V (and the sparse residuals) per token over 32 channels."""
    base = small_config(**{"head_dim": 32, **overrides})
    keys = jflashloop.CodecSpec(fmt, "channel", min(16, base.page_size))
    values = jflashloop.CodecSpec(fmt, "token", 32)
    loops = (LoopStorage(keys, values), LoopStorage(keys, values), LoopStorage(values, values, 4),
             LoopStorage(values, values, 2))
    return dataclasses.replace(base, loops=loops[: base.num_loops])


def looped_tokens(rng, config, tokens, *, batch=None):
    """Random K/V whose loops drift slowly, rounded to bfloat16 like a model's.

    Returns numpy float32 ``[layers, loops, (batch,) tokens, H, D]`` keys and values.
    """
    lead = (config.num_layers,) + ((batch,) if batch else ()) + (tokens,)
    shape = (*lead, config.num_kv_heads, config.head_dim)

    def one():
        offsets = rng.standard_normal((config.num_layers, 1, config.num_kv_heads, config.head_dim)) * 2
        if batch:
            offsets = offsets[:, None]
        first = rng.standard_normal(shape) + offsets
        loops = [first]
        for _ in range(config.num_loops - 1):
            loops.append(loops[-1] + 0.2 * rng.standard_normal(shape))
        stacked = np.stack(loops, axis=1).astype(np.float32)
        return stacked.astype(ml_dtypes.bfloat16).astype(np.float32)

    return one(), one()


def oracle_codec(spec):
    """A codec spec as the oracle's ``(format, axis, group_size, rotation_seed, table)`` tuple (``table``: a
    fitted format's per-head widths or divisors, None otherwise)."""
    return (spec.format, spec.axis, spec.group_size, spec.rotation_seed, spec.fitted_table and spec.fitted_table[1])


def oracle_sequence(cache, history_k, history_v, layer, loop, slot, *, include_pending=False, stored_pages=None):
    """The oracle's float32 K and V ``[visible, H, D]`` for one sequence.

    ``visible`` is 0 for an inactive slot and at most the sequence capacity
    (a full sequence's pending token is dropped); ``stored_pages`` (default:
    the leading pages of the slot's block-table row) as in
    ``reference.paged_cache.readable_positions``.
    """
    config = cache.config
    length = int(cache.lengths[slot])
    visible = min(length + int(include_pending), config.max_tokens_per_sequence)
    visible = visible if bool(cache.active[slot]) else 0
    pages = np.asarray(cache.block_tables[slot])
    if stored_pages is None:
        stored_pages = int(np.cumprod(pages >= 0).sum())
    row_positions = []
    for loop_tiles in cache.layers[layer].loops:
        if loop_tiles.row_positions is None:
            row_positions.append(None)
        else:
            row_positions.append(np.asarray(loop_tiles.row_positions)[:, np.maximum(pages, 0)])
    common = dict(
        length=length, visible=visible, page_size=config.page_size, sink_tokens=config.sink_tokens,
        recent_tokens=config.recent_tokens, row_positions=row_positions, loop=loop, stored_pages=stored_pages,
    )
    policy = config.layer(layer).loops  # this layer's loops
    keys = reference.paged_cache.reconstruct_sequence(
        history_k[layer, :, slot],
        loops=[(oracle_codec(s.key_spec), None, s.sparse_rows_per_page, s.direct) for s in policy], **common,
    )
    values = reference.paged_cache.reconstruct_sequence(
        history_v[layer, :, slot],
        loops=[(oracle_codec(s.value_spec), None, s.sparse_rows_per_page, s.direct) for s in policy], **common,
    )
    return keys, values


def assert_matches_oracle(cache, history_k, history_v, *, loops=None, layers=None, include_pending=False):
    config = cache.config
    for slot in np.flatnonzero(np.asarray(cache.active)):
        for layer in layers if layers is not None else range(config.num_layers):
            for loop in loops if loops is not None else range(config.num_loops):
                keys, values, visible = paged_cache.reconstruct(
                    cache, layer, loop, slot, include_pending=include_pending
                )
                expected_k, expected_v = oracle_sequence(
                    cache, history_k, history_v, layer, loop, slot, include_pending=include_pending
                )
                assert int(visible) == expected_k.shape[0]
                where = f"slot {slot} layer {layer} loop {loop + 1}"
                assert_bits_equal(np.asarray(keys)[: int(visible)], expected_k, f"keys {where}")
                assert_bits_equal(np.asarray(values)[: int(visible)], expected_v, f"values {where}")
                assert not np.asarray(keys)[int(visible):].any(), "positions beyond visible must be zero"


class History:
    """A dense record of everything written to a cache, per slot."""

    def __init__(self, config, capacity):
        shape = (config.num_layers, config.num_loops, config.max_sequences, capacity,
                 config.num_kv_heads, config.head_dim)
        self.keys = np.zeros(shape, np.float32)
        self.values = np.zeros(shape, np.float32)
        self.lengths = np.zeros(config.max_sequences, int)

    def prefill(self, slot, keys, values, length):
        self.keys[:, :, slot, :length] = keys[:, :, :length]
        self.values[:, :, slot, :length] = values[:, :, :length]
        self.lengths[slot] = length

    def append(self, keys, values, active):
        for slot in np.flatnonzero(active):
            self.keys[:, :, slot, self.lengths[slot]] = keys[:, :, slot]
            self.values[:, :, slot, self.lengths[slot]] = values[:, :, slot]
            self.lengths[slot] += 1


_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append, donate_argnums=0)
_append_kept = jax.jit(paged_cache.append)  # no donation: the input cache is compared afterwards


def build(rng, config, prompt_lengths, steps, *, padded_tokens=None, value_scale=1.0):
    """A cache with prompts of ``prompt_lengths`` prefilled and ``steps`` tokens appended to every
    sequence (random looped K/V, values times ``value_scale``): ``(cache, history)``."""
    cache = paged_cache.create(config)
    history = History(config, max(prompt_lengths) + steps + 1)
    padded_tokens = padded_tokens or max(prompt_lengths)
    for slot, length in enumerate(prompt_lengths):
        keys, values = looped_tokens(rng, config, padded_tokens)
        values = values * value_scale
        cache = _prefill(cache, slot, keys, values, length)
        history.prefill(slot, keys, values, length)
    for _ in range(steps):
        keys, values = looped_tokens(rng, config, 1, batch=config.max_sequences)
        keys, values = keys[:, :, :, 0], values[:, :, :, 0] * value_scale
        active = np.asarray(cache.active)
        cache = _append(cache, keys, values)
        history.append(keys, values, active)
    paged_cache.check(cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), history.lengths)
    return cache, history


def tiny_config(**overrides) -> CacheConfig:
    arguments = dict(num_layers=1, num_pages=8, max_sequences=2, max_pages_per_sequence=4, num_loops=2)
    arguments.update(overrides)
    return small_config(**arguments)


def lost_page_cache(rng, config, neighbour_seed):
    """Slot 0 (the neighbour) takes 2 of 3 pages; slot 1's jitted 40-token prefill gets one, its second is lost.

    Slot 1's tokens are the same for every ``neighbour_seed``; returns ``(cache, history)``.
    """
    history = History(config, 41)
    keys, values = looped_tokens(np.random.default_rng(neighbour_seed), config, 40)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 40)
    history.prefill(0, keys, values, 40)
    keys, values = looped_tokens(rng, config, 40)
    cache = _prefill(cache, 1, keys, values, 40)
    history.prefill(1, keys, values, 40)
    return cache, history


def hole_cache(rng, config):
    """Slot 1's page 0 is lost (slot 0 held the pool); its page 1 fills after slot 0 was freed.

    Page 1 is not stored (no page is stored after a lost one) although the
    pool has room again. Returns ``(cache, history)``; slot 1's block-table
    row is ``[-1, -1, -1]``.
    """
    keys, values = looped_tokens(rng, config, 48)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 48)
    history = History(config, 33)
    keys, values = looped_tokens(rng, config, 20)
    cache = _prefill(cache, 1, keys, values, 20)
    history.prefill(1, keys, values, 20)
    cache = jax.jit(paged_cache.free)(cache, 0)
    for _ in range(12):
        keys, values = looped_tokens(rng, config, 1, batch=config.max_sequences)
        cache = _append_kept(cache, keys[:, :, :, 0], values[:, :, :, 0])
        history.append(keys[:, :, :, 0], values[:, :, :, 0], np.array([False, True]))
    return cache, history


def lost_page_config():
    return tiny_config(num_pages=3, max_pages_per_sequence=3, num_loops=3)  # loop 3 sparse


def assert_file_round_trip(cache, path):
    """Save ``cache`` to ``path`` and load it back: the same config and every array bit for bit; the loaded cache."""
    persistence.save(path, cache)
    loaded = persistence.load(path)
    assert loaded.config == cache.config
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(cache), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "reloaded")
    return loaded
