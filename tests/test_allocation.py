"""Per-layer allocation under a bit budget and layer-policy files (``jflashloop.allocation``)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import jflashloop
from jflashloop import CodecSpec, allocation, int2_lloyd_max

INT4_G64 = allocation.Candidate("int4 g64", jflashloop.INT4_KEYS, jflashloop.INT4_VALUES)
INT4_G32 = allocation.Candidate("int4 g32", CodecSpec("int4", "channel", 32), CodecSpec("int4", "token", 32))
INT2 = allocation.Candidate("int2", int2_lloyd_max(64, 0), int2_lloyd_max(64, 1))
INT3_G32 = allocation.Candidate("int3 g32", CodecSpec("int3", "channel", 32), CodecSpec("int3", "token", 32))
INT3_G64 = allocation.Candidate("int3 g64", CodecSpec("int3", "channel", 64), CodecSpec("int3", "token", 64))


def brute_force(errors, costs, budget):
    """The smallest summed error over every assignment within the budget (costs rounded up as allocate does)."""
    layers, candidates = errors.shape
    units = np.ceil(costs * allocation.COST_RESOLUTION - 1e-9)
    best = np.inf
    for choice in itertools.product(range(candidates), repeat=layers):
        rows = np.arange(layers)
        if units[rows, choice].sum() <= budget * layers * allocation.COST_RESOLUTION + 1e-9:
            best = min(best, errors[rows, choice].sum())
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocate_finds_the_best_assignment_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    layers, candidates = 4, 4
    errors = rng.random((layers, candidates))
    costs = rng.integers(8, 50, size=(layers, candidates)) / 8 if seed % 2 else rng.integers(8, 50, candidates) / 8
    costs2d = np.broadcast_to(costs, errors.shape)
    for budget in np.linspace(costs2d.min(axis=1).mean(), costs2d.max(axis=1).mean(), 5):
        choice = allocation.allocate(errors, costs, budget)
        rows = np.arange(layers)
        assert costs2d[rows, choice].mean() <= budget + 1e-12
        assert errors[rows, choice].sum() == pytest.approx(brute_force(errors, costs2d, budget))


def test_allocate_prefers_the_cheaper_total_and_the_lower_index_on_ties():
    errors = np.array([[1.0, 1.0, 2.0], [0.5, 0.5, 0.5]])
    costs = np.array([4.0, 3.0, 2.0])
    assert allocation.allocate(errors, costs, 4.0).tolist() == [1, 2]


def test_allocate_never_exceeds_the_budget_through_rounding():
    errors = np.array([[0.0, 1.0]] * 3)
    costs = np.array([1 + 1e-6, 0.5])  # rounds up to 1 + 1/COST_RESOLUTION: three of it exceed 3 x 1.0
    choice = allocation.allocate(errors, costs, 1.0)
    assert costs[choice].mean() <= 1.0
    assert sorted(choice.tolist()) == [0, 0, 1]  # two at the rounded-up cost fit with one cheap one


@pytest.mark.parametrize("errors, costs, budget, message", [
    (np.ones((2, 3)), np.ones(3), 0.5, "below the cheapest"),
    (np.ones(3), np.ones(3), 2.0, "layers, candidates"),
    (np.ones((2, 3)), np.ones(4), 2.0, "costs must be"),
    (np.array([[1.0, np.nan]]), np.ones(2), 2.0, "finite"),
    (np.ones((1, 2)), np.array([1.0, -1.0]), 2.0, "non-negative"),
    (np.ones((1, 2)), np.ones(2), float("inf"), "budget must be finite"),
])
def test_allocate_rejects_bad_input(errors, costs, budget, message):
    with pytest.raises(ValueError, match=message):
        allocation.allocate(errors, costs, budget)


def test_candidate_bits_counts_full_pages_and_the_windows():
    # INT4 G64 K and V: 4.5 bits per element in full pages; the 4 sink and 64 ring slots (16 recent
    # tokens, 64-token pages) in bfloat16 are a fixed cost per sequence.
    bits = allocation.candidate_bits(INT4_G64, num_kv_heads=3, head_dim=64, context_tokens=4096)
    assert bits == pytest.approx(4.5 + (4 + 64) * 16 / 4096)
    assert allocation.candidate_bits(INT2, num_kv_heads=3, head_dim=64, context_tokens=4096) == pytest.approx(
        2.25 + (4 + 64) * 16 / 4096)
    with pytest.raises(ValueError, match="context_tokens"):
        allocation.candidate_bits(INT4_G64, num_kv_heads=3, head_dim=64, context_tokens=0)


def test_candidate_bits_price_int3_exactly():
    # INT3: 3-bit codes plus a float16 min and scale per group; same windows as INT4.
    for candidate, page_bits in ((INT3_G64, 3 + 32 / 64), (INT3_G32, 3 + 32 / 32)):
        bits = allocation.candidate_bits(candidate, num_kv_heads=3, head_dim=64, context_tokens=4096)
        assert bits == pytest.approx(page_bits + (4 + 64) * 16 / 4096)
    with pytest.raises(ValueError, match="divisible by 32"):
        allocation.candidate_bits(INT3_G64, num_kv_heads=3, head_dim=48, context_tokens=4096)


def test_an_int3_policy_file_round_trips_and_makes_its_cache(tmp_path):
    policy = allocation.policy_for("with int3", [INT4_G64, INT3_G32, INT3_G64], [1, 0, 2])
    path = tmp_path / "policy.json"
    allocation.save_policy(path, policy)
    assert json.loads(path.read_text())["layers"][0]["keys"] == {
        "format": "int3", "axis": "channel", "group_size": 32, "rotation_seed": None}
    loaded = allocation.load_policy(path)
    assert loaded == policy
    config = loaded.cache_config(num_layers=3, num_kv_heads=2, head_dim=64, max_tokens=256)
    assert [config.layer(i).loops[0].value_spec for i in range(3)] == [INT3_G32.value_spec, INT4_G64.value_spec,
                                                                         INT3_G64.value_spec]
    with pytest.raises(ValueError, match="int3 pages need head_dim divisible by 32"):
        loaded.cache_config(num_layers=3, num_kv_heads=2, head_dim=48, max_tokens=256)


def test_a_policy_file_round_trips_and_makes_its_cache(tmp_path):
    policy = allocation.policy_for("mixed", [INT4_G64, INT4_G32, INT2], [0, 2, 1], recent_tokens=64)
    path = tmp_path / "policy.json"
    allocation.save_policy(path, policy, {"budget": 4.5})
    document = json.loads(path.read_text())
    assert document["format"] == allocation.POLICY_FORMAT and document["version"] == allocation.POLICY_VERSION
    assert document["metadata"] == {"budget": 4.5}
    loaded = allocation.load_policy(path)
    assert loaded == policy
    config = loaded.cache_config(num_layers=3, num_kv_heads=2, head_dim=64, max_tokens=256)
    assert [config.layer(i).loops[0].key_spec for i in range(3)] == [INT4_G64.key_spec, INT2.key_spec,
                                                                       INT4_G32.key_spec]
    assert config.recent_tokens == 64
    cache = jflashloop.paged_cache.create(config)
    assert len(cache.layers) == 3


def _document():
    policy = allocation.policy_for("mixed", [INT4_G64, INT2], [0, 1])
    return allocation.policy_to_json(policy)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="something else"), "not a jflashloop layer policy"),
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.update(layers=[]), "non-empty list"),
    (lambda d: d.update(sink_tokens=-1), "sink_tokens must be a non-negative integer"),
    (lambda d: d.update(page_size="64"), "page_size must be a non-negative integer"),
    (lambda d: d.update(name=3), "name must be a string"),
    (lambda d: d["layers"][1].pop("values"), r"layers\[1\] must be an object"),
    (lambda d: d["layers"][0]["keys"].update(bits=4), r"layers\[0\].keys has unknown fields"),
    (lambda d: d["layers"][0]["values"].update(group_size=0), r"layers\[0\].values is not a valid CodecSpec"),
    (lambda d: d["layers"][0]["values"].update(format="int5"), r"layers\[0\].values is not a valid CodecSpec"),
    (lambda d: d["layers"][0].update(keys=[1, 2]), r"layers\[0\].keys must be an object"),
    (lambda d: d.update(metadata=[1]), "metadata must be an object"),
])
def test_a_bad_policy_document_is_refused_with_its_reason(change, message):
    document = _document()
    change(document)
    with pytest.raises(ValueError, match=message):
        allocation.policy_from_json(document)


def test_files_that_are_not_policies_are_refused(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        allocation.load_policy(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        allocation.load_policy(path)
    with pytest.raises(ValueError, match="no layer_specs"):
        allocation.policy_to_json(jflashloop.Policy("uniform"))
