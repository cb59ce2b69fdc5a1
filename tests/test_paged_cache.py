"""PagedKVCache: prefill, append, free, reconstruct and attention against the oracles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from jflashloop import CacheConfig, LoopStorage, paged_cache, storage
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    History,
    assert_matches_oracle,
    build,
    hole_cache,
    looped_tokens,
    lost_page_cache,
    lost_page_config,
    nvfp4_residual_config,
    oracle_codec,
    oracle_sequence,
    small_affine_config,
    small_config,
    tiny_config,
)

_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append, donate_argnums=0)


@pytest.mark.parametrize(
    "sink, recent", [(4, 16), (0, 0), (4, 64), (0, 128)], ids=lambda v: str(v)
)
def test_prefill_matches_oracle(rng, sink, recent):
    config = small_config(sink_tokens=sink, recent_tokens=recent)
    cache, history = build(rng, config, prompt_lengths=[37, 16, 70], steps=0, padded_tokens=80)
    assert_matches_oracle(cache, history.keys, history.values, layers=[1])


def test_appends_across_pages_match_oracle(rng):
    config = small_config()
    # 5 + 60 crosses three page boundaries; 31 + 60 starts one short of a boundary.
    # (Prompts padded to test_prefill_matches_oracle's 80 tokens: one prefill shape per config.)
    cache, history = build(rng, config, prompt_lengths=[5, 31, 16], steps=60, padded_tokens=80)
    assert_matches_oracle(cache, history.keys, history.values, layers=[0])


def test_nvfp4_residual_streams_match_oracle(rng):
    config = nvfp4_residual_config()
    cache, history = build(rng, config, prompt_lengths=[50, 17], steps=20)
    assert_matches_oracle(cache, history.keys, history.values, layers=[1])


@pytest.mark.parametrize("fmt", ["int3", "int2"])
def test_small_affine_streams_match_oracle(rng, fmt):
    config = small_affine_config(fmt, max_sequences=2, num_loops=3)  # base, dense residual, sparse residual
    cache, history = build(rng, config, prompt_lengths=[37, 17], steps=0)
    assert_matches_oracle(cache, history.keys, history.values, layers=[1])


@pytest.mark.parametrize("fmt, head_dim, rule", [("int3", 16, "int3 pages need head_dim divisible by 32"),
                                                 ("int2", 8, "int2 pages need head_dim divisible by 16")])
def test_small_affine_pages_need_whole_words(fmt, head_dim, rule):
    with pytest.raises(ValueError, match=rule):
        small_affine_config(fmt, head_dim=head_dim)


@pytest.mark.parametrize("page_size", [32, 64])
def test_larger_pages_match_oracle(rng, page_size):
    config = small_config(page_size=page_size, max_pages_per_sequence=4, max_sequences=2)
    cache, history = build(rng, config, prompt_lengths=[page_size * 2 + 3, page_size - 1], steps=5)
    assert_matches_oracle(cache, history.keys, history.values, layers=[0], loops=[0, 3])


def test_pending_token_is_visible_before_commit(rng):
    config = small_config()
    cache, history = build(rng, config, prompt_lengths=[31, 3, 64], steps=0, padded_tokens=80)
    keys, values = looped_tokens(rng, config, 1, batch=config.max_sequences)
    for layer in range(config.num_layers):
        for loop in range(config.num_loops):
            cache = paged_cache.write_token(cache, layer, loop, keys[layer, loop, :, 0], values[layer, loop, :, 0])
    history.append(keys[:, :, :, 0], values[:, :, :, 0], np.ones(3, bool))
    history.lengths -= 1  # not committed yet
    assert_matches_oracle(cache, history.keys, history.values, layers=[1], include_pending=True)
    committed = paged_cache.commit(cache)
    history.lengths += 1
    assert_matches_oracle(committed, history.keys, history.values, layers=[1])


# small_config(max_sequences=1)'s capacity (20 pages of 16): the one prompt shape of the one-sequence tests
# below, so their prefill (and append) compile once for the module.
ONE_SEQUENCE_TOKENS = 320


def test_append_equals_prefill_of_the_same_history(rng):
    config = small_config(max_sequences=1)
    keys, values = looped_tokens(rng, config, ONE_SEQUENCE_TOKENS)  # 150 used: prefill reads the first length
    direct = _prefill(paged_cache.create(config), 0, keys, values, 150)
    incremental = _prefill(paged_cache.create(config), 0, keys, values, 37)  # the first 37 tokens (one shape)
    for t in range(37, 150):
        incremental = _append(incremental, keys[:, :, t : t + 1], values[:, :, t : t + 1])
    for layer in range(config.num_layers):
        for loop in range(config.num_loops):
            a = paged_cache.reconstruct(direct, layer, loop, 0)
            b = paged_cache.reconstruct(incremental, layer, loop, 0)
            assert_bits_equal(a[0], b[0], f"keys layer {layer} loop {loop}")
            assert_bits_equal(a[1], b[1], f"values layer {layer} loop {loop}")


def test_sparse_rows_are_the_largest_residuals(rng):
    config = small_config(max_sequences=1, sink_tokens=4)
    keys, values = looped_tokens(rng, config, ONE_SEQUENCE_TOKENS)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 96)
    keys, values = keys[:, :, :96], values[:, :, :96]  # the prefilled tokens
    layer = 0
    pages = np.asarray(cache.block_tables[0])[:6]
    for loop in (2, 3):
        storage_ = config.loops[loop]
        chosen = np.asarray(cache.layers[layer].loops[loop].row_positions)[:, pages]  # [H, pages, rows]
        # Packed-page reconstruction of the previous loop (no windows) from the oracle:
        row_positions = [None if r.row_positions is None else np.asarray(r.row_positions)[:, pages]
                         for r in cache.layers[layer].loops]
        rec_k = reference.paged_cache.reconstruct_pages(
            keys[layer], 16, 4, [(oracle_codec(s.key_spec), None, s.sparse_rows_per_page) for s in config.loops],
            row_positions, loop - 1, 6)
        rec_v = reference.paged_cache.reconstruct_pages(
            values[layer], 16, 4, [(oracle_codec(s.value_spec), None, s.sparse_rows_per_page) for s in config.loops],
            row_positions, loop - 1, 6)
        energy = ((keys[layer, loop, :96] - rec_k) ** 2).sum(-1) + ((values[layer, loop, :96] - rec_v) ** 2).sum(-1)
        for page in range(6):
            for head in range(config.num_kv_heads):
                page_energy = energy[page * 16 : (page + 1) * 16, head].astype(np.float64)
                eligible = np.ones(16, bool)
                if page == 0:
                    eligible[:4] = False
                rows = [int(p) for p in chosen[head, page] if p >= 0]
                assert rows == sorted(rows) and len(rows) == storage_.sparse_rows_per_page
                assert all(eligible[rows])
                unchosen = np.setdiff1d(np.flatnonzero(eligible), rows)
                assert page_energy[rows].min() >= page_energy[unchosen].max() * (1 - 1e-5)


def test_done_when_four_loops_two_layers_three_sequences_200_appends(rng):
    config = small_config()  # 277 tokens take 18 of its 20 pages per sequence
    # Prompts padded to test_prefill_matches_oracle's 80 tokens: its prefill, and the append of
    # test_appends_across_pages_match_oracle (the same config), compile once for the module.
    cache, history = build(rng, config, prompt_lengths=[5, 40, 77], steps=200, padded_tokens=80)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [205, 240, 277])
    assert_matches_oracle(cache, history.keys, history.values, layers=[1], loops=[0, 1, 3])
    queries = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.float32)  # GQA 4 query heads per KV head
    for loop in range(config.num_loops):
        out = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=False)
        for slot in range(3):
            keys, values = oracle_sequence(cache, history.keys, history.values, 1, loop, slot)
            expected = reference.attention.decode_attention(np.asarray(queries[slot]), keys, values, keys.shape[0])
            error = np.linalg.norm(np.asarray(out[slot]) - expected) / np.linalg.norm(expected)
            assert error < 1e-5, (loop, slot, error)


def test_free_returns_pages_and_slot(rng):
    config = small_config(num_pages=8, max_pages_per_sequence=8)
    cache, _ = build(rng, config, prompt_lengths=[70, 40], steps=0, padded_tokens=96)  # 4 + 2 pages
    assert int(cache.page_free.sum()) == 2
    cache = jax.jit(paged_cache.free)(cache, 0)
    assert int(cache.page_free.sum()) == 6 and not bool(cache.active[0]) and int(cache.lengths[0]) == 0
    assert (np.asarray(cache.block_tables[0]) == -1).all()
    keys, values = looped_tokens(rng, config, 96)
    cache = _prefill(cache, 0, keys, values, 96)  # 6 pages: reuses the freed ones
    paged_cache.check(cache)
    assert int(cache.page_free.sum()) == 0
    used = np.concatenate([np.asarray(cache.block_tables[s])[np.asarray(cache.block_tables[s]) >= 0] for s in (0, 1)])
    assert sorted(used.tolist()) == list(range(8))


def test_running_out_of_pages_is_flagged(rng):
    config = small_config(num_pages=3, max_pages_per_sequence=8, max_sequences=1)
    keys, values = looped_tokens(rng, config, 64)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 64)
    with pytest.raises(RuntimeError, match="ran out of free pages"):
        paged_cache.check(cache)


def test_sequence_capacity_is_flagged(rng):
    config = small_config(max_sequences=1)  # test_append_equals_prefill_of_the_same_history's programs
    assert config.max_tokens_per_sequence == ONE_SEQUENCE_TOKENS
    keys, values = looped_tokens(rng, config, ONE_SEQUENCE_TOKENS)
    cache = _prefill(paged_cache.create(config), 0, keys, values, ONE_SEQUENCE_TOKENS)
    step_k, step_v = looped_tokens(rng, config, 1, batch=1)
    cache = _append(cache, step_k[:, :, :, 0], step_v[:, :, :, 0])
    assert int(cache.lengths[0]) == ONE_SEQUENCE_TOKENS
    with pytest.raises(RuntimeError, match="max_pages_per_sequence"):
        paged_cache.check(cache)


def test_storage_accounting_matches_arrays_and_hand_count():
    config = small_config()
    # Per (page, head) tile with page 16, head_dim 16:
    # (payloads are stored as uint32 words: the same bytes)
    # K INT4 channel G16: payload 16*8=128 + 1 group x 16 channels x 4 B = 64 -> 192
    # V INT4 token G64:   payload 128 + 16 rows x 1 group x 4 B = 64          -> 192
    # sparse 4 rows (token G64): K 4*8+4*4=48, V 48, positions 4               -> 100
    # sparse 2 rows: K 2*8+2*4=24, V 24, positions 2                           -> 50
    expected = storage.PageBytes(loops=(2 * 384, 2 * 384, 2 * 100, 2 * 50), total=2 * (384 + 384 + 100 + 50))
    assert storage.page_bytes(config) == expected
    cache = paged_cache.create(config)
    pool_bytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache.layers[0].loops)
    )
    assert pool_bytes == expected.total * config.num_pages
    assert storage.bytes_per_token(config) == expected.total / 16
    assert storage.unquantized_bytes_per_token(config) == 4 * 2 * HEADS * HEAD_DIM * 2
    windows = (4 + 16) * 4 * 2 * HEADS * HEAD_DIM * 2  # sink 4 + ring max(16, 16), bf16
    assert storage.window_bytes_per_sequence(config) == windows
    assert storage.sequence_bytes(config, 40) == LAYERS * (2 * expected.total + windows)


@pytest.mark.parametrize("fmt, row", [("int3", 12), ("int2", 8)])
def test_small_affine_storage_accounting_matches_arrays_and_hand_count(fmt, row):
    config = small_affine_config(fmt)
    # Per (page, head) tile with page 16, head_dim 32 (a row's payload: 32 * 3 / 8 = 12 bytes for INT3,
    # 32 * 2 / 8 = 8 for INT2), metadata 4 bytes a group:
    # K channel G16: payload 16 * row + 1 group x 32 channels x 4 B = 128
    # V token G32:   payload 16 * row + 16 rows x 1 group x 4 B = 64
    # sparse 4 rows (token G32): K 4 * row + 4 * 4, V the same, positions 4
    # sparse 2 rows: K 2 * row + 2 * 4, V the same, positions 2
    dense = (16 * row + 128) + (16 * row + 64)
    sparse4, sparse2 = 2 * (4 * row + 16) + 4, 2 * (2 * row + 8) + 2
    expected = storage.PageBytes(loops=(2 * dense, 2 * dense, 2 * sparse4, 2 * sparse2),
                                 total=2 * (2 * dense + sparse4 + sparse2))
    assert storage.page_bytes(config) == expected
    cache = paged_cache.create(config)
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache.layers[0].loops))
    assert pool_bytes == expected.total * config.num_pages
    assert cache.layers[0].loops[0].keys.payload.shape == (HEADS, config.num_pages, 16, row // 4)  # as words


def test_ouro_storage_figure():
    config = storage.config_for(storage.OURO_1_4B)
    bf16 = storage.unquantized_bytes_per_token(config)
    assert bf16 == 32768
    ratio = bf16 / storage.bytes_per_token(config)
    assert ratio == pytest.approx(6.02, abs=0.01)
    assert storage.tokens_that_fit(config, 1.0) > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(page_size=48), "page_size"),
        (dict(sink_tokens=16), "sink_tokens"),
        (dict(recent_tokens=-1), "recent_tokens"),
        (dict(num_pages=0), "num_pages"),
    ],
)
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_config_rejects_groups_spanning_pages():
    with pytest.raises(ValueError, match="divide the page size"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=1, max_sequences=1,
                    max_pages_per_sequence=1, page_size=32, loops=(LoopStorage(jflashloop.INT4_KEYS),))
    with pytest.raises(ValueError, match="sparse loop must group per token"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=1, max_sequences=1,
                    max_pages_per_sequence=1, page_size=64,
                    loops=(LoopStorage(), LoopStorage(jflashloop.INT4_KEYS, jflashloop.INT4_VALUES, 8)))


def test_prefill_rejects_wrong_shapes():
    config = small_config()
    cache = paged_cache.create(config)
    with pytest.raises(ValueError, match="layers=2, loops=4"):
        paged_cache.prefill(cache, 0, jnp.zeros((2, 3, 10, 2, 16)), jnp.zeros((2, 3, 10, 2, 16)))


# --------------------------------------------------------------------------- edge values in the cache


def test_nonfinite_inputs_are_stored_as_zero_counted_and_flagged(rng):
    config = tiny_config()
    # Padded to the capacity (64 tokens): the prefill test_a_token_dropped_at_capacity_changes_nothing compiles.
    keys, values = looped_tokens(rng, config, config.max_tokens_per_sequence)
    keys[0, 0, 20, 1, 3] = np.nan  # packed into page 1
    values[0, 1, 38, 0, 0] = np.inf  # in the ring
    keys[0, 1, 39, 0, 0] = -np.inf  # padding beyond length: not stored, not counted
    cache = _prefill(paged_cache.create(config), 0, keys, values, 39)
    assert int(cache.nonfinite_counts[0]) == 2
    assert cache.error_flags[0] & paged_cache.ERROR_NONFINITE_INPUT
    with pytest.raises(RuntimeError, match=r"NaN or \+-inf K/V were written .*nonfinite_counts=2"):
        paged_cache.check(cache)
    history = History(config, 41)
    stored_k = np.where(np.isfinite(keys), keys, 0).astype(np.float32)
    stored_v = np.where(np.isfinite(values), values, 0).astype(np.float32)
    history.prefill(0, stored_k, stored_v, 39)
    # A decode token with a NaN for the active slot 0 and one for the inactive slot 1 (not counted).
    step_k, step_v = looped_tokens(rng, config, 1, batch=config.max_sequences)
    step_k, step_v = step_k[:, :, :, 0], step_v[:, :, :, 0]
    step_k[0, 1, 0, 0, 5] = np.nan
    step_k[0, 0, 1, 0, 5] = np.nan
    cache = _append(cache, step_k, step_v)
    history.append(np.nan_to_num(step_k, nan=0.0), step_v, np.array([True, False]))
    assert cache.nonfinite_counts.tolist() == [3, 0]
    assert_matches_oracle(cache, history.keys, history.values)
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    out = jflashloop.decode_attention_reference(queries, cache, 0, 1, include_pending=False)
    assert bool(jnp.isfinite(out).all())
    freed = paged_cache.free(cache, 0)
    assert int(freed.nonfinite_counts[0]) == 0 and int(freed.error_flags[0]) == 0


@pytest.mark.parametrize("fmt", ["int3", "int2"])
def test_small_affine_saturation_is_counted_from_its_metadata(rng, fmt):
    config = small_affine_config(fmt, num_loops=1, max_sequences=1)
    keys, values = looped_tokens(rng, config, 40)
    values[0, 0, 10, 1, :] -= 7e4  # in page 0: the min of the V group (token 10, head 1) is beyond float16
    cache = _prefill(paged_cache.create(config), 0, keys, values, 40)
    assert cache.error_flags[0] & paged_cache.ERROR_SATURATED
    assert int(cache.saturation_counts[0]) == 32  # the group's 32 members


def test_saturation_is_counted_per_sequence(rng):
    config = tiny_config(window_dtype="float16")
    keys, values = looped_tokens(rng, config, 40)
    keys[0, 0, 30, 0, 2] = 1e5  # beyond float16: the window stores 65504 and counts it
    values[0, 0, 10, 1, 0] = 7e4  # in page 0: the base V group's min/scale saturate
    cache = _prefill(paged_cache.create(config), 0, keys, values, 40)
    paged_cache.check(cache)  # saturation is a warning by default
    with pytest.raises(RuntimeError, match=r"stored at their format's limit .*saturation_counts="):
        paged_cache.check(cache, allow_saturation=False)
    assert cache.error_flags[0] & paged_cache.ERROR_SATURATED
    counted = int(cache.saturation_counts[0])
    # 1 window value + the 16 members of the saturated V group in loop 1 (+ the loop-2
    # residual groups that carry the outliers' differences)
    assert counted >= 1 + 16
    keys_out, _, _ = paged_cache.reconstruct(cache, 0, 0, 0)
    assert float(keys_out[30, 0, 2]) == 65504.0
    clean = _prefill(paged_cache.create(config), 0, *looped_tokens(rng, config, 40), 40)
    assert int(clean.saturation_counts[0]) == 0 and int(clean.error_flags[0]) == 0


def test_create_rejects_a_config_of_another_type():
    with pytest.raises(TypeError, match="config must be a CacheConfig"):
        paged_cache.create({"num_layers": 1})


# --------------------------------------------------------------------------- isolation between sequences


def assert_same_cache(actual, expected, *, except_fields=()):
    """Every array of the two caches is bit-identical, apart from ``except_fields``."""
    actual = dataclasses.replace(actual, **{name: getattr(expected, name) for name in except_fields})
    leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, leaf), other in zip(leaves, jax.tree.leaves(actual), strict=True):
        assert_bits_equal(other, leaf, jax.tree_util.keystr(path))


def oracle_attention(cache, history, queries, layer, loop, *, include_pending=False):
    """float64 ``[max_sequences, q_heads, D]``: each slot's attention over its readable positions."""
    config = cache.config
    out = np.zeros(queries.shape)
    for slot in range(config.max_sequences):
        keys, values = oracle_sequence(cache, history.keys, history.values, layer, loop, slot,
                                       include_pending=include_pending)
        readable = reference.paged_cache.readable_positions(
            length=int(cache.lengths[slot]), visible=keys.shape[0], page_size=config.page_size,
            sink_tokens=config.sink_tokens, recent_tokens=config.recent_tokens,
            stored_pages=int(np.cumprod(np.asarray(cache.block_tables[slot]) >= 0).sum()),
        )
        out[slot] = reference.attention.decode_attention(
            np.asarray(queries[slot]), keys[readable], values[readable], int(readable.sum()))
    return out


def assert_attention_matches_oracle(cache, history, queries, *, include_pending=False):
    """Loops 1 and the last (regions do not depend on the loop; the last reads every stream)."""
    for loop in (0, cache.config.num_loops - 1):
        actual = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=include_pending)
        expected = oracle_attention(cache, history, queries, 0, loop, include_pending=include_pending)
        np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-6, err_msg=f"loop {loop + 1}")


# Windows 4/16 at page 16 and 4/64 at page 64: the ring is exactly the recent window.
FULL_WINDOWS = {"16/16": {}, "4/64": dict(page_size=64, recent_tokens=64, max_pages_per_sequence=2, num_pages=4)}
_append_kept = jax.jit(paged_cache.append)  # no donation: the input cache is compared afterwards


@pytest.mark.parametrize("windows", list(FULL_WINDOWS))
def test_a_token_dropped_at_capacity_changes_nothing(rng, windows):
    config = tiny_config(**FULL_WINDOWS[windows])
    capacity = config.max_tokens_per_sequence
    keys, values = looped_tokens(rng, config, capacity)
    full = _prefill(paged_cache.create(config), 0, keys, values, capacity)  # slot 1 stays free
    step_k, step_v = looped_tokens(rng, config, 1, batch=config.max_sequences)
    step_k, step_v = step_k[:, :, :, 0], step_v[:, :, :, 0]
    step_k[:, :, :, 0, 0] = np.nan  # a dropped token is not counted either
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, full, 0, 1, include_pending=False)
    written = full
    for loop in range(config.num_loops):
        written = paged_cache.write_token(written, 0, loop, step_k[0, loop], step_v[0, loop])
    assert_same_cache(written, full)  # nothing stored: the pending token is not visible
    _, _, visible = paged_cache.reconstruct(written, 0, 1, 0, include_pending=True)
    assert int(visible) == capacity
    pending = jflashloop.decode_attention_reference(queries, written, 0, 1, include_pending=True)
    np.testing.assert_allclose(np.asarray(pending), np.asarray(expected), rtol=1e-5, atol=1e-6)
    appended = _append_kept(full, step_k, step_v)
    assert appended.error_flags.tolist() == [paged_cache.ERROR_SEQUENCE_FULL, 0]
    assert_same_cache(appended, full, except_fields=("error_flags",))


@pytest.mark.parametrize("windows", list(FULL_WINDOWS))
def test_prefill_beyond_capacity_equals_prefill_of_the_kept_tokens(rng, windows):
    config = tiny_config(**FULL_WINDOWS[windows])
    capacity = config.max_tokens_per_sequence
    keys, values = looped_tokens(rng, config, capacity + 5)
    longer = _prefill(paged_cache.create(config), 0, keys, values, capacity + 5)
    kept = _prefill(paged_cache.create(config), 0, keys[:, :, :capacity], values[:, :, :capacity], capacity)
    assert longer.error_flags.tolist() == [paged_cache.ERROR_SEQUENCE_FULL, 0]
    assert_same_cache(longer, kept, except_fields=("error_flags",))


def test_lost_pages_are_never_read(rng):
    config = lost_page_config()
    seed = int(rng.integers(2**31))
    (cache, history), (other, _) = (lost_page_cache(np.random.default_rng(seed), config, s) for s in (1, 2))
    assert np.asarray(cache.block_tables[1]).tolist() == [2, -1, -1]
    assert cache.error_flags.tolist() == [0, paged_cache.ERROR_OUT_OF_PAGES]
    assert_matches_oracle(cache, history.keys, history.values)
    keys, _, visible = paged_cache.reconstruct(cache, 0, 2, 1)
    assert int(visible) == 40 and not np.asarray(keys)[16:24].any()  # page 1's tokens that left the ring
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    assert_attention_matches_oracle(cache, history, queries)
    # Slot 1 reads nothing of its neighbour: another neighbour gives the same bits.
    for loop in range(config.num_loops):
        for a, b in zip(paged_cache.reconstruct(cache, 0, loop, 1), paged_cache.reconstruct(other, 0, loop, 1),
                        strict=True):
            assert_bits_equal(a, b, f"slot 1 loop {loop + 1}")
    for loop in (0, config.num_loops - 1):
        mine = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=False)[1]
        theirs = jflashloop.decode_attention_reference(queries, other, 0, loop, include_pending=False)[1]
        assert_bits_equal(mine, theirs, f"attention of slot 1 loop {loop + 1}")


def test_no_page_is_stored_after_a_lost_page(rng):
    config = lost_page_config()
    cache, history = hole_cache(rng, config)
    row = np.asarray(cache.block_tables[1])
    assert (row == -1).all() and int(cache.lengths[1]) == 32  # page 1 filled with the pool free again
    assert np.asarray(cache.page_free).all()
    # Only the pool ran out: the page after the lost one is not a capacity error.
    assert int(cache.error_flags[1]) == paged_cache.ERROR_OUT_OF_PAGES
    paged_cache.validate(cache)
    assert_matches_oracle(cache, history.keys, history.values)
    keys, _, _ = paged_cache.reconstruct(cache, 0, 0, 1)
    assert not np.asarray(keys)[4:16].any()  # only the sink and the ring (tokens 16..31) are read
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    assert_attention_matches_oracle(cache, history, queries)


def test_a_freed_slot_attends_to_nothing(rng):
    config = tiny_config()
    cache, _ = build(rng, config, prompt_lengths=[20, 33], steps=0, padded_tokens=config.max_tokens_per_sequence)
    freed = jax.jit(paged_cache.free)(cache, 0)
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    step_k, step_v = looped_tokens(rng, config, 1, batch=config.max_sequences)
    written = freed
    for loop in range(config.num_loops):
        written = paged_cache.write_token(written, 0, loop, step_k[0, loop, :, 0], step_v[0, loop, :, 0])
    for state in (freed, written):
        for include_pending in (False, True):
            out = jflashloop.decode_attention_reference(queries, state, 0, 1, include_pending=include_pending)
            assert not np.asarray(out[0]).any()
            keys, values, visible = paged_cache.reconstruct(state, 0, 1, 0, include_pending=include_pending)
            assert int(visible) == 0 and not np.asarray(keys).any() and not np.asarray(values).any()
    for name in ("sink_keys", "ring_keys", "ring_values"):  # the inactive slot's windows were not written
        assert_bits_equal(getattr(written.layers[0], name)[:, 0], getattr(freed.layers[0], name)[:, 0], name)


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_prefill_shorter_than_the_sink_window(rng, tokens):
    config = tiny_config()  # sink_tokens=4
    cache, history = paged_cache.create(config), History(config, max(tokens, 2) + 18)
    for slot, length in enumerate([tokens, 2]):
        keys, values = looped_tokens(rng, config, length)
        cache = _prefill(cache, slot, keys, values, length)
        history.prefill(slot, keys, values, length)
    assert_matches_oracle(cache, history.keys, history.values, include_pending=False)
    eager = paged_cache.prefill(paged_cache.create(config), 0, *looped_tokens(rng, config, tokens))
    assert int(eager.lengths[0]) == tokens
    for _ in range(18):  # across the sink window and the first page boundary
        keys, values = looped_tokens(rng, config, 1, batch=config.max_sequences)
        cache = _append(cache, keys[:, :, :, 0], values[:, :, :, 0])
        history.append(keys[:, :, :, 0], values[:, :, :, 0], np.ones(2, bool))
    assert_matches_oracle(cache, history.keys, history.values)
