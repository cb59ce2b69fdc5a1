"""Lossless save/load of a cache and page transfer between caches."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import stat
import struct
import subprocess
import sys
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import jflashloop
from jflashloop import CacheConfig, LoopStorage, paged_cache, persistence
from jflashloop.persistence import PersistenceError
from tests.bits import assert_bits_equal
from tests.builders import small_affine_config

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


@pytest.mark.parametrize("fmt", ["int3", "int2"])
def test_a_small_affine_cache_round_trips(tmp_path, fmt):
    config = small_affine_config(fmt, num_layers=1, num_loops=3, max_sequences=1, num_pages=4,
                                 max_pages_per_sequence=4)
    keys, values = kv((1, 3, 40, 2, 32), 5)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 40)
    persistence.save(tmp_path / f"{fmt}.jflkv", cache)
    loaded = persistence.load(tmp_path / f"{fmt}.jflkv", config=config)
    assert_caches_identical(cache, loaded)
    assert loaded.config.loops[0].key_spec == jflashloop.CodecSpec(fmt, "channel", 16)
    for loop in range(3):
        for a, b in zip(paged_cache.reconstruct(cache, 0, loop, 0), paged_cache.reconstruct(loaded, 0, loop, 0),
                        strict=True):
            assert_bits_equal(b, a, f"loop {loop}")


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


def test_files_hold_nvfp4_payloads_in_the_codec_byte_order():
    """Tiles hold NVFP4 bytes in page order; a file holds the codec's (FlashLoop) order, other formats as is."""
    import jflashloop_reference as reference

    cache = busy_cache()
    _, arrays = persistence._format.read(io.BytesIO(persistence.cache_to_bytes(cache)), persistence.CACHE_FORMAT)
    for loop, nvfp4 in ((0, False), (1, True)):
        for stream in ("keys", "values"):
            in_file = arrays[f".layers[0].loops[{loop}].{stream}.payload"]
            held = np.asarray(getattr(cache.layers[0].loops[loop], stream).payload)
            assert np.any(held), "the pages hold data"
            if nvfp4:
                assert not np.array_equal(in_file, held)
                in_file = reference.paged_cache.nvfp4_page_bytes(in_file.view(np.uint8)).view(np.uint32)
            assert_bits_equal(in_file, held, f"loop {loop} {stream}")


def _header_length(data: bytes) -> int:
    return struct.unpack_from("<Q", data, 12)[0]


def _first_array_byte(data: bytes) -> int:
    return -(-(52 + _header_length(data)) // 64) * 64


def _flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    changed = bytearray(data)
    changed[offset] ^= mask
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
        *[(functools.partial(_flip, offset=offset, mask=0xFF), "truncated") for offset in (16, 17, 18, 19)],
    ],
    ids=["magic", "version", "header-digest", "header", "last-byte", "middle-byte", "first-array", "prefix-cut",
         "header-cut", "data-cut", "trailing", "empty", "header-length-16", "header-length-17",
         "header-length-18", "header-length-19"],
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
    broken = dataclasses.replace(busy_cache(), page_refs=jnp.zeros((CONFIG.num_pages,), jnp.int32))
    with pytest.raises(PersistenceError, match=r"inconsistent bookkeeping: page .* but page_refs"):
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
        full = dataclasses.replace(busy_cache(), page_refs=busy_cache().page_refs.at[jnp.arange(10)].set(
            jnp.where(jnp.arange(10) == 9, 0, 1)))
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


# --------------------------------------------------------------------------- malformed files

TINY = CacheConfig(
    num_layers=1, num_kv_heads=1, head_dim=8, num_pages=2, max_sequences=1, max_pages_per_sequence=2,
    page_size=16, recent_tokens=4,
    loops=(LoopStorage(jflashloop.CodecSpec("int4", "channel", 16), jflashloop.CodecSpec("int4", "token", 8)),),
)


@functools.cache
def tiny_cache():
    """One sequence of 20 tokens (one full page)."""
    return _prefill(paged_cache.create(TINY), 0, *kv((1, 1, 20, 1, 8), 3), 20)


@functools.cache
def tiny_files() -> dict[str, bytes]:
    """:func:`tiny_cache` in the file format, and its page bundle."""
    return {"cache": persistence.cache_to_bytes(tiny_cache()),
            "bundle": persistence.pages_to_bytes(persistence.export_pages(tiny_cache(), 0))}


_FROM_BYTES = {"cache": persistence.cache_from_bytes, "bundle": persistence.pages_from_bytes}


def _with_header(data: bytes, change) -> bytes:
    """``data`` with its JSON header replaced by ``change(header)``, under a valid checksum."""
    header = change(json.loads(data[52 : 52 + _header_length(data)]))
    header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
    head = struct.pack("<8sIQ32s", b"JFLASHKV", 1, len(header_bytes), hashlib.sha256(header_bytes).digest())
    head += header_bytes
    return head + b"\0" * (-len(head) % 64) + data[_first_array_byte(data) :]


def _edited(path: str, value=None, *, delete: bool = False):
    """A header change: set (or delete) the item at a dotted path (list indices as ints)."""
    def change(header):
        *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
        node = header
        for key in parents:
            node = node[key]
        if delete:
            del node[last]
        else:
            node[last] = value
        return header
    return change


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h: [h], "the header is a JSON list, not an object"),
        (_edited("arrays", delete=True), "header field 'arrays' must be a JSON list"),
        (_edited("config", "page_size=16"), "header field 'config' must be a JSON dict"),
        (_edited("data_nbytes", delete=True), "'data_nbytes' must be an integer >= 0"),
        (_edited("data_nbytes", -64), "'data_nbytes' must be an integer >= 0"),
        (_edited("data_nbytes", 64.0), "'data_nbytes' must be an integer >= 0"),
        (_edited("data_nbytes", 2**70), "file is truncated"),
        (_edited("arrays.0.name", delete=True), "arrays\\[0\\] must hold name, dtype, shape"),
        (_edited("arrays.0.shape", "3"), "arrays\\[0\\] must hold name, dtype, shape"),
        (_edited("arrays.0.shape", [-1, -64]), "offset, nbytes and shape must be integers >= 0"),
        (_edited("arrays.0.offset", True), "offset, nbytes and shape must be integers >= 0"),
        (_edited("arrays.0.offset", 2**70), "inconsistent size or offset"),
        (_edited("arrays.0.shape", [2**62, 2**62]), "inconsistent size or offset"),
        (_edited("arrays.0.dtype", "complex64"), "unsupported dtype 'complex64'"),
        (lambda h: {**h, "arrays": h["arrays"] + h["arrays"][:1]}, "appears twice"),
        (_edited("config.num_layers", delete=True), "not a valid CacheConfig"),
        (_edited("config.loops.0", 7), "not a valid CacheConfig"),
        (_edited("config.num_layers", 10**9), "implies at least 1000000000 x 1 arrays \\(layers x loops\\), the file holds \\d+"),
        (_edited("config.recent_tokens", 3.5), "not a valid CacheConfig"),
        (_edited("config.num_pages", 2**40), "not a valid CacheConfig: CacheConfig.num_pages must be < 2\\*\\*31"),
    ],
)
def test_hand_built_headers_with_valid_checksums_load_nothing(change, message):
    with pytest.raises(PersistenceError, match=message):
        persistence.cache_from_bytes(_with_header(tiny_files()["cache"], change))
    with pytest.raises(PersistenceError):
        persistence.pages_from_bytes(_with_header(tiny_files()["bundle"], change))


@pytest.mark.parametrize(
    "change, message",
    [
        (_edited("metadata.length", delete=True), "length must be an int32 >= 0"),
        (_edited("metadata.error_flags", "0"), "error_flags must be an int32 >= 0"),
        (_edited("metadata.page_columns", [2**40]), "page_columns must be a list of int32 >= 0"),
        (_edited("metadata.page_columns", 0), "page_columns must be a list of int32 >= 0"),
    ],
)
def test_hand_built_bundle_metadata_loads_nothing(change, message):
    with pytest.raises(PersistenceError, match=message):
        persistence.pages_from_bytes(_with_header(tiny_files()["bundle"], change))


@pytest.mark.parametrize("length", [2**26, 2**40, 2**64 - 1])
def test_a_huge_header_length_is_refused_before_anything_is_allocated(tmp_path, length):
    data = tiny_files()["cache"]
    path = tmp_path / "cache.jflkv"
    path.write_bytes(data[:12] + struct.pack("<Q", length) + data[20:])
    tracemalloc.start()
    try:
        with pytest.raises(PersistenceError, match=f"expected {length} bytes of the header, got {len(data) - 52}"):
            persistence.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data) + 2**20, peak


@pytest.mark.parametrize("kind", ["cache", "bundle"])
@given(data=st.data())
def test_any_damaged_or_cut_file_raises_persistence_error(kind, data):
    original = tiny_files()[kind]
    damaged = bytearray(original)
    for offset in data.draw(st.lists(st.integers(0, len(original) - 1), min_size=1, max_size=3, unique=True)):
        damaged[offset] ^= data.draw(st.integers(1, 255))
    damaged = bytes(damaged)
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(original) - 1)))
    if cut is not None:
        damaged = data.draw(st.sampled_from([damaged[:cut], original[:cut], original + original[cut:]]))
    with pytest.raises(PersistenceError):
        _FROM_BYTES[kind](damaged)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


def _header_paths(node, prefix=()):
    """Every (path, node) below a parsed JSON header."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield (*prefix, key)
        yield from _header_paths(child, (*prefix, key))


@pytest.mark.parametrize("kind", ["cache", "bundle"])
@given(data=st.data())
def test_any_hand_built_header_loads_or_raises_persistence_error(kind, data):
    original = tiny_files()[kind]
    paths = sorted(_header_paths(json.loads(original[52 : 52 + _header_length(original)])), key=str)
    path = data.draw(st.sampled_from(paths))
    delete = data.draw(st.booleans())
    value = None if delete else data.draw(_JSON)
    note(f"{path} {'deleted' if delete else f'= {value!r}'}")
    edit = _edited(".".join(str(key) for key in path), value, delete=delete)
    try:
        _FROM_BYTES[kind](_with_header(original, edit))
    except PersistenceError:
        pass


# --------------------------------------------------------------------------- paths and durable writes


@pytest.mark.parametrize("as_path", [str, os.fsencode, lambda p: p], ids=["str", "bytes", "PathLike"])
def test_paths_may_be_str_bytes_or_path_like(tmp_path, as_path):
    persistence.save(as_path(tmp_path / "cache.jflkv"), tiny_cache())
    assert_caches_identical(tiny_cache(), persistence.load(as_path(tmp_path / "cache.jflkv")))
    bundle = persistence.export_pages(tiny_cache(), 0)
    persistence.save_pages(as_path(tmp_path / "sequence.jflkv"), bundle)
    assert persistence.load_pages(as_path(tmp_path / "sequence.jflkv")).length == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.jflkv", "sequence.jflkv"]


def test_a_path_of_another_type_is_refused(tmp_path):
    for call in (lambda: persistence.save(3, tiny_cache()), lambda: persistence.load(3),
                 lambda: persistence.load_pages(None)):
        with pytest.raises(TypeError, match=r"path must be a str, bytes or os\.PathLike, got"):
            call()


def test_save_fsyncs_the_file_then_renames_then_fsyncs_the_folder(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "fsync file")
        fsync(descriptor)

    def recording_replace(source, destination):
        events.append("rename")
        replace(source, destination)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    persistence.save(tmp_path / "cache.jflkv", tiny_cache())
    assert events == ["fsync file", "rename"] + (["fsync folder"] if os.name == "posix" else [])


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.skipif(os.name != "posix", reason="writers' PIDs can be checked on POSIX only")
def test_save_removes_only_stale_temporaries_of_its_own_target(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    old = time.time() - 2 * persistence.STALE_AFTER_SECONDS

    def leftover(name, modified=old, directory=False):
        path = tmp_path / name
        if directory:
            path.mkdir()
        else:
            path.write_bytes(b"half a file")
        os.utime(path, (modified, modified))
        return name

    stale = [leftover(f"cache.jflkv.tmp-{dead}"), leftover(f"cache.jflkv.tmp-{dead}-0123abcd")]
    kept = [
        leftover(f"cache.jflkv.tmp-{dead}-89abcdef", modified=time.time()),  # too recent
        leftover(f"cache.jflkv.tmp-{alive}-0123abcd"),  # its writer still runs
        leftover(f"other.jflkv.tmp-{dead}"),  # another target
        leftover(f"xcache.jflkv.tmp-{dead}"),
        leftover(f"cache.jflkv.tmp-{dead}x"),
        leftover(f"cache.jflkv.tmp-{dead}-0123ABCD"),
        leftover("cache.jflkv.bak"),
        leftover(f"cache.jflkv.tmp-{dead}-fedcba98", directory=True),
    ]
    persistence.save(tmp_path / "cache.jflkv", tiny_cache())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache.jflkv", *kept])
    assert not set(stale) & {p.name for p in tmp_path.iterdir()}


def _cache_with_a_hole():
    """busy_cache() with slot 2's first page lost after the fact (its later pages still stored)."""
    cache = busy_cache()
    row = np.asarray(cache.block_tables[2])
    return dataclasses.replace(
        cache,
        block_tables=cache.block_tables.at[2, 0].set(-1),
        page_refs=cache.page_refs.at[int(row[0])].set(0),
        error_flags=cache.error_flags.at[2].set(cache.error_flags[2] | paged_cache.ERROR_OUT_OF_PAGES),
    ), row


def test_pages_after_a_lost_page_are_released_on_load():
    hole, row = _cache_with_a_hole()
    assert (row[1:3] >= 0).all()
    with pytest.raises(jflashloop.CacheStateError, match=r"columns \[1, 2\] after its lost page at column 0"):
        paged_cache.validate(hole)
    loaded = persistence.cache_from_bytes(persistence.cache_to_bytes(hole))
    assert (np.asarray(loaded.block_tables[2]) == -1).all()
    assert np.asarray(loaded.page_free)[row[:3]].all()
    paged_cache.validate(loaded)
    for before, after in zip(_reconstructions(hole, 2), _reconstructions(loaded, 2), strict=True):
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bundle = persistence.export_pages(busy_cache(), 2)
    with pytest.raises(PersistenceError, match=r"page_columns must be 0 \.\. 2"):
        persistence.import_pages(paged_cache.create(CONFIG), 0,
                                 dataclasses.replace(bundle, page_columns=np.array([0, 1, 3], np.int32)))
