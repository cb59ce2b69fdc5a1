"""Policy: a named one-loop cache layout that makes a CacheConfig for any model shape."""

from __future__ import annotations

import math

import pytest

import jflashloop
from jflashloop import CacheConfig, LoopStorage, Policy, storage


def test_defaults_are_the_cache_config_defaults():
    config = Policy("default").cache_config(num_layers=2, num_kv_heads=3, head_dim=64, max_tokens=64)
    plain = CacheConfig(num_layers=2, num_kv_heads=3, head_dim=64, num_pages=1, max_sequences=1,
                        max_pages_per_sequence=1)
    assert config == plain


@pytest.mark.parametrize("max_tokens, page_size", [(1, 16), (64, 64), (65, 64), (300, 32)])
def test_the_pool_holds_every_sequence(max_tokens, page_size):
    policy = Policy("nvfp4", jflashloop.NVFP4, jflashloop.NVFP4, 0, 32, page_size)
    config = policy.cache_config(num_layers=1, num_kv_heads=2, head_dim=32, max_tokens=max_tokens,
                                 max_sequences=3)
    pages = math.ceil(max_tokens / page_size)
    assert (config.max_pages_per_sequence, config.num_pages, config.max_sequences) == (pages, 3 * pages, 3)
    assert config.loops == (LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4),)
    assert (config.page_size, config.sink_tokens, config.recent_tokens) == (page_size, 0, 32)
    assert config.max_tokens_per_sequence >= max_tokens


@pytest.mark.parametrize("key_spec, value_spec", [
    (jflashloop.INT4_KEYS, jflashloop.INT4_VALUES),
    (jflashloop.CodecSpec("int4", "channel", 32), jflashloop.CodecSpec("int4", "token", 32)),
    (jflashloop.NVFP4, jflashloop.NVFP4),
    (jflashloop.INT4_KEYS, jflashloop.NVFP4),
    (jflashloop.int4_rotated(64, 0), jflashloop.int4_rotated(64, 1)),
    (jflashloop.E8_KEYS, jflashloop.INT4_GROUP_ROTATED_VALUES),
], ids=["int4", "int4-g32", "nvfp4", "int4-nvfp4", "rotated", "rk2v4-e8"])
@pytest.mark.parametrize("kv_heads", [1, 3, 8])
def test_bits_per_element_is_the_storage_figure(key_spec, value_spec, kv_heads):
    policy = Policy("p", key_spec, value_spec)
    config = policy.cache_config(num_layers=1, num_kv_heads=kv_heads, head_dim=64, max_tokens=64)
    expected = 8 * storage.bytes_per_token(config) / (2 * kv_heads * 64)
    assert policy.bits_per_element(kv_heads, 64) == pytest.approx(expected, rel=1e-15)


def test_a_layout_the_cache_rejects_raises():
    with pytest.raises(ValueError, match="must divide the page size"):
        Policy("bad", page_size=32).cache_config(num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=64)


def test_the_defaults_are_the_recommended_layout():
    """bench/QUALITY.md's recommendation: INT4 G64 (K per channel, V per token), 64-token pages, 4 sink
    tokens and the 64 most recent ones unquantized, at no memory beyond the ring a page needs."""
    config = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=1, max_sequences=1,
                         max_pages_per_sequence=1)
    assert config.loops == (LoopStorage(jflashloop.INT4_KEYS, jflashloop.INT4_VALUES),)
    assert (config.page_size, config.sink_tokens, config.recent_tokens) == (64, 4, 64)
    assert config.window_tokens == config.page_size
    assert Policy("default").recent_tokens == 64
    assert jflashloop.CacheConfig.flashloop(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=1, max_sequences=1,
                                            max_pages_per_sequence=1).recent_tokens == 64


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_the_recent_window_defaults_to_one_page(page_size):
    key_spec = jflashloop.CodecSpec("int4", "channel", min(64, page_size))
    config = Policy("p", key_spec, page_size=page_size).cache_config(num_layers=1, num_kv_heads=1, head_dim=64,
                                                                     max_tokens=page_size)
    assert config.recent_tokens == page_size == config.window_tokens
    explicit = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=1, max_sequences=1,
                           max_pages_per_sequence=1, loops=(LoopStorage(key_spec),), page_size=page_size,
                           recent_tokens=16)
    assert explicit.recent_tokens == 16
    with pytest.raises(TypeError, match="recent_tokens must be an int"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=1, max_sequences=1,
                    max_pages_per_sequence=1, recent_tokens=16.0)
