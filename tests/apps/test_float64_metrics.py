"""The float64 measures shared by the quality measurements and the loops report."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jflashloop.apps.float64_metrics import (
    causal_attention_float64,
    kl_divergence,
    log_softmax,
    negative_log_likelihoods,
    next_token_agreement,
    relative_error,
)


def test_causal_attention_float64(rng):
    queries = rng.standard_normal((1, 2, 4, 8))
    keys, values = rng.standard_normal((2, 1, 5, 2, 8))
    out = causal_attention_float64(queries, keys, values, np.array([0, 3]))
    assert out.shape == (1, 2, 4, 8) and out.dtype == np.float64
    np.testing.assert_allclose(out[0, 0], values[0, 0][[0, 0, 1, 1]], rtol=1e-12)  # only t = 0
    scores = np.einsum("hd,thd->ht", queries[0, 1], np.repeat(keys[0, :4], 2, axis=1))
    scores /= math.sqrt(8)
    weights = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(out[0, 1], np.einsum("ht,thd->hd", weights,
                                                    np.repeat(values[0, :4], 2, axis=1)))


def test_causal_attention_float64_without_a_batch_axis(rng):
    queries = rng.standard_normal((2, 4, 8))
    keys, values = rng.standard_normal((2, 5, 2, 8))
    out = causal_attention_float64(queries, keys, values, np.array([0, 3]))
    batched = causal_attention_float64(queries[None], keys[None], values[None], np.array([0, 3]))
    assert out.shape == (2, 4, 8)
    np.testing.assert_array_equal(out, batched[0])


def test_relative_error(rng):
    exact = rng.standard_normal((3, 4, 5))
    estimate = exact + 1e-3 * rng.standard_normal((3, 4, 5))
    total = relative_error(estimate, exact)
    assert total == pytest.approx(np.linalg.norm(estimate - exact) / np.linalg.norm(exact), rel=1e-15)
    per_row = relative_error(estimate, exact, axis=(0, 2))
    assert per_row.shape == (4,)
    np.testing.assert_allclose(
        per_row, np.linalg.norm(estimate - exact, axis=(0, 2)) / np.linalg.norm(exact, axis=(0, 2)))
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0


def test_logit_measures(rng):
    logits = rng.standard_normal((6, 3, 10))
    np.testing.assert_allclose(np.exp(log_softmax(logits)).sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(kl_divergence(logits, logits), 0.0, atol=1e-12)
    shifted = logits + 5.0  # the same distributions
    np.testing.assert_allclose(kl_divergence(logits, shifted), 0.0, atol=1e-12)
    other = logits + rng.standard_normal(logits.shape)
    assert kl_divergence(logits, other).shape == (6, 3) and (kl_divergence(logits, other) > 0).all()
    assert next_token_agreement(logits, shifted) == 1.0
    flipped = logits.copy()
    flipped[0, 0] = -flipped[0, 0]
    assert next_token_agreement(logits, flipped) == pytest.approx(17 / 18)
    targets = rng.integers(0, 10, (6, 3))
    nll = negative_log_likelihoods(logits, targets)
    expected = [[-log_softmax(logits[i, j])[targets[i, j]] for j in range(3)] for i in range(6)]
    np.testing.assert_allclose(nll, expected, rtol=1e-12)
    flat = negative_log_likelihoods(logits[:, 0], list(targets[:, 0]))
    np.testing.assert_array_equal(flat, nll[:, 0])
    assert math.isclose(float(nll.mean()), -float(np.mean(
        np.take_along_axis(log_softmax(logits), targets[..., None], -1))), rel_tol=1e-15)
