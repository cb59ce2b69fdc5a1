"""The fitted formats in the paged cache: per-head tables through prefill, append, reconstruct, attention, files,
policies and sharding."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import (
    CacheConfig,
    CodecSpec,
    LoopStorage,
    allocation,
    paged_cache,
    sharding,
    storage,
)
from jflashloop.codecs import round_channel_scales
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    HEADS,
    assert_file_round_trip,
    assert_matches_oracle,
    build,
    small_config,
)


def fitted_specs(rng, heads: int = HEADS, head_dim: int = HEAD_DIM) -> tuple[CodecSpec, CodecSpec]:
    """``int_mixed`` keys (a mean width of 4: each head a permutation of 2..6-bit widths) and ``int4_scaled``
    values (divisors over four octaves), different in every head."""
    first = np.resize([2, 6, 3, 5, 4, 4], head_dim)
    first[-1] += 4 * head_dim - first.sum()  # INT4's row width, in whole words
    widths = np.stack([rng.permutation(first) for _ in range(heads)])
    scales = round_channel_scales(np.exp2(rng.uniform(-2, 2, (heads, head_dim))))
    return (CodecSpec("int_mixed", "channel", 16, channel_bits=widths.tolist()),
            CodecSpec("int4_scaled", "token", HEAD_DIM, channel_scale=scales.tolist()))


def fitted_config(rng, **overrides) -> CacheConfig:
    """:func:`small_config` with every dense loop in the fitted formats and the sparse residual rows in
    ``int4_scaled`` (per token, as rows are)."""
    base = small_config(**overrides)
    keys, values = fitted_specs(rng)
    loops = tuple(LoopStorage(values, values, loop.sparse_rows_per_page) if loop.is_sparse
                  else LoopStorage(keys, values, direct=loop.direct) for loop in base.loops)
    return dataclasses.replace(base, loops=loops)


def test_prefill_and_append_match_the_oracle_in_every_loop(rng):
    config = fitted_config(rng)
    cache, history = build(rng, config, prompt_lengths=[37, 16, 50], steps=4)
    assert_matches_oracle(cache, history.keys, history.values)  # each head's tile in its own head's table


def test_heads_are_coded_with_their_own_tables(rng):
    """The same K/V in both heads decode differently: each head's widths and divisors apply to it alone."""
    config = fitted_config(rng, num_loops=1)
    cache = paged_cache.create(config)
    keys = np.repeat(rng.standard_normal((config.num_layers, 1, 40, 1, HEAD_DIM)), HEADS, axis=3).astype(np.float32)
    cache = paged_cache.prefill(cache, 0, keys, keys, 40)
    rebuilt_keys, rebuilt_values, _ = paged_cache.reconstruct(cache, 0, 0, 0)
    for rebuilt in (np.asarray(rebuilt_keys), np.asarray(rebuilt_values)):
        assert not np.array_equal(rebuilt[4:32, 0], rebuilt[4:32, 1])  # the first page (sinks excluded)
        one_head = jflashloop.decode(jflashloop.encode(keys[0, 0, :32, :1], config.loops[0].key_spec.for_head(1)))
        if rebuilt is rebuilt_keys:
            assert_bits_equal(rebuilt[16:32, 1], np.asarray(one_head)[16:32, 0], "head 1's second page")


def test_attention_falls_back_to_the_reference_path(rng):
    config = fitted_config(rng)
    cache, _ = build(rng, config, prompt_lengths=[40], steps=1)
    queries = jnp.asarray(rng.standard_normal((config.max_sequences, 4, HEAD_DIM)), jnp.float32)
    automatic = jflashloop.decode_attention(queries, cache, 0, 3)
    assert_bits_equal(automatic, jflashloop.decode_attention_reference(queries, cache, 0, 3), "fallback")
    with pytest.raises(NotImplementedError, match="int_mixed"):
        jflashloop.decode_attention(queries, cache, 0, 3, implementation="pallas", interpret=True)


def test_files_and_policies_keep_the_tables(rng, tmp_path):
    config = fitted_config(rng)
    cache, _ = build(rng, config, prompt_lengths=[37], steps=2)
    assert assert_file_round_trip(cache, tmp_path / "fitted.jfl").config == config
    keys, values = config.loops[0].key_spec, config.loops[0].value_spec
    policy = jflashloop.Policy("fitted", keys, values, 4, 16, 16, layer_specs=((keys, values),) * 2)
    allocation.save_policy(tmp_path / "policy.json", policy)
    assert allocation.load_policy(tmp_path / "policy.json") == policy
    text = (tmp_path / "policy.json").read_text()
    assert "[" + ", ".join(str(b) for b in keys.channel_bits[0]) + "]" in text  # a table row on one line
    assert len(text.splitlines()) < 100


def test_bytes_are_int4s_at_a_mean_width_of_four(rng):
    config = fitted_config(rng)
    int4 = small_config()
    assert storage.pool_page_bytes(config) == storage.pool_page_bytes(int4)


def test_the_config_checks_the_tables(rng):
    keys, values = fitted_specs(rng)
    base = small_config(num_loops=1)
    with pytest.raises(ValueError, match=r"loops\[0\]\.key_spec: int_mixed was fitted for \[kv_heads, channels\]"):
        dataclasses.replace(base, num_kv_heads=4, loops=(LoopStorage(keys, values),))
    narrow = CodecSpec("int_mixed", "channel", 16, channel_bits=[[4] * 15 + [3]] * HEADS)
    with pytest.raises(ValueError, match="multiple of 32 bits"):
        dataclasses.replace(base, loops=(LoopStorage(narrow, values),))


def test_a_shard_takes_the_tables_only_when_its_heads_share_them(rng):
    mesh = types.SimpleNamespace(shape={"data": 1, "model": 2})
    config = fitted_config(rng, num_loops=2)
    with pytest.raises(ValueError, match="fitted per kv head cannot be split over mesh axis 'model'"):
        sharding.local_config(config, mesh)
    keys, values = config.loops[0].key_spec, config.loops[0].value_spec
    shared_keys = dataclasses.replace(keys, channel_bits=(keys.channel_bits[0],) * HEADS)
    shared_values = dataclasses.replace(values, channel_scale=(values.channel_scale[0],) * HEADS)
    shared = dataclasses.replace(config, loops=(LoopStorage(shared_keys, shared_values),) * 2)
    local = sharding.local_config(shared, mesh)
    assert local.num_kv_heads == 1 and local.loops[0].key_spec.channel_bits == (keys.channel_bits[0],)
    assert sharding.local_config(config, types.SimpleNamespace(shape={"data": 1, "model": 1})) == config
