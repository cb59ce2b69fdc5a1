"""``jflashloop.fitting``: key widths and value scales fitted to a layer's own tensors."""

from __future__ import annotations

import doctest
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import CodecSpec, Policy, fitting
from jflashloop.apps.quality import reconstructed_kv


def channel_sizes(rng, heads=2, group=3, head_dim=64) -> dict:
    """What the fits exploit: query energy and key spans that differ by channel, value channels of very
    different sizes."""
    return dict(key=np.exp2(rng.uniform(-3, 3, (heads, head_dim))), offset=rng.standard_normal((heads, head_dim)),
                value=np.exp2(rng.uniform(-4, 4, (heads, head_dim))),
                query=np.exp2(rng.uniform(-3, 3, (heads * group, head_dim))))


def layer(rng, sizes=None, tokens=260):
    """One layer's K ``[T, H, D]``, V and Q ``[T, H * 3, D]`` (float32) of channel ``sizes`` (fresh ones if None)."""
    sizes = sizes or channel_sizes(rng)
    heads, head_dim = sizes["key"].shape
    group = sizes["query"].shape[0] // heads
    keys = rng.standard_normal((tokens, heads, head_dim)) * sizes["key"] + sizes["offset"]
    values = rng.standard_normal((tokens, heads, head_dim)) * sizes["value"]
    queries = (rng.standard_normal((tokens, heads * group, head_dim)) * sizes["query"]
               / sizes["key"].repeat(group, axis=0))
    return keys.astype(np.float32), values.astype(np.float32), queries.astype(np.float32)


def test_key_weights_are_query_energy_times_squared_spans(rng):
    keys, _, queries = layer(rng, tokens=4 + 3 * 64)
    weights = fitting.key_channel_weights(keys, queries, group_size=64, sink_tokens=4)
    pages = keys[4:].astype(np.float64).reshape(3, 64, 2, 64)
    spans = ((pages.max(1) - pages.min(1)) ** 2).mean(0)
    q2 = (queries[4:].astype(np.float64) ** 2).reshape(-1, 2, 3, 64).mean(axis=(0, 2))  # heads 0-2 read kv head 0
    np.testing.assert_allclose(weights, q2 * spans, rtol=1e-12)
    louder = queries.copy()
    louder[:, 4, 7] *= 10  # query head 4 reads kv head 1
    changed = fitting.key_channel_weights(keys, louder) != weights
    assert changed[1, 7] and changed.sum() == 1


def test_widths_are_the_exact_optimum(rng):
    """Against every assignment of widths 2..6 to 5 channels with the same total."""
    def cost(weights, b):
        return float((weights / (2.0 ** np.asarray(b) - 1) ** 2).sum())

    for mean in (3.0, 3.4, 4.0, 5.2):
        weights = np.exp2(rng.uniform(-6, 6, 5))
        chosen = fitting.fit_key_widths(weights, mean)
        assert chosen.sum() == round(mean * 5)
        best = min(cost(weights, b) for b in itertools.product(range(2, 7), repeat=5) if sum(b) == round(mean * 5))
        assert cost(weights, chosen) == pytest.approx(best, rel=1e-12)


def test_widths_follow_the_weights_and_rows_are_independent():
    weights = np.array([[1.0, 1e6, 1.0, 1e-6], [1e6, 1.0, 1.0, 1.0]])
    chosen = fitting.fit_key_widths(weights, 4.0)
    assert chosen[0, 1] == 6 and chosen[0, 3] == 2 and chosen[1, 0] == 6
    assert (chosen.sum(axis=1) == 16).all()
    np.testing.assert_array_equal(fitting.fit_key_widths(np.ones(4), 4.5), [5, 5, 4, 4])  # ties: lower index


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights=np.ones(4), mean_bits=4.1), "whole number of bits"),
    (dict(weights=np.ones(4), mean_bits=7.0), r"in \[8, 24\]"),
    (dict(weights=np.ones(4), mean_bits=4.0, widths=(2, 4)), "consecutive"),
    (dict(weights=np.ones(4), mean_bits=4.0, widths=(5, 6, 7, 8, 9)), "consecutive ints in 1..8"),
    (dict(weights=-np.ones(4), mean_bits=4.0), "non-negative"),
])
def test_width_fit_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fitting.fit_key_widths(**kwargs)


def test_value_scales(rng):
    _, values, _ = layer(rng)
    values[:, 1, 5] = 0.0  # a dead channel
    scales = fitting.fit_value_scales(values)
    CodecSpec("int4_scaled", "token", 64, channel_scale=scales.tolist())  # valid divisors
    rms = np.sqrt((values[4:].astype(np.float64) ** 2).mean(0))
    rms[1, 5] = rms[1][rms[1] > 0].min()  # the dead channel counts at its head's smallest RMS
    expected = (rms / np.exp(np.log(rms).mean(axis=1, keepdims=True))) ** 0.75
    np.testing.assert_allclose(scales, expected, rtol=2.0**-9)  # 9 significant bits
    assert np.abs(np.log(scales).mean(axis=1)).max() < 0.01  # a geometric mean of about 1 per head
    assert np.isfinite(scales).all() and scales[1, 5] > 0
    np.testing.assert_array_equal(fitting.fit_value_scales(values, exponent=0.0), np.ones_like(scales))
    with pytest.raises(ValueError, match="exponent"):
        fitting.fit_value_scales(values, exponent=3.0)


@pytest.mark.parametrize("call, match", [
    (lambda k, v, q: fitting.key_channel_weights(k[:40], q[:40]), "at least group_size=64 tokens"),
    (lambda k, v, q: fitting.key_channel_weights(k, q[:, :5]), "multiple of kv_heads"),
    (lambda k, v, q: fitting.key_channel_weights(k[0], q), r"\[tokens, heads, head_dim\]"),
    (lambda k, v, q: fitting.fit_value_scales(np.where(v > 3, np.nan, v)), "finite"),
    (lambda k, v, q: fitting.fit_value_scales(v[:4]), "tokens after the 4 sink tokens"),
])
def test_tensors_are_checked(rng, call, match):
    with pytest.raises(ValueError, match=match):
        call(*layer(rng))


def attention_error(keys, values, queries, key_spec, value_spec) -> float:
    """Relative error of every query's attention output over the whole layer (non-causal, exact windows 4/16)."""
    policy = Policy("fitted", key_spec, value_spec, 4, 16, 64)
    config = policy.cache_config(num_layers=1, num_kv_heads=keys.shape[1], head_dim=keys.shape[2],
                                 max_tokens=keys.shape[0])
    keys_hat, values_hat = reconstructed_kv(config, jnp.asarray(keys[None]), jnp.asarray(values[None]))

    def attend(k, v):
        k, v = np.repeat(k, 3, axis=1).astype(np.float64), np.repeat(v, 3, axis=1).astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", queries[-32:].astype(np.float64), k) / 8
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), v)

    exact = attend(keys, values)
    return float(np.linalg.norm(attend(keys_hat[0], values_hat[0]) - exact) / np.linalg.norm(exact))


def test_fitted_specs_beat_int4_at_its_bytes(rng):
    """Fitted on one draw of a layer's tokens, checked on another draw of the same channels: less attention error
    than INT4 G64 at its bytes."""
    sizes = channel_sizes(rng)
    keys, values, queries = layer(rng, sizes)
    key_spec, value_spec = fitting.fitted_keys(keys, queries, 4.0), fitting.fitted_values(values)
    assert key_spec.bits_per_element() == value_spec.bits_per_element() == 4.5
    held_out = layer(rng, sizes)
    int4 = attention_error(*held_out, jflashloop.INT4_KEYS, jflashloop.INT4_VALUES)
    assert attention_error(*held_out, key_spec, value_spec) < 0.85 * int4  # 0.64 on average, 0.73 at most in 52 draws
    assert attention_error(*held_out, key_spec, jflashloop.INT4_VALUES) < int4  # each fit helps on its own
    assert attention_error(*held_out, jflashloop.INT4_KEYS, value_spec) < int4


def test_a_mean_width_the_pages_cannot_hold_is_refused_by_the_config(rng):
    keys, values, queries = layer(rng)
    spec = fitting.fitted_keys(keys, queries, 3.25)  # 208 bits a row: not whole words
    assert spec.row_bits == 208
    with pytest.raises(ValueError, match="multiple of 32 bits"):
        Policy("p", spec, fitting.fitted_values(values), 4, 16, 64).cache_config(
            num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256)


def test_module_examples():
    assert doctest.testmod(fitting).failed == 0


def test_a_whole_model_policy_fits_each_layer(rng):
    sizes = channel_sizes(rng)
    layers = [layer(rng, sizes), layer(rng)]  # two layers of different channels
    keys, values, queries = (np.stack(x) for x in zip(*layers, strict=True))
    policy = fitting.fitted_policy(keys, values, queries, 3.5, recent_tokens=64)
    assert [k.row_bits for k, _ in policy.layer_specs] == [224, 224]
    assert policy.layer_specs[0][0] == fitting.fitted_keys(keys[0], queries[0], 3.5)
    assert policy.layer_specs[1][1] == fitting.fitted_values(values[1])
    config = policy.cache_config(num_layers=2, num_kv_heads=2, head_dim=64, max_tokens=512)
    assert config.layer(1).loops[0].value_spec == policy.layer_specs[1][1]
    with pytest.raises(ValueError, match=r"\[layers, tokens, kv_heads, head_dim\]"):
        fitting.fitted_policy(keys[0], values[0], queries[0])
