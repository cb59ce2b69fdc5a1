"""Residual chains: bit-exact against the oracles, closed loop beats open loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from jflashloop_reference.paged_cache import round_trip
from tests.bits import assert_bits_equal

NVFP4_RESIDUAL = jflashloop.NVFP4


def _codec(spec):
    return (spec.format, spec.axis, spec.group_size)


def _looped(rng, loops, shape, drift=0.1):
    """Successive loops that are close to each other, as in a trained looped model."""
    first = rng.standard_normal(shape).astype(np.float32) * 2.0
    out = [first]
    for _ in range(loops - 1):
        out.append((out[-1] + drift * rng.standard_normal(shape)).astype(np.float32))
    return out


SMALL_AFFINE = [jflashloop.CodecSpec(fmt, axis, 64) for fmt in ("int3", "int2") for axis in ("channel", "token")]


@pytest.mark.parametrize("spec", [jflashloop.INT4_KEYS, jflashloop.INT4_VALUES, NVFP4_RESIDUAL, *SMALL_AFFINE],
                         ids=lambda s: f"{s.format}-{s.axis}")
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_residual_matches_oracle(rng, spec, sparse):
    target, predecessor = _looped(rng, 2, (70, 2, 24))
    positions = np.sort(rng.choice(70, 17, replace=False)).astype(np.int32) if sparse else None
    residual = jax.jit(jflashloop.encode_residual, static_argnums=2)(target, predecessor, spec, positions)
    reconstructed = jflashloop.decode_residual(residual, predecessor)
    difference = (target - predecessor).astype(np.float32)
    expected = predecessor.copy()
    if sparse:
        decoded = round_trip(difference[positions], _codec(spec))
        expected[positions] = (expected[positions] + decoded).astype(np.float32)
        assert residual.packed.shape == (17, 2, 24)
        untouched = np.setdiff1d(np.arange(70), positions)
        assert_bits_equal(np.asarray(reconstructed)[untouched], predecessor[untouched], "inherited rows")
    else:
        expected = (expected + round_trip(difference, _codec(spec))).astype(np.float32)
    assert_bits_equal(reconstructed, expected, "reconstruction")


def test_int4_base_with_nvfp4_residuals(rng):
    loops = _looped(rng, 4, (64, 2, 32))
    positions = [None, np.arange(0, 64, 4, dtype=np.int32), np.arange(0, 64, 8, dtype=np.int32)]
    chain = jflashloop.encode_chain(loops, jflashloop.INT4_KEYS, [NVFP4_RESIDUAL] * 3, positions)
    assert all(r.packed.spec == NVFP4_RESIDUAL for r in chain.residuals)
    # Oracle chain, closed loop.
    reconstruction = round_trip(loops[0], _codec(jflashloop.INT4_KEYS))
    for loop_index, selected in enumerate(positions, start=1):
        rows = slice(None) if selected is None else selected
        difference = (loops[loop_index][rows] - reconstruction[rows]).astype(np.float32)
        reconstruction = reconstruction.copy()
        reconstruction[rows] = (reconstruction[rows] + round_trip(difference, _codec(NVFP4_RESIDUAL))).astype(np.float32)
        assert_bits_equal(jflashloop.decode_loop(chain, loop_index), reconstruction, f"loop {loop_index}")


def test_general_positions_need_not_be_subsets(rng):
    loops = _looped(rng, 4, (40, 1, 16))
    # Loop 3 selects rows loop 2 did not: still exact against the reconstructed predecessor.
    positions = [None, np.array([1, 5, 9], np.int32), np.array([2, 5, 30], np.int32)]
    chain = jflashloop.encode_chain(loops, jflashloop.INT4_VALUES, [jflashloop.INT4_VALUES] * 3, positions)
    loop2 = np.asarray(jflashloop.decode_loop(chain, 2))
    loop3 = np.asarray(jflashloop.decode_loop(chain, 3))
    untouched = np.setdiff1d(np.arange(40), [2, 5, 30])
    assert_bits_equal(loop3[untouched], loop2[untouched], "absent positions inherit loop 2")
    assert np.abs(loop3[30] - loops[3][30]).max() < np.abs(loop2[30] - loops[3][30]).max()


def test_closed_loop_beats_open_loop(rng):
    loops = _looped(rng, 4, (256, 4, 64), drift=0.05)
    specs = [jflashloop.INT4_VALUES] * 3
    positions = [None, None, None]

    def final_error(closed_loop):
        chain = jflashloop.encode_chain(loops, jflashloop.INT4_KEYS, specs, positions, closed_loop=closed_loop)
        error = jflashloop.decode_chain(chain) - loops[-1]
        return float(jnp.linalg.norm(error) / np.linalg.norm(loops[-1]))

    closed, opened = final_error(True), final_error(False)
    # Open loop carries loop 1's full quantization error to the end; closed loop
    # leaves only the last residual's much smaller error.
    assert closed * 3 < opened, (closed, opened)


@pytest.mark.parametrize(
    "positions, error, message",
    [
        (np.array([3, 1], np.int32), ValueError, "sorted"),
        (np.array([1, 1], np.int32), ValueError, "sorted"),
        (np.array([0, 99], np.int32), ValueError, r"\[0, 10\)"),
        (np.array([[1]], np.int32), ValueError, "1-D"),
        (np.array([0.5]), TypeError, "integers"),
    ],
)
def test_bad_positions_are_rejected(positions, error, message):
    x = jnp.ones((10, 1, 8))
    with pytest.raises(error, match=message):
        jflashloop.encode_residual(x, x, jflashloop.INT4_VALUES, positions)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="predecessor shape"):
        jflashloop.encode_residual(jnp.ones((10, 1, 8)), jnp.ones((9, 1, 8)), jflashloop.INT4_VALUES)
    residual = jflashloop.encode_residual(jnp.ones((10, 1, 8)), jnp.ones((10, 1, 8)), jflashloop.INT4_VALUES)
    with pytest.raises(ValueError, match="10"):
        jflashloop.decode_residual(residual, jnp.ones((9, 1, 8)))


def test_residual_storage(rng):
    target, predecessor = _looped(rng, 2, (64, 2, 32))
    sparse = jflashloop.encode_residual(target, predecessor, jflashloop.INT4_VALUES, np.arange(16, dtype=np.int32))
    # 16 rows x 2 heads x (16 payload bytes + 1 group x 4 metadata bytes) + 16 int32 positions
    assert sparse.nbytes == 16 * 2 * (16 + 4) + 16 * 4
    assert reference.int4.metadata_shape("token", 64, (16, 2, 32)) == (16, 2, 1)


def test_nonfinite_target_rows_do_not_spread(rng):
    target, predecessor = _looped(rng, 2, (16, 1, 16))
    target[3, 0, 5] = np.nan
    target[7, 0, 2] = np.inf
    for spec in (jflashloop.INT4_VALUES, NVFP4_RESIDUAL):
        residual = jflashloop.encode_residual(target, predecessor, spec)
        reconstructed = np.asarray(jflashloop.decode_residual(residual, predecessor))
        assert np.isfinite(reconstructed).all()
        clean = np.setdiff1d(np.arange(16), [3, 7])
        difference = (target - predecessor).astype(np.float32)
        expected = (predecessor + round_trip(difference, _codec(spec))).astype(np.float32)
        assert_bits_equal(reconstructed[clean], expected[clean], "rows without non-finite values")


def test_positions_are_checked_statically_under_jit():
    encode = jax.jit(jflashloop.encode_residual, static_argnums=2)
    x = jnp.ones((10, 1, 8))
    with pytest.raises(ValueError, match="1-D"):
        encode(x, x, jflashloop.INT4_VALUES, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="at most tokens=10"):
        encode(x, x, jflashloop.INT4_VALUES, jnp.arange(11, dtype=jnp.int32))
