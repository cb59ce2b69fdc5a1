"""The cross-loop policy sweep (``jflashloop loops --policies``): configs, bytes, the front, a small run."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import jax
import numpy as np
import pytest

from jflashloop import (
    INT4_KEYS,
    INT4_VALUES,
    NVFP4,
    CacheConfig,
    CodecSpec,
    LoopPrediction,
    LoopStorage,
    int2_lloyd_max,
)
from jflashloop.apps import loops
from jflashloop.apps.loops import policies
from jflashloop.models import ouro

TINY = ouro.OuroConfig.tiny()
SMALL = dataclasses.replace(TINY, layers=1, kv_heads=2)


def test_the_flashloop_entry_is_the_flashloop_preset():
    config = policies.policy_config(policies.FLASHLOOP, TINY, sequences=2, max_tokens=512)
    assert config == loops.cross_loop_cache_config(TINY, 2, 512)


def test_the_compact_entry_is_the_compact_preset():
    config = policies.policy_config(policies.COMPACT_LOOPS, TINY, sequences=2, max_tokens=512)
    preset = CacheConfig.compact_loops(
        num_layers=TINY.layers, num_kv_heads=TINY.kv_heads, head_dim=TINY.head_dim, num_pages=config.num_pages,
        max_sequences=2, max_pages_per_sequence=config.max_pages_per_sequence, recent_tokens=config.recent_tokens)
    assert preset == config
    assert policies.bytes_per_token(config)[0] == 2652.5
    with pytest.raises(ValueError, match="needs num_loops >= 2"):
        CacheConfig.compact_loops(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=1, max_sequences=1,
                                  max_pages_per_sequence=1, num_loops=1)


def test_loop_storage_reads_each_kind_of_entry():
    int2 = int2_lloyd_max(64, 0)
    assert policies.loop_storage("int4", 64) == LoopStorage(INT4_KEYS, INT4_VALUES)
    assert policies.loop_storage("int2", 64) == LoopStorage(int2, int2)
    assert policies.loop_storage("int4/int2", 64) == LoopStorage(INT4_KEYS, int2)
    assert policies.loop_storage("int4 16", 64) == LoopStorage(INT4_VALUES, INT4_VALUES, 16)
    assert policies.loop_storage("nvfp4 7", 64) == LoopStorage(NVFP4, NVFP4, 7)
    int3_keys, int3_values = CodecSpec("int3", "channel", 64), CodecSpec("int3", "token", 64)
    assert policies.loop_storage("int3", 64) == LoopStorage(int3_keys, int3_values)
    assert policies.loop_storage("int3 16", 64) == LoopStorage(int3_values, int3_values, 16)
    affine_int2 = CodecSpec("int2", "token", 64)
    assert policies.loop_storage("int2a 24", 64) == LoopStorage(affine_int2, affine_int2, 24)
    assert policies.loop_storage("int2a", 64) == LoopStorage(CodecSpec("int2", "channel", 64), affine_int2)
    with pytest.raises(ValueError, match="unknown residual codec"):
        policies.loop_storage("int5", 64)
    assert policies.loop_storage("direct int4", 64) == LoopStorage(INT4_KEYS, INT4_VALUES, direct=True)
    with pytest.raises(ValueError, match="a direct loop is dense"):
        policies.loop_storage("direct int4 16", 64)


def test_direct_loops_in_some_layers():
    """'direct int4 @1-2' stores loop 2 on its own in layers 1-2 and as a residual in the others."""
    config = policies.policy_config(policies.POLICIES["flashloop, direct loop 2 in layers 1-2"], TINY, 2, 512)
    assert [config.layer(layer).loops[1].direct for layer in range(TINY.layers)] == [True, True, False, False]
    assert [config.layer(layer).chain_start(3) for layer in range(TINY.layers)] == [1, 1, 0, 0]
    uniform = policies.policy_config(("int4", "direct int4 @1-4", "int4 16", "int4 7"), TINY, 2, 512)
    assert uniform.layer_loops is None and uniform.loops[1].direct
    assert policies.bytes_per_token(config) == policies.bytes_per_token(
        policies.policy_config(policies.FLASHLOOP, TINY, 2, 512))
    with pytest.raises(ValueError, match="a per-layer entry"):
        policies.policy_config(("int4", "int4 @1-2"), TINY, 2, 512)


def test_bytes_per_token_of_the_flashloop_policy():
    per_token, ratio = policies.bytes_per_token(policies.policy_config(policies.FLASHLOOP, TINY, 1, 64))
    assert per_token == 2723.75
    assert ratio == Fraction(65536, 10895)


def placeholder_fitted(policy) -> dict:
    """Fitted codecs of the right shapes for ``policy``'s fitted loops (widths alternating about the mean, unit
    divisors), as :func:`policies.fitted_specs` returns them."""
    fitted = {}
    for loop, entry in ((loop, text) for loop, entries in enumerate(policy)
                        for text in ((entries,) if isinstance(entries, str) else entries)):
        codec = entry.removeprefix("direct ")
        if codec in policies.FITTED_CODECS:
            mean = policies.FITTED_CODECS[codec]
            row = [int(mean + 0.5), int(mean)] * (TINY.head_dim // 2)
            keys = CodecSpec("int_mixed", "channel", 64, channel_bits=[row] * TINY.kv_heads)
            values = CodecSpec("int4_scaled", "token", 64, channel_scale=[[1.0] * TINY.head_dim] * TINY.kv_heads)
            fitted[(codec, loop)] = [(keys, values)] * TINY.layers
    return fitted


def placeholder_predicted(policy, model=TINY) -> dict:
    """Identity predictions for ``policy``'s predicted loops, as :func:`policies.fitted_predicted_loops` returns them."""
    identity = LoopPrediction.identity(model.kv_heads, model.head_dim)
    return {loop: [policies.loop_storage(entry if isinstance(entry, str) else entry[layer], model.head_dim,
                                         prediction=identity) for layer in range(model.layers)]
            for loop, entry in enumerate(policy) if policies._predicted(entry)}


@pytest.mark.parametrize("name", sorted(policies.POLICIES))
def test_every_policy_makes_a_valid_cache(name):
    policy = policies.POLICIES[name]
    config = policies.policy_config(policy, TINY, 1, 64, fitted=placeholder_fitted(policy),
                                    predicted=placeholder_predicted(policy))
    per_token, ratio = policies.bytes_per_token(config)
    assert config.num_loops == TINY.loops and not config.loops[0].is_sparse
    assert float(ratio) == pytest.approx(16384 / per_token, rel=1e-12)


def test_pareto_front():
    points = [(1.0, 3.0), (2.0, 2.0), (2.0, 2.5), (3.0, 2.0), (4.0, 1.0), (1.0, 3.0)]
    assert policies.pareto_front(points) == [True, True, False, False, True, True]


def test_a_small_sweep():
    params = ouro.init_params(SMALL, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4000).astype(np.uint8)
    # 140 tokens for 2 sequences: the caches of tests/apps/test_loops.py's comparison (136 tokens + 4 generated),
    # so one of the sweep's decode steps is a program that module compiles (the run's on-disk cache).
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,),
                                      query_positions=4)
    chosen = {"flashloop": policies.FLASHLOOP, "int2 base": policies.POLICIES["int2 base"]}
    results = policies.sweep(params, SMALL, held_out, settings, chosen, log=lambda message: None)
    flashloop, int2_base = results["policies"]["flashloop"], results["policies"]["int2 base"]
    assert flashloop["kl"].shape == (1, 2) and flashloop["attention"].shape == (1, SMALL.loops)
    assert np.all(flashloop["kl"] >= 0) and np.all(np.isfinite(int2_base["kl"]))
    # Loop 1 reads the base alone: the INT2 base serves it worse than the INT4 one.
    assert int2_base["attention"][0, 0] > flashloop["attention"][0, 0]
    table = policies.format_table(results)
    assert table.count("\n") == 4 and "| 2/2 |" in table
    assert f"{flashloop['bytes_per_token']:,.1f}" in table


def test_fitted_codecs_are_fitted_to_each_loop_that_stores_them():
    params = ouro.init_params(SMALL, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4)
    policy = ("fit", "direct fit3.5", "int2a 16", "int2a 4")
    fitted = policies.fitted_specs(params, SMALL, held_out, [policy, policies.FLASHLOOP], settings)
    assert set(fitted) == {("fit", 0), ("fit3.5", 1)} and len(fitted[("fit", 0)]) == SMALL.layers
    keys, values = fitted[("fit", 0)][0]
    assert keys.format == "int_mixed" and keys.row_bits == 4 * SMALL.head_dim and values.format == "int4_scaled"
    assert fitted[("fit3.5", 1)][0][0].row_bits == 224
    config = policies.policy_config(policy, SMALL, 2, 512, fitted=fitted)
    assert config.loops[0] == LoopStorage(keys, values) and config.loops[1].direct
    assert config.loops[1].key_spec == fitted[("fit3.5", 1)][0][0]
    assert policies.bytes_per_token(config)[0] < policies.bytes_per_token(
        policies.policy_config(("int4", "direct int4", "int2a 16", "int2a 4"), SMALL, 2, 512))[0]
    with pytest.raises(ValueError, match="a fitted codec stores a loop on its own"):
        policies.fitted_specs(params, SMALL, held_out, [("int4", "fit", "int4 16", "int4 7")], settings)
    with pytest.raises(ValueError, match="fitted codecs are dense"):
        policies.fitted_specs(params, SMALL, held_out, [("int4", "int4", "fit 16", "int4 7")], settings)
    with pytest.raises(ValueError, match="needs codecs fitted to it"):
        policies.loop_storage("fit", 64)


def test_fits_take_the_calibration_windows(monkeypatch):
    """The fitted codecs and the predicted loops' maps are fitted on ``calibration_sequences`` windows of the
    calibration seed (the measured batches keep ``sequences``); a count below 1 is refused."""
    params = ouro.init_params(SMALL, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4,
                                      calibration_sequences=3)
    assert settings.calibration().sequences == 3 and settings.calibration().calibration_sequences is None
    assert policies.SweepSettings(sequences=5).calibration().sequences == 5
    drawn = []
    windows = policies.held_out_windows
    monkeypatch.setattr(policies, "held_out_windows",
                        lambda text, count, tokens, seed: drawn.append((count, seed)) or windows(text, count, tokens,
                                                                                                  seed))
    policy = ("fit", "pred", "int2a 16", "int2a 4")
    fitted = policies.fitted_specs(params, SMALL, held_out, [policy], settings)
    predicted = policies.fitted_predicted_loops(params, SMALL, held_out, policy, settings, fitted)
    assert drawn == [(3, policies.CALIBRATION_SEED)] * 2 and sorted(predicted) == [1]
    with pytest.raises(ValueError, match="calibration_sequences must be at least 1"):
        policies.SweepSettings(calibration_sequences=0)
    from jflashloop.apps.loops import cli

    assert cli.parse_arguments(["--policies", "--calibration-sequences", "24"]).calibration_sequences == 24
    assert cli.parse_arguments(["--policies"]).calibration_sequences is None


def test_predicted_loops_are_fitted_in_order_from_the_reconstruction_before_them():
    identity = LoopPrediction.identity(2, 64)
    assert policies.loop_storage("pred", 64, prediction=identity) == LoopStorage(INT4_VALUES, INT4_VALUES, 0,
                                                                              prediction=identity)
    affine_int2 = CodecSpec("int2", "token", 64)
    assert policies.loop_storage("pred int2a 8", 64, prediction=identity) == LoopStorage(
        affine_int2, affine_int2, 8, prediction=identity)
    with pytest.raises(ValueError, match="needs a prediction fitted to it"):
        policies.loop_storage("pred", 64)
    assert policies.loop_storage("pred int4", 64, prediction=identity) == LoopStorage(INT4_KEYS, INT4_VALUES,
                                                                                   prediction=identity)
    with pytest.raises(ValueError, match="a predicted loop is a residual against its prediction"):
        policies.loop_storage("pred direct int4", 64, prediction=identity)
    assert policies.loop_storage("pred fit3.5", 64, prediction=identity) == LoopStorage(INT4_KEYS, INT4_VALUES,
                                                                                     prediction=identity)
    assert policies.loop_storage("pred fit3/int3", 64, prediction=identity) == LoopStorage(
        INT4_KEYS, CodecSpec("int3", "token", 64), prediction=identity)
    with pytest.raises(ValueError, match="predicted in every layer or in none"):
        policies.policy_config(("int4", ("pred",) + ("int4",) * (TINY.layers - 1)), TINY, 1, 64)
    with pytest.raises(ValueError, match=r"one entry per layer \(1\)"):
        policies.policy_config(("int4", ("int4", "int4")), SMALL, 1, 64)
    assert policies.describe_policy(("int4", ("fit", "fit3"))) == "int4 · [fit, fit3]"
    params = ouro.init_params(SMALL, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4)
    policy = ("int4", "direct int4", "pred int2a 8", "pred")
    predicted = policies.fitted_predicted_loops(params, SMALL, held_out, policy, settings)
    assert sorted(predicted) == [2, 3] and len(predicted[2]) == SMALL.layers
    assert predicted[2][0].sparse_rows_per_page == 8 and predicted[3][0].sparse_rows_per_page == 0
    assert all(s.prediction.num_kv_heads == SMALL.kv_heads and not s.prediction.same_for_every_head
               for s in predicted[3])
    assert policies.fitted_predicted_loops(params, SMALL, held_out, policies.FLASHLOOP, settings) == {}
    config = policies.policy_config(policy, SMALL, 2, 140, predicted=predicted)
    assert config.loops[3] == predicted[3][0] and config.loops[2] == predicted[2][0]
    with pytest.raises(ValueError, match=r"loops \[2\] are not predicted"):
        policies.policy_config(policy, SMALL, 2, 140, predicted={1: predicted[2]})
    with pytest.raises(ValueError, match="needs a prediction fitted to it"):
        policies.policy_config(policy, SMALL, 2, 140, predicted={3: predicted[3]})


def test_a_predicted_loops_residual_codecs_are_fitted_to_it_and_the_loops_after_refitted():
    params = ouro.init_params(SMALL, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4)
    fitted = policies.fitted_predicted_loops(params, SMALL, held_out, ("int4", "pred fit3.5", "int4 7", "pred"),
                                             settings)
    plain = policies.fitted_predicted_loops(params, SMALL, held_out, ("int4", "pred int4", "int4 7", "pred"),
                                            settings)
    loop = fitted[1][0]
    assert loop.key_spec.format == "int_mixed" and loop.value_spec.format == "int4_scaled" and not loop.is_sparse
    int3 = policies.fitted_predicted_loops(params, SMALL, held_out, ("int4", "pred fit3/int3", "int4 7", "pred"),
                                           settings)[1][0]
    assert int3.key_spec.format == "int_mixed" and int3.value_spec == CodecSpec("int3", "token", 64)
    assert int3.key_spec.bits_per_element() == 3.5
    assert loop.key_spec.bits_per_element() == 4.0  # a mean of 3.5 bits and INT4's per-group metadata
    assert loop.prediction == plain[1][0].prediction  # loop 2's map predicts from loop 1, whatever loop 2 stores
    assert fitted[3][0].prediction != plain[3][0].prediction  # loop 4's is refitted to the fitted loop 2's chain


PER_LAYER_FITTED = (("fit", "fit3"), ("pred fit", "pred fit3/int3"), "pred", "pred")
"""A per-layer sweep policy of two layers (the shape of the 7.88x choice): widths 4 and 3 bits for the base, for
loop 2's residual 4 bits with fitted values and 3 bits with INT3 values."""


@pytest.mark.parametrize("policy, per_layer", [
    (("fit3.5", "pred fit3.5", "pred", "pred"), {}),
    (PER_LAYER_FITTED, dict(base_bits=(4, 3.0), loop_bits=[4.0, 3], loop_values=(None, CodecSpec("int3", "token", 64)))),
])
def test_the_fitted_loops_preset_is_the_sweeps_fitted_policy(policy, per_layer):
    """``fitting.fitted_loops`` on the calibration windows makes exactly the cache of the sweep's policy (the fitted
    base, loop 2's map and residual codecs, then loops 3-4's maps): ``fit3.5 · pred fit3.5 · pred · pred`` with one
    width for all layers, and a per-layer policy with widths and value codecs chosen per layer."""
    from jflashloop import fitting
    from jflashloop.apps.loops.runner import (
        RECENT_TOKENS,
        _forward,
        held_out_windows,
        model_queries,
    )

    model = SMALL if not per_layer else dataclasses.replace(SMALL, layers=2)
    params = ouro.init_params(model, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, model.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4)
    fitted = policies.fitted_specs(params, model, held_out, [policy], settings)
    predicted = policies.fitted_predicted_loops(params, model, held_out, policy, settings, fitted)
    swept = policies.policy_config(policy, model, 2, 140, fitted=fitted, predicted=predicted)
    token_ids = jax.numpy.asarray(held_out_windows(held_out, 2, 140, policies.CALIBRATION_SEED))
    _, keys, values, _ = _forward(params, model, token_ids)
    queries = model_queries(params, model, token_ids, 32)
    preset = fitting.fitted_loops(*(np.asarray(x).transpose(2, 1, 0, 3, 4, 5) for x in (keys, values, queries)),
                                  num_pages=swept.num_pages, max_sequences=2,
                                  max_pages_per_sequence=swept.max_pages_per_sequence, recent_tokens=RECENT_TOKENS,
                                  **per_layer)
    assert preset == swept
    if per_layer:  # the layers differ as chosen
        first, second = (preset.layer(layer).loops for layer in (0, 1))
        assert first[0].key_spec.bits_per_element() == 4.5 and second[0].key_spec.bits_per_element() == 3.5
        assert first[1].value_spec.format == "int4_scaled" and second[1].value_spec == CodecSpec("int3", "token", 64)
        with pytest.raises(ValueError, match="one per layer"):
            fitting.fitted_loops(*(np.asarray(x).transpose(2, 1, 0, 3, 4, 5) for x in (keys, values, queries)),
                                 num_pages=4, max_sequences=1, max_pages_per_sequence=4, base_bits=(4, 3, 3))
        return
    loops_ = preset.layer(0).loops
    assert [loop.key_spec.format for loop in loops_[:2]] == ["int_mixed"] * 2
    assert [loop.prediction is not None for loop in loops_] == [False, True, True, True]
    assert loops_[2].sparse_rows_per_page == 0 == loops_[3].sparse_rows_per_page
    with pytest.raises(ValueError, match="loops >= 2"):
        fitting.fitted_loops(*(np.asarray(x).transpose(2, 1, 0, 3, 4, 5)[:, :, :1] for x in (keys, values, queries)),
                             num_pages=4, max_sequences=1, max_pages_per_sequence=4)
