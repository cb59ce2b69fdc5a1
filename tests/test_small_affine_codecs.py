"""The INT3 and INT2 affine codecs against their numpy oracles (``reference.int3``, ``reference.int2``), bit for bit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jflashloop
import jflashloop_reference as reference
from jflashloop import CodecSpec, checked
from jflashloop.codecs import (
    encode_with_statistics,
    pack_crumbs,
    pack_triplets,
    unpack_crumbs,
    unpack_triplets,
)
from jflashloop.codecs._spec import AFFINE_MAX_CODE
from tests.bits import assert_bits_equal, assert_matches_affine_oracle
from tests.cases import CASES, affine_division_ties
from tests.test_properties import codec_inputs

ON_GPU = jax.default_backend() == "gpu"
# "xla" is exact on CPU only: XLA's float32 division on GPU is not correctly rounded.
IMPLEMENTATIONS = [None, "pallas"] + ([] if ON_GPU else ["xla"])

FORMATS = ("int3", "int2")
# format: (oracle encode, oracle decode, pack, unpack, oracle pack, oracle unpack)
CODECS = {
    "int3": (reference.encode_int3, reference.decode_int3, pack_triplets, unpack_triplets, reference.pack_triplets,
             reference.unpack_triplets),
    "int2": (reference.encode_int2, reference.decode_int2, pack_crumbs, unpack_crumbs, reference.pack_crumbs,
             reference.unpack_crumbs),
}
SPECS = [
    CodecSpec(fmt, axis, group)
    for fmt in FORMATS
    for axis, group in (("channel", 8),  # K layout, 19 tokens: a partial last group of 3
                        ("channel", 64),  # one partial group
                        ("token", 5),  # V layout, 13 channels: a partial last group of 3
                        ("token", 32))
]
SHAPE = (19, 2, 13)  # odd channels, partial groups on both axes


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def _encode_decode(x, spec, implementation=None):
    packed, statistics = encode_with_statistics(x, spec, implementation=implementation)
    return packed, statistics, jflashloop.decode(packed, jnp.float32)


def assert_matches_oracle(x: np.ndarray, spec: CodecSpec, implementation=None):
    packed, statistics, decoded = _encode_decode(jnp.asarray(x), spec, implementation)
    assert packed.payload.shape == (*x.shape[:2], spec.payload_bytes_per_row(x.shape[2]))
    assert_matches_affine_oracle(packed, statistics, decoded, x, spec, *CODECS[spec.format][:2])
    assert not np.isnan(np.asarray(decoded)).any()
    return packed


# --------------------------------------------------------------------------- hard cases


def exact_ties(rng, shape, top):
    """Groups spanning [0, top] exactly (scale 1), so x = k + 0.5 is an exact rounding tie."""
    values = rng.integers(0, top, shape).astype(np.float32) + np.float32(0.5)
    values[0::8, :, :] = 0.0  # min 0 and max top in every group of either axis
    values[:, :, 0::5] = 0.0
    values[1::8, :, :] = top
    values[:, :, 1::5] = top
    return values


def division_ties(rng, shape, top):
    """:func:`tests.cases.affine_division_ties` for a top code ``top``: scale = span / top, offsets of one ulp."""
    return affine_division_ties(rng, shape, max_code=top, nudge=1, token_pin=8, channel_pin=5)


def outlier_channels(rng, shape):
    """K-like: per-channel offsets and scales, and one channel a thousand times larger."""
    values = CASES["random"](rng, shape)
    values[:, :, 3] *= np.float32(1000.0)
    return values


def constant_groups(rng, shape):
    """Zero spans: every group constant along either axis (scale falls back to 1)."""
    return np.full(shape, np.float32(rng.standard_normal()), np.float32)


HARD_CASES = {
    "exact_ties": exact_ties,
    "division_ties": division_ties,
    "outlier_channels": outlier_channels,
    "zero_span": constant_groups,
    **{name: CASES[name] for name in ("random", "tiny", "huge", "negative_zero", "nonfinite", "subnormal")},
}
TOP_CODE_CASES = ("exact_ties", "division_ties")  # these take the format's top code


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("case", sorted(HARD_CASES))
def test_matches_oracle_on_hard_cases(rng, case, spec):
    top = (AFFINE_MAX_CODE[spec.format],) if case in TOP_CODE_CASES else ()
    assert_matches_oracle(HARD_CASES[case](rng, SHAPE, *top), spec)


@pytest.mark.parametrize("fmt, expected", [("int3", [0, 0, 2, 2, 4, 4, 6, 6, 7]), ("int2", [0, 0, 2, 2, 3])])
def test_exact_ties_round_half_to_even(fmt, expected):
    top = AFFINE_MAX_CODE[fmt]
    x = np.array([[[0.0, *(np.arange(top) + 0.5), top]]], np.float32)  # 0, 0.5, 1.5, ..., top - 0.5, top
    packed = assert_matches_oracle(x, CodecSpec(fmt, "token", x.shape[2]))
    codes = np.asarray(CODECS[fmt][3](packed.payload, x.shape[2]))[0, 0]
    np.testing.assert_array_equal(codes, expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_division_ties_on_every_implementation(rng, fmt, implementation):
    x = division_ties(rng, (16, 1, 10), AFFINE_MAX_CODE[fmt])
    assert_matches_oracle(x, CodecSpec(fmt, "channel", 8), implementation)


@pytest.mark.parametrize("fmt", FORMATS)
def test_constant_groups_decode_exactly(fmt):
    x = np.full((5, 1, 7), np.float32(0.25), np.float32)  # exact in float16
    for spec in (CodecSpec(fmt, "channel", 4), CodecSpec(fmt, "token", 3)):
        packed = assert_matches_oracle(x, spec)
        assert np.all(np.asarray(packed.scale) == 1.0)
        np.testing.assert_array_equal(np.asarray(jflashloop.decode(packed)), x)


# --------------------------------------------------------------------------- fresh random inputs

PROPERTY_SHAPES = [(1, 1, 1), (5, 2, 7), (17, 1, 5)]
PROPERTY_SPECS = [CodecSpec(fmt, axis, group) for fmt in FORMATS for axis in ("channel", "token")
                  for group in (1, 3, 64)]


@given(x=codec_inputs(PROPERTY_SHAPES), spec=st.sampled_from(PROPERTY_SPECS))
def test_matches_oracle_on_any_input(x, spec):
    packed = assert_matches_oracle(x, spec)
    assert np.isfinite(np.asarray(packed.minimum, np.float32)).all()
    assert np.isfinite(np.asarray(packed.scale, np.float32)).all()


# --------------------------------------------------------------------------- error bound


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_decode_error_within_half_a_step(rng, spec):
    """|x - decode(encode(x))| <= scale / 2, plus what float16 metadata and float32 decoding add."""
    x = CASES["random"](rng, SHAPE)
    packed, _, decoded = _encode_decode(jnp.asarray(x), spec)
    g = spec.group_size
    error = np.abs(np.asarray(decoded, np.float64) - x)
    for index in np.ndindex(*spec.metadata_shape(SHAPE)):
        if spec.axis == "channel":
            members = (slice(index[0] * g, (index[0] + 1) * g), index[1], index[2])
        else:
            members = (index[0], index[1], slice(index[2] * g, (index[2] + 1) * g))
        group = x[members].astype(np.float64)
        top = AFFINE_MAX_CODE[spec.format]
        scale = (group.max() - group.min()) / top
        scale16 = float(np.asarray(packed.scale)[index])
        minimum16 = float(np.asarray(packed.minimum)[index])
        bound = scale / 2 + top * abs(scale16 - scale) + abs(minimum16 - group.min())
        bound += 4 * np.finfo(np.float32).eps * (np.abs(group).max() + top * abs(scale16))
        assert error[members].max() <= bound, (index, error[members].max(), bound)


# --------------------------------------------------------------------------- packing


def test_crumb_packing_of_known_codes():
    """Four 2-bit codes fill a byte, little-endian; a partial byte leaves its top bits zero."""
    codes = jnp.asarray([[0, 1, 2, 3], [3, 3, 3, 3]], jnp.uint8)
    # 0 | 1 << 2 | 2 << 4 | 3 << 6 = 0xE4
    np.testing.assert_array_equal(np.asarray(pack_crumbs(codes)), [[0xE4], [0xFF]])
    np.testing.assert_array_equal(np.asarray(pack_crumbs(jnp.asarray([3, 0, 2, 1, 1], jnp.uint8))), [0x63, 0x01])
    assert pack_crumbs(jnp.zeros((2, 13), jnp.uint8)).shape == (2, 4)  # ceil(13 / 4)


def test_triplet_packing_of_known_codes():
    """Eight codes fill three bytes, little-endian; a partial octet leaves its top bits zero."""
    codes = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 7], [7, 7, 7, 7, 7, 7, 7, 7]], jnp.uint8)
    # sum(i << 3i) = 0xFAC688
    np.testing.assert_array_equal(np.asarray(pack_triplets(codes)), [[0x88, 0xC6, 0xFA], [0xFF, 0xFF, 0xFF]])
    # [7, 0, 5]: bits 0-2 = 111, 3-5 = 000, 6-8 = 101 -> 0b01000111, 0b00000001
    np.testing.assert_array_equal(np.asarray(pack_triplets(jnp.asarray([7, 0, 5], jnp.uint8))), [0x47, 0x01])
    assert pack_triplets(jnp.zeros((2, 11), jnp.uint8)).shape == (2, 5)  # ceil(33 / 8)


@pytest.mark.parametrize("fmt, payload", [("int3", [0x88, 0xC6, 0xFA]), ("int2", [0xE4])])
def test_encode_stores_the_known_bytes(fmt, payload):
    """x = 0..top along the channels of one token (V layout): min 0, scale 1, codes 0..top."""
    top = AFFINE_MAX_CODE[fmt]
    x = jnp.arange(top + 1, dtype=jnp.float32).reshape(1, 1, top + 1)
    packed = _encode_decode(x, CodecSpec(fmt, "token", top + 1))[0]
    np.testing.assert_array_equal(np.asarray(packed.payload), [[payload]])
    assert float(packed.scale[0, 0, 0]) == 1.0 and float(packed.minimum[0, 0, 0]) == 0.0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("channels", [1, 3, 8, 13, 64, 67])
def test_packing_matches_oracle_and_round_trips(rng, fmt, channels):
    _, _, pack, unpack, oracle_pack, oracle_unpack = CODECS[fmt]
    codes = rng.integers(0, AFFINE_MAX_CODE[fmt] + 1, (3, 2, channels)).astype(np.uint8)
    packed = pack(jnp.asarray(codes))
    assert_bits_equal(packed, oracle_pack(codes), "packed")
    assert_bits_equal(unpack(packed, channels), codes, "unpacked")
    assert_bits_equal(oracle_unpack(np.asarray(packed), channels), codes, "oracle unpacked")


# --------------------------------------------------------------------------- spec, bytes and checks


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_bytes_are_what_the_spec_says(spec):
    packed = jax.eval_shape(lambda x: jflashloop.encode(x, spec), jax.ShapeDtypeStruct(SHAPE, jnp.float32))
    assert packed.nbytes == spec.nbytes(SHAPE)
    assert spec.payload_bytes_per_row(13) == {"int3": 5, "int2": 4}[spec.format]


def test_bits_per_element():
    assert CodecSpec("int3", "token", 64).bits_per_element() == 3.5
    assert CodecSpec("int3", "channel", 32).bits_per_element() == 4.0
    assert CodecSpec("int2", "token", 64).bits_per_element() == 2.5
    assert CodecSpec("int2", "channel", 32).bits_per_element() == 3.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_rejects_a_payload_of_the_wrong_size(fmt):
    packed = _encode_decode(jnp.ones((2, 1, 16), jnp.float32), CodecSpec(fmt, "token", 8))[0]
    wrong = dataclasses.replace(packed, payload=jnp.zeros((2, 1, 8), jnp.uint8))  # INT4's size for 16 channels
    with pytest.raises(ValueError, match="payload"):
        jflashloop.decode(wrong)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checked_encode_rejects_saturating_groups(fmt):
    x = jnp.asarray([[[1e6, -1e6, 0.0]]], jnp.float32)
    with pytest.raises(checked.SaturationError, match="65504"):
        checked.encode(x, CodecSpec(fmt, "token", 3))
    checked.encode(x, CodecSpec(fmt, "token", 3), allow_saturation=True)
