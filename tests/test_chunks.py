"""Chunks of tokens per sequence: ``paged_cache.append_tokens`` and ``jflashloop.chunk_attention``.

``append_tokens``' reference is ``append`` called once per chunk step with
the slots that take a token at that step (the others set inactive for that
call): every array of the resulting cache must match bit for bit.
``chunk_attention`` is checked against a float64 oracle over ``reconstruct``
plus the chunk, and against ``decode_attention`` for one-token chunks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import paged_cache
from tests.bits import assert_bits_equal
from tests.builders import HEAD_DIM, build, looped_tokens, small_config, tiny_config


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


@pytest.mark.parametrize("chunk", [1, 16, 37])  # one token, one page, a chunk across pages
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


# --------------------------------------------------------------------------- chunk attention


def chunk_oracle(queries, cache, layer, loop, keys, values, counts, scale=None):
    """float64 numpy: ``reconstruct`` (the cached positions below ``lengths``) plus the chunk, causal."""
    c = cache.config
    queries, counts = np.asarray(queries, np.float64), np.asarray(counts)
    sequences, chunk, q_heads, head_dim = queries.shape
    group = q_heads // c.num_kv_heads
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    window = np.dtype(cache.window_dtype)
    own_k = np.nan_to_num(np.asarray(keys, np.float32).astype(window).astype(np.float64), nan=0, posinf=0, neginf=0)
    own_v = np.nan_to_num(np.asarray(values, np.float32).astype(window).astype(np.float64), nan=0, posinf=0, neginf=0)
    out = np.zeros((sequences, chunk, q_heads, head_dim))
    for s in range(sequences):
        if not bool(cache.active[s]):
            continue
        k, v, _ = paged_cache.reconstruct(cache, layer, loop, s, include_pending=True)
        regions = paged_cache.sequence_regions(cache, s, include_pending=True)
        length = int(cache.lengths[s])
        held = np.asarray(regions["sink"] | regions["ring"] | regions["pages"])[:length]
        k, v = np.asarray(k, np.float64)[:length][held], np.asarray(v, np.float64)[:length][held]
        for i in range(int(counts[s])):
            own = [j for j in range(i + 1) if length + j < c.max_tokens_per_sequence]
            all_k = np.concatenate([k, own_k[s, own]]).repeat(group, axis=1)
            all_v = np.concatenate([v, own_v[s, own]]).repeat(group, axis=1)
            if not len(all_k):
                continue
            scores = np.einsum("hd,thd->ht", queries[s, i], all_k) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[s, i] = np.einsum("ht,thd->hd", weights, all_v) / weights.sum(axis=1)[:, None]
    return out


def _chunk(rng, config, chunk, q_heads=4):
    queries = jnp.asarray(rng.standard_normal((config.max_sequences, chunk, q_heads, config.head_dim)), jnp.float32)
    keys, values = chunk_of(rng, config, chunk)
    return queries, keys, values


def _relative(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.linalg.norm(expected.reshape(len(expected), -1), axis=1)
    return np.linalg.norm((actual - expected).reshape(len(expected), -1), axis=1) / np.where(scale > 0, scale, 1)


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_chunk_attention_matches_the_float64_oracle(rng, chunk):
    config = small_config(page_size=16, max_pages_per_sequence=8, num_pages=64, sink_tokens=4, recent_tokens=16)
    cache, _ = build(rng, config, prompt_lengths=[40, 0, 17], steps=1)
    queries, keys, values = _chunk(rng, config, chunk)
    counts = jnp.asarray([chunk, chunk, max(chunk - 2, 0)], jnp.int32)
    for loop in (0, config.num_loops - 1):
        layer_k, layer_v = keys[1, loop], values[1, loop]  # [S, chunk, H, D]
        actual = jflashloop.chunk_attention(queries, cache, 1, loop, layer_k, layer_v, counts)
        assert actual.shape == queries.shape and actual.dtype == jnp.float32
        expected = chunk_oracle(queries, cache, 1, loop, layer_k, layer_v, counts)
        assert (_relative(actual, expected) < 1e-5).all()
        assert not np.asarray(actual)[2, max(chunk - 2, 0):].any()  # rows beyond counts are zeros


@pytest.mark.parametrize("chunk", [1, 9])
def test_the_dense_path_matches_the_float64_oracle(rng, chunk):
    """Cached positions decoded to bfloat16, then dot_product_attention with the mask (bfloat16 rounding)."""
    config = small_config(page_size=16, max_pages_per_sequence=8, num_pages=64, sink_tokens=4, recent_tokens=16)
    cache, _ = build(rng, config, prompt_lengths=[40, 0, 17], steps=1)
    queries, keys, values = _chunk(rng, config, chunk, q_heads=8)
    counts = jnp.asarray([chunk, chunk, max(chunk - 2, 0)], jnp.int32)
    loop = config.num_loops - 1
    actual = jflashloop.chunk_attention(queries, cache, 1, loop, keys[1, loop], values[1, loop], counts,
                                        implementation="dense")
    expected = chunk_oracle(queries, cache, 1, loop, keys[1, loop], values[1, loop], counts)
    error = _relative(actual, expected)
    assert (error < 2e-2).all() and error.max() > 0, error  # bfloat16 inputs: close, not exact
    assert not np.asarray(actual)[2, max(chunk - 2, 0):].any()  # rows beyond counts are zeros


def test_one_token_chunk_equals_decode_after_write_token(rng):
    config = small_config(page_size=16, max_pages_per_sequence=4, num_pages=64, recent_tokens=8)
    cache, _ = build(rng, config, prompt_lengths=[33, 63, 16], steps=1)  # slot 1 reaches capacity (64)
    queries, keys, values = _chunk(rng, config, 1, q_heads=8)
    for loop in range(config.num_loops):
        written = paged_cache.write_token(cache, 0, loop, keys[0, loop][:, 0], values[0, loop][:, 0])
        expected = jflashloop.decode_attention(queries[:, 0], written, 0, loop, include_pending=True,
                                               implementation="xla")
        actual = jflashloop.chunk_attention(queries, cache, 0, loop, keys[0, loop], values[0, loop],
                                            jnp.ones((3,), jnp.int32))
        np.testing.assert_allclose(np.asarray(actual)[:, 0], np.asarray(expected), rtol=2e-6, atol=2e-6)


def test_chunk_attention_is_causal_and_isolated(rng):
    config = small_config(page_size=16, num_pages=64)
    cache, _ = build(rng, config, prompt_lengths=[30, 12, 50], steps=0)
    cache = paged_cache.free(cache, 1)
    queries, keys, values = _chunk(rng, config, 6)
    counts = jnp.full((3,), 6, jnp.int32)
    base = np.asarray(jflashloop.chunk_attention(queries, cache, 0, 0, keys[0, 0], values[0, 0], counts))
    later_k = keys[0, 0].at[:, 4:].set(7.0)  # tokens 4-5 change: queries 0-3 must not see it
    moved = np.asarray(jflashloop.chunk_attention(queries, cache, 0, 0, later_k, values[0, 0], counts))
    assert_bits_equal(moved[:, :4], base[:, :4], "rows before the change")
    assert np.abs(moved[0, 4:] - base[0, 4:]).max() > 0
    assert not base[1].any()  # the freed slot
    other = keys[0, 0].at[2].set(-3.0)  # another sequence's chunk changes nothing for slot 0
    assert_bits_equal(np.asarray(jflashloop.chunk_attention(queries, cache, 0, 0, other, values[0, 0], counts))[0],
                      base[0], "slot 0")


def test_chunk_then_append_tokens_is_the_next_cache(rng):
    """After attending, the accepted tokens go in with append_tokens; a 1-token chunk then reads them."""
    config = small_config(page_size=16, num_pages=64)
    cache, _ = build(rng, config, prompt_lengths=[30, 12, 15], steps=0)
    _, keys, values = _chunk(rng, config, 5)
    accepted = jnp.asarray([5, 2, 1], jnp.int32)
    after = paged_cache.append_tokens(cache, keys, values, accepted)
    assert np.asarray(after.lengths).tolist() == [35, 14, 16]
    nxt_q, nxt_k, nxt_v = _chunk(rng, config, 1)
    actual = jflashloop.chunk_attention(nxt_q, after, 0, 0, nxt_k[0, 0], nxt_v[0, 0], jnp.ones((3,), jnp.int32))
    expected = chunk_oracle(nxt_q, after, 0, 0, nxt_k[0, 0], nxt_v[0, 0], np.ones(3, int))
    assert (_relative(actual, expected) < 1e-5).all()


def test_chunk_attention_checks_its_arguments(rng):
    config = small_config()
    cache, _ = build(rng, config, prompt_lengths=[5], steps=0)
    queries, keys, values = _chunk(rng, config, 3)
    k, v = keys[0, 0], values[0, 0]
    ones = jnp.ones((3,), jnp.int32)
    with pytest.raises(ValueError, match="rank 4"):
        jflashloop.chunk_attention(queries[:, 0], cache, 0, 0, k, v, ones)
    with pytest.raises(ValueError, match="keys must be"):
        jflashloop.chunk_attention(queries, cache, 0, 0, k[:, :2], v, ones)
    with pytest.raises(TypeError, match="values must be a floating array"):
        jflashloop.chunk_attention(queries, cache, 0, 0, k, v.astype(jnp.int32), ones)
    with pytest.raises(ValueError, match=r"counts must be in \[0, chunk=3\]"):
        jflashloop.chunk_attention(queries, cache, 0, 0, k, v, ones * 4)
    with pytest.raises(ValueError, match="layer must be in"):
        jflashloop.chunk_attention(queries, cache, 5, 0, k, v, ones)
    with pytest.raises(ValueError, match="implementation must be"):
        jflashloop.chunk_attention(queries, cache, 0, 0, k, v, ones, implementation="cuda")
    traced = jax.jit(lambda n: jflashloop.chunk_attention(queries, cache, 0, 0, k, v, n))(ones * 2)
    assert not np.asarray(traced)[:, 2:].any() and np.asarray(traced)[0, :2].any()
    assert HEAD_DIM == config.head_dim


@pytest.mark.parametrize("chunk, q_heads, loop, compact", [(3, 8, 0, False), (1, 4, 0, False), (8, 4, 2, False),
                                                            (2, 2, 1, False), (8, 4, 2, True)])
def test_gluon_chunk_path_matches_the_reference(rng, chunk, q_heads, loop, compact):
    """The Gluon decode kernel over the pages (numpy emulation of its body on a CPU; compiled on a GPU
    in test_gluon_decode's manner), the chunk's own tokens in XLA: up to 32 query rows per KV head
    (``compact``: ``CacheConfig.compact_loops``' affine INT2 rows, read per block of 8 rows)."""
    pytest.importorskip("triton.experimental.gluon")
    from jflashloop.ops import _chunk_attention

    layout = dict(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, max_pages_per_sequence=8, num_pages=64,
                  max_sequences=3, num_loops=3)
    config = (jflashloop.CacheConfig.compact_loops(**layout) if compact
              else small_config(**{k: v for k, v in layout.items() if k not in ("num_kv_heads", "max_sequences")}))
    cache, _ = build(rng, config, prompt_lengths=[70, 0, 33], steps=1)
    queries, keys, values = _chunk(rng, config, chunk, q_heads=q_heads)
    counts = jnp.asarray([chunk, chunk, max(chunk - 1, 0)], jnp.int32)
    layer_k, layer_v = keys[0, loop], values[0, loop]
    expected = jflashloop.chunk_attention_reference(queries, cache, 0, loop, layer_k, layer_v, counts)
    from jflashloop_triton_kernels import call

    compiled = jax.default_backend() == "gpu" and call.available()
    actual = _chunk_attention._gluon(queries, cache, 0, loop, layer_k, layer_v, counts, scale=None,
                                     emulate=not compiled)
    assert actual.shape == expected.shape
    assert (_relative(actual, expected) < 2e-3).all(), _relative(actual, expected)
    assert not np.asarray(actual)[2, max(chunk - 1, 0):].any()


@pytest.mark.parametrize("chunk, fallback", [(3, "xla"), (9, "dense")])
def test_the_automatic_choice_on_a_gpu_tries_gluon_then_its_fallback(rng, monkeypatch, chunk, fallback):
    """On a GPU the Gluon path goes first; where it cannot serve the call, the dense path (cuDNN's
    flash attention over the bfloat16-decoded cache) for chunks of more than 32 query rows per KV
    head, the float32 reference path for smaller ones."""
    from jflashloop.ops import _chunk_attention, _dispatch

    config = small_config(page_size=16, num_pages=64)
    cache, _ = build(rng, config, prompt_lengths=[30, 12, 50], steps=0)
    queries, keys, values = _chunk(rng, config, chunk, q_heads=4 * config.num_kv_heads)  # 4 rows per token
    counts = jnp.full((3,), chunk, jnp.int32)
    expected = jflashloop.chunk_attention(queries, cache, 0, 0, keys[0, 0], values[0, 0], counts, implementation="xla")
    tried = []
    originals = {name: getattr(_chunk_attention, name) for name in ("_dense", "_reference")}

    def recorded(*args, **kwargs):  # as the Gluon path does where it cannot serve the call
        tried.append("gluon")
        raise NotImplementedError("not here")

    def recording(name, label):
        def call(*args, **kwargs):
            tried.append(label)
            return originals[name](*args, **kwargs)
        return call

    monkeypatch.setattr(_chunk_attention, "_gluon", recorded)
    monkeypatch.setattr(_chunk_attention, "_dense", recording("_dense", "dense"))
    monkeypatch.setattr(_chunk_attention, "_reference", recording("_reference", "xla"))
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    actual = jflashloop.chunk_attention(queries, cache, 0, 0, keys[0, 0], values[0, 0], counts)
    assert tried == ["gluon", fallback]
    assert (_relative(actual, expected) < (2e-2 if fallback == "dense" else 1e-6)).all(), _relative(actual, expected)
