"""``jflashloop loops --allocate``: a looped model's two dense loops chosen per layer (jflashloop.apps.loops.allocation)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from jflashloop import CodecSpec, int3_lloyd_max
from jflashloop.apps.loops import allocation, policies
from jflashloop.models import ouro


def synthetic(rng, layers=3) -> allocation.Sensitivity:
    residuals = len(allocation.residual_entries())
    return allocation.Sensitivity(
        base_errors=rng.uniform(0.02, 0.08, (layers, len(allocation.BASES))),
        residual_errors=rng.uniform(0.02, 0.08, (layers, residuals)),
        base_bits=np.array([4.5, 4.25, 4.0]),
        residual_bits=rng.choice([3.5, 3.75, 4.0, 4.25, 4.5, 5.0, 5.5], residuals),
        flashloop=(0.045, 0.046), elements=2 * 4 * 64)


@pytest.mark.parametrize("bytes_per_token, weight", [(1550, 1.0), (1650, 0.5), (1800, 2.0), (2000, 1.0)])
def test_a_weighted_choice_is_the_least_weighted_error_within_the_budget(bytes_per_token, weight):
    """Against every per-layer assignment of (base, residual) pairs: none within the budget has a smaller sum of
    ``weight x`` loop-1 errors over FlashLoop's plus loop-2 errors over FlashLoop's."""
    found = synthetic(np.random.default_rng(bytes_per_token))
    layers = found.base_errors.shape[0]
    residuals = allocation.residual_entries()
    pairs = list(itertools.product(range(len(allocation.BASES)), range(len(residuals))))

    def score(choice):
        return sum(weight * found.base_errors[layer, b] / 0.045 + found.residual_errors[layer, r] / 0.046
                   for layer, (b, r) in enumerate(choice))

    def cost(choice):  # full-page bytes a token over the layers
        return sum(found.base_bits[b] + found.residual_bits[r] for b, r in choice) * found.elements / 8

    feasible = [choice for choice in itertools.product(pairs, repeat=layers) if cost(choice) <= bytes_per_token]
    bases, chosen = allocation.pairs_entries(allocation.weighted_choice(found, bytes_per_token, weight))
    choice = [(allocation.BASES.index(b), residuals.index(r)) for b, r in zip(bases, chosen, strict=True)]
    assert cost(choice) <= bytes_per_token
    assert score(choice) <= min(score(c) for c in feasible) + 1e-9
    first, second = allocation.calibration_errors(found, bases, chosen)
    assert first == pytest.approx(np.mean([found.base_errors[layer, b] for layer, (b, _) in enumerate(choice)]))
    assert second == pytest.approx(np.mean([found.residual_errors[layer, r] for layer, (_, r) in enumerate(choice)]))


def test_the_choice_brings_the_larger_loop_error_lowest_among_the_weights():
    """``choose`` is the weighted choice, among every weight tried, whose larger loop error over FlashLoop's is
    least (on errors where some weights lead to a worse one)."""
    found, budget = synthetic(np.random.default_rng(1)), 1650

    def larger(bases, residuals):
        first, second = allocation.calibration_errors(found, bases, residuals)
        return max(first / 0.045, second / 0.046)

    chosen = allocation.choose(found, budget)
    tried = [allocation.pairs_entries(allocation.weighted_choice(found, budget, w)) for w in allocation.WEIGHTS]
    assert larger(*chosen) == min(larger(*t) for t in tried)
    assert max(larger(*t) for t in tried) > larger(*chosen) + 0.05  # the weights lead elsewhere


def test_a_budget_below_the_cheapest_pairs_is_refused():
    found = synthetic(np.random.default_rng(0))
    cheapest = 3 * (found.base_bits.min() + found.residual_bits.min()) * found.elements / 8
    allocation.choose(found, cheapest)
    with pytest.raises(ValueError, match="below the cheapest assignment"):
        allocation.choose(found, cheapest - 8)
    with pytest.raises(ValueError, match="below the cheapest assignment"):
        allocation.weighted_choice(found, cheapest - 8)


def test_the_choice_as_fitted_loops_arguments():
    bases = ("fit", "fit3", "fit3.5")
    residuals = ("pred fit", "pred fit3/int3", "pred fit4.5/int4", "pred fit3.5/int3lm")
    assert allocation.fitted_loops_arguments((*bases, "fit"), residuals, 64) == dict(
        base_bits=(4.0, 3.0, 3.5, 4.0), loop_bits=(4.0, 3.0, 4.5, 3.5),
        loop_values=(None, CodecSpec("int3", "token", 64), CodecSpec("int4", "token", 64), int3_lloyd_max(64, 0)))
    assert all(entry in allocation.residual_entries() for entry in residuals)


def test_sensitivity_and_the_chosen_policy_on_a_small_model(monkeypatch):
    """Per-layer calibration errors of every candidate (two bases and two residuals here), and a chosen policy that
    builds its cache: the budget of the cheapest pairs takes the narrowest codecs in every layer."""
    monkeypatch.setattr(allocation, "BASES", ("fit", "fit3"))
    monkeypatch.setattr(allocation, "RESIDUAL_KEYS", ("fit3",))
    monkeypatch.setattr(allocation, "RESIDUAL_VALUES", ("fit", "int3"))
    model = dataclasses.replace(ouro.OuroConfig.tiny(), layers=1, kv_heads=2)
    params = ouro.init_params(model, jax.random.PRNGKey(0))
    held_out = np.random.default_rng(0).integers(0, model.vocab_size, 4000).astype(np.uint8)
    settings = policies.SweepSettings(tokens=140, prompt_tokens=128, sequences=2, seeds=(0,), query_positions=4)
    messages = []
    found = allocation.sensitivity(params, model, held_out, settings, log=messages.append)
    assert found.base_errors.shape == (1, 2) and found.residual_errors.shape == (1, 2) and len(messages) == 2 + 2 + 1
    assert np.all(found.base_errors > 0) and np.all(found.residual_errors > 0) and min(found.flashloop) > 0
    assert np.all(found.base_errors[:, 1] > found.base_errors[:, 0])  # 3-bit keys lose more than 4-bit ones
    np.testing.assert_array_equal(found.base_bits, [4.5, 4.0])  # mean key width + 0.5, int4_scaled values
    np.testing.assert_array_equal(found.residual_bits, [4.0, 3.5])
    assert found.elements == 2 * 2 * 64
    cheapest = (4.0 + 3.5) * found.elements / 8
    policy = allocation.chosen_policy(model, found, cheapest)
    assert policy == (("fit3",), ("pred fit3/int3",), "pred", "pred")
    fitted = policies.fitted_specs(params, model, held_out, [policy], settings)
    predicted = policies.fitted_predicted_loops(params, model, held_out, policy, settings, fitted)
    config = policies.policy_config(policy, model, 1, 64, fitted=fitted, predicted=predicted)
    assert policies.bytes_per_token(config)[0] == cheapest


def test_the_printed_arguments_are_python():
    """The command prints each per-layer argument as ``fitting.fitted_loops`` takes it."""
    from jflashloop.apps.loops import cli

    arguments = allocation.fitted_loops_arguments(("fit", "fit3", "fit"), ("pred fit", "pred fit3/int3",
                                                                          "pred fit3/int3lm"), 64)
    printed = {key: cli._short(value) for key, value in arguments.items()}
    assert printed == {"base_bits": "(4.0, 3.0, 4.0)", "loop_bits": "(4.0, 3.0, 3.0)",
                       "loop_values": '(None, CodecSpec("int3", "token", 64), '
                                      'CodecSpec("int3_lloyd_max", "token", 64, rotation_seed=0))'}
    assert eval(printed["loop_values"], {"CodecSpec": CodecSpec}) == arguments["loop_values"]
