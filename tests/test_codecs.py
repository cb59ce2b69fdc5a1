"""jflashloop codecs against the numpy oracles, bit for bit."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from tests.bits import assert_bits_equal
from tests.cases import CASES

ON_GPU = jax.default_backend() == "gpu"
# "xla" is exact on CPU only: XLA's float32 division on GPU is not correctly rounded.
IMPLEMENTATIONS = [None, "pallas"] + ([] if ON_GPU else ["xla"])

INT4_SPECS = [
    jflashloop.INT4_KEYS,
    jflashloop.INT4_VALUES,
    jflashloop.CodecSpec("int4", "channel", 16),
    jflashloop.CodecSpec("int4", "token", 32),
    jflashloop.CodecSpec("int4", "token", 3),
]
SHAPES = [(130, 2, 37), (1, 3, 5), (64, 1, 64), (17, 2, 33)]
INT4_CASES = ["random", "int4_exact_ties", "int4_division_ties", "zero_span", "tiny", "huge",
              "negative_zero"]
NVFP4_CASES = ["random", "nvfp4_ties", "nvfp4_scale_ties", "nvfp4_division_ties",
               "nvfp4_saturating", "zero_span", "tiny", "huge", "negative_zero"]


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def _encode(x, spec, implementation, global_scale=None):
    return jflashloop.encode(x, spec, global_scale=global_scale, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _decode(packed, dtype):
    return jflashloop.decode(packed, dtype)


def _as_input(x32: np.ndarray, dtype) -> tuple[jax.Array, np.ndarray]:
    """The jax input in ``dtype`` and the exact float32 values the oracle sees."""
    narrow = x32.astype(dtype)
    return jnp.asarray(narrow), narrow.astype(np.float32)


def _expected_decoded(decoded32: np.ndarray, dtype) -> np.ndarray:
    if dtype == jnp.bfloat16:
        return np.vectorize(reference.floats.bfloat16_round, otypes=[np.float32])(decoded32).astype(
            ml_dtypes.bfloat16
        )
    if dtype == jnp.float16:  # decode saturates at +-65504 (huge cases would round to inf)
        return np.vectorize(reference.floats.float16_saturating, otypes=[np.float16])(decoded32)
    return decoded32.astype(dtype)


def check_int4(x32, spec, implementation, input_dtype=np.float32):
    x, oracle_input = _as_input(x32, input_dtype)
    packed = _encode(x, spec, implementation)
    expected = reference.encode_int4(oracle_input, spec.axis, spec.group_size)
    assert_bits_equal(packed.payload, expected["payload"], "payload")
    assert_bits_equal(packed.minimum, expected["minimum"], "minimum")
    assert_bits_equal(packed.scale, expected["scale"], "scale")
    decoded32 = reference.decode_int4(
        expected["payload"], expected["minimum"], expected["scale"], spec.axis, spec.group_size,
        oracle_input.shape,
    )
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert_bits_equal(_decode(packed, dtype), _expected_decoded(decoded32, dtype), f"decoded {dtype}")


def check_nvfp4(x32, implementation, global_scale=None, input_dtype=np.float32):
    x, oracle_input = _as_input(x32, input_dtype)
    packed = _encode(x, jflashloop.NVFP4, implementation, global_scale)
    expected = reference.encode_nvfp4(oracle_input, global_scale)
    assert_bits_equal(packed.payload, expected["payload"], "payload")
    assert_bits_equal(packed.scale, expected["scale"], "scale")
    assert_bits_equal(packed.global_scale, np.float32(expected["global_scale"]), "global_scale")
    assert packed.global_scale_origin == ("tensor_amax" if global_scale is None else "given")
    decoded32 = reference.decode_nvfp4(
        expected["payload"], expected["scale"], expected["global_scale"], oracle_input.shape
    )
    assert np.isfinite(decoded32).all()
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert_bits_equal(_decode(packed, dtype), _expected_decoded(decoded32, dtype), f"decoded {dtype}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", INT4_CASES)
@pytest.mark.parametrize("spec", INT4_SPECS, ids=lambda s: f"{s.axis}{s.group_size}")
def test_int4_matches_oracle(rng, spec, case, shape):
    check_int4(CASES[case](rng, shape), spec, implementation=None)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("case", INT4_CASES)
def test_int4_every_implementation(rng, case, implementation):
    for spec in (jflashloop.INT4_KEYS, jflashloop.INT4_VALUES):
        check_int4(CASES[case](rng, (70, 2, 19)), spec, implementation)


@pytest.mark.parametrize("input_dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("spec", INT4_SPECS[:2], ids=lambda s: s.axis)
def test_int4_narrow_inputs(rng, spec, input_dtype):
    x32 = CASES["random"](rng, (130, 2, 37))
    check_int4(x32, spec, None, input_dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", NVFP4_CASES)
def test_nvfp4_matches_oracle_default_global(rng, case, shape):
    check_nvfp4(CASES[case](rng, shape), implementation=None)


@pytest.mark.parametrize("global_scale", [1e-3, 1 / 6, 2.0**-20, 7.5])
@pytest.mark.parametrize("case", NVFP4_CASES)
def test_nvfp4_matches_oracle_given_global(rng, case, global_scale):
    check_nvfp4(CASES[case](rng, (19, 2, 37)), None, np.float32(global_scale))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("case", NVFP4_CASES)
def test_nvfp4_every_implementation(rng, case, implementation):
    check_nvfp4(CASES[case](rng, (9, 2, 35)), implementation)
    check_nvfp4(CASES[case](rng, (9, 2, 35)), implementation, np.float32(1 / 6))


@pytest.mark.parametrize("input_dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_nvfp4_narrow_inputs(rng, input_dtype):
    check_nvfp4(CASES["random"](rng, (33, 2, 40)), None, input_dtype=input_dtype)


def test_nvfp4_saturates_without_nan(rng):
    x = jnp.asarray(rng.standard_normal((8, 2, 32)).astype(np.float32) * 1e30)
    packed = jflashloop.encode(x, jflashloop.NVFP4, global_scale=1e-6)
    decoded = jflashloop.decode(packed)
    assert bool(jnp.isfinite(decoded).all())
    limit = np.float32(6 * 448) * np.float32(1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(decoded)), limit, rtol=1e-6)


def test_storage_accounting():
    shape = (130, 2, 37)
    packed = jflashloop.encode(jnp.ones(shape), jflashloop.INT4_KEYS)
    # payload 130*2*19, metadata ceil(130/64)=3 groups x 2 heads x 37 channels x (2+2) bytes
    assert packed.nbytes == 130 * 2 * 19 + 3 * 2 * 37 * 4 == jflashloop.INT4_KEYS.nbytes(shape)
    assert packed.bits_per_element == pytest.approx(8 * packed.nbytes / (130 * 2 * 37))
    assert jflashloop.INT4_KEYS.bits_per_element() == 4.5
    nv = jflashloop.encode(jnp.ones(shape), jflashloop.NVFP4)
    assert nv.nbytes == 130 * 2 * 19 + 130 * 2 * 3 + 4 == jflashloop.NVFP4.nbytes(shape)
    assert jflashloop.NVFP4.bits_per_element() == 4.5


def test_packed_is_a_pytree_that_jits_and_vmaps(rng):
    x = jnp.asarray(rng.standard_normal((3, 70, 2, 20)).astype(np.float32))
    for spec in (jflashloop.INT4_KEYS, jflashloop.NVFP4):
        # Jitted and vmapped (the Packed pytree leaves one jit and enters the next), against eager calls.
        batched = jax.jit(jax.vmap(lambda x, spec=spec: jflashloop.encode(x, spec)))(x)
        assert batched.payload.shape == (3, 70, 2, 10)
        decoded = jax.jit(jax.vmap(jflashloop.decode))(batched)
        for i in range(3):
            single = jflashloop.encode(x[i], spec)
            chex.assert_trees_all_equal(jax.tree.map(lambda a, i=i: a[i], batched), single)
            assert_bits_equal(decoded[i], jflashloop.decode(single), "vmapped decode")
        leaves, treedef = jax.tree_util.tree_flatten(batched)
        assert jax.tree_util.tree_unflatten(treedef, leaves).spec == spec


def test_encode_traces_once_per_shape(rng):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def round_trip(x):
        return jflashloop.decode(jflashloop.encode(x, jflashloop.INT4_KEYS))

    for _ in range(3):
        round_trip(jnp.asarray(rng.standard_normal((65, 2, 8)).astype(np.float32)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(format="int8"), "format"),
        (dict(axis="head"), "axis"),
        (dict(group_size=0), "group_size"),
        (dict(format="nvfp4", axis="channel", group_size=16), "NVFP4"),
        (dict(format="nvfp4", axis="token", group_size=32), "NVFP4"),
    ],
)
def test_codec_spec_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jflashloop.CodecSpec(**kwargs)
    with pytest.raises(TypeError, match="group_size"):
        jflashloop.CodecSpec("int4", "token", 64.0)


def test_codec_spec_is_static_and_hashable():
    assert hash(jflashloop.CodecSpec("int4", "channel", 64)) == hash(jflashloop.INT4_KEYS)
    assert {jflashloop.INT4_KEYS: 1}[jflashloop.CodecSpec("int4", "channel", 64)] == 1


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="rank 3"):
        jflashloop.encode(jnp.ones((4, 8)), jflashloop.INT4_KEYS)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jflashloop.encode(jnp.ones((4, 2, 8), jnp.int32), jflashloop.INT4_KEYS)
    with pytest.raises(ValueError, match="NVFP4 only"):
        jflashloop.encode(jnp.ones((4, 2, 8)), jflashloop.INT4_KEYS, global_scale=1.0)
    with pytest.raises(ValueError, match="finite positive float32"):
        jflashloop.encode(jnp.ones((4, 2, 8)), jflashloop.NVFP4, global_scale=0.0)
    with pytest.raises(ValueError, match="implementation"):
        jflashloop.encode(jnp.ones((4, 2, 8)), jflashloop.NVFP4, implementation="cuda")
    with pytest.raises(TypeError, match="dtype"):
        jflashloop.decode(jflashloop.encode(jnp.ones((4, 2, 8)), jflashloop.NVFP4), jnp.int8)


# --------------------------------------------------------------------------- edge values


def _int4_codes(packed):
    return reference.unpack_nibbles(np.asarray(packed.payload), packed.shape[2])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_int4_nonfinite_values_do_not_spread_across_their_group(implementation):
    # One group of 8 channels: NaN, +inf and -inf among finite values in [-1, 2].
    x = np.array([[[-1.0, np.nan, 0.5, np.inf, 2.0, -np.inf, 0.0, 1.0]]], np.float32)
    spec = jflashloop.CodecSpec("int4", "token", 8)
    packed, statistics = jflashloop.codecs.encode_with_statistics(jnp.asarray(x), spec, implementation=implementation)
    assert float(packed.minimum[0, 0, 0]) == -1.0 and float(packed.scale[0, 0, 0]) == np.float16(0.2)
    assert _int4_codes(packed)[0, 0].tolist() == [0, 5, 8, 15, 15, 0, 5, 10]  # NaN as 0.0; +-inf saturated
    assert (int(statistics.nonfinite), int(statistics.saturated)) == (3, 0)
    decoded = np.asarray(jflashloop.decode(packed))
    assert np.isfinite(decoded).all()
    finite = np.isfinite(x)
    assert np.abs(decoded[finite] - x[finite]).max() <= 0.1 + 1e-3  # half a step, as without the non-finite values
    check_int4(x, spec, implementation)


def test_int4_group_without_finite_values_is_a_zero_group():
    x = np.array([[[np.nan], [np.inf], [-np.inf], [np.nan]]], np.float32).reshape(4, 1, 1)
    packed = jflashloop.encode(jnp.asarray(x), jflashloop.CodecSpec("int4", "channel", 4))
    assert float(packed.minimum[0, 0, 0]) == 0.0 and float(packed.scale[0, 0, 0]) == 1.0
    assert _int4_codes(packed)[:, 0, 0].tolist() == [0, 15, 0, 0]
    check_int4(x, jflashloop.CodecSpec("int4", "channel", 4), None)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_nvfp4_nonfinite_values_saturate_and_are_counted(implementation):
    x = np.full((1, 1, 16), 0.5, np.float32)
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, -np.nan]
    packed, statistics = jflashloop.codecs.encode_with_statistics(
        jnp.asarray(x), jflashloop.NVFP4, implementation=implementation
    )
    codes = _int4_codes(packed)[0, 0]
    assert codes[:4].tolist() == [0, 7, 15, 0]  # NaN +0 whatever its sign, +-inf +-6
    decoded = np.asarray(jflashloop.decode(packed))[0, 0]
    np.testing.assert_array_equal(decoded[:4], [0.0, 0.5, -0.5, 0.0])  # +-6 * local * global = +-amax
    np.testing.assert_array_equal(decoded[4:], 0.5)
    assert (int(statistics.nonfinite), int(statistics.saturated)) == (4, 0)
    check_nvfp4(x, implementation)


def test_saturation_is_counted_not_silent():
    int4 = jflashloop.CodecSpec("int4", "token", 4)
    x = jnp.array([[[1.0, 2.0, 3.0, 4.0], [-1e6, 0.0, 1.0, 2.0]]], jnp.float32).reshape(2, 1, 4)
    statistics = jflashloop.codecs.count_saturations(x, int4)
    assert (int(statistics.nonfinite), int(statistics.saturated)) == (0, 4)  # the second group's 4 members
    # NVFP4 with a small given global scale: 6 * 448 * 1e-3 = 2.688; 7/6 of it is 3.136.
    y = jnp.array([[[1.0, 3.0, 3.2, -100.0] + [0.0] * 12]], jnp.float32)
    statistics = jflashloop.codecs.count_saturations(y, jflashloop.NVFP4, global_scale=1e-3)
    assert int(statistics.saturated) == 2
    # Default global scale: nothing saturates, even with a huge outlier.
    assert int(jflashloop.codecs.count_saturations(y * 1e30, jflashloop.NVFP4).saturated) == 0


def test_nvfp4_nonfinite_traced_global_scale_is_counted():
    # Outside jit such a global scale is refused; traced, it decodes to NaN or
    # inf, so every finite element (here all but the NaN; padding excluded) counts as saturated.
    x = np.linspace(-2, 2, 2 * 1 * 20, dtype=np.float32).reshape(2, 1, 20)
    x[1, 0, 3] = np.nan
    encode = jax.jit(lambda x, g: jflashloop.codecs.encode_with_statistics(x, jflashloop.NVFP4, global_scale=g))
    for global_scale in (np.inf, np.nan):
        packed, statistics = encode(jnp.asarray(x), jnp.float32(global_scale))
        assert (int(statistics.nonfinite), int(statistics.saturated)) == (1, 39), global_scale
    expected = reference.encode_nvfp4(x, np.float32(np.inf))
    assert (expected["nonfinite"], expected["saturated"]) == (1, 39)
    packed, _ = encode(jnp.asarray(x), jnp.float32(np.inf))
    assert_bits_equal(packed.payload, expected["payload"], "payload")


@pytest.mark.parametrize("spec", [jflashloop.CodecSpec("int4", "token", 8), jflashloop.CodecSpec("int4", "channel", 2)],
                         ids=["token", "channel"])
def test_int4_decodes_float16_extremes_to_float16_without_overflow(spec):
    # min -65504, scale16 8736: the top code decodes to 65536 in float32, which
    # float16 rounds to inf. The stored bits stay the oracle's; decoding to
    # float16 saturates at 65504, the input's own value.
    x = np.array([[[-65504, 65504, 0, 1000, -3, 7, 65504, 12]], [[65504, -65504, 1, 2, 3, 4, 5, 6]]], np.float16)
    x = np.swapaxes(x, 0, 2).reshape(8, 1, 2) if spec.axis == "channel" else x
    packed = jflashloop.encode(jnp.asarray(x), spec)
    check_int4(x.astype(np.float32), spec, None, np.float16)
    decoded32 = np.asarray(jflashloop.decode(packed, jnp.float32))
    assert decoded32.max() == 65536.0
    decoded = np.asarray(jflashloop.decode(packed, jnp.float16))
    assert np.isfinite(decoded).all()
    np.testing.assert_array_equal(decoded[x == 65504], 65504)
    np.testing.assert_array_equal(decoded[x == -65504], -65504)
    assert_bits_equal(decoded, _expected_decoded(decoded32, jnp.float16), "float16 decode")
    # checked mode accepts it: nothing is stored at a limit and nothing decodes to inf.
    chex.assert_trees_all_equal(jflashloop.checked.encode(jnp.asarray(x), spec), packed)


def test_statistics_work_under_jit_and_vmap(rng):
    x = jnp.asarray(rng.standard_normal((3, 16, 2, 8)).astype(np.float32)).at[1, 0, 0, 0].set(jnp.nan)
    spec = jflashloop.INT4_VALUES
    _, statistics = jax.jit(jax.vmap(lambda x: jflashloop.codecs.encode_with_statistics(x, spec)))(x)
    assert statistics.nonfinite.tolist() == [0, 1, 0] and statistics.saturated.tolist() == [0, 0, 0]
    single, _ = jflashloop.codecs.encode_with_statistics(x[1], spec)
    chex.assert_trees_all_equal(single, jflashloop.encode(x[1], spec))


def test_subnormal_inputs_are_read_as_signed_zeros():
    # XLA on CPU flushes subnormal arithmetic; the codecs read subnormals as zeros
    # everywhere, so results agree with the oracle on every backend.
    tiny = np.float32(1e-40)
    x = np.array([[[tiny, -tiny, 0.0, 2.0**-126] + [0.0] * 12]], np.float32)
    check_nvfp4(x, None)
    check_nvfp4(x, None, np.float32(2.0**-116))
    assert _int4_codes(jflashloop.encode(jnp.asarray(x), jflashloop.NVFP4))[0, 0, :3].tolist() == [0, 8, 0]
    # A group whose span is below 2**-121 is encoded like a constant group.
    group = np.array([[[2.0**-126, 2.0**-125, 3 * 2.0**-126, 0.0]]], np.float32)
    packed = jflashloop.encode(jnp.asarray(group), jflashloop.CodecSpec("int4", "token", 4))
    assert float(packed.scale[0, 0, 0]) == 1.0 and not _int4_codes(packed).any()
    check_int4(group, jflashloop.CodecSpec("int4", "token", 4), None)
    check_int4(x, jflashloop.CodecSpec("int4", "channel", 1), None)
