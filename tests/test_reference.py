"""Checks of the numpy oracles themselves against hand-computed values and
against independent conversions (numpy float16, ml_dtypes float8)."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

import jflashloop_reference as reference
from jflashloop_reference import floats


def test_oracle_never_imports_jax():
    import subprocess
    import sys

    code = (
        "import sys, jflashloop_reference; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'jflashloop')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_int4_identity_group():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 16)
    encoded = reference.encode_int4(x, "token", 16)
    assert encoded["minimum"].item() == 0.0 and encoded["scale"].item() == 1.0
    assert reference.unpack_nibbles(encoded["payload"], 16).ravel().tolist() == list(range(16))
    assert encoded["payload"][0, 0, 0] == 0x10  # channel 0 low nibble, channel 1 high nibble


def test_int4_ties_round_to_even():
    # min 0, max 15 -> scale 1: x = k + 0.5 is an exact tie.
    x = np.array([0, 15, 0.5, 1.5, 2.5, 13.5, 14.5], dtype=np.float32).reshape(1, 1, 7)
    codes = reference.unpack_nibbles(reference.encode_int4(x, "token", 64)["payload"], 7)
    assert codes.ravel().tolist() == [0, 15, 0, 2, 2, 14, 14]


def test_int4_zero_span_and_saturation():
    x = np.full((1, 1, 4), 3.25, np.float32)
    encoded = reference.encode_int4(x, "token", 4)
    assert encoded["scale"].item() == 1.0 and encoded["minimum"].item() == 3.25
    huge = np.array([-1e6, 1e6], np.float32).reshape(1, 1, 2)
    encoded = reference.encode_int4(huge, "token", 2)
    assert encoded["minimum"].item() == -65504.0 and encoded["scale"].item() == 65504.0


def test_pack_odd_channels_leaves_high_nibble_zero():
    codes = np.array([[[15, 15, 15]]], np.uint8)
    assert reference.pack_nibbles(codes).tolist() == [[[0xFF, 0x0F]]]


@pytest.mark.parametrize(
    "magnitude, code",
    [(0.0, 0), (0.25, 0), (0.2500001, 1), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4),
     (3.5, 6), (5.0, 6), (5.0001, 7), (6.0, 7), (1e30, 7), (math.inf, 7), (math.nan, 0)],
)
def test_e2m1_rounding(magnitude, code):
    assert floats.e2m1_round(np.float32(magnitude)) == code


def test_e4m3_matches_ml_dtypes(rng):
    # Every representable value, every midpoint, and random values in range.
    values = [floats.e4m3_value(c) for c in range(1, 0x7F)]
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(values)]
    randoms = np.exp(rng.uniform(np.log(2.0**-9), np.log(448.0), 2000)).tolist()
    for value in values + midpoints + randoms:
        value32 = float(np.float32(value))
        expected = np.array(value32, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert floats.e4m3_round(value32) == int(expected), value32


def test_float16_saturating_matches_numpy(rng):
    values = rng.standard_normal(1000).astype(np.float32) * np.float32(3e4)
    for value in values:
        expected = np.float16(value)
        if np.isinf(expected):
            expected = np.float16(math.copysign(65504.0, float(value)))
        assert floats.float16_bits(floats.float16_saturating(value)) == floats.float16_bits(expected)


def test_bfloat16_round_matches_ml_dtypes(rng):
    values = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-30, 30, 2000)).astype(np.float32)
    for value in values:
        expected = np.float32(np.array(value).astype(ml_dtypes.bfloat16))
        assert floats.float32_bits(floats.bfloat16_round(value)) == floats.float32_bits(expected)


def test_nvfp4_exact_block():
    # global 1/6 makes 6 * global == 1.0 in float32, so the block scale is amax.
    x = np.array([6, 3, -1.5, 0.5, -0.0, 0.25, 0.75, 5], np.float32).reshape(1, 1, 8)
    encoded = reference.encode_nvfp4(x, global_scale=np.float32(1 / 6))
    assert floats.e4m3_value(int(encoded["scale"][0, 0, 0])) == 6.0
    codes = reference.unpack_nibbles(encoded["payload"], 8).ravel().tolist()
    # x / (6 * (1/6)) ~ x; -1.5 -> 8|3, -0.0 -> 8, 0.25 tie -> 0, 0.75 tie -> 2 (1.0), 5 tie -> 6 (4.0)
    assert codes == [7, 5, 11, 1, 8, 0, 2, 6]
    decoded = reference.decode_nvfp4(encoded["payload"], encoded["scale"], encoded["global_scale"], x.shape)
    assert decoded.ravel()[4] == 0 and math.copysign(1, decoded.ravel()[4]) < 0


def test_nvfp4_default_global_scale():
    assert reference.global_scale_from_amax(2688.0) == np.float32(1.0)
    assert reference.global_scale_from_amax(0.0) == np.float32(np.float32(1e-12) / np.float32(2688.0))
