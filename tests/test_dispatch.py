"""The one backend rule of every op (``jflashloop/ops/_dispatch.py``) and the exact-division op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop.ops import Implementation, _dispatch
from jflashloop.ops._division import divide
from tests.bits import assert_bits_equal

ON_GPU = jax.default_backend() == "gpu"


def test_resolve_picks_pallas_on_a_gpu_and_xla_elsewhere():
    automatic = _dispatch.resolve(None)
    assert automatic == Implementation("pallas" if ON_GPU else "xla", interpret=not ON_GPU)
    assert _dispatch.resolve("pallas").interpret is not ON_GPU
    assert _dispatch.resolve("pallas", interpret=True) == Implementation("pallas", True)
    assert _dispatch.resolve(automatic) is automatic  # resolving twice changes nothing
    with pytest.raises(ValueError, match="implementation must be None, 'xla' or 'pallas', got 'cuda'"):
        _dispatch.resolve("cuda")
    with pytest.raises(ValueError, match="None, 'xla', 'pallas' or 'gluon'"):
        _dispatch.resolve("cuda", choices=("xla", "pallas", "gluon"))


def test_call_tries_the_automatic_order_and_an_explicit_choice_alone():
    tried = []

    def backend(name, works):
        def run(chosen):
            tried.append((name, chosen.backend))
            if not works:
                raise NotImplementedError(f"{name} cannot")
            return name
        return run

    backends = {"xla": backend("xla", True), "pallas": backend("pallas", False), "gluon": backend("gluon", False)}
    assert _dispatch.call(None, backends, automatic=("gluon", "pallas", "xla")) == "xla"
    assert tried == [("gluon", "gluon"), ("pallas", "pallas"), ("xla", "xla")]
    with pytest.raises(NotImplementedError, match="pallas cannot"):
        _dispatch.call("pallas", backends)
    with pytest.raises(NotImplementedError, match="gluon cannot"):
        _dispatch.call(None, backends, automatic=("pallas", "gluon"))  # the last one's error


def test_exact_division_backends_agree_bit_for_bit(rng):
    numerator = jnp.asarray(rng.standard_normal((64, 9)) * 100, jnp.float32)
    denominator = jnp.asarray(rng.standard_normal((1, 9)) + 3, jnp.float32)  # a broadcast denominator
    expected = np.asarray(numerator) / np.asarray(denominator)  # numpy rounds correctly
    for implementation in (["pallas"] if ON_GPU else ["xla", "pallas"]):
        assert_bits_equal(divide(numerator, denominator, implementation), expected, implementation)
    interpreted = divide(numerator, denominator, Implementation("pallas", interpret=True))
    assert_bits_equal(interpreted, expected, "pallas interpret mode")


def test_codecs_take_a_resolved_implementation(rng):
    x = jnp.asarray(rng.standard_normal((16, 2, 32)), jnp.float32)
    for spec in (jflashloop.INT4_KEYS, jflashloop.NVFP4, jflashloop.int4_rotated(32)):
        plain = jflashloop.encode(x, spec, implementation="pallas")
        interpreted = jflashloop.encode(x, spec, implementation=Implementation("pallas", interpret=True))
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(interpreted), strict=True):
            assert_bits_equal(a, b, spec.format)
