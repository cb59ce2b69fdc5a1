"""Loops predicted from the loop before them (``LoopStorage.prediction``): the tables, the config's checks, the
cache's encode and reconstruction (with rows and with none), bytes, files, attention and sharding."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import LoopPrediction, fitting, paged_cache, persistence, sharding, storage
from jflashloop.cache import _storage
from reference.paged_cache import round_trip
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    HEADS,
    assert_file_round_trip,
    build,
    oracle_codec,
    small_config,
)


def random_prediction(rng, heads: int = HEADS, head_dim: int = HEAD_DIM) -> LoopPrediction:
    """A map near the identity (the loops of a looped model are close), different in every head."""
    def matrix():
        return np.eye(head_dim) + 0.3 * rng.standard_normal((heads, head_dim, head_dim)) / np.sqrt(head_dim)
    return LoopPrediction.from_arrays(matrix(), 0.2 * rng.standard_normal((heads, head_dim)),
                                      matrix(), 0.2 * rng.standard_normal((heads, head_dim)))


def predicted_config(rng, rows=(4, 0), **overrides):
    """:func:`small_config` (INT4 base, dense INT4 residual, two sparse loops) with loops 3 and 4 predicted,
    storing ``rows`` rows a page (0: none)."""
    base = small_config(**overrides)
    loops = list(base.loops)
    for loop, count in zip((2, 3), rows, strict=True):
        loops[loop] = dataclasses.replace(loops[loop], sparse_rows_per_page=count, prediction=random_prediction(rng))
    return dataclasses.replace(base, loops=tuple(loops))


def page_positions(cache, slot) -> np.ndarray:
    """The positions a sequence reads from its pages (not the sink or recent windows)."""
    return np.flatnonzero(np.asarray(paged_cache.sequence_regions(cache, slot)["pages"]))


def test_tables_round_trip_and_validate(rng):
    prediction = random_prediction(rng)
    keys, values = prediction.tables()
    assert keys.shape == values.shape == (HEADS, HEAD_DIM + 1, HEAD_DIM) and keys.dtype == np.float32
    assert LoopPrediction.from_json(prediction.to_json()) == prediction
    assert hash(LoopPrediction.from_json(prediction.to_json())) == hash(prediction)
    assert prediction.for_heads(1, 1).tables()[0][0].tobytes() == keys[1].tobytes()
    assert not prediction.same_for_every_head and LoopPrediction.identity(HEADS, HEAD_DIM).same_for_every_head
    x = jnp.asarray(rng.standard_normal((5, HEADS, HEAD_DIM)), jnp.float32)
    mapped_keys, _ = prediction.apply(x, 2 * x)
    np.testing.assert_allclose(np.asarray(mapped_keys), np.einsum("thd,hde->the", np.asarray(x), keys[:, :-1])
                               + keys[:, -1], rtol=1e-5, atol=1e-5)
    identity_keys, identity_values = LoopPrediction.identity(HEADS, HEAD_DIM).apply(x, 2 * x)
    assert_bits_equal(identity_keys, x, "identity keys")
    assert_bits_equal(identity_values, 2 * x, "identity values")
    with pytest.raises(ValueError, match="must be 2176 bytes"):
        LoopPrediction(HEADS, HEAD_DIM, b"\0" * 8, prediction.value_table)
    with pytest.raises(ValueError, match="finite"):
        LoopPrediction.from_arrays(np.full((1, 8, 8), np.nan), np.zeros((1, 8)), np.eye(8)[None], np.zeros((1, 8)))
    with pytest.raises(ValueError, match="value_matrix and value_bias must be"):
        LoopPrediction.from_arrays(np.eye(8)[None], np.zeros((1, 8)), np.eye(8)[None], np.zeros((2, 8)))
    with pytest.raises(ValueError, match="not in"):
        prediction.for_heads(1, 2)


def test_the_config_checks_where_a_prediction_goes(rng):
    base = small_config()
    prediction = random_prediction(rng)

    def with_loop(index, **changes):
        loops = list(base.loops)
        loops[index] = dataclasses.replace(loops[index], **changes)
        return dataclasses.replace(base, loops=tuple(loops))

    with pytest.raises(ValueError, match="only a residual loop"):
        with_loop(0, prediction=prediction)
    with pytest.raises(ValueError, match="only a residual loop"):
        with_loop(1, direct=True, prediction=prediction)
    with pytest.raises(ValueError, match="maps 1 KV heads of head_dim 16; the cache has 2 of 16"):
        with_loop(2, prediction=prediction.for_heads(0, 1))
    with pytest.raises(TypeError, match="must be a LoopPrediction or None"):
        with_loop(2, prediction="identity")
    with pytest.raises(ValueError, match="needs a prediction"):
        with_loop(2, sparse_rows_per_page=0)
    with pytest.raises(ValueError, match=r"must be in \[1, 16\] \(0 for a predicted loop\), got -1"):
        with_loop(2, sparse_rows_per_page=-1, prediction=prediction)
    assert with_loop(1, prediction=prediction).loops[1].prediction == prediction  # a dense residual may be predicted


def test_the_identity_prediction_is_the_plain_residual(rng):
    """Bit for bit: the same tiles and reconstructions as the chain without predictions."""
    plain = small_config()
    identity = LoopPrediction.identity(HEADS, HEAD_DIM)
    config = dataclasses.replace(plain, loops=(plain.loops[0], *(dataclasses.replace(loop, prediction=identity)
                                                                  for loop in plain.loops[1:])))
    predicted_cache, _ = build(np.random.default_rng(5), config, prompt_lengths=[37, 16, 50], steps=4)
    plain_cache, _ = build(np.random.default_rng(5), plain, prompt_lengths=[37, 16, 50], steps=4)
    for a, b in zip(jax.tree.leaves(predicted_cache), jax.tree.leaves(plain_cache), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "identity-predicted cache")


def test_a_loop_with_no_rows_is_its_prediction(rng):
    config = predicted_config(rng, rows=(4, 0))
    cache, history = build(rng, config, prompt_lengths=[37, 16, 50], steps=4)
    assert cache.layers[0].loops[3].keys is None and cache.layers[0].loops[3].row_positions is None
    for slot in range(config.max_sequences):
        pages = page_positions(cache, slot)
        for layer in range(config.num_layers):
            previous = paged_cache.reconstruct(cache, layer, 2, slot)
            keys, values, visible = paged_cache.reconstruct(cache, layer, 3, slot)
            expected = config.loops[3].prediction.apply(previous[0], previous[1])
            assert_bits_equal(np.asarray(keys)[pages], np.asarray(expected[0])[pages], f"keys slot {slot}")
            assert_bits_equal(np.asarray(values)[pages], np.asarray(expected[1])[pages], f"values slot {slot}")
            windows = np.setdiff1d(np.arange(int(visible)), pages)  # sinks and recent tokens: exact
            np.testing.assert_array_equal(np.asarray(keys)[windows], history.keys[layer, 3, slot, windows])


def test_rows_are_coded_against_the_prediction(rng):
    """The rows of a predicted sparse loop: the largest residuals against the prediction, coded as the oracle
    codes them (given the prediction), added to it."""
    config = predicted_config(rng, rows=(4, 0))
    cache, history = build(rng, config, prompt_lengths=[80], steps=0)
    storage_3 = config.loops[2]
    page_size, slot, checked = config.page_size, 0, 0
    for layer in range(config.num_layers):
        previous = paged_cache.reconstruct(cache, layer, 1, slot)
        predicted = [np.asarray(x) for x in storage_3.prediction.apply(previous[0], previous[1])]
        rebuilt = [np.asarray(x) for x in paged_cache.reconstruct(cache, layer, 2, slot)[:2]]
        exact = [history.keys[layer, 2, slot], history.values[layer, 2, slot]]
        positions = np.asarray(cache.layers[layer].loops[2].row_positions)  # [H, pool, rows]
        block = np.asarray(cache.block_tables[slot])
        read = page_positions(cache, slot)
        for column, page in enumerate(block[:80 // page_size]):
            span = slice(column * page_size, (column + 1) * page_size)
            if not np.isin(np.arange(max(span.start, config.sink_tokens), span.stop), read).all():
                continue  # a page the recent window serves: the loop before is read from the window there
            for head in range(HEADS):
                rows = [int(p) for p in positions[head, page] if p >= 0]
                residual = [(e[span, head] - p[span, head]).astype(np.float32) for e, p in zip(exact, predicted, strict=True)]
                if column == 0:  # the sink rows are not candidates
                    assert min(rows) >= config.sink_tokens
                energy = sum((r**2).sum(-1) for r in residual)
                candidates = np.arange(config.sink_tokens if column == 0 else 0, page_size)
                assert set(rows) == set(candidates[np.argsort(-energy[candidates], kind="stable")[:len(rows)]])
                for stream, spec in enumerate((storage_3.key_spec, storage_3.value_spec)):
                    coded = round_trip(residual[stream][rows][:, None, :], oracle_codec(spec), head)[:, 0]
                    expected = predicted[stream][span, head].copy()
                    expected[rows] = expected[rows] + coded
                    inside = slice(config.sink_tokens if column == 0 else 0, page_size)
                    checked += 1
                    assert_bits_equal(rebuilt[stream][span, head][inside], expected[inside],
                                      f"layer {layer} page {column} head {head}")
    assert checked > 0


def test_bytes_and_description(rng):
    """A prediction costs no bytes a page; a loop with no rows stores none."""
    config = predicted_config(rng, rows=(4, 0))
    unpredicted = dataclasses.replace(config, loops=(*config.loops[:3], dataclasses.replace(
        config.loops[3], prediction=None, sparse_rows_per_page=1)))
    unpredicted = dataclasses.replace(unpredicted, loops=(*unpredicted.loops[:2], dataclasses.replace(
        unpredicted.loops[2], prediction=None), unpredicted.loops[3]))
    page, plain = storage.page_bytes(config), storage.page_bytes(unpredicted)
    assert page.loops[:3] == plain.loops[:3] and page.loops[3] == 0 < plain.loops[3]
    assert _storage._describe(config.loops[3], config.page_size) == "predicted from the loop before (no rows stored)"
    assert "against a prediction" in _storage._describe(config.loops[2], config.page_size)


def test_files_keep_the_predictions(rng, tmp_path):
    config = predicted_config(rng, rows=(4, 0))
    cache, _ = build(rng, config, prompt_lengths=[37], steps=2)
    assert assert_file_round_trip(cache, tmp_path / "predicted.jfl").config == config


def test_attention_over_predicted_loops(rng):
    """Loops with no rows: the kernel reads the loop they are predicted from with the query moved into its basis
    (and this loop's windows moved likewise); a predicted loop with rows takes the reference path."""
    config = predicted_config(rng, rows=(0, 0))
    cache, _ = build(rng, config, prompt_lengths=[40, 70], steps=2)  # slot 2 holds nothing
    queries = jnp.asarray(rng.standard_normal((config.max_sequences, 4, HEAD_DIM)), jnp.float32)
    for loop in (2, 3):  # loop 3 is loop 2's prediction of loop 1's: one composed map
        reference = jflashloop.decode_attention_reference(queries, cache, 0, loop)
        kernel = jflashloop.decode_attention(queries, cache, 0, loop, implementation="pallas", interpret=True)
        for slot in range(2):
            error = np.linalg.norm(kernel[slot] - reference[slot]) / max(np.linalg.norm(reference[slot]), 1e-30)
            assert error < 2e-3, (loop, slot, error)
        assert not np.asarray(kernel[2]).any()  # no token: zero, as the reference gives, not the bias
    with_rows = predicted_config(rng, rows=(4, 0))
    cache, _ = build(rng, with_rows, prompt_lengths=[40], steps=1)
    for loop in (2, 3):
        automatic = jflashloop.decode_attention(queries, cache, 0, loop)
        assert_bits_equal(automatic, jflashloop.decode_attention_reference(queries, cache, 0, loop), "fallback")
        with pytest.raises(NotImplementedError, match="predicted loop that stores rows"):
            jflashloop.decode_attention(queries, cache, 0, loop, implementation="pallas", interpret=True)
    singular = dataclasses.replace(with_rows, loops=(*with_rows.loops[:2], dataclasses.replace(
        with_rows.loops[2], sparse_rows_per_page=0, prediction=LoopPrediction.from_arrays(
            np.zeros((HEADS, HEAD_DIM, HEAD_DIM)), np.zeros((HEADS, HEAD_DIM)),
            np.zeros((HEADS, HEAD_DIM, HEAD_DIM)), np.zeros((HEADS, HEAD_DIM)))), with_rows.loops[3]))
    with pytest.raises(NotImplementedError, match="ill-conditioned"):
        jflashloop.decode_attention(queries, paged_cache.create(singular), 0, 2, implementation="pallas",
                                    interpret=True)


@pytest.mark.parametrize("window_dtype, sink", [("bfloat16", True), ("float32", True), ("bfloat16", False)])
def test_the_maps_around_the_kernel_match_float64(rng, window_dtype, sink):
    """The query's, the windows' and the output's maps of a predicted loop against float64 numpy: a bfloat16
    window through the inverse split in two bfloat16 halves, a float32 one at full precision (all windows in one
    product; without sink windows, the ring's alone); with the high half alone (the control) a bfloat16 window's
    error is far above the bound."""
    from jflashloop.ops import _decode_attention as ops

    config = dataclasses.replace(predicted_config(rng, rows=(0, 0)), window_dtype=window_dtype)
    plan = ops.kernel_plan(config.layer(0), 3)  # loop 4: two maps composed
    key_table, value_table = (t.astype(np.float64) for t in plan.prediction.tables())
    sequences, heads = config.max_sequences, config.num_kv_heads
    windows = {name: jnp.asarray(rng.standard_normal((config.num_loops, sequences, heads, tokens, HEAD_DIM)),
                                 window_dtype)
               for name, tokens in (("sink_keys", config.sink_tokens), ("ring_keys", config.recent_tokens),
                                    ("sink_values", config.sink_tokens), ("ring_values", config.recent_tokens))}
    if not sink:
        windows.update(sink_keys=None, sink_values=None)
    queries = jnp.asarray(rng.standard_normal((sequences, 2 * heads, HEAD_DIM)), jnp.float32)
    mapped, moved, window_loop = ops.predicted_inputs(queries, windows, 3, plan)
    assert window_loop == 0 and set(moved) == set(windows)

    def relative(got, want):
        return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))

    grouped = np.asarray(queries, np.float64).reshape(sequences, heads, 2, HEAD_DIM)
    want_query = np.einsum("hde,shge->shgd", key_table[:, :-1], grouped)
    assert relative(mapped.reshape(want_query.shape), want_query) < 3e-5
    for name, table in (("sink_keys", key_table), ("ring_keys", key_table), ("sink_values", value_table),
                        ("ring_values", value_table)):
        if windows[name] is None:
            assert moved[name] is None, name
            continue
        window = np.asarray(windows[name][3:4], np.float64)
        want = np.einsum("lshtd,hde->lshte", window - table[:, -1][:, None], np.linalg.inv(table[:, :-1]))
        assert moved[name].dtype == jnp.float32 and moved[name].shape == want.shape, name
        assert relative(moved[name], want) < 3e-5, name
        if window_dtype == "bfloat16" and name == "ring_keys":  # control: the rounded inverse alone
            rounded = np.asarray(jnp.asarray(np.linalg.inv(table[:, :-1]), jnp.bfloat16), np.float64)
            shift = np.einsum("hd,hde->he", table[:, -1], np.linalg.inv(table[:, :-1]))
            assert relative(np.einsum("lshtd,hde->lshte", window, rounded) - shift[:, None], want) > 1e-4
    bounds = jnp.asarray([[5, 0]] + [[0, 0]] * (sequences - 1), jnp.int32)  # only sequence 0 has a token
    output = ops.predicted_output(queries, {"bounds": bounds}, plan)
    want_output = np.einsum("shgd,hde->shge", grouped, value_table[:, :-1]) + value_table[:, -1][None, :, None]
    want_output[1:] -= value_table[:, -1][None, :, None]
    assert relative(output.reshape(want_output.shape), want_output) < 3e-5


def test_a_shard_takes_a_prediction_only_when_its_heads_share_it(rng):
    mesh = types.SimpleNamespace(shape={"data": 1, "model": 2})
    config = predicted_config(rng, rows=(4, 0))
    with pytest.raises(ValueError, match="loop prediction fitted per kv head cannot be split over mesh axis"):
        sharding.local_config(config, mesh)
    shared = LoopPrediction.identity(HEADS, HEAD_DIM)
    loops = tuple(dataclasses.replace(loop, prediction=shared) if loop.prediction else loop for loop in config.loops)
    local = sharding.local_config(dataclasses.replace(config, loops=loops), mesh)
    assert local.loops[3].prediction == LoopPrediction.identity(1, HEAD_DIM)
    assert sharding.local_config(config, types.SimpleNamespace(shape={"data": 1, "model": 1})) == config


def test_fitting_recovers_an_exact_affine_map(rng):
    truth = random_prediction(rng)
    previous_keys, previous_values = rng.standard_normal((2, 200, HEADS, HEAD_DIM))
    keys, values = (np.asarray(x) for x in truth.apply(jnp.asarray(previous_keys, jnp.float32),
                                                       jnp.asarray(previous_values, jnp.float32)))
    fitted = fitting.fitted_prediction(previous_keys, previous_values, keys, values)
    for got, want in zip(fitted.tables(), truth.tables(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    with pytest.raises(ValueError, match="one shape"):
        fitting.fitted_prediction(previous_keys, previous_values, keys[:10], values)
    with pytest.raises(ValueError, match="head_dim \\+ 1 = 17 tokens after the 4 sink tokens, got 6"):
        fitting.fitted_prediction(*(x[:10] for x in (previous_keys, previous_values, keys, values)))
    with pytest.raises(ValueError, match="finite"):
        fitting.fitted_prediction(previous_keys * np.nan, previous_values, keys, values)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the public call's fused kernel runs on a GPU")
def test_public_call_reads_predicted_loops_on_the_gpu(rng):
    """On a GPU the default call (the Gluon kernel at head_dim 128, 64-token pages) reads loops predicted from a
    direct loop (CacheConfig.predicted_loops) as the reference does."""
    predictions = [[random_prediction(rng, 2, 128) for _ in range(2)] for _ in range(2)]
    config = jflashloop.CacheConfig.predicted_loops(
        predictions=predictions, num_layers=2, num_kv_heads=2, head_dim=128, num_pages=40, max_sequences=3,
        max_pages_per_sequence=12)
    cache, _ = build(rng, config, prompt_lengths=[600, 9, 200], steps=3)
    queries = jnp.asarray(rng.standard_normal((3, 8, 128)), jnp.float32)
    for loop in (1, 2, 3):
        expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=True)
        for implementation in (None, "gluon"):
            actual = jflashloop.decode_attention(queries, cache, 1, loop, include_pending=True,
                                                 implementation=implementation)
            error = np.linalg.norm(np.asarray(actual - expected), axis=-1) / np.linalg.norm(np.asarray(expected),
                                                                                           axis=-1)
            assert (error < 2e-3).all(), (loop, implementation, error.max())


def test_the_predicted_preset(rng):
    predictions = [[random_prediction(rng) for _ in range(2)] for _ in range(2)]
    config = jflashloop.CacheConfig.predicted_loops(predictions=predictions, num_layers=2, num_kv_heads=HEADS,
                                                    head_dim=HEAD_DIM, num_pages=8, max_sequences=1,
                                                    max_pages_per_sequence=8)
    assert config.num_loops == 4 and config.layer(1).loops[3].prediction == predictions[1][1]
    assert config.chain_starts() == (True, True, False, False)
    assert [storage.page_bytes(config.layer(layer)).loops[2:] for layer in range(2)] == [(0, 0)] * 2
    with pytest.raises(ValueError, match="one non-empty sequence of LoopPrediction per layer"):
        jflashloop.CacheConfig.predicted_loops(predictions=predictions[:1], num_layers=2, num_kv_heads=HEADS,
                                               head_dim=HEAD_DIM, num_pages=8, max_sequences=1,
                                               max_pages_per_sequence=8)


def test_shared_and_moved_pages_keep_their_predictions(rng):
    """fork and a page bundle carry a cache whose last loop stores nothing."""
    config = predicted_config(rng, rows=(4, 0))
    cache, _ = build(rng, config, prompt_lengths=[40], steps=1)
    forked = paged_cache.fork(cache, 0, 1)
    assert_bits_equal(paged_cache.reconstruct(forked, 0, 3, 1)[0], paged_cache.reconstruct(forked, 0, 3, 0)[0],
                      "forked")
    bundle = persistence.pages_from_bytes(persistence.pages_to_bytes(persistence.export_pages(cache, 0)))
    imported = persistence.import_pages(cache, 2, bundle)
    paged_cache.check(imported)
    assert_bits_equal(paged_cache.reconstruct(imported, 1, 3, 2)[0], paged_cache.reconstruct(imported, 1, 3, 0)[0],
                      "imported")


@pytest.mark.parametrize("kind", ["residual", "predicted", "direct"])
def test_fit_residual_codecs_fits_what_the_loop_stores(rng, kind):
    """Loop 2 is the reference its storage subtracts (the loop before as the cache decodes it, its prediction of
    it, or nothing for a direct loop) plus a residual whose one channel (per head) carries almost all its energy:
    the fitted keys give that channel the widest code and the fitted values their largest divisor there. The
    control (the same K/V, fitted as a plain residual) does not, so the test sees which residual was fitted."""
    doubling = LoopPrediction.from_arrays(*(np.stack([2 * np.eye(HEAD_DIM)] * HEADS), np.full((HEADS, HEAD_DIM), 0.5)) * 2)
    storage = {"residual": {}, "predicted": {"prediction": doubling}, "direct": {"direct": True}}[kind]
    base = small_config(num_pages=24, max_sequences=3, max_pages_per_sequence=8)
    config = dataclasses.replace(base, loops=(base.loops[0], dataclasses.replace(base.loops[1], **storage),
                                              *base.loops[2:]))
    loud = rng.integers(HEAD_DIM, size=HEADS)
    keys, values = (rng.standard_normal((3, 2, 4, 96, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    residual = 0.01 * rng.standard_normal((2, 3, 2, 96, HEADS, HEAD_DIM)).astype(np.float32)
    residual[..., np.arange(HEADS), loud] = rng.standard_normal((2, 3, 2, 96, HEADS))
    reference = {"residual": (keys[:, :, 0], values[:, :, 0]), "direct": (0, 0),
                 "predicted": tuple(np.asarray(x) for x in doubling.apply(keys[:, :, 0], values[:, :, 0]))}[kind]
    keys[:, :, 1], values[:, :, 1] = reference[0] + residual[0], reference[1] + residual[1]
    queries = rng.standard_normal((3, 2, 4, 8, HEADS, HEAD_DIM)).astype(np.float32)
    fitted = fitting.fit_residual_codecs(config, keys, values, queries, loop=1, mean_bits=4.0)
    control = fitting.fit_residual_codecs(base, keys, values, queries, loop=1, mean_bits=4.0)
    for layer in range(2):
        loop = fitted.layer(layer).loops[1]
        assert loop.key_spec.format == "int_mixed" and loop.value_spec.format == "int4_scaled"
        assert (loop.prediction, loop.direct) == (config.loops[1].prediction, config.loops[1].direct)
        assert fitted.layer(layer).loops[2:] == config.loops[2:] and fitted.layer(layer).loops[0] == config.loops[0]
        widths, scales = np.array(loop.key_spec.channel_bits), np.array(loop.value_spec.channel_scale)
        assert np.all(widths.sum(axis=1) == 4 * HEAD_DIM)
        assert np.all(widths[np.arange(HEADS), loud] == max(fitting.KEY_WIDTHS)), (widths, loud)
        assert np.all(np.argmax(scales, axis=1) == loud)
        if kind != "residual":
            wrong = np.array(control.layer(layer).loops[1].key_spec.channel_bits)
            assert np.any(wrong[np.arange(HEADS), loud] < max(fitting.KEY_WIDTHS)), wrong
    cache = paged_cache.prefill(paged_cache.create(fitted), 0, keys[0], values[0])  # the fitted codecs store pages
    paged_cache.check(cache)
    with pytest.raises(ValueError, match="loop must be a residual loop"):
        fitting.fit_residual_codecs(config, keys, values, queries, loop=0)
    with pytest.raises(ValueError, match="stores sparse rows"):
        fitting.fit_residual_codecs(config, keys, values, queries, loop=2)
    with pytest.raises(ValueError, match="queries must be"):
        fitting.fit_residual_codecs(config, keys, values, queries[:, :1], loop=1)


def test_fit_residual_codecs_of_some_layers_with_given_values(rng):
    """``layers`` fits only those layers (the others keep their storage); ``value_spec`` takes the values' codec
    as given and fits only the keys."""
    config = small_config(num_pages=24, max_sequences=3, max_pages_per_sequence=8)
    keys, values = (rng.standard_normal((3, 2, 4, 96, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    queries = rng.standard_normal((3, 2, 4, 8, HEADS, HEAD_DIM)).astype(np.float32)
    plain = jflashloop.CodecSpec("int4", "token", HEAD_DIM)
    fitted = fitting.fit_residual_codecs(config, keys, values, queries, loop=1, layers=[1], value_spec=plain)
    assert fitted.layer(0).loops == config.loops
    loop = fitted.layer(1).loops[1]
    assert loop.key_spec.format == "int_mixed" and loop.value_spec == plain
    assert fitted.layer(1).loops[1].key_spec == fitting.fit_residual_codecs(
        config, keys, values, queries, loop=1).layer(1).loops[1].key_spec
    with pytest.raises(ValueError, match=r"layers must be in \[0, 2\)"):
        fitting.fit_residual_codecs(config, keys, values, queries, loop=1, layers=[2])


def test_fit_predicted_loops_fits_each_loop_from_the_reconstruction_before_it(rng):
    """On K/V whose later loops are exact affine maps of the loop before, the fitted maps recover them and a
    predicted loop with no rows is then as close as its source's coding allows."""
    placeholder = LoopPrediction.identity(HEADS, HEAD_DIM)
    config = jflashloop.CacheConfig.predicted_loops(
        predictions=[[placeholder, placeholder]] * 2, num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        num_pages=8, max_sequences=1, max_pages_per_sequence=8, page_size=16, recent_tokens=16)
    truth = [[random_prediction(rng) for _ in range(2)] for _ in range(2)]
    keys, values = (rng.standard_normal((3, 2, 4, 96, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    for layer in range(2):
        for loop in (2, 3):
            mapped = truth[layer][loop - 2].apply(keys[:, layer, loop - 1], values[:, layer, loop - 1])
            keys[:, layer, loop], values[:, layer, loop] = (np.asarray(x) for x in mapped)
    fitted = fitting.fit_predicted_loops(config, keys, values)
    assert fitted.num_pages == config.num_pages and fitted.layer_loops is not None
    # loop 2 is fitted from loop 1's INT4 reconstruction (not its exact K/V), so the map is close, not exact
    for layer in range(2):
        got, want = fitted.layer(layer).loops[2].prediction.tables(), truth[layer][0].tables()
        for g, w in zip(got, want, strict=True):
            assert np.abs(g - w).max() < 0.1
    errors = {}
    for name, policy in (("fitted", fitted), ("placeholder", config)):
        cache = paged_cache.prefill(paged_cache.create(policy), 0, keys[0], values[0])
        served = page_positions(cache, 0)
        rebuilt = np.asarray(paged_cache.reconstruct(cache, 1, 3, 0)[0])[served]
        errors[name] = np.linalg.norm(rebuilt - keys[0, 1, 3][served]) / np.linalg.norm(keys[0, 1, 3][served])
    assert errors["fitted"] < 0.1 and errors["placeholder"] > 4 * errors["fitted"], errors
    with pytest.raises(ValueError, match="keys and values must be"):
        fitting.fit_predicted_loops(config, keys[:, :1], values[:, :1])
