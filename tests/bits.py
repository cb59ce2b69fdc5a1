"""Helpers comparing arrays bit for bit."""

from __future__ import annotations

import numpy as np

_UNSIGNED_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_bits(array) -> np.ndarray:
    """View any array as unsigned integers of the same width (exact bits)."""
    array = np.asarray(array)
    return array.view(_UNSIGNED_OF_WIDTH[array.dtype.itemsize])


def assert_bits_equal(actual, expected, what: str) -> None:
    """Assert two arrays have identical shapes and bit patterns."""
    actual_bits, expected_bits = raw_bits(actual), raw_bits(expected)
    assert actual_bits.shape == expected_bits.shape, (what, actual_bits.shape, expected_bits.shape)
    mismatch = np.flatnonzero(actual_bits != expected_bits)
    if mismatch.size:
        first = np.unravel_index(mismatch[0], actual_bits.shape)
        raise AssertionError(
            f"{what}: {mismatch.size} of {actual_bits.size} elements differ; first at {first}: "
            f"got {np.asarray(actual)[first]!r} (bits {actual_bits[first]:#x}), "
            f"expected {np.asarray(expected)[first]!r} (bits {expected_bits[first]:#x})"
        )


def assert_matches_affine_oracle(packed, statistics, decoded, x, spec, oracle_encode, oracle_decode) -> None:
    """An affine codec's (INT4, INT3) encode and decode against its numpy oracle, bit for bit.

    ``packed``/``statistics``/``decoded``: what the library gave for ``x`` under ``spec``;
    ``oracle_encode``/``oracle_decode``: e.g. ``reference.encode_int4`` and ``reference.decode_int4``.
    """
    expected = oracle_encode(x, spec.axis, spec.group_size)
    for name in ("payload", "minimum", "scale"):
        assert_bits_equal(getattr(packed, name), expected[name], name)
    assert int(statistics.nonfinite) == expected["nonfinite"]
    assert int(statistics.saturated) == expected["saturated"]
    oracle_decoded = oracle_decode(expected["payload"], expected["minimum"], expected["scale"], spec.axis,
                                   spec.group_size, x.shape)
    assert_bits_equal(decoded, oracle_decoded, "decoded")
