"""Per-layer storage policies: ``CacheConfig(layer_loops=...)`` through the cache, kernels, files and bytes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import CacheConfig, LoopStorage, PersistenceError, paged_cache, persistence, storage
from jflashloop_pallas_kernels.decode_attention import KernelConfig
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    History,
    assert_file_round_trip,
    assert_matches_oracle,
    build,
    small_config,
)


def three_policies(**overrides) -> CacheConfig:
    """Layer 0: FlashLoop's INT4 chain; layer 1: NVFP4 everywhere; layer 2: int4_rotated, other sparse rows."""
    base = small_config(num_layers=3, **overrides)
    nvfp4 = jflashloop.NVFP4
    rotated_k, rotated_v = jflashloop.int4_rotated(HEAD_DIM, 3), jflashloop.int4_rotated(HEAD_DIM, 4)
    layer_loops = (
        base.loops,
        (LoopStorage(nvfp4, nvfp4), LoopStorage(nvfp4, nvfp4), LoopStorage(nvfp4, nvfp4, 4), LoopStorage(nvfp4, nvfp4, 2)),
        (LoopStorage(rotated_k, rotated_v), LoopStorage(rotated_k, rotated_v), LoopStorage(rotated_k, rotated_v, 8),
         LoopStorage(rotated_k, rotated_v, 3)),
    )
    return dataclasses.replace(base, layer_loops=layer_loops)


def test_each_layer_is_stored_in_its_own_policy(rng):
    config = three_policies()
    cache, history = build(rng, config, prompt_lengths=[37, 16, 50], steps=4)
    assert_matches_oracle(cache, history.keys, history.values)  # every layer against its own codecs' oracle
    for layer, loops in enumerate(config.layer_loops):
        formats = [tiles.keys.spec for tiles in cache.layers[layer].loops]
        assert formats == [storage.key_spec for storage in loops]
    assert config.layer(1).loops == config.layer_loops[1] and config.layer(1).layer_loops is None
    assert not config.is_uniform and small_config().layer(2) is not None


@pytest.mark.parametrize("layer", [1, 2])  # layer 0 is the uniform policy's, tested everywhere else
def test_the_fused_kernel_reads_each_layer_in_its_format(rng, layer):
    config = three_policies()  # the other tests' config and prompt shape: their compiled prefill and append
    cache, _ = build(rng, config, prompt_lengths=[37, 20, 5], steps=1, padded_tokens=50)
    queries = jnp.asarray(rng.standard_normal((config.max_sequences, 4, HEAD_DIM)), jnp.float32)
    precise = KernelConfig(products="float32", num_splits=1)
    for loop in (config.num_loops - 1,):  # the whole chain, sparse loops included
        expected = np.asarray(jflashloop.decode_attention(queries, cache, layer, loop, implementation="xla"))
        actual = np.asarray(jflashloop.decode_attention(queries, cache, layer, loop, implementation="pallas",
                                                        kernel_config=precise))
        errors = np.linalg.norm(actual - expected, axis=(1, 2)) / np.linalg.norm(expected, axis=(1, 2))
        assert (errors < 1e-5).all(), (layer, loop, errors)


def test_a_layer_policy_is_checked_like_the_uniform_one():
    base = small_config(num_layers=2)
    with pytest.raises(ValueError, match="layer_loops must be None or a tuple of num_layers=2"):
        dataclasses.replace(base, layer_loops=(base.loops,))
    with pytest.raises(ValueError, match=r"layer_loops\[1\] must be a tuple of 4 LoopStorage"):
        dataclasses.replace(base, layer_loops=(base.loops, base.loops[:2]))
    with pytest.raises(ValueError, match=r"layer_loops\[1\]\[0\] \(the base\) must be dense"):
        dataclasses.replace(base, layer_loops=(base.loops, (base.loops[2], *base.loops[1:])))
    wide = LoopStorage(jflashloop.CodecSpec("int4", "channel", 32), jflashloop.INT4_VALUES)
    with pytest.raises(ValueError, match=r"layer_loops\[0\]\[1\]\.key_spec: channel-axis group_size 32 must divide"):
        dataclasses.replace(base, layer_loops=((base.loops[0], wide, *base.loops[2:]), base.loops))
    with pytest.raises(ValueError, match="layer must be in"):
        dataclasses.replace(base, layer_loops=(base.loops, base.loops)).layer(2)


def test_files_and_bundles_keep_the_layer_policies(rng, tmp_path):
    config = three_policies()
    cache, _ = build(rng, config, prompt_lengths=[37, 0, 50], steps=2)
    cache = paged_cache.free(cache, 1)
    assert assert_file_round_trip(cache, tmp_path / "layers.jfl").config == config
    bundle = persistence.pages_from_bytes(persistence.pages_to_bytes(persistence.export_pages(cache, 2)))
    moved = persistence.import_pages(cache, 1, bundle)
    for layer in range(config.num_layers):
        got = paged_cache.reconstruct(moved, layer, 3, 1)
        want = paged_cache.reconstruct(cache, layer, 3, 2)
        assert_bits_equal(np.asarray(got[0]), np.asarray(want[0]), f"layer {layer}")
    uniform = paged_cache.create(dataclasses.replace(config, layer_loops=None))
    with pytest.raises(PersistenceError, match="do not fit this cache's layout"):
        persistence.import_pages(uniform, 0, bundle)


def test_storage_sums_the_layers():
    config = three_policies()
    per_layer = [storage.page_bytes(config.layer(i)).total for i in range(3)]
    assert len(set(per_layer)) == 3  # three different policies
    assert storage.pool_page_bytes(config) == sum(per_layer)
    windows = 3 * storage.window_bytes_per_sequence(config)
    assert storage.sequence_bytes(config, 50) == 3 * sum(per_layer) + windows
    assert storage.bytes_per_token(config) == sum(per_layer) / 3 / config.page_size
    with pytest.raises(ValueError, match="stores its layers differently"):
        storage.page_bytes(config)
    uniform = dataclasses.replace(config, layer_loops=(config.loops,) * 3)
    assert uniform.is_uniform and storage.page_bytes(uniform) == storage.page_bytes(config.layer(0))


def test_fork_and_append_tokens_follow_the_layer_policies(rng):
    config = three_policies()
    cache, built = build(rng, config, prompt_lengths=[40, 0, 33], steps=0, padded_tokens=50)
    cache = paged_cache.free(cache, 1)
    history = History(config, 64)
    kept = built.keys.shape[3]
    history.keys[..., :kept, :, :], history.values[..., :kept, :, :] = built.keys, built.values
    forked = jax.jit(paged_cache.fork)(cache, 0, 1)  # eager and jitted forks agree: test_sharing
    paged_cache.validate(forked)
    for layer in range(config.num_layers):
        got, want = paged_cache.reconstruct(forked, layer, 3, 1), paged_cache.reconstruct(forked, layer, 3, 0)
        assert_bits_equal(np.asarray(got[0]), np.asarray(want[0]), f"fork, layer {layer}")
    shape = (3, config.num_loops, 3, 20, config.num_kv_heads, HEAD_DIM)
    keys = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).astype(jnp.float32)  # as the windows hold it
    counts = jnp.asarray([20, 0, 17], jnp.int32)
    chunked = jax.jit(paged_cache.append_tokens)(cache, keys, keys, counts)
    history.keys[:, :, 0, 40:60] = history.values[:, :, 0, 40:60] = np.asarray(keys[:, :, 0])
    history.keys[:, :, 2, 33:50] = history.values[:, :, 2, 33:50] = np.asarray(keys[:, :, 2, :17])
    history.lengths[0], history.lengths[2] = 60, 50
    assert_matches_oracle(chunked, history.keys, history.values, loops=[config.num_loops - 1])
