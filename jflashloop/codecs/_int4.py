"""The affine codecs, INT4 (FlashLoop-compatible), INT3, INT2 and the fitted ``int_mixed`` and ``int4_scaled``,
bit-exact with ``reference.int4`` / ``int3`` / ``int2`` / ``fitted``.

Per group in float32: ``min = amin(x)`` (-0.0 counted as +0.0), ``span = amax(x) - min``,
``scale = span / M`` (``1`` when ``span < 2**-121``), ``code = clamp(rne((x - min) /
scale), 0, M)`` with ``M = 15`` for INT4, ``7`` for INT3 and ``3`` for INT2
(:data:`~jflashloop.codecs._spec.AFFINE_MAX_CODE`); min and scale are then
stored as float16 (RNE, saturating at +-65504). Decode: ``code *
float32(scale16) + float32(min16)``. INT4 packs two codes per byte
(:func:`~jflashloop.codecs._packed.pack_nibbles`), INT3 eight codes per three
bytes (:func:`~jflashloop.codecs._packed.pack_triplets`), INT2 four codes per byte
(:func:`~jflashloop.codecs._packed.pack_crumbs`). ``int_mixed`` takes ``M = 2**b - 1`` for each
channel's width ``b`` and packs a bit stream of those widths (:func:`~jflashloop.codecs._packed.pack_widths`);
``int4_scaled`` is INT4 of ``x / s`` (``s`` per head and channel, 9 significant bits), decoded as
``code * (scale16 * s) + min16 * s`` (exact products).

float32 subnormal inputs are read as zeros and a group whose span is below
``2**-121`` gets scale 1 (:data:`MINIMUM_SPAN`), so no subnormal arithmetic
decides a stored bit. Non-finite elements take no part in min and max (a group without a finite
element counts as all zeros); +inf is stored as code ``M``, -inf as code 0 and
NaN as the code of 0.0. :func:`encode_affine_with_statistics` counts them and
the finite elements of groups whose metadata overflows float16.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..ops._division import divide
from . import _floats as floats
from ._packed import (
    Packed,
    pack_crumbs,
    pack_nibbles,
    pack_triplets,
    pack_widths,
    unpack_crumbs,
    unpack_nibbles,
    unpack_triplets,
    unpack_widths,
)
from ._spec import AFFINE_MAX_CODE, CodecSpec
from ._statistics import EncodeStatistics, count, int4_saturated_groups

MINIMUM_SPAN = 2.0**-121
"""Groups whose span is below this are encoded like constant groups (scale 1).

Their scale would be below ``2**-125``, where float32 subnormal arithmetic
(flushed to zero by XLA on CPU, kept by numpy) could change a code; every
such group decodes to its float16 min either way (its float16 scale would be 0).
"""
_PACKINGS = {"int4": (pack_nibbles, unpack_nibbles), "int3": (pack_triplets, unpack_triplets),
             "int2": (pack_crumbs, unpack_crumbs), "int4_scaled": (pack_nibbles, unpack_nibbles)}


def max_codes(spec: CodecSpec) -> jax.Array:
    """float32 top code: ``[]``, or ``[H, C]`` for ``int_mixed`` (``2**width - 1``, broadcasting against the
    channel axis' metadata ``[groups, H, C]``)."""
    if spec.format == "int_mixed":
        return jnp.asarray(2.0 ** np.asarray(spec.channel_bits) - 1.0, jnp.float32)
    return jnp.float32(AFFINE_MAX_CODE[spec.format])


def pack_codes(codes: jax.Array, spec: CodecSpec) -> jax.Array:
    """uint8 codes ``[T, H, C]`` as the spec's payload bytes."""
    if spec.format == "int_mixed":
        return pack_widths(codes, spec.channel_bits)
    return _PACKINGS[spec.format][0](codes)


def unpack_codes(payload: jax.Array, spec: CodecSpec, channels: int) -> jax.Array:
    """Inverse of :func:`pack_codes`: uint8 codes ``[T, H, C]``."""
    if spec.format == "int_mixed":
        return unpack_widths(payload, spec.channel_bits)
    return _PACKINGS[spec.format][1](payload, channels)


def channel_scales(spec: CodecSpec) -> jax.Array:
    """float32 ``[H, C]``: ``int4_scaled``'s divisors."""
    return jnp.asarray(np.asarray(spec.channel_scale, np.float32))


def _grouped(x: jax.Array, spec: CodecSpec) -> jax.Array:
    """View ``[T, H, C]`` as groups; partial groups are padded with edge values.

    Returns ``[T/G, G, H, C]`` for the channel axis and ``[T, H, C/G, G]`` for
    the token axis (sizes rounded up). Edge padding repeats a member of the
    group, so it changes neither its min nor its max.
    """
    tokens, _, channels = x.shape
    group = spec.group_size
    if spec.axis == "channel":
        padded = math.ceil(tokens / group) * group
        x = jnp.pad(x, [(0, padded - tokens), (0, 0), (0, 0)], mode="edge")
        return x.reshape(padded // group, group, *x.shape[1:])
    padded = math.ceil(channels / group) * group
    x = jnp.pad(x, [(0, 0), (0, 0), (0, padded - channels)], mode="edge")
    return x.reshape(*x.shape[:2], padded // group, group)


def _ungrouped(grouped: jax.Array, spec: CodecSpec, shape) -> jax.Array:
    """Inverse of :func:`_grouped` (drops the padding)."""
    tokens, heads, channels = shape
    if spec.axis == "channel":
        return grouped.reshape(-1, heads, channels)[:tokens]
    return grouped.reshape(tokens, heads, -1)[..., :channels]


def _expand(metadata: jax.Array, spec: CodecSpec) -> jax.Array:
    """Insert the within-group axis so metadata broadcasts against groups."""
    return metadata[:, None] if spec.axis == "channel" else metadata[..., None]


def group_parameters(x: jax.Array, spec: CodecSpec, implementation: str):
    """float32 per-group ``(minimum, scale)`` of ``x`` float32 ``[T, H, C]``.

    Both are shaped ``spec.metadata_shape(x.shape)``.
    """
    groups = _grouped(x, spec)
    # -0.0 counts as +0.0, so the result never depends on reduction order.
    groups = jnp.where(groups == 0, jnp.float32(0.0), groups)
    finite = jnp.isfinite(groups)
    reduce_axis = 1 if spec.axis == "channel" else -1
    minimum = jnp.where(finite, groups, jnp.inf).min(axis=reduce_axis)
    maximum = jnp.where(finite, groups, -jnp.inf).max(axis=reduce_axis)
    has_finite = minimum <= maximum  # both infinite (and crossed) when no member is finite
    minimum = jnp.where(has_finite, minimum, jnp.float32(0.0))
    span = jnp.where(has_finite, maximum, jnp.float32(0.0)) - minimum
    scale = jnp.where(
        span >= MINIMUM_SPAN,
        divide(span, max_codes(spec), implementation),
        jnp.float32(1.0),
    )
    return minimum, scale


def codes_from_parameters(x, minimum, scale, spec: CodecSpec, implementation: str) -> jax.Array:
    """uint8 codes ``[T, H, C]`` of float32 ``x`` given float32 group parameters.

    NaN is coded as 0.0 would be; +-inf clamp to the top code and 0.
    """
    groups = _grouped(jnp.where(jnp.isnan(x), jnp.float32(0.0), x), spec)
    quotient = divide(
        groups - _expand(minimum, spec), _expand(scale, spec), implementation
    )
    codes = jnp.clip(floats.round_half_to_even(quotient), 0.0, max_codes(spec))
    codes = jnp.where(jnp.isnan(codes), 0.0, codes)
    return _ungrouped(codes, spec, x.shape).astype(jnp.uint8)


def statistics_from_parameters(x, minimum, scale, spec: CodecSpec) -> EncodeStatistics:
    """Non-finite elements of float32 ``x`` and finite members of float16-overflowing groups."""
    finite = jnp.isfinite(x)
    overflow = int4_saturated_groups(minimum, scale)
    grouped_shape = _grouped(x, spec).shape
    member_overflow = _ungrouped(jnp.broadcast_to(_expand(overflow, spec), grouped_shape), spec, x.shape)
    return EncodeStatistics(nonfinite=count(~finite), saturated=count(member_overflow & finite))


def affine_input(x: jax.Array, spec: CodecSpec, implementation: str) -> jax.Array:
    """float32 ``[T, H, C]``: what the affine rule codes (subnormals read as zeros; ``int4_scaled``: ``x / s``,
    correctly rounded, flushed again)."""
    x = floats.flush_subnormals(x.astype(jnp.float32))
    if spec.format == "int4_scaled":
        x = floats.flush_subnormals(divide(x, channel_scales(spec), implementation))
    return x


def _encode(x: jax.Array, spec: CodecSpec, implementation: str):
    x = affine_input(x, spec, implementation)
    minimum, scale = group_parameters(x, spec, implementation)
    codes = codes_from_parameters(x, minimum, scale, spec, implementation)
    packed = Packed(
        payload=pack_codes(codes, spec),
        scale=floats.round_to_float16(scale).astype(jnp.float16),
        minimum=floats.round_to_float16(minimum).astype(jnp.float16),
        global_scale=None,
        spec=spec,
        shape=tuple(x.shape),
    )
    return packed, x, minimum, scale


def encode_affine(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    """Encode ``x`` ``[T, H, C]`` (float32/bfloat16/float16) with an INT4 or INT3 ``spec``."""
    return _encode(x, spec, implementation)[0]


def encode_affine_with_statistics(
    x: jax.Array, spec: CodecSpec, implementation: str
) -> tuple[Packed, EncodeStatistics]:
    """:func:`encode_affine` and its :class:`EncodeStatistics`."""
    packed, x, minimum, scale = _encode(x, spec, implementation)
    return packed, statistics_from_parameters(x, minimum, scale, spec)


def affine_statistics(x: jax.Array, spec: CodecSpec, implementation: str) -> EncodeStatistics:
    """The :class:`EncodeStatistics` of encoding ``x`` ``[T, H, C]``, without encoding it."""
    x = affine_input(x, spec, implementation)
    minimum, scale = group_parameters(x, spec, implementation)
    return statistics_from_parameters(x, minimum, scale, spec)


def decode_affine(packed: Packed) -> jax.Array:
    """float32 ``[T, H, C]``: ``code * float32(scale16) + float32(min16)`` (``int4_scaled``: ``code * (scale16 * s)
    + min16 * s``)."""
    spec, shape = packed.spec, packed.shape
    codes = unpack_codes(packed.payload, spec, shape[2]).astype(jnp.float32)
    groups = _grouped(codes, spec)
    scale = _expand(packed.scale.astype(jnp.float32), spec)
    minimum = _expand(packed.minimum.astype(jnp.float32), spec)
    if spec.format == "int4_scaled":
        # code * (scale16 * s) + min16 * s: both products are exact (11 + 9 significant bits, then 4 + 20), so a
        # fused multiply-add, wherever a compiler forms one, rounds exactly as the separate operations do.
        def per_element(metadata):
            return _ungrouped(jnp.broadcast_to(metadata, groups.shape), spec, shape) * channel_scales(spec)

        return codes * per_element(scale) + per_element(minimum)
    return _ungrouped(groups * scale + minimum, spec, shape)
