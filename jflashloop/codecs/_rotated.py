"""Rotated and lattice KV codecs, bit-exact with ``reference.rotations``.

* ``int4_rotated`` (vLLM's INT4 per token-head): a randomized Hadamard
  rotation of the head dimension (signs from ``CodecSpec.rotation_seed``),
  then asymmetric 4-bit codes with one float32 scale per (token, head) whose
  4 low mantissa bits hold the zero point. Queries take the same rotation, so
  ``q . k = (Rq) . (Rk)`` and the score correction is ``scale * zp * sum(Rq)``.
  Its input rule (:func:`int4_rotated_input`): NaN and +-inf are read as 0
  and finite values beyond +-2**64 as +-2**64 (saturated), so neither the
  rotation nor its inverse can overflow; :func:`encode_int4_rotated_with_statistics`
  counts both.
* ``int2_lloyd_max``: the same rotation, then the 4-level Lloyd-Max quantizer
  of N(0, 1) (levels +-0.4528, +-1.5104; thresholds 0, +-0.9816) scaled by
  the vector's RMS, stored as one float16 per (token, head).
* ``int3_lloyd_max``: the same with the 8-level quantizer (levels +-0.2451,
  +-0.7560, +-1.3439, +-2.1519; thresholds 0, +-0.5006, +-1.0500, +-1.7479),
  codes packed as INT3's (:func:`~jflashloop.codecs._packed.pack_triplets`).
* ``e8`` (the K half of rk2v4-e8): a normalized Hadamard over the head, one
  float16 scale per 64 channels (``amax / 1.5``), and per 8 channels two
  bytes: the nearest of 241 E8 codewords (zero and the 240 roots), then the
  nearest codeword to twice the remainder (so ``x ~ s (c_a + c_b / 2)``).
* ``int4_group_rotated`` (the V half of rk2v4-e8): per 64-channel group a
  normalized Hadamard, then symmetric 4-bit codes (-8..7) with one float16
  scale (``amax / 7``).

Every rounding is specified (see the oracle): rotations are butterflies of
exact-order float32 additions, divisions are correctly rounded
(:func:`jflashloop.ops._division.divide`), squares for the RMS are of bfloat16-
rounded values (exact in float32, so no compiler can fuse them differently),
and E8 scores are sums of exact products.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..ops._division import divide
from . import _floats as floats
from ._packed import Packed, pack_nibbles, pack_triplets, unpack_nibbles, unpack_triplets
from ._spec import CodecSpec
from ._statistics import EncodeStatistics, count

MASK64 = (1 << 64) - 1
LLOYD_MAX_THRESHOLD = 0.9816
LLOYD_MAX_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)
LLOYD_MAX_3_THRESHOLDS = (-1.7479, -1.05, -0.5006, 0.0, 0.5006, 1.05, 1.7479)
LLOYD_MAX_3_LEVELS = (-2.1519, -1.3439, -0.756, -0.2451, 0.2451, 0.756, 1.3439, 2.1519)
E8_SCALE_DIVISOR = 1.5
INT4_SYMMETRIC_DIVISOR = 7.0
INT4_ROTATED_INPUT_LIMIT = 2.0**64
"""Largest input magnitude ``int4_rotated`` stores as is (larger ones saturate to it).

With ``|x| <= L`` over ``D`` channels, every partial sum of the rotation is at
most ``D * L``, the scale at most ``2 * sqrt(D) * L / 15``, and every partial
sum of the inverse (the transform of the integer levels, then the scale) at
most ``2 * D**1.5 * L``: all finite in float32 for any head below ``2**42`` channels.
"""


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


@functools.cache
def random_signs(seed: int, dim: int) -> np.ndarray:
    """float32 ``[dim]`` of +-1: bit 0 of splitmix64(``seed * 2**32 + i``) set means -1."""
    return np.array(
        [-1.0 if _splitmix64(((seed & 0xFFFFFFFF) << 32) + i) & 1 else 1.0 for i in range(dim)],
        np.float32,
    )


def hadamard_transform(x: jax.Array) -> jax.Array:
    """Unnormalized Walsh-Hadamard transform over the last axis (a power of two).

    Butterflies ``(a, b) -> (a + b, a - b)`` at distances 1, 2, 4, ...: the same
    float32 additions, in the same order, as the oracle.
    """
    *lead, dim = x.shape
    if dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {dim}")
    distance = 1
    while distance < dim:
        pairs = x.reshape(*lead, dim // (2 * distance), 2, distance)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([first + second, first - second], axis=-2).reshape(*lead, dim)
        distance *= 2
    return x


def _inverse_sqrt(dim: int) -> np.float32:
    return np.float32(1.0 / math.sqrt(dim))


def _times_inverse_sqrt(x: jax.Array, dim: int) -> jax.Array:
    """``x * float32(1/sqrt(dim))``, with the final multiplication exact.

    ``float32(1/sqrt(dim)) = m * 2**k``; ``(x * m) * 2**k`` rounds once, like
    ``x * float32(1/sqrt(dim))``, and its last product is exact, so a consumer's
    addition fused into a multiply-add (XLA on CPU does this) gives the same bits.
    """
    mantissa, exponent = math.frexp(float(_inverse_sqrt(dim)))
    return (x * np.float32(mantissa)) * np.float32(2.0**exponent)


def rotate(x: jax.Array, seed: int | None) -> jax.Array:
    """``H (signs * x) / sqrt(D)`` over the last axis (no signs when ``seed`` is None)."""
    dim = x.shape[-1]
    if seed is not None:
        x = x * random_signs(seed, dim)
    return _times_inverse_sqrt(hadamard_transform(x), dim)


def unrotate(y: jax.Array, seed: int | None) -> jax.Array:
    """Inverse of :func:`rotate`."""
    dim = y.shape[-1]
    x = _times_inverse_sqrt(hadamard_transform(y), dim)
    return x if seed is None else x * random_signs(seed, dim)


@functools.cache
def rotation_matrix(seed: int | None, dim: int, inverse: bool = False) -> np.ndarray:
    """float32 ``[dim, dim]`` ``M`` (read-only) with ``x @ M`` = :func:`rotate` ``(x, seed)`` in exact
    arithmetic (:func:`unrotate` with ``inverse``): ``signs_i H_ij / sqrt(dim)`` (``H_ij sign_j / sqrt(dim)``),
    ``H`` the Sylvester-ordered Hadamard matrix the butterflies apply.

    Raises:
      ValueError: ``dim`` is not a power of two.
    """
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {dim}")
    hadamard = np.ones((1, 1), np.float64)
    while hadamard.shape[0] < dim:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = np.ones(dim) if seed is None else random_signs(seed, dim).astype(np.float64)
    matrix = hadamard * signs[None, :] if inverse else signs[:, None] * hadamard
    matrix = (matrix / math.sqrt(dim)).astype(np.float32)
    matrix.setflags(write=False)
    return matrix


def rotate_by_product(x: jax.Array, seed: int | None, *, inverse: bool = False) -> jax.Array:
    """:func:`rotate` (:func:`unrotate` with ``inverse``) of float32 ``x [..., D]`` as one float32 matrix
    product with :func:`rotation_matrix` (precision HIGHEST): float32 ``[..., D]``.

    Not bit-exact with the butterflies (the product sums in its own order; the two differ by float32
    rounding, within ``2e-6`` of the row's norm). For the fused kernels' queries, windows and outputs,
    which no oracle fixes bit for bit: XLA makes it one GEMM where the butterflies become a chain of
    fusions and slices around the kernel (H200, ``bench/RESULTS.md``: int4_rotated's whole call 45.5
    against 54.6 us of GPU time at B1 Hq16 Hkv16 T64K). Encoding keeps :func:`rotate`.
    """
    matrix = rotation_matrix(seed, x.shape[-1], inverse)
    return jnp.matmul(x, matrix, precision=jax.lax.Precision.HIGHEST)


def _pack_crumbs(codes: jax.Array) -> jax.Array:
    """uint8 2-bit codes ``[..., C]`` (C % 4 == 0) -> ``[..., C / 4]``, channel ``4b + i`` in bits ``2i``."""
    quads = codes.reshape(*codes.shape[:-1], -1, 4).astype(jnp.uint8)
    return (quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)).astype(jnp.uint8)


def _unpack_crumbs(payload: jax.Array) -> jax.Array:
    shifts = jnp.arange(4, dtype=jnp.uint8) * 2
    return ((payload[..., None] >> shifts) & 3).reshape(*payload.shape[:-1], -1)


def _to_float16(x: jax.Array) -> jax.Array:
    return floats.round_to_float16(x).astype(jnp.float16)


def _used_scale(scale16: jax.Array) -> jax.Array:
    scale = scale16.astype(jnp.float32)
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


# ---------------------------------------------------------------- int4_rotated


def int4_rotated_input(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What ``int4_rotated`` encodes of float32 ``x``: its one saturation rule.

    The rotation mixes every channel of a (token, head) vector, so a
    non-finite element cannot keep a code of its own: NaN and +-inf are read
    as 0. Finite values beyond :data:`INT4_ROTATED_INPUT_LIMIT` (``2**64``)
    are read as +-2**64. Every other value (signed zeros included) is unchanged.

    Returns:
      ``(values, nonfinite, saturated)``: float32 values and two bool masks,
      all of ``x``'s shape.
    """
    finite = jnp.isfinite(x)
    limit = jnp.float32(INT4_ROTATED_INPUT_LIMIT)
    values = jnp.where(finite, jnp.clip(x, -limit, limit), jnp.float32(0.0))
    return values, ~finite, finite & (jnp.abs(x) > limit)


def int4_rotated_statistics(x: jax.Array) -> EncodeStatistics:
    """The :class:`EncodeStatistics` of encoding ``x`` ``[T, H, D]`` as ``int4_rotated``."""
    _, nonfinite, saturated = int4_rotated_input(x.astype(jnp.float32))
    return EncodeStatistics(nonfinite=count(nonfinite), saturated=count(saturated))


def _encode_int4_rotated(x: jax.Array, spec: CodecSpec, implementation: str):
    values, nonfinite, saturated = int4_rotated_input(x.astype(jnp.float32))
    y = rotate(values, spec.rotation_seed)
    low = jnp.minimum(jnp.min(y, axis=-1, keepdims=True), 0.0)
    high = jnp.maximum(jnp.max(y, axis=-1, keepdims=True), 0.0)
    span = high - low
    scale = jnp.where(span > 0, divide(span, jnp.float32(15.0), implementation), jnp.float32(1.0))
    zero_point = jnp.clip(jnp.round(divide(-low, scale, implementation)), 0.0, 15.0)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFFFFFFF0)
    stored = jax.lax.bitcast_convert_type(bits | zero_point.astype(jnp.uint32), jnp.float32)
    codes = jnp.clip(jnp.round(divide(y, stored, implementation)) + zero_point, 0.0, 15.0)
    packed = Packed(pack_nibbles(codes.astype(jnp.uint8)), stored, None, None, spec, tuple(x.shape))
    return packed, EncodeStatistics(nonfinite=count(nonfinite), saturated=count(saturated))


def encode_int4_rotated(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    """Encode ``x`` float32/bfloat16/float16 ``[T, H, D]`` (``D == spec.group_size``)."""
    return _encode_int4_rotated(x, spec, implementation)[0]


def encode_int4_rotated_with_statistics(
    x: jax.Array, spec: CodecSpec, implementation: str
) -> tuple[Packed, EncodeStatistics]:
    """:func:`encode_int4_rotated` and the counts of :func:`int4_rotated_input`'s two masks."""
    return _encode_int4_rotated(x, spec, implementation)


def zero_points(stored_scale: jax.Array) -> jax.Array:
    """float32 zero points held in the 4 low mantissa bits of ``int4_rotated`` scales."""
    return (jax.lax.bitcast_convert_type(stored_scale, jnp.uint32) & jnp.uint32(15)).astype(jnp.float32)


def scaled_unrotate(levels: jax.Array, scale: jax.Array, seed: int) -> jax.Array:
    """``signs * ((H levels) * scale * 1/sqrt(D))``: ``R^-1 (levels * scale)`` with the transform first.

    Equal in exact arithmetic; evaluated this way no addition follows a
    rounded product, so a compiler's fused multiply-adds cannot change the bits.
    """
    dim = levels.shape[-1]
    return _times_inverse_sqrt(hadamard_transform(levels) * scale, dim) * random_signs(seed, dim)


def decode_int4_rotated(packed: Packed, rotated: bool = False) -> jax.Array:
    """float32 ``[T, H, D]`` (``(code - zp) * scale`` in the rotated basis when ``rotated``)."""
    codes = unpack_nibbles(packed.payload, packed.shape[2]).astype(jnp.float32)
    levels = codes - zero_points(packed.scale)  # exact small integers
    if rotated:
        return levels * packed.scale
    return scaled_unrotate(levels, packed.scale, packed.spec.rotation_seed)


# ---------------------------------------------------------------- int2_lloyd_max


def _pairwise_sum(x: jax.Array) -> jax.Array:
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _rotated_rms(y: jax.Array) -> jax.Array:
    """float32 ``[..., 1]``: the RMS of rotated rows ``y`` (squares of their bfloat16 roundings, pairwise sum;
    subnormal squares and means count as zero; 1 for a zero row)."""
    rounded = floats.round_mantissa(y, dropped_bits=16)  # bfloat16 value (RNE) as float32
    tiny = np.float32(np.finfo(np.float32).tiny)
    squares = rounded * rounded
    squares = jnp.where(squares >= tiny, squares, 0.0)  # subnormals count as zero on every backend
    mean = _pairwise_sum(squares) * np.float32(1.0 / y.shape[-1])
    mean = jnp.where(mean >= tiny, mean, 0.0)
    return jnp.where(mean > 0, jnp.sqrt(mean), jnp.float32(1.0))


def lloyd_max_codes(u: jax.Array, thresholds) -> jax.Array:
    """uint8 codes of float32 ``u`` (any shape): how many of the increasing ``thresholds`` each value exceeds
    (a value equal to a threshold takes the code below it; one below float32's smallest normal in magnitude
    counts as zero, as XLA's CPU comparisons read it)."""
    u = jnp.where(jnp.abs(u) >= np.float32(np.finfo(np.float32).tiny), u, 0.0)
    codes = jnp.zeros(u.shape, jnp.uint8)
    for threshold in thresholds:
        codes = codes + (u > jnp.float32(threshold)).astype(jnp.uint8)
    return codes


def _encode_lloyd_max(x: jax.Array, spec: CodecSpec, implementation: str, thresholds, pack) -> Packed:
    y = rotate(x.astype(jnp.float32), spec.rotation_seed)
    sigma = _rotated_rms(y)
    codes = lloyd_max_codes(divide(y, sigma, implementation), thresholds)
    return Packed(pack(codes), _to_float16(sigma), None, None, spec, tuple(x.shape))


def _decode_lloyd_max(packed: Packed, codes: jax.Array, levels) -> jax.Array:
    values = jnp.asarray(levels, jnp.float32)[codes.astype(jnp.int32)]
    return scaled_unrotate(values, packed.scale.astype(jnp.float32), packed.spec.rotation_seed)


def encode_int2_lloyd_max(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    thresholds = (-LLOYD_MAX_THRESHOLD, 0.0, LLOYD_MAX_THRESHOLD)
    return _encode_lloyd_max(x, spec, implementation, thresholds, _pack_crumbs)


def decode_int2_lloyd_max(packed: Packed) -> jax.Array:
    return _decode_lloyd_max(packed, _unpack_crumbs(packed.payload), LLOYD_MAX_LEVELS)


def encode_int3_lloyd_max(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    return _encode_lloyd_max(x, spec, implementation, LLOYD_MAX_3_THRESHOLDS, pack_triplets)


def decode_int3_lloyd_max(packed: Packed) -> jax.Array:
    return _decode_lloyd_max(packed, unpack_triplets(packed.payload, packed.shape[2]), LLOYD_MAX_3_LEVELS)


# ---------------------------------------------------------------- e8


@functools.cache
def e8_codebook() -> np.ndarray:
    """float32 ``[241, 8]``: zero, the 112 roots ``(+-1, +-1, 0^6)``, the 128 even-sign ``(+-1/2)^8``."""
    book = [(0.0,) * 8]
    for i, j in itertools.combinations(range(8), 2):
        for si, sj in ((1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)):
            v = [0.0] * 8
            v[i], v[j] = si, sj
            book.append(tuple(v))
    for mask in range(256):
        if bin(mask).count("1") % 2 == 0:
            book.append(tuple(-0.5 if mask >> k & 1 else 0.5 for k in range(8)))
    return np.array(book, np.float32)


def nearest_e8(blocks: jax.Array) -> jax.Array:
    """uint8 index of the nearest codeword for float32 ``[..., 8]`` (ties: lowest index)."""
    book = e8_codebook()
    half_norms = (book**2).sum(axis=1) / 2
    total = blocks[..., 0:1] * book[:, 0]
    for k in range(1, 8):
        total = total + blocks[..., k : k + 1] * book[:, k]  # exact products, channel order
    return jnp.argmax(total - half_norms, axis=-1).astype(jnp.uint8)


def encode_e8(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    tokens, heads, dim = x.shape
    group = spec.group_size
    y = rotate(x.astype(jnp.float32), None).reshape(tokens, heads, dim // group, group)
    scale = divide(jnp.max(jnp.abs(y), axis=-1), jnp.float32(E8_SCALE_DIVISOR), implementation)
    scale16 = _to_float16(scale)
    blocks = divide(y, _used_scale(scale16)[..., None], implementation).reshape(tokens, heads, -1, 8)
    book = jnp.asarray(e8_codebook())
    first = nearest_e8(blocks)
    second = nearest_e8(2.0 * (blocks - book[first.astype(jnp.int32)]))
    payload = jnp.stack([first, second], axis=-1).reshape(tokens, heads, dim // 4)
    return Packed(payload, scale16, None, None, spec, tuple(x.shape))


def decode_e8(packed: Packed) -> jax.Array:
    tokens, heads, dim = packed.shape
    group = packed.spec.group_size
    codes = packed.payload.reshape(tokens, heads, dim // 8, 2).astype(jnp.int32)
    book = jnp.asarray(e8_codebook())
    blocks = book[codes[..., 0]] + book[codes[..., 1]] * 0.5  # exact
    y = blocks.reshape(tokens, heads, dim // group, group) * _used_scale(packed.scale)[..., None]
    return rotate(y.reshape(tokens, heads, dim), None)


# ---------------------------------------------------------------- int4_group_rotated


def encode_int4_group_rotated(x: jax.Array, spec: CodecSpec, implementation: str) -> Packed:
    tokens, heads, dim = x.shape
    group = spec.group_size
    y = rotate(x.astype(jnp.float32).reshape(tokens, heads, dim // group, group), None)
    scale = divide(jnp.max(jnp.abs(y), axis=-1), jnp.float32(INT4_SYMMETRIC_DIVISOR), implementation)
    scale16 = _to_float16(scale)
    codes = jnp.clip(jnp.round(divide(y, _used_scale(scale16)[..., None], implementation)), -8.0, 7.0)
    codes = (codes + 8.0).astype(jnp.uint8).reshape(tokens, heads, dim)
    return Packed(pack_nibbles(codes), scale16, None, None, spec, tuple(x.shape))


def decode_int4_group_rotated(packed: Packed) -> jax.Array:
    tokens, heads, dim = packed.shape
    group = packed.spec.group_size
    codes = unpack_nibbles(packed.payload, dim).astype(jnp.float32) - 8.0
    y = codes.reshape(tokens, heads, dim // group, group) * _used_scale(packed.scale)[..., None]
    return rotate(y, None).reshape(tokens, heads, dim)
