"""Lossless save/load of a cache and page transfer between caches."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import paged_cache, persistence
from jflashloop.cache_config import CacheConfig, LoopStorage
from jflashloop.persistence import PersistenceError
from tests.bits import assert_bits_equal

CONFIG = CacheConfig(
    num_layers=2, num_kv_heads=2, head_dim=16, num_pages=10, max_sequences=3, max_pages_per_sequence=4,
    page_size=16, recent_tokens=8,
    loops=(
        LoopStorage(jflashloop.CodecSpec("int4", "channel", 16), jflashloop.INT4_VALUES),
        LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4),
        LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 4),
    ),
)
_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append)


def kv(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


@functools.cache
def busy_cache():
    """Slots 0 and 2 hold sequences (with a NaN counted in slot 2); slot 1 was freed."""
    cache = paged_cache.create(CONFIG)
    keys, values = kv((2, 3, 64, 2, 16), 0)
    keys[1, 2, 3, 1, 4] = np.nan
    cache = _prefill(cache, 0, keys, values, 37)
    cache = _prefill(cache, 1, keys, values, 20)
    cache = _prefill(cache, 2, keys, values, 50)
    cache = jax.jit(paged_cache.free)(cache, 1)
    for step in range(3):
        cache = _append(cache, *kv((2, 3, 3, 2, 16), 10 + step))
    # A written but uncommitted token: saved too.
    step_keys, step_values = kv((3, 2, 16), 99)
    return paged_cache.write_token(cache, 1, 2, step_keys, step_values)


def assert_caches_identical(a, b):
    assert a.config == b.config
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b
    for (path, leaf_a), (_, leaf_b) in zip(flat_a, flat_b, strict=True):
        assert leaf_a.dtype == leaf_b.dtype, path
        assert_bits_equal(leaf_b, leaf_a, jax.tree_util.keystr(path))


def test_save_and_load_are_bit_identical(tmp_path):
    cache = busy_cache()
    path = tmp_path / "cache.jflkv"
    persistence.save(path, cache)
    loaded = persistence.load(path, config=CONFIG)
    assert_caches_identical(cache, loaded)
    paged_cache.validate(loaded)
    assert int(loaded.nonfinite_counts[2]) == 1
    # Saving over an existing file replaces it; no temporary file is left behind.
    persistence.save(path, paged_cache.create(CONFIG))
    assert_caches_identical(paged_cache.create(CONFIG), persistence.load(path))
    assert [p.name for p in tmp_path.iterdir()] == ["cache.jflkv"]


def test_file_layout_is_the_documented_one():
    data = persistence.cache_to_bytes(busy_cache())
    magic, version, header_length, digest = struct.unpack_from("<8sIQ32s", data)
    assert magic == b"JFLASHKV" and version == persistence.FORMAT_VERSION == 1
    header_bytes = data[52 : 52 + header_length]
    assert hashlib.sha256(header_bytes).digest() == digest
    header = json.loads(header_bytes)
    data_start = -(-(52 + header_length) // 64) * 64
    assert len(data) == data_start + header["data_nbytes"]
    assert header["format"] == "jflashloop.paged_kv_cache" and header["config"]["page_size"] == 16
    entry = next(e for e in header["arrays"] if e["name"] == ".lengths")
    assert entry["offset"] % 64 == 0 and entry["dtype"] == "int32" and entry["shape"] == [3]
    raw = data[data_start + entry["offset"] : data_start + entry["offset"] + entry["nbytes"]]
    assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
    np.testing.assert_array_equal(np.frombuffer(raw, "<i4"), np.asarray(busy_cache().lengths))
    names = {e["name"] for e in header["arrays"]}
    assert ".layers[1].loops[2].row_positions" in names and ".layers[0].ring_keys" in names


def _header_length(data: bytes) -> int:
    return struct.unpack_from("<Q", data, 12)[0]


def _first_array_byte(data: bytes) -> int:
    return -(-(52 + _header_length(data)) // 64) * 64


def _flip(data: bytes, offset: int) -> bytes:
    changed = bytearray(data)
    changed[offset] ^= 0x01
    return bytes(changed)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _flip(d, 0), "not a jflashloop file"),
        (lambda d: d[:8] + struct.pack("<I", 2) + d[12:], "unsupported format version 2; this jflashloop reads version 1"),
        (lambda d: _flip(d, 20), "header checksum mismatch"),
        (lambda d: _flip(d, 60), "header checksum mismatch"),
        (lambda d: _flip(d, len(d) - 1), "is corrupt"),  # array bytes or zero padding
        (lambda d: _flip(d, len(d) // 2), "is corrupt"),
        (lambda d: _flip(d, _first_array_byte(d)), "SHA-256 mismatch, the data is corrupt"),
        (lambda d: d[:30], "truncated"),
        (lambda d: d[: 52 + _header_length(d) // 2], "truncated"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: d + b"\0", "trailing bytes"),
        (lambda d: b"", "truncated"),
    ],
    ids=["magic", "version", "header-digest", "header", "last-byte", "middle-byte", "first-array", "prefix-cut",
         "header-cut", "data-cut", "trailing", "empty"],
)
def test_damaged_files_load_nothing(tmp_path, damage, message):
    data = damage(persistence.cache_to_bytes(busy_cache()))
    with pytest.raises(PersistenceError, match=message):
        persistence.cache_from_bytes(data)
    path = tmp_path / "damaged.jflkv"
    path.write_bytes(data)
    with pytest.raises(PersistenceError, match=message):
        persistence.load(path)


def test_wrong_kind_config_or_bookkeeping_is_refused():
    bundle_bytes = persistence.pages_to_bytes(persistence.export_pages(busy_cache(), 0))
    with pytest.raises(PersistenceError, match=r"holds 'jflashloop\.page_bundle', expected 'jflashloop\.paged_kv_cache'"):
        persistence.cache_from_bytes(bundle_bytes)
    data = persistence.cache_to_bytes(busy_cache())
    other = dataclasses.replace(CONFIG, num_pages=11)
    with pytest.raises(PersistenceError, match="differs from the expected"):
        persistence.cache_from_bytes(data, config=other)
    # Valid checksums, inconsistent contents: every page marked free.
    broken = dataclasses.replace(busy_cache(), page_free=jnp.ones((CONFIG.num_pages,), bool))
    with pytest.raises(PersistenceError, match=r"inconsistent bookkeeping: page .* marked free"):
        persistence.cache_from_bytes(persistence.cache_to_bytes(broken))


def _reconstructions(cache, slot):
    return [paged_cache.reconstruct(cache, layer, loop, slot, include_pending=True)
            for layer in range(CONFIG.num_layers) for loop in range(CONFIG.num_loops)]


def test_pages_move_between_caches_bit_exactly(tmp_path):
    source = busy_cache()
    bundle = persistence.export_pages(source, 2)
    assert bundle.length == 53 and bundle.num_pages == 3 and bundle.nonfinite_count == 1
    path = tmp_path / "sequence.jflkv"
    persistence.save_pages(path, bundle)
    loaded = persistence.load_pages(path)
    for a, b in zip(jax.tree.leaves(bundle.layers), jax.tree.leaves(loaded.layers), strict=True):
        assert_bits_equal(b, a, "bundle array")
    # Another server: a bigger pool with other pages in use, more slots, a wider block table.
    destination_config = dataclasses.replace(CONFIG, num_pages=16, max_sequences=4, max_pages_per_sequence=6)
    destination = paged_cache.create(destination_config)
    destination = jax.jit(paged_cache.prefill)(destination, 0, *kv((2, 3, 40, 2, 16), 5), 40)
    destination = persistence.import_pages(destination, 3, loaded)
    paged_cache.validate(destination)
    assert int(destination.lengths[3]) == 53 and int(destination.nonfinite_counts[3]) == 1
    source_ids = np.asarray(source.block_tables[2])[:3]
    destination_ids = np.asarray(destination.block_tables[3])[:3]
    # New page ids: the lowest free ones of the destination (its slot 0 holds pages 0 and 1).
    assert source_ids.tolist() == [3, 4, 5] and destination_ids.tolist() == [2, 3, 4]
    for (k_a, v_a, n_a), (k_b, v_b, n_b) in zip(_reconstructions(source, 2), _reconstructions(destination, 3),
                                                strict=True):
        assert int(n_a) == int(n_b) == 54  # the pending token came along
        assert_bits_equal(np.asarray(k_b)[:54], np.asarray(k_a)[:54], "keys")
        assert_bits_equal(np.asarray(v_b)[:54], np.asarray(v_a)[:54], "values")
    # The moved sequence keeps decoding in its new home.
    destination = jax.jit(paged_cache.commit)(destination)
    assert int(destination.lengths[3]) == 54


def test_import_refuses_what_does_not_fit():
    bundle = persistence.export_pages(busy_cache(), 0)
    with pytest.raises(ValueError, match="slot 0 is already active"):
        persistence.import_pages(busy_cache(), 0, bundle)
    with pytest.raises(IndexError, match="slot must be in \\[0, 3\\), got 3"):
        persistence.import_pages(busy_cache(), 3, bundle)
    with pytest.raises(PersistenceError, match="needs 2 free pages, this cache has 1"):
        full = dataclasses.replace(busy_cache(), page_free=busy_cache().page_free.at[jnp.arange(10)].set(
            jnp.arange(10) == 9))
        persistence.import_pages(full, 1, bundle)
    narrow = paged_cache.create(dataclasses.replace(CONFIG, max_pages_per_sequence=1))
    with pytest.raises(PersistenceError, match="does not fit max_pages_per_sequence=1"):
        persistence.import_pages(narrow, 0, bundle)
    other_layout = paged_cache.create(dataclasses.replace(CONFIG, recent_tokens=16))
    with pytest.raises(PersistenceError, match="recent_tokens: bundle 8 vs cache 16"):
        persistence.import_pages(other_layout, 0, bundle)
    with pytest.raises(ValueError, match="slot 1 is not active"):
        persistence.export_pages(busy_cache(), 1)
    damaged = dataclasses.replace(bundle, page_columns=np.array([1, 0], np.int32))
    with pytest.raises(PersistenceError, match="strictly increasing"):
        persistence.import_pages(paged_cache.create(CONFIG), 0, damaged)
    short = dataclasses.replace(bundle, page_columns=np.array([0], np.int32))
    with pytest.raises(PersistenceError, match=r"page bundle: array .* its config implies"):
        persistence.import_pages(paged_cache.create(CONFIG), 0, short)


def test_damaged_bundles_load_nothing():
    data = persistence.pages_to_bytes(persistence.export_pages(busy_cache(), 2))
    with pytest.raises(PersistenceError, match="SHA-256 mismatch"):
        persistence.pages_from_bytes(_flip(data, len(data) - 3))
    with pytest.raises(PersistenceError, match="truncated"):
        persistence.pages_from_bytes(data[:-64])
    with pytest.raises(PersistenceError, match="unsupported format version"):
        persistence.pages_from_bytes(data[:8] + struct.pack("<I", 0) + data[12:])
