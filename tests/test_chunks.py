"""Appending a chunk of tokens per sequence: ``paged_cache.append_tokens``.

The reference is ``append`` called once per chunk step with the slots that
take a token at that step (the others set inactive for that call): every
array of the resulting cache must match bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jflashloop import paged_cache
from tests.bits import assert_bits_equal
from tests.builders import build, looped_tokens, small_config, tiny_config


@jax.jit
def _append_masked(cache, keys, values, takes):
    """``append`` for the slots in ``takes`` only (the others unchanged)."""
    masked = dataclasses.replace(cache, active=cache.active & takes)
    return dataclasses.replace(paged_cache.append(masked, keys, values), active=cache.active)


def sequential(cache, keys, values, counts):
    for i in range(keys.shape[3]):
        takes = jnp.asarray(np.asarray(counts) > i)
        if takes.any():
            cache = _append_masked(cache, keys[:, :, :, i], values[:, :, :, i], takes)
    return cache


def assert_caches_equal(actual, expected):
    leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    got = jax.tree_util.tree_leaves(actual)
    assert len(got) == len(leaves)
    for (path, want), have in zip(leaves, got, strict=True):
        assert_bits_equal(np.asarray(have), np.asarray(want), jax.tree_util.keystr(path))


_append_tokens = jax.jit(paged_cache.append_tokens)


def chunk_of(rng, config, chunk):
    keys, values = looped_tokens(rng, config, chunk, batch=config.max_sequences)  # [L, loops, S, chunk, H, D]
    return jnp.asarray(keys), jnp.asarray(values)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_append_tokens_equals_single_appends(rng, chunk):
    config = small_config(page_size=16, max_pages_per_sequence=8, num_pages=64, sink_tokens=4, recent_tokens=16)
    cache, _ = build(rng, config, prompt_lengths=[20, 3, 47], steps=2)
    for _ in range(2):
        keys, values = chunk_of(rng, config, chunk)
        counts = jnp.asarray(rng.integers(0, chunk + 1, config.max_sequences), jnp.int32)
        expected = sequential(cache, keys, values, counts)
        actual = _append_tokens(cache, keys, values, counts)
        assert_caches_equal(actual, expected)
        paged_cache.validate(actual)
        cache = actual


def test_append_tokens_at_the_edges(rng):
    """A small pool (pages run out mid-chunk), a sequence at capacity, an inactive slot, NaN tokens."""
    config = tiny_config(num_pages=5, max_pages_per_sequence=4, max_sequences=3, page_size=16, num_loops=3)
    cache, _ = build(rng, config, prompt_lengths=[60, 20, 5], steps=0)
    cache = paged_cache.free(cache, 2)
    keys, values = chunk_of(rng, config, 24)
    keys = keys.at[0, 1, 1, 3, 0, 5].set(jnp.nan).at[0, 0, 0, 2, 1, 2].set(1e30)  # 1e30: into slot 0's last page
    counts = jnp.asarray([24, 24, 9], jnp.int32)
    expected = sequential(cache, keys, values, counts)
    actual = _append_tokens(cache, keys, values, counts)
    assert_caches_equal(actual, expected)
    flags = np.asarray(actual.error_flags)
    assert flags[0] & paged_cache.ERROR_SEQUENCE_FULL and flags[0] & paged_cache.ERROR_SATURATED  # 60 + 24 > 64
    assert flags[1] & paged_cache.ERROR_OUT_OF_PAGES and flags[1] & paged_cache.ERROR_NONFINITE_INPUT
    assert not np.asarray(actual.active)[2] and int(actual.lengths[2]) == 0


def test_append_tokens_checks_its_arguments(rng):
    config = tiny_config()
    cache, _ = build(rng, config, prompt_lengths=[5, 6], steps=0)
    keys, values = chunk_of(rng, config, 3)
    with pytest.raises(ValueError, match=r"counts must be in \[0, chunk=3\], got counts\[1\] = 4"):
        paged_cache.append_tokens(cache, keys, values, jnp.asarray([1, 4], jnp.int32))
    with pytest.raises(ValueError, match=r"counts must be \[max_sequences=2\]"):
        paged_cache.append_tokens(cache, keys, values, jnp.asarray([1], jnp.int32))
    with pytest.raises(TypeError, match="counts must be an integer array"):
        paged_cache.append_tokens(cache, keys, values, jnp.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match="chunk, kv_heads"):
        paged_cache.append_tokens(cache, keys[:, :, :, 0], values[:, :, :, 0], jnp.asarray([1, 1]))
    # Under jit out-of-range counts are clamped and flagged.
    flagged = _append_tokens(cache, keys, values, jnp.asarray([-1, 7], jnp.int32))
    assert (np.asarray(flagged.error_flags) & paged_cache.ERROR_INVALID_LENGTH).all()
    assert np.asarray(flagged.lengths).tolist() == [5, 9]
