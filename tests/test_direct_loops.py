"""Direct loops: a dense loop after the base stored on its own (``LoopStorage.direct``), not as a residual.

Its reconstruction reads its own stream only and the loops after it are residuals against it; the
cache, the numpy oracle, the reference attention path, the fused kernels and the files all follow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import CacheConfig, paged_cache
from jflashloop._chains import decode_loops, encode_loops
from jflashloop.ops._decode_attention import kernel_inputs, loop_formats
from jflashloop.persistence import _format
from tests.bits import assert_bits_equal
from tests.builders import _prefill, assert_matches_oracle, build, looped_tokens, small_config


def direct_config(**overrides) -> CacheConfig:
    return small_config(direct_loop=True, **overrides)


@pytest.fixture(scope="module")
def built():
    """One direct cache for the module's tests: prompts of 37, 5 and 70 tokens (partial pages, a sink),
    then 12 appends that pack pages (quantize on write); ``(cache, history)``."""
    seed = int(os.environ.get("JFLASHLOOP_TEST_SEED", secrets.randbits(32)))
    print(f"test_direct_loops.built: JFLASHLOOP_TEST_SEED={seed}")
    return build(np.random.default_rng(seed), direct_config(), prompt_lengths=[37, 5, 70], steps=12)


def test_config_marks_the_chain_starts():
    config = direct_config()
    assert config.chain_starts() == (True, True, False, False)
    assert [config.chain_start(loop) for loop in range(4)] == [0, 1, 1, 1]
    plain = small_config()
    assert plain.chain_starts() == (True, False, False, False)
    assert [plain.chain_start(loop) for loop in range(4)] == [0, 0, 0, 0]
    # the storage is the same: a direct loop costs the bytes of the residual it replaces
    assert jflashloop.storage.pool_page_bytes(config) == jflashloop.storage.pool_page_bytes(plain)
    table = jflashloop.storage.storage_table(jflashloop.storage.OURO_1_4B, direct_loop=True)
    assert "loop 1: stored on its own (direct)" in table and "6.02x" in table


def test_config_refuses_direct_loops_it_cannot_store():
    config = small_config()
    sparse = dataclasses.replace(config.loops[2], direct=True)
    with pytest.raises(ValueError, match="must be dense"):
        dataclasses.replace(config, loops=(*config.loops[:2], sparse, config.loops[3]))
    with pytest.raises(TypeError, match="direct must be a bool"):
        dataclasses.replace(config, loops=(config.loops[0], dataclasses.replace(config.loops[1], direct=1),
                                           *config.loops[2:]))
    with pytest.raises(ValueError, match="num_loops >= 2"):
        small_config(num_loops=1, direct_loop=True)


def test_chain_algebra_restarts_at_each_start():
    """encode_loops hands a start no predecessor; decode_loops reads from the last start."""
    seen = []

    def encode_step(loop, target, predecessor):
        seen.append((loop, predecessor))
        return target if predecessor is None else target - predecessor

    def reconstruct_step(step, previous):
        return step if previous is None else previous + step

    targets = [1.0, 10.0, 12.0, 15.0]
    steps = encode_loops(targets, encode_step, reconstruct_step, starts=(True, False, True, False))
    assert seen == [(0, None), (1, 1.0), (2, None), (3, 12.0)]
    assert steps == [1.0, 9.0, 12.0, 3.0]
    assert [decode_loops(steps, reconstruct_step, loop, (True, False, True, False)) for loop in range(4)] == targets
    assert decode_loops(steps, reconstruct_step, 3) == 25.0  # read as one chain it is another tensor
    with pytest.raises(ValueError, match="the first True"):
        encode_loops(targets, encode_step, reconstruct_step, starts=(False, True, True, True))
    with pytest.raises(ValueError, match="4 bools"):
        decode_loops(steps, reconstruct_step, 1, (True, False))


def test_cache_matches_the_oracle(built):
    """Prefill, appends that pack pages and the windows: every loop of every layer bit for bit as the
    oracle rebuilds it."""
    cache, history = built
    assert_matches_oracle(cache, history.keys, history.values)


def test_a_direct_loop_does_not_read_the_base(rng):
    """Loops 1-3 of a direct cache keep their bits whatever loop 0 held; with residuals they change."""
    for direct, unchanged in ((True, True), (False, False)):
        config = small_config(direct_loop=direct)
        keys, values = [np.asarray(x) for x in looped_tokens(rng, config, 70)]  # build()'s prompt shape
        other_k, other_v = keys.copy(), values.copy()
        other_k[:, 0] = keys[:, 0] * 3 + 1
        other_v[:, 0] = values[:, 0] - 2
        caches = [_prefill(paged_cache.create(config), 0, jnp.asarray(k), jnp.asarray(v), 40)
                  for k, v in ((keys, values), (other_k, other_v))]
        for loop in (1, 3):
            a, b = (np.asarray(paged_cache.reconstruct(cache, 0, loop, 0)[0]) for cache in caches)
            assert np.array_equal(a, b) == unchanged, (direct, loop)


def test_kernels_read_the_streams_from_the_chain_start(built):
    cache, _ = built
    formats = loop_formats(cache.config, 3)
    assert [f.sparse for f in formats] == [False, True, True]
    inputs = kernel_inputs(cache, 1, 2, include_pending=True)
    assert len(inputs["streams"]) == 2 and inputs["window_loop"] == 2
    assert inputs["streams"][0]["keys"]["payload"] is cache.layers[1].loops[1].keys.payload
    assert len(kernel_inputs(cache, 1, 0, include_pending=True)["streams"]) == 1


@pytest.mark.parametrize("loop", [1, 2, 3])
def test_pallas_kernel_matches_the_reference(built, rng, loop):
    """The Pallas kernel (interpret mode on a CPU) reads a direct loop's chain like any other."""
    cache, _ = built
    queries = jnp.asarray(rng.standard_normal((3, 2 * cache.config.num_kv_heads, cache.config.head_dim)),
                          jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=True)
    actual = jflashloop.decode_attention(queries, cache, 1, loop, implementation="pallas", include_pending=True)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the public call's fused kernel runs on a GPU")
def test_public_call_reads_a_direct_chain_on_the_gpu(rng):
    """On a GPU the default call (the Gluon kernel at head_dim 128, 64-token pages) reads loops 2-4 of a
    direct chain as the reference does."""
    config = direct_config(head_dim=128, page_size=64, num_kv_heads=2, max_pages_per_sequence=12, num_pages=40)
    cache, _ = build(rng, config, prompt_lengths=[600, 9, 200], steps=3)
    queries = jnp.asarray(rng.standard_normal((3, 8, 128)), jnp.float32)
    for loop in (1, 2, 3):
        expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=True)
        actual = jflashloop.decode_attention(queries, cache, 1, loop, include_pending=True)
        error = np.linalg.norm(np.asarray(actual - expected), axis=-1) / np.linalg.norm(np.asarray(expected), axis=-1)
        assert (error < 2e-3).all(), (loop, error.max())


def test_files_keep_the_direct_loops(tmp_path, built):
    cache, _ = built
    path = tmp_path / "direct.jfl"
    jflashloop.persistence.save(path, cache)
    loaded = jflashloop.persistence.load(path)
    assert loaded.config == cache.config and loaded.config.chain_starts() == (True, True, False, False)
    for loop in range(4):
        a, b = paged_cache.reconstruct(cache, 0, loop, 0), paged_cache.reconstruct(loaded, 0, loop, 0)
        assert_bits_equal(a[0], b[0], f"keys loop {loop}")
    # a file written before direct loops existed has no "direct" key: every later loop is a residual
    stored = json.loads(json.dumps(_format.config_to_json(small_config())))
    for loop in stored["loops"]:
        del loop["direct"]
    assert _format.config_from_json(stored) == small_config()
