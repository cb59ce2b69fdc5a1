"""The fitted codecs, ``int_mixed`` (per-channel key widths) and ``int4_scaled`` (per-channel value scales),
against their numpy oracles (``reference.fitted``), bit for bit."""

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
from jflashloop import CodecSpec
from jflashloop.codecs import encode_with_statistics, round_channel_scales
from jflashloop.codecs._packed import pack_nibbles, pack_widths, unpack_widths
from tests.bits import assert_bits_equal
from tests.cases import CASES
from tests.test_properties import codec_inputs

ON_GPU = jax.default_backend() == "gpu"
# "xla" is exact on CPU only: XLA's float32 division on GPU is not correctly rounded.
IMPLEMENTATIONS = [None, "pallas"] + ([] if ON_GPU else ["xla"])
SHAPE = (19, 2, 13)  # odd channels, partial groups on both axes


def random_widths(rng, heads: int, channels: int) -> np.ndarray:
    """Widths 1..8 per (head, channel), every head's summing to the same row width (a permutation of head 0's)."""
    first = rng.integers(1, 9, channels)
    return np.stack([rng.permutation(first) for _ in range(heads)])


def random_scales(rng, heads: int, channels: int) -> np.ndarray:
    """float32 divisors over several octaves, with the range's ends."""
    scales = round_channel_scales(np.exp2(rng.uniform(-6, 6, (heads, channels))))
    scales.reshape(-1)[::7] = 2.0**-64
    scales.reshape(-1)[3::11] = 2.0**64
    return scales


def mixed_spec(widths, group: int) -> CodecSpec:
    return CodecSpec("int_mixed", "channel", group, channel_bits=np.asarray(widths).tolist())


def scaled_spec(scales, group: int) -> CodecSpec:
    return CodecSpec("int4_scaled", "token", group, channel_scale=np.asarray(scales).tolist())


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def _encode_decode(x, spec, implementation=None):
    packed, statistics = encode_with_statistics(x, spec, implementation=implementation)
    return packed, statistics, jflashloop.decode(packed, jnp.float32)


def oracle(x, spec: CodecSpec):
    """``(encoded dict, decoded)`` of the numpy oracle."""
    if spec.format == "int_mixed":
        widths = np.asarray(spec.channel_bits)
        expected = reference.encode_int_mixed(x, spec.group_size, widths)
        decoded = reference.decode_int_mixed(expected["payload"], expected["minimum"], expected["scale"],
                                             spec.group_size, widths, x.shape)
    else:
        scales = np.asarray(spec.channel_scale, np.float32)
        expected = reference.encode_int4_scaled(x, spec.group_size, scales)
        decoded = reference.decode_int4_scaled(expected["payload"], expected["minimum"], expected["scale"],
                                               spec.group_size, scales, x.shape)
    return expected, decoded


def assert_matches_oracle(x: np.ndarray, spec: CodecSpec, implementation=None):
    packed, statistics, decoded = _encode_decode(jnp.asarray(x), spec, implementation)
    assert packed.payload.shape == (*x.shape[:2], spec.payload_bytes_per_row(x.shape[2]))
    expected, expected_decoded = oracle(x, spec)
    for name in ("payload", "minimum", "scale"):
        assert_bits_equal(getattr(packed, name), expected[name], name)
    assert int(statistics.nonfinite) == expected["nonfinite"]
    assert int(statistics.saturated) == expected["saturated"]
    assert_bits_equal(decoded, expected_decoded, "decoded")
    return packed


def specs(rng, heads: int, channels: int) -> list[CodecSpec]:
    widths, scales = random_widths(rng, heads, channels), random_scales(rng, heads, channels)
    return [mixed_spec(widths, 8),  # 19 tokens: a partial last group of 3
            mixed_spec(widths, 64),  # one partial group
            scaled_spec(scales, 5),  # 13 channels: a partial last group of 3
            scaled_spec(scales, 32)]


# --------------------------------------------------------------------------- hard cases and fresh inputs


def outlier_channels(rng, shape):
    values = CASES["random"](rng, shape)
    values[:, :, 3] *= np.float32(1000.0)
    return values


HARD_CASES = {"outlier_channels": outlier_channels,
              **{name: CASES[name] for name in ("random", "int4_exact_ties", "int4_division_ties", "zero_span",
                                                "tiny", "huge", "negative_zero", "nonfinite", "subnormal")}}


@pytest.mark.parametrize("case", sorted(HARD_CASES))
def test_matches_oracle_on_hard_cases(rng, case):
    for spec in specs(rng, SHAPE[1], SHAPE[2]):
        assert_matches_oracle(HARD_CASES[case](rng, SHAPE), spec)


def width_division_ties(rng, widths: np.ndarray, tokens: int) -> np.ndarray:
    """Per channel, values within an ulp of ``(k + 0.5) * span / (2**b - 1)`` for the channel's width ``b`` (an
    inexact scale), with the span pinned by the first two tokens: codes that hang on the quotient's last bit."""
    heads, channels = widths.shape
    x = np.zeros((tokens, heads, channels), np.float32)
    for h, c in np.ndindex(heads, channels):
        top = (1 << int(widths[h, c])) - 1
        span = np.float32(rng.uniform(0.5, 3.0))
        ties = ((rng.integers(0, top, tokens) + np.float32(0.5)) * np.float32(span / np.float32(top)))
        ties = ties.astype(np.float32)
        nudge = rng.integers(-1, 2, tokens)
        x[:, h, c] = np.where(nudge == 0, ties, np.nextafter(ties, np.where(nudge > 0, np.inf, -np.inf))
                              .astype(np.float32))
        x[0, h, c], x[1, h, c] = 0.0, span
    return x


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_division_ties_of_every_width_on_every_implementation(rng, implementation):
    widths = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]])
    x = width_division_ties(rng, widths, 16)
    assert_matches_oracle(x, mixed_spec(widths, 16), implementation)
    scales = random_scales(rng, 2, 8)
    assert_matches_oracle(x * scales[None], scaled_spec(scales, 4), implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matches_oracle_on_fresh_random_inputs(rng, implementation):
    for spec in specs(rng, 3, 64):
        assert_matches_oracle(CASES["random"](rng, (70, 3, 64)), spec, implementation)


@given(x=codec_inputs([(1, 1, 1), (5, 2, 7), (17, 1, 5)]), seed=st.integers(0, 2**32 - 1),
       group=st.sampled_from([1, 3, 64]))
def test_matches_oracle_on_any_input(x, seed, group):
    rng = np.random.default_rng(seed)
    heads, channels = x.shape[1:]
    for spec in (mixed_spec(random_widths(rng, heads, channels), group),
                 scaled_spec(random_scales(rng, heads, channels), group)):
        packed = assert_matches_oracle(x, spec)
        assert np.isfinite(np.asarray(packed.scale, np.float32)).all()


# --------------------------------------------------------------------------- the formats they generalize


def test_width_four_everywhere_is_int4(rng):
    """``int_mixed`` at width 4 in every channel stores INT4's bytes: the same bit stream as nibbles."""
    x = CASES["random"](rng, SHAPE)
    mixed = _encode_decode(jnp.asarray(x), mixed_spec(np.full(SHAPE[1:], 4), 8))
    plain = _encode_decode(jnp.asarray(x), CodecSpec("int4", "channel", 8))
    for got, expected in zip(jax.tree.leaves(mixed), jax.tree.leaves(plain), strict=True):
        assert_bits_equal(got, expected, "int_mixed at width 4")


def test_unit_scales_are_int4(rng):
    x = CASES["random"](rng, SHAPE)
    scaled = _encode_decode(jnp.asarray(x), scaled_spec(np.ones(SHAPE[1:]), 5))
    plain = _encode_decode(jnp.asarray(x), CodecSpec("int4", "token", 5))
    for got, expected in zip(jax.tree.leaves(scaled), jax.tree.leaves(plain), strict=True):
        assert_bits_equal(got, expected, "int4_scaled with unit scales")


def test_each_channel_has_its_own_step(rng):
    """A channel of width ``b`` decodes within half of its own step, ``span / (2**b - 1) / 2`` (plus float16
    metadata's rounding): 2-bit channels beside 8-bit ones, in one group."""
    x = CASES["random"](rng, (64, 1, 16))
    widths = np.array([[2, 8] * 8])
    decoded = np.asarray(_encode_decode(jnp.asarray(x), mixed_spec(widths, 64))[2])
    span = x.max(axis=0) - x.min(axis=0)  # [1, 16]
    half_step = span / (2.0 ** widths - 1) / 2
    error = np.abs(decoded - x).max(axis=0)
    slack = 2e-3 * np.abs(x).max(axis=0)  # float16 min and scale
    assert np.all(error <= half_step + slack), (error, half_step)


def test_scales_take_an_outlier_channel_out_of_every_token_step(rng):
    x = rng.standard_normal((32, 1, 16)).astype(np.float32)
    x[:, :, 5] *= 100.0
    scales = np.ones((1, 16), np.float32)
    scales[0, 5] = 100.0
    plain = np.asarray(_encode_decode(jnp.asarray(x), CodecSpec("int4", "token", 16))[2])
    scaled = np.asarray(_encode_decode(jnp.asarray(x), scaled_spec(scales, 16))[2])
    others = np.arange(16) != 5
    assert np.abs(scaled - x)[..., others].mean() * 8 < np.abs(plain - x)[..., others].mean()  # about 20x


# --------------------------------------------------------------------------- packing


def test_width_packing_of_known_codes():
    """Widths 3, 1, 4 (8 bits): codes 5, 1, 9 -> bits 101 | 1 | 1001 -> 0b1001_1_101 = 0x9D."""
    codes = jnp.asarray([[[5, 1, 9]]], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(pack_widths(codes, [[3, 1, 4]])), [[[0x9D]]])
    np.testing.assert_array_equal(reference.fitted.pack_widths(np.asarray(codes), [[3, 1, 4]]), [[[0x9D]]])
    # widths 5 and 6 (11 bits): 0b11111 | 0b000001 << 5 -> 0x3F, 0x00 (the high bits of byte 1 zero)
    np.testing.assert_array_equal(np.asarray(pack_widths(jnp.asarray([[[31, 1]]], jnp.uint8), [[5, 6]])),
                                  [[[0x3F, 0x00]]])


@pytest.mark.parametrize("channels", [1, 3, 8, 13, 64])
def test_width_packing_matches_oracle_and_round_trips(rng, channels):
    widths = random_widths(rng, 2, channels)
    codes = (rng.integers(0, 256, (3, 2, channels)) & ((1 << widths) - 1)).astype(np.uint8)
    packed = pack_widths(jnp.asarray(codes), widths)
    assert_bits_equal(packed, reference.fitted.pack_widths(codes, widths), "packed")
    assert_bits_equal(unpack_widths(packed, widths), codes, "unpacked")
    assert_bits_equal(reference.fitted.unpack_widths(np.asarray(packed), widths), codes, "oracle unpacked")
    four = np.full((2, channels), 4)
    nibbles = codes & 15
    assert_bits_equal(pack_widths(jnp.asarray(nibbles), four), pack_nibbles(jnp.asarray(nibbles)), "as nibbles")


# --------------------------------------------------------------------------- spec, bytes and checks


def test_bytes_are_what_the_spec_says(rng):
    for spec in specs(rng, SHAPE[1], SHAPE[2]):
        packed = jax.eval_shape(lambda x, spec=spec: jflashloop.encode(x, spec),
                                jax.ShapeDtypeStruct(SHAPE, jnp.float32))
        assert packed.nbytes == spec.nbytes(SHAPE)
    widths = np.tile([3, 5, 4, 4], (2, 16))  # mean 4 over 64 channels
    assert mixed_spec(widths, 64).bits_per_element() == 4.5
    assert mixed_spec(widths, 64).payload_bytes_per_row(64) == 32
    assert mixed_spec(widths[:, :63], 64).payload_bytes_per_row(63) == 32  # 252 bits
    assert scaled_spec(np.ones((2, 64)), 64).bits_per_element() == 4.5


def test_spec_tables_are_normalized_and_serializable():
    spec = CodecSpec("int_mixed", "channel", 64, channel_bits=[[4, 3, 5], [5, 4, 3]])
    assert spec.channel_bits == ((4, 3, 5), (5, 4, 3)) and spec.fitted_shape == (2, 3) and spec.row_bits == 12
    assert hash(spec) == hash(CodecSpec(**dataclasses.asdict(spec)))
    assert spec.for_head(1).channel_bits == ((5, 4, 3),)
    scaled = CodecSpec("int4_scaled", "token", 64, channel_scale=round_channel_scales(np.full((1, 2), 0.1)))
    assert scaled.channel_scale == ((0.10009765625,) * 2,)  # 205 / 2048: 9 significant bits
    assert CodecSpec(**dataclasses.asdict(scaled)) == scaled
    assert "channel_bits" not in repr(CodecSpec("int4", "token", 64))


@pytest.mark.parametrize("kwargs, match", [
    (dict(format="int_mixed", axis="channel"), "needs channel_bits"),
    (dict(format="int_mixed", axis="token", channel_bits=[[4]]), "axis='channel'"),
    (dict(format="int_mixed", axis="channel", channel_bits=[[4, 4], [4, 3]]), "same row width"),
    (dict(format="int_mixed", axis="channel", channel_bits=[[4, 9]]), "in 1..8"),
    (dict(format="int_mixed", axis="channel", channel_bits=[[4, 0]]), "in 1..8"),
    (dict(format="int_mixed", axis="channel", channel_bits=[[4, 2.5]]), "must be ints"),
    (dict(format="int_mixed", axis="channel", channel_bits=[[4, 4], [4]]), "one length"),
    (dict(format="int_mixed", axis="channel", channel_bits=[]), "non-empty"),
    (dict(format="int4", axis="channel", channel_bits=[[4]]), "applies to 'int_mixed' only"),
    (dict(format="int4_scaled", axis="token"), "needs channel_scale"),
    (dict(format="int4_scaled", axis="channel", channel_scale=[[1.0]]), "axis='token'"),
    (dict(format="int4_scaled", axis="token", channel_scale=[[0.0]]), r"\[2\*\*-64, 2\*\*64\]"),
    (dict(format="int4_scaled", axis="token", channel_scale=[[float("nan")]]), r"\[2\*\*-64, 2\*\*64\]"),
    (dict(format="int4_scaled", axis="token", channel_scale=[[-1.0]]), r"\[2\*\*-64, 2\*\*64\]"),
    (dict(format="int4_scaled", axis="token", channel_scale=[[0.1]]), "at most 9 significant bits"),
    (dict(format="int4_scaled", axis="token", channel_scale=[[1 + 2**-9]]), "at most 9 significant bits"),
    (dict(format="int4", axis="token", channel_scale=[[1.0]]), "applies to 'int4_scaled' only"),
])
def test_spec_rejects_bad_tables(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec(**kwargs)


def test_a_tensor_of_other_heads_or_channels_is_refused(rng):
    spec = mixed_spec(random_widths(rng, 2, 13), 8)
    for shape in ((4, 3, 13), (4, 2, 12)):
        with pytest.raises(ValueError, match=r"fitted for \[kv_heads, channels\] = \[2, 13\]"):
            jflashloop.encode(jnp.zeros(shape), spec)
    packed = jflashloop.encode(jnp.zeros((4, 2, 13)), spec)
    with pytest.raises(ValueError, match="fitted for"):
        jflashloop.decode(dataclasses.replace(packed, spec=mixed_spec(random_widths(rng, 1, 13), 8)))
    with pytest.raises(ValueError, match="outside"):
        spec.for_head(2)


def test_round_channel_scales():
    rounded = round_channel_scales([0.1, 1.0, 1 + 2**-9, 1 + 3 * 2**-9, 3.0, 1e30, 1e-30])
    np.testing.assert_array_equal(rounded, np.array([205 / 2048, 1.0, 1.0, 1 + 2**-7, 3.0, 2.0**64, 2.0**-64],
                                                    np.float32))  # ties to even: 1 + 2**-9 -> 1
    assert rounded.dtype == np.float32
    for bad in ([0.0], [-1.0], [np.inf], [np.nan]):
        with pytest.raises(ValueError, match="finite and positive"):
            round_channel_scales(bad)


def test_a_fused_multiply_add_cannot_change_the_decode(rng):
    """A residual chain adds the decoded values to the previous loop inside one jit, where XLA may fuse the decode's
    last multiply with that add: the 9-bit divisors keep every product exact, so the bits do not move."""
    scales = random_scales(rng, 1, 16)
    spec = scaled_spec(scales, 16)
    first = CASES["random"](rng, (16, 1, 16))
    second = first + np.float32(0.2) * CASES["random"](rng, (16, 1, 16))

    def chain(first, second):
        rebuilt = jflashloop.decode(jflashloop.encode(first, spec))
        return rebuilt + jflashloop.decode(jflashloop.encode(second - rebuilt, spec))

    _, rebuilt = oracle(first, spec)
    _, delta = oracle((second - rebuilt).astype(np.float32), spec)
    expected = (rebuilt + delta).astype(np.float32)
    assert_bits_equal(jax.jit(chain)(first, second), expected, "chain under jit")
