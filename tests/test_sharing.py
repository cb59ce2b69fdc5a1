"""Prefix sharing: ``paged_cache.fork`` against independent prefills of the same histories."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import CacheStateError, LoopStorage, paged_cache, persistence, storage
from tests.bits import assert_bits_equal
from tests.builders import assert_file_round_trip, looped_tokens, small_config

_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append)
_jitted_fork = jax.jit(paged_cache.fork)


def _fork(cache, source, target, *tokens):
    """The jitted fork, its slots (and tokens) passed as int32 arrays: Python ints and ``jnp.int32`` values
    give one compiled program (a weakly typed argument would compile another)."""
    return _jitted_fork(cache, jnp.int32(source), jnp.int32(target), *(jnp.int32(t) for t in tokens))
_free = jax.jit(paged_cache.free)
_reconstruct = jax.jit(paged_cache.reconstruct, static_argnums=(1, 2))


@jax.jit
def _append_for(cache, keys, values, takes):
    """``append`` for the slots in ``takes`` only."""
    masked = dataclasses.replace(cache, active=cache.active & takes)
    return dataclasses.replace(paged_cache.append(masked, keys, values), active=cache.active)


def _assert_same_sequence(cache, slot, expected, expected_slot, what):
    """Every layer and loop of ``slot`` reconstructs to the bits of ``expected_slot`` in ``expected``."""
    c = cache.config
    for layer in range(c.num_layers):
        for loop in range(c.num_loops):
            got, want = _reconstruct(cache, layer, loop, slot), _reconstruct(expected, layer, loop, expected_slot)
            assert int(got[2]) == int(want[2]), what
            assert_bits_equal(np.asarray(got[0]), np.asarray(want[0]), f"{what}: keys layer {layer} loop {loop}")
            assert_bits_equal(np.asarray(got[1]), np.asarray(want[1]), f"{what}: values layer {layer} loop {loop}")


def test_a_prompt_forked_eight_ways_equals_eight_independent_prefills(rng):
    """One 4K-token prompt, 8 sequences, different continuations: the bits of 8 separate prefills."""
    # The pool holds the eight independent histories too: the shared and the independent caches are one config
    # (their prefill, reconstructions and attention compile once).
    config = small_config(num_layers=1, num_kv_heads=1, page_size=64, max_pages_per_sequence=66, num_pages=8 * 66,
                          max_sequences=8, recent_tokens=64)
    prompt, steps = 4096, 70  # the continuations fill one more page each
    keys, values = looped_tokens(rng, config, prompt)
    # Padded to the independent histories' length (prefill reads the first `prompt` tokens): one prefill shape.
    padding = [(0, 0), (0, 0), (0, steps), (0, 0), (0, 0)]
    cache = _prefill(paged_cache.create(config), 0, np.pad(keys, padding), np.pad(values, padding), prompt)
    before = int(cache.page_free.sum())
    for target in range(1, 8):
        cache = _fork(cache, 0, target)
    assert int(cache.page_free.sum()) == before  # nothing copied in the pool
    assert (np.asarray(cache.page_refs)[np.asarray(cache.block_tables[0])[:64]] == 8).all()
    step_k, step_v = looped_tokens(rng, config, steps, batch=8)  # [L, loops, 8, steps, H, D]
    for step in range(steps):
        cache = _append(cache, step_k[:, :, :, step], step_v[:, :, :, step])
    paged_cache.validate(cache)
    assert int(cache.page_free.sum()) == before - 8  # one own page each

    independent = paged_cache.create(config)
    for slot in range(8):
        history_k = np.concatenate([keys, step_k[:, :, slot]], axis=2)
        history_v = np.concatenate([values, step_v[:, :, slot]], axis=2)
        independent = _prefill(independent, slot, history_k, history_v, prompt + steps)
    for slot in range(8):
        _assert_same_sequence(cache, slot, independent, slot, f"slot {slot}")
    queries = jnp.asarray(rng.standard_normal((8, 4, config.head_dim)), jnp.float32)
    for loop in (0, config.num_loops - 1):
        shared = jflashloop.decode_attention(queries, cache, 0, loop, include_pending=False, implementation="xla")
        alone = jflashloop.decode_attention(queries, independent, 0, loop, include_pending=False,
                                            implementation="xla")
        assert_bits_equal(np.asarray(shared), np.asarray(alone), f"attention loop {loop}")
    for slot in range(8):
        cache = _free(cache, slot)
    assert int(cache.page_free.sum()) == config.num_pages and not np.asarray(cache.page_refs).any()


def test_appends_and_frees_never_change_what_the_other_reads(rng):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 70)
    forked = _fork(cache, 0, 2)
    _assert_same_sequence(forked, 2, forked, 0, "the fork")
    step_k, step_v = looped_tokens(rng, config, 30, batch=config.max_sequences)
    only_source = jnp.asarray([True, False, False])
    grown = forked
    for step in range(30):  # the source fills two more pages; the target does not move
        grown = _append_for(grown, step_k[:, :, :, step], step_v[:, :, :, step], only_source)
    _assert_same_sequence(grown, 2, forked, 2, "the target after the source's appends")
    freed = _free(grown, 0)
    paged_cache.validate(freed)
    _assert_same_sequence(freed, 2, forked, 2, "the target after the source was freed")
    assert int(freed.page_free.sum()) == config.num_pages - 70 // config.page_size
    other = _free(_fork(cache, 0, 1), 1)  # freeing the target leaves the source intact
    _assert_same_sequence(other, 0, cache, 0, "the source after the target was freed")
    assert_bits_equal(np.asarray(other.page_refs), np.asarray(cache.page_refs), "page_refs")


@pytest.mark.parametrize("tokens", [48, 40])  # on a page boundary; inside a page
def test_a_fork_behind_the_window_decodes_its_window_rows(rng, tokens):
    """Shared pages keep their bits; window rows no longer in the source's ring come from its pages."""
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 70)  # its ring holds 54..69
    forked = _fork(cache, 0, 1, tokens)
    paged_cache.validate(forked)
    alone = _prefill(paged_cache.create(config), 1, keys, values, tokens)  # the same prompt, cut at tokens
    window_start = min(tokens - config.recent_tokens, tokens // config.page_size * config.page_size)
    for layer in range(config.num_layers):
        for loop in range(config.num_loops):
            got = np.asarray(_reconstruct(forked, layer, loop, 1)[0])
            want = np.asarray(_reconstruct(alone, layer, loop, 1)[0])
            source = np.asarray(_reconstruct(cache, layer, loop, 0)[0])
            where = f"layer {layer} loop {loop}"
            assert_bits_equal(got[:window_start], want[:window_start], f"shared pages and sink, {where}")
            # The window rows: the source's page values (it reads them from its pages), in the window dtype.
            rounded = source[window_start:tokens].astype(jnp.bfloat16).astype(np.float32)
            assert_bits_equal(got[window_start:tokens], rounded, f"decoded window rows, {where}")
            assert not got[tokens:].any()
    # Appends after the fork pack the target's partial page again from those rows: close to the independent one.
    step_k, step_v = looped_tokens(rng, config, 20, batch=config.max_sequences)
    for step in range(20):
        forked = _append(forked, step_k[:, :, :, step], step_v[:, :, :, step])
        alone = _append(alone, step_k[:, :, :, step], step_v[:, :, :, step])
    paged_cache.validate(forked)
    for loop in range(config.num_loops):
        got = np.asarray(_reconstruct(forked, 0, loop, 1)[0])
        want = np.asarray(_reconstruct(alone, 0, loop, 1)[0])
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 0.2 * scale, loop  # two roundings of the partial page's first rows


CODEC_PAIRS = {
    "int4_rotated": lambda d: (jflashloop.int4_rotated(d, 3), jflashloop.int4_rotated(d, 4)),
    "int2_lloyd_max keys": lambda d: (jflashloop.int2_lloyd_max(d, 5), jflashloop.INT4_VALUES),
    "e8 keys, int4_group_rotated values": lambda d: (jflashloop.E8_KEYS, jflashloop.INT4_GROUP_ROTATED_VALUES),
}


@pytest.mark.parametrize("codecs", sorted(CODEC_PAIRS))
def test_fork_with_every_codec(rng, codecs):
    """A fork at the end holds the source's bits; one behind the window, the source's page values."""
    base = small_config(max_pages_per_sequence=6, num_pages=20, num_loops=2, head_dim=64, page_size=64,
                        recent_tokens=64)
    key_spec, value_spec = CODEC_PAIRS[codecs](base.head_dim)
    config = dataclasses.replace(base, loops=(LoopStorage(key_spec, value_spec), base.loops[1]))
    keys, values = looped_tokens(rng, config, 200)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 200)
    whole, behind = _fork(cache, 0, 1), _fork(cache, 0, 2, 100)
    paged_cache.validate(behind)
    _assert_same_sequence(whole, 1, cache, 0, "a fork at the end")
    for loop in range(config.num_loops):
        got = np.asarray(_reconstruct(behind, 0, loop, 2)[0])
        source = np.asarray(_reconstruct(cache, 0, loop, 0)[0])
        assert_bits_equal(got[:36], source[:36], f"the sink and the shared page, loop {loop}")
        rounded = source[36:100].astype(jnp.bfloat16).astype(np.float32)
        assert_bits_equal(got[36:100], rounded, f"decoded window rows, loop {loop}")


def test_fork_under_jit_with_traced_slots_and_tokens(rng):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _prefill(paged_cache.create(config), 1, keys, values, 70)
    eager = paged_cache.fork(cache, 1, 0, 37)
    traced = _fork(cache, jnp.int32(1), jnp.int32(0), jnp.int32(37))
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(eager), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "traced fork")
    clamped = _fork(cache, jnp.int32(1), jnp.int32(0), jnp.int32(99))  # beyond the source: clamped, flagged
    assert int(clamped.lengths[0]) == 70 and clamped.error_flags[0] & paged_cache.ERROR_INVALID_LENGTH
    for slots in ((1, 1), (2, 0), (7, 0)):  # the same slot, an inactive source, out of range: nothing changes
        unchanged = _fork(cache, *(jnp.int32(s) for s in slots))
        for a, b in zip(jax.tree.leaves(unchanged), jax.tree.leaves(cache), strict=True):
            assert_bits_equal(np.asarray(a), np.asarray(b), f"fork {slots}")
    replaced = _fork(_prefill(cache, 0, keys, values, 40), jnp.int32(1), jnp.int32(0))  # an active target
    paged_cache.validate(replaced)
    assert replaced.error_flags[0] & paged_cache.ERROR_SLOT_REPLACED
    assert int(replaced.page_free.sum()) == config.num_pages - 70 // config.page_size


def test_fork_checks_its_arguments(rng):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _prefill(_prefill(paged_cache.create(config), 0, keys, values, 70), 1, keys, values, 20)
    with pytest.raises(ValueError, match="must differ"):
        paged_cache.fork(cache, 0, 0)
    with pytest.raises(ValueError, match="holds no sequence"):
        paged_cache.fork(cache, 2, 0)
    with pytest.raises(ValueError, match="already active"):
        paged_cache.fork(cache, 0, 1)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, lengths\[0\]=70\]"):
        paged_cache.fork(cache, 0, 2, 71)
    with pytest.raises(IndexError):
        paged_cache.fork(cache, 0, 3)
    with pytest.raises(TypeError):
        paged_cache.fork(cache, 0, 2, 1.5)


def test_validate_counts_the_references(rng):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _fork(_prefill(paged_cache.create(config), 0, keys, values, 70), 0, 1)
    page = int(cache.block_tables[0, 0])
    with pytest.raises(CacheStateError, match=rf"page_refs\[{page}\] = 1"):
        paged_cache.validate(dataclasses.replace(cache, page_refs=cache.page_refs.at[page].set(1)))
    moved = cache.block_tables.at[1, 0].set(cache.block_tables[1, 1]).at[1, 1].set(page)
    with pytest.raises(CacheStateError, match="different block-table columns"):
        paged_cache.validate(dataclasses.replace(cache, block_tables=moved))


def test_persistence_keeps_sharing_and_bundles_materialize(rng, tmp_path):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _fork(_prefill(paged_cache.create(config), 0, keys, values, 70), 0, 1)
    assert_file_round_trip(cache, tmp_path / "shared.jfl")  # a shared page is stored once
    bundle = persistence.export_pages(cache, 1)
    imported = persistence.import_pages(cache, 2, bundle)  # the bundle holds the pages' data: own copies
    paged_cache.validate(imported)
    assert not set(np.asarray(imported.block_tables[2])[:4].tolist()) & set(np.asarray(cache.block_tables[0]).tolist())
    _assert_same_sequence(imported, 2, cache, 1, "the imported fork")


def test_files_with_a_free_list_load_as_reference_counts(rng):
    """Files written before reference counts hold ``.page_free``; no page was shared then."""
    from jflashloop.persistence import _format

    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 70)
    leaves = [(".page_free", np.asarray(cache.page_free)) if name == ".page_refs" else (name, array)
              for name, array in _format.named_leaves(cache)]
    import io

    stream = io.BytesIO()
    _format.write(stream, _format.CACHE_FORMAT, config, {}, leaves)
    loaded = persistence.cache_from_bytes(stream.getvalue())
    assert_bits_equal(np.asarray(loaded.page_refs), np.asarray(cache.page_refs), "page_refs")


def test_storage_counts_shared_pages_once(rng):
    config = small_config(max_pages_per_sequence=10, num_pages=40)
    keys, values = looped_tokens(rng, config, 70)
    cache = _fork(_fork(_prefill(paged_cache.create(config), 0, keys, values, 70), 0, 1), 0, 2, 40)
    held = storage.cache_bytes(cache)
    page = storage.page_bytes(config).total * config.num_layers
    windows = storage.window_bytes_per_sequence(config) * config.num_layers
    assert held.pages == 4 and held.page_references == 4 + 4 + 2
    assert held.bytes == 4 * page + 3 * windows
    assert held.bytes_without_sharing == 10 * page + 3 * windows
    assert storage.shared_prefix_bytes(config, 3, 64) == held.bytes
    assert storage.shared_prefix_bytes(config, 3, 64, shared=False) == 12 * page + 3 * windows
    assert storage.shared_prefix_bytes(config, 1, 70) == storage.sequence_bytes(config, 70)
    table = storage.sharing_table(storage.OURO_1_4B, sequences=64, prefix_tokens=4096, own_tokens=(0,))
    ouro = storage.config_for(storage.OURO_1_4B)
    shared = storage.shared_prefix_bytes(ouro, 64, 4096) / 2**30
    alone = storage.shared_prefix_bytes(ouro, 64, 4096, shared=False) / 2**30
    assert f"| {alone:.2f} GiB | {shared:.2f} GiB |" in table
