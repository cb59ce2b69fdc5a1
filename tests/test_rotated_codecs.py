"""Rotated and lattice codecs (int4_rotated, int2/int3_lloyd_max, e8, int4_group_rotated) vs the oracles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference.rotations as oracle
from jflashloop import storage
from jflashloop.codecs import _rotated as rotated_codecs
from tests.bits import assert_bits_equal
from tests.builders import assert_matches_oracle, build, small_config

ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = ["pallas"] if ON_GPU else ["xla", "pallas"]


def _vectors(rng, tokens, heads, dim, case):
    if case == "random":
        return (rng.standard_normal((tokens, heads, dim)) * rng.uniform(0.05, 8, (tokens, heads, 1))).astype(np.float32)
    if case == "outliers":  # K-like: a few channels with large offsets
        x = rng.standard_normal((tokens, heads, dim))
        x[..., rng.choice(dim, 3, replace=False)] += 12.0
        return x.astype(np.float32)
    if case == "zero_and_constant":
        x = np.zeros((tokens, heads, dim), np.float32)
        x[1::2] = 0.75
        return x
    if case == "tiny_and_huge":
        x = rng.standard_normal((tokens, heads, dim)).astype(np.float32)
        x[0::2] *= np.float32(1e-20)
        x[1::2] *= np.float32(3e3)
        return x
    raise ValueError(case)


CODECS = {
    "int4_rotated": (lambda d: jflashloop.int4_rotated(d, 7), rotated_codecs.encode_int4_rotated,
                     rotated_codecs.decode_int4_rotated),
    "int2_lloyd_max": (lambda d: jflashloop.int2_lloyd_max(d, 7), rotated_codecs.encode_int2_lloyd_max,
                       rotated_codecs.decode_int2_lloyd_max),
    "int3_lloyd_max": (lambda d: jflashloop.int3_lloyd_max(d, 7), rotated_codecs.encode_int3_lloyd_max,
                       rotated_codecs.decode_int3_lloyd_max),
    "e8": (lambda d: jflashloop.E8_KEYS, rotated_codecs.encode_e8, rotated_codecs.decode_e8),
    "int4_group_rotated": (lambda d: jflashloop.INT4_GROUP_ROTATED_VALUES,
                           rotated_codecs.encode_int4_group_rotated, rotated_codecs.decode_int4_group_rotated),
}


def _oracle_row(name, vector, dim, seed=7):
    if name == "int4_rotated":
        codes, scale = oracle.encode_int4_rotated_vector(vector, seed)
        return oracle.decode_int4_rotated_vector(codes, scale, seed), (codes, [scale])
    if name == "int2_lloyd_max":
        codes, sigma = oracle.encode_int2_lloyd_max_vector(vector, seed)
        return oracle.decode_int2_lloyd_max_vector(codes, sigma, seed), (codes, [sigma])
    if name == "int3_lloyd_max":
        codes, sigma = oracle.encode_int3_lloyd_max_vector(vector, seed)
        return oracle.decode_int3_lloyd_max_vector(codes, sigma, seed), (codes, [sigma])
    if name == "e8":
        codes, scales = oracle.encode_e8_vector(vector)
        return oracle.decode_e8_vector(codes, scales, dim), ([c for pair in codes for c in pair], scales)
    codes, scales = oracle.encode_int4_group_rotated_vector(vector)
    return oracle.decode_int4_group_rotated_vector(codes, scales), (codes, scales)


def _jax_codes(name, packed):
    payload = np.asarray(packed.payload)
    if name in ("int4_rotated", "int4_group_rotated"):
        return np.asarray(jflashloop.codecs.unpack_nibbles(packed.payload, packed.shape[2]))
    if name == "int2_lloyd_max":
        return np.asarray(rotated_codecs._unpack_crumbs(packed.payload))
    if name == "int3_lloyd_max":
        return np.asarray(jflashloop.codecs.unpack_triplets(packed.payload, packed.shape[2]))
    return payload


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("case", ["random", "outliers", "zero_and_constant", "tiny_and_huge"])
@pytest.mark.parametrize("name", list(CODECS))
def test_rotated_codec_matches_oracle(rng, name, case, dim, implementation):
    make_spec, encode, decode = CODECS[name]
    spec = make_spec(dim)
    x = _vectors(rng, 4, 2, dim, case)
    packed = jax.jit(functools.partial(encode, spec=spec, implementation=implementation))(jnp.asarray(x))
    decoded = np.asarray(jax.jit(decode)(packed))
    codes = _jax_codes(name, packed)
    scales = np.asarray(packed.scale)
    for t in range(4):
        for h in range(2):
            expected, (expected_codes, expected_scales) = _oracle_row(name, x[t, h], dim)
            assert_bits_equal(decoded[t, h], np.asarray(expected, np.float32), f"{name} decoded [{t},{h}]")
            assert codes[t, h].tolist() == list(expected_codes), f"{name} codes [{t},{h}]"
            assert_bits_equal(scales[t, h].reshape(-1), np.asarray(expected_scales, scales.dtype).reshape(-1),
                              f"{name} scales [{t},{h}]")


def test_nearest_e8_ties_and_exact_points():
    book = oracle.e8_codebook()
    blocks = [
        [0.5, 0.5, 0, 0, 0, 0, 0, 0],  # equidistant from zero and several roots
        [0.25] * 8,
        [1, 1, 0, 0, 0, 0, 0, 0],  # a root itself
        [-0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # odd minus signs: not a root
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0.75, -0.75, 0.25, 0.25, 0, 0, 0, 0],
    ]
    got = np.asarray(rotated_codecs.nearest_e8(jnp.asarray(blocks, jnp.float32)))
    for block, index in zip(blocks, got, strict=True):
        assert index == oracle.nearest_e8(np.asarray(block, np.float32)), block
    assert book[got[2]] == (1.0, 1.0, 0, 0, 0, 0, 0, 0)


def test_rotation_is_orthonormal_and_signs_are_seeded(rng):
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    y = rotated_codecs.rotate(x, 5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rotated_codecs.unrotate(y, 5), x, atol=1e-5)
    assert not np.array_equal(rotated_codecs.random_signs(5, 128), rotated_codecs.random_signs(6, 128))
    assert rotated_codecs.random_signs(5, 128).tolist() == oracle.random_signs(5, 128)


@pytest.mark.parametrize("dim", [1, 2, 64, 128, 256])
@pytest.mark.parametrize("seed", [None, 5])
def test_rotation_by_product_matches_the_butterflies(rng, dim, seed):
    x = rng.standard_normal((4, 3, dim)).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 0, :] = 2.0**60  # the int4_rotated input limit's neighbourhood stays finite
    x[2, 1, ::2] *= 1e4  # outlier channels
    for inverse, butterflies in ((False, rotated_codecs.rotate), (True, rotated_codecs.unrotate)):
        got = np.asarray(rotated_codecs.rotate_by_product(jnp.asarray(x), seed, inverse=inverse))
        want = np.asarray(butterflies(jnp.asarray(x), seed), np.float64)
        assert got.dtype == np.float32 and got.shape == x.shape
        norm = np.linalg.norm(want, axis=-1, keepdims=True)
        assert np.all(np.abs(got - want) <= 2e-6 * np.maximum(norm, 1e-30)), (inverse, np.abs(got - want).max())
    matrix = rotated_codecs.rotation_matrix(seed, dim)
    np.testing.assert_allclose(matrix @ rotated_codecs.rotation_matrix(seed, dim, True), np.eye(dim), atol=1e-6)
    assert not matrix.flags.writeable


def test_rotation_matrix_refuses_other_lengths():
    with pytest.raises(ValueError, match="power-of-two"):
        rotated_codecs.rotation_matrix(None, 96)


def test_storage_per_head_token():
    # rk2v4-e8 at head_dim 256: K 64 code bytes + 4 float16 scales, V 128 + 4 scales = 208 bytes.
    for dim, expected in ((256, 208), (128, 104), (64, 52)):
        key = jflashloop.E8_KEYS.nbytes((1, 1, dim))
        value = jflashloop.INT4_GROUP_ROTATED_VALUES.nbytes((1, 1, dim))
        assert key + value == expected == storage.head_token_bytes(jflashloop.E8_KEYS,
                                                                  jflashloop.INT4_GROUP_ROTATED_VALUES, dim)
    assert jflashloop.int4_rotated(128).nbytes((1, 1, 128)) == 64 + 4  # scale with the zero point inside
    assert jflashloop.int2_lloyd_max(128).nbytes((1, 1, 128)) == 32 + 2
    assert jflashloop.int4_rotated(128).bits_per_element() == 4.25
    assert jflashloop.int2_lloyd_max(128).bits_per_element() == 2.125
    assert jflashloop.int3_lloyd_max(64).nbytes((1, 1, 64)) == 24 + 2
    assert jflashloop.int3_lloyd_max(64).bits_per_element() == 3.25


@pytest.mark.parametrize("thresholds", [(-rotated_codecs.LLOYD_MAX_THRESHOLD, 0.0, rotated_codecs.LLOYD_MAX_THRESHOLD),
                                        rotated_codecs.LLOYD_MAX_3_THRESHOLDS], ids=["int2", "int3"])
def test_lloyd_max_codes_at_and_beside_the_thresholds(thresholds):
    """A value equal to a threshold takes the code below it, its float32 neighbours the codes on either side (a
    subnormal counts as zero: XLA's CPU comparisons read it so)."""
    at = np.float32(thresholds)
    u = np.concatenate([at, np.nextafter(at, np.float32(-np.inf)), np.nextafter(at, np.float32(np.inf)),
                        np.float32([-np.inf, np.inf, -1e30, 1e30, 0.0, -0.0])])
    got = np.asarray(rotated_codecs.lloyd_max_codes(jnp.asarray(u), thresholds)).tolist()
    assert got == [oracle.lloyd_max_code(v, [np.float32(t) for t in thresholds]) for v in u]
    n, zero = len(thresholds), len(thresholds) // 2  # the middle threshold is 0
    above = list(range(1, n + 1))
    above[zero] = zero  # 0's upper neighbour is subnormal: it counts as zero
    assert got[:n] == list(range(n)) == got[n:2 * n] and got[2 * n:3 * n] == above
    assert got[3 * n:] == [0, n, 0, n, zero, zero]


def test_int3_lloyd_max_has_less_error_than_int3_on_gaussian_rows(rng):
    """The reason for the format: on zero-centred Gaussian rows it beats INT3 G64 (3.5 bits) with 3.25 bits."""
    x = jnp.asarray(rng.standard_normal((256, 2, 64)) * rng.uniform(0.1, 4, (256, 2, 1)), jnp.float32)
    errors = {}
    for name, spec in (("lloyd", jflashloop.int3_lloyd_max(64, 3)), ("int3", jflashloop.CodecSpec("int3", "token", 64))):
        decoded = jflashloop.codecs.decode(jflashloop.codecs.encode(x, spec))
        errors[name] = float(jnp.sum((decoded - x) ** 2) / jnp.sum(x**2))
    assert errors["lloyd"] < 0.95 * errors["int3"], errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(format="int4_rotated", axis="token", group_size=128), "rotation_seed"),
        (dict(format="e8", axis="channel", group_size=64), "axis='token'"),
        (dict(format="int4_group_rotated", axis="token", group_size=48), "power-of-two"),
        (dict(format="int4", axis="token", group_size=64, rotation_seed=1), "rotation_seed"),
    ],
)
def test_bad_rotated_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jflashloop.CodecSpec(**kwargs)


def _rotated_config(key_spec, value_spec):
    from jflashloop import LoopStorage

    base = small_config(head_dim=64, num_loops=3)
    loops = (LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec, 4))
    return base.__class__(**{**base.__dict__, "loops": loops})


@pytest.mark.parametrize(
    "key_spec, value_spec",
    [
        (jflashloop.int4_rotated(64, 1), jflashloop.int4_rotated(64, 2)),
        (jflashloop.int2_lloyd_max(64, 1), jflashloop.int2_lloyd_max(64, 1)),
        (jflashloop.int3_lloyd_max(64, 1), jflashloop.int3_lloyd_max(64, 2)),
        (jflashloop.E8_KEYS, jflashloop.INT4_GROUP_ROTATED_VALUES),
    ],
    ids=["int4_rotated", "int2", "int3_lloyd_max", "rk2v4_e8"],
)
def test_rotated_formats_in_the_cache_match_the_oracle(rng, key_spec, value_spec):
    config = _rotated_config(key_spec, value_spec)
    # 40 + 9 tokens cross the 48-token page boundary while appending.
    cache, history = build(rng, config, prompt_lengths=[40, 19], steps=9)
    assert_matches_oracle(cache, history.keys, history.values, layers=[1], loops=[0, 2])


# --------------------------------------------------------------------------- int4_rotated edge values


def _edge_vectors(dim):
    limit = np.float32(2.0**64)
    rows = np.random.default_rng(0).standard_normal((7, dim)).astype(np.float32)
    rows[0, 3] = np.inf
    rows[1, :2] = [-np.inf, np.nan]
    rows[2, 5] = 1e38  # finite, far beyond the limit
    rows[3] = np.float32(3.4e38) * np.sign(rows[3])  # every channel at the float32 limit
    rows[4, 1] = limit  # exactly the limit: kept
    rows[5, 1] = np.nextafter(limit, np.float32(np.inf))  # just above: saturated
    rows[6] = limit * np.asarray(oracle.random_signs(7, dim), np.float32)  # the rotation adds them all in one channel
    return rows[:, None, :]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dim", [16, 128])
def test_int4_rotated_saturates_and_counts_edge_values(dim, implementation):
    spec = jflashloop.int4_rotated(dim, 7)
    x = _edge_vectors(dim)
    encode = functools.partial(jflashloop.codecs.encode_with_statistics, spec=spec, implementation=implementation)
    packed, statistics = jax.jit(encode)(jnp.asarray(x))
    decoded = np.asarray(jax.jit(rotated_codecs.decode_int4_rotated)(packed))
    assert np.isfinite(np.asarray(packed.scale)).all() and np.isfinite(decoded).all()
    nonfinite = saturated = 0
    for t in range(x.shape[0]):
        expected, (codes, scales) = _oracle_row("int4_rotated", x[t, 0], dim)
        assert_bits_equal(decoded[t, 0], np.asarray(expected, np.float32), f"decoded [{t}]")
        assert _jax_codes("int4_rotated", packed)[t, 0].tolist() == codes, f"codes [{t}]"
        assert_bits_equal(np.asarray(packed.scale)[t, 0], np.asarray(scales, np.float32), f"scale [{t}]")
        counts = oracle.int4_rotated_input(x[t, 0])[1:]
        nonfinite, saturated = nonfinite + counts[0], saturated + counts[1]
    assert (int(statistics.nonfinite), int(statistics.saturated)) == (nonfinite, saturated) == (3, dim + 2)
    alone = jflashloop.codecs.count_saturations(jnp.asarray(x), spec)
    assert (int(alone.nonfinite), int(alone.saturated)) == (3, dim + 2)
    # Values within the limit are stored as before: the clean rows match an encode of their own.
    clean = jflashloop.encode(jnp.asarray(x[4:5]), spec, implementation=implementation)
    assert_bits_equal(packed.payload[4:5], clean.payload, "payload of a clean row")


def test_int4_rotated_cache_saturates_and_counts_huge_values(rng):
    from jflashloop import CacheConfig, LoopStorage, paged_cache

    spec = jflashloop.int4_rotated(16, 3)
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=3, page_size=16, recent_tokens=4, sink_tokens=0,
                         loops=(LoopStorage(spec, spec), LoopStorage(spec, spec)))
    keys, values = (rng.standard_normal((1, 2, 34, 1, 16)).astype(np.float32) for _ in range(2))
    keys[0, :, 3, 0, 5] = 1e38  # representable in bfloat16, packed into page 0
    values[0, 0, 20, 0, 2] = -1e38
    cache = jax.jit(paged_cache.prefill)(paged_cache.create(config), 0, keys, values, 34)
    # Loop 1: K at token 3 and V at token 20; loop 2: the K residual at token 3 is ~1e38 again.
    assert int(cache.saturation_counts[0]) == 3
    assert int(cache.error_flags[0]) == paged_cache.ERROR_SATURATED
    queries = jnp.asarray(rng.standard_normal((1, 8, 16)), jnp.float32)
    for loop in range(2):
        reconstructed = paged_cache.reconstruct(cache, 0, loop, 0)
        assert all(np.isfinite(np.asarray(part)).all() for part in reconstructed[:2])
        assert np.isfinite(np.asarray(jflashloop.decode_attention_reference(queries, cache, 0, loop))).all()
