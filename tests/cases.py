"""Named hard-case inputs for codec tests (numpy float32 ``[T, H, C]``)."""

from __future__ import annotations

import numpy as np


def random_with_offsets(rng, shape):
    """Normal values with per-channel offsets and scales (K-like outliers)."""
    _tokens, heads, channels = shape
    offsets = rng.standard_normal((1, heads, channels)) * 3.0
    scales = np.exp(rng.uniform(-2.0, 2.0, (1, heads, channels)))
    return (rng.standard_normal(shape) * scales + offsets).astype(np.float32)


def int4_exact_ties(rng, shape):
    """Groups spanning [0, 15] exactly, so x = k + 0.5 is an exact rounding tie."""
    values = rng.integers(0, 15, shape).astype(np.float32) + np.float32(0.5)
    values.reshape(-1)[::7] = 0.0
    values.reshape(-1)[3::7] = 15.0
    return values


def affine_division_ties(rng, shape, *, max_code: int = 15, nudge: int = 2, token_pin: int = 16,
                         channel_pin: int = 16):
    """Values within an ulp of (k + 0.5) * scale for an inexact scale = span / ``max_code``.

    The code then depends on the last bit of the float32 quotient, which an
    incorrectly rounded division gets wrong. Offsets of ``-nudge..nudge``
    (+-1: one ulp down or up, +-2: the tie itself); every ``token_pin``-th
    token and ``channel_pin``-th channel pinned to 0 and the next to the span.
    """
    span = np.float32(rng.uniform(0.5, 3.0))
    scale = np.float32(span / np.float32(max_code))
    k = rng.integers(0, max_code, shape).astype(np.float32)
    ties = ((k + np.float32(0.5)) * scale).astype(np.float32)
    offsets = rng.integers(-nudge, nudge + 1, shape)
    values = np.nextafter(ties, np.where(offsets > 0, np.inf, -np.inf).astype(np.float32))
    values = np.where((offsets == 0) | (np.abs(offsets) == 2), ties, values).astype(np.float32)
    values[0::token_pin, :, :] = 0.0
    values[:, :, 0::channel_pin] = 0.0
    values[1::token_pin, :, :] = span
    values[:, :, 1::channel_pin] = span
    return values


def int4_division_ties(rng, shape):
    """:func:`affine_division_ties` for INT4 (scale = span / 15, pinned every 16)."""
    return affine_division_ties(rng, shape)


def zero_span(rng, shape):
    """Constant rows and columns (scale falls back to 1)."""
    constant = np.float32(rng.standard_normal())
    return np.full(shape, constant, np.float32)


def tiny(rng, shape):
    """Magnitudes around 1e-30 plus float32 subnormals."""
    values = rng.standard_normal(shape).astype(np.float32) * np.float32(1e-30)
    values.reshape(-1)[::5] = np.float32(1e-40)
    return values


def huge(rng, shape):
    """Magnitudes beyond float16 (metadata saturates at 65504)."""
    return (rng.standard_normal(shape) * 1e5).astype(np.float32)


def negative_zero(rng, shape):
    """A mix of +0.0, -0.0 and small values."""
    values = rng.standard_normal(shape).astype(np.float32) * np.float32(1e-3)
    choice = rng.integers(0, 3, shape)
    values = np.where(choice == 0, np.float32(0.0), values)
    values = np.where(choice == 1, np.float32(-0.0), values)
    return values.astype(np.float32)


def nvfp4_ties(rng, shape):
    """Block amax 6 and E2M1 midpoints; with global 1/6 the quotient is exact."""
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0, 0.5], np.float32)
    values = rng.choice(midpoints, shape) * rng.choice(np.array([1, -1], np.float32), shape)
    values[..., 0::16] = 6.0
    return values.astype(np.float32)


def nvfp4_scale_ties(rng, shape):
    """Block amaxes on E4M3 midpoints (with global 1/6 the local scale is amax)."""
    e4m3 = np.array([1.0, 1.125, 1.25, 2.0**-9, 2.0**-8, 448.0, 416.0], np.float64)
    midpoints = np.array([1.0625, 1.1875, 1.5 * 2.0**-9, 432.0, 500.0, 2.0**-11], np.float32)
    values = (rng.uniform(-1, 1, shape) * 0.5).astype(np.float32)
    candidates = np.concatenate([midpoints, e4m3.astype(np.float32)])
    for start in range(0, values.shape[-1], 16):
        values[..., start] = rng.choice(candidates, values.shape[:-1])
    return values


def nvfp4_division_ties(rng, shape, global_scale=1e-3):
    """Values within an ulp of E2M1 midpoints times each block's denominator.

    Meant for the given global scale ``1e-3``: the quotient's last bit then
    decides the code, which an incorrectly rounded division gets wrong.
    """
    from jflashloop_reference import floats, nvfp4

    global_scale = np.float32(global_scale)
    values = np.zeros(shape, np.float32)
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    for index in np.ndindex(*shape[:-1]):
        for start in range(0, shape[-1], 16):
            stop = min(start + 16, shape[-1])
            amax = np.float32(rng.uniform(0.01, 2.0))
            local = floats.e4m3_value(nvfp4.block_scale_code(amax, global_scale))
            denominator = np.float32(np.float32(local) * global_scale)
            block = (rng.choice(midpoints, stop - start) * denominator).astype(np.float32)
            nudge = rng.integers(-1, 2, stop - start)
            block = np.where(nudge == 0, block, np.nextafter(block, np.where(nudge > 0, np.inf, -np.inf).astype(np.float32)))
            block[0] = amax
            values[(*index, slice(start, stop))] = block * rng.choice([-1, 1])
    return values.astype(np.float32)


def nvfp4_saturating(rng, shape):
    """Values far beyond what a small given global scale can represent."""
    return (rng.standard_normal(shape) * 1e4).astype(np.float32)


def nonfinite(rng, shape):
    """Normal values with NaN, +inf and -inf sprinkled in, and one all-NaN row."""
    values = rng.standard_normal(shape).astype(np.float32)
    choice = rng.integers(0, 12, shape)
    values = np.where(choice == 0, np.float32(np.nan), values)
    values = np.where(choice == 1, np.float32(np.inf), values)
    values = np.where(choice == 2, np.float32(-np.inf), values)
    values.reshape(-1, shape[-1])[0] = np.nan
    return values.astype(np.float32)


def subnormal(rng, shape):
    """Float32 subnormals (read as signed zeros) mixed with small normal values."""
    values = (rng.standard_normal(shape) * 1e-38).astype(np.float32)
    values.reshape(-1)[::3] = np.float32(3e-39) * rng.choice(np.array([1, -1], np.float32))
    return values


CASES = {
    "random": random_with_offsets,
    "int4_exact_ties": int4_exact_ties,
    "int4_division_ties": int4_division_ties,
    "zero_span": zero_span,
    "tiny": tiny,
    "huge": huge,
    "negative_zero": negative_zero,
    "nvfp4_ties": nvfp4_ties,
    "nvfp4_scale_ties": nvfp4_scale_ties,
    "nvfp4_division_ties": nvfp4_division_ties,
    "nvfp4_saturating": nvfp4_saturating,
    "nonfinite": nonfinite,
    "subnormal": subnormal,
}
