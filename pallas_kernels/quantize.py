"""Quantize-on-write: encode page tiles to INT4 or NVFP4 in one Pallas-Triton kernel.

Each program encodes one ``[rows, head_dim]`` tile (one page of one KV head of
one stream) and writes its packed words and metadata, bit-exact with the
``reference`` oracles: float32 divisions are PTX ``div.rn.f32`` (correctly
rounded), rounding to integers uses the float adder's own round-half-even, and
float16/E4M3 roundings are exact conversions of exactly computed values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from .exact_division import divide_rn

FLOAT16_MAX = 65504.0
FLOAT32_MIN_NORMAL = 2.0**-126
MINIMUM_SPAN = 2.0**-121  # INT4 groups with a smaller span get scale 1 (jflashloop/codecs/_int4.py)


@dataclasses.dataclass(frozen=True)
class TileFormat:
    """Static codec of the tiles: ``format`` ("int4"/"nvfp4"), ``axis``, ``group_size``."""

    format: str
    axis: str
    group_size: int


def _round_half_even(x, interpret):
    """Round float32 to the nearest integer, ties to even (PTX ``cvt.rni`` on GPU).

    Triton has no ``round``; the compiled kernel issues the rounding
    instruction itself, interpret mode uses ``jnp.round`` (also ties to even).
    """
    if interpret:
        return jnp.round(x)
    (rounded,) = pallas_triton.elementwise_inline_asm(
        "cvt.rni.f32.f32 $0, $1;",
        args=[x],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return rounded


def _float16_value(x):
    """Saturating RNE float16 rounding (the conversion itself is RNE on every backend)."""
    return jnp.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(jnp.float16)


def _e4m3_round(x, interpret):
    """float32 in [2**-9, 448] -> nearest E4M3 value (RNE) as float32, by integer arithmetic."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x7FFFF) + ((bits >> 20) & jnp.uint32(1))) & jnp.uint32(0xFFF00000)
    normal = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    subnormal = _round_half_even(x * jnp.float32(512.0), interpret) * jnp.float32(2.0**-9)
    return jnp.where(x >= 2.0**-6, normal, subnormal)


def _e4m3_bits(value):
    """uint8 float8_e4m3fn bit pattern of a float32 that is exactly an E4M3 value in [2**-9, 448]."""
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32).astype(jnp.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = (bits >> 20) & 7
    normal = ((exponent - 120) << 3) | mantissa
    subnormal = (value * jnp.float32(512.0)).astype(jnp.int32)
    return jnp.where(value >= 2.0**-6, normal, subnormal).astype(jnp.uint8)


def _pack_words(codes):
    """int32 codes ``[rows, D]`` (0-15) -> uint32 words ``[rows, D/8]``."""
    rows, head_dim = codes.shape
    nibbles = codes.astype(jnp.uint32).reshape(rows, head_dim // 8, 8)
    shifts = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 8), 2) * jnp.uint32(4)
    return jnp.sum(nibbles << shifts, axis=-1).astype(jnp.uint32)


def _flush_subnormals(x):
    """Subnormal float32 values become zeros of their sign (the codecs read them so)."""
    sign_only = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x80000000), jnp.float32
    )
    return jnp.where(jnp.abs(x) < FLOAT32_MIN_NORMAL, sign_only, x)


def _is_finite(x):
    return jnp.abs(x) < jnp.inf  # False for NaN and +-inf


def _int4_codes(x, minimum, scale, interpret):
    x = jnp.where(x == x, x, 0.0)  # NaN is coded as 0.0 would be
    quotient = divide_rn(x - minimum, scale, interpret=interpret)
    codes = jnp.clip(_round_half_even(quotient, interpret), 0.0, 15.0)
    return jnp.where(codes == codes, codes, 0.0).astype(jnp.int32)  # NaN -> 0


def _group_range(grouped, axis):
    """(min, span) over finite members; a group with none counts as all zeros."""
    finite = _is_finite(grouped)
    minimum = jnp.min(jnp.where(finite, grouped, jnp.inf), axis=axis)
    maximum = jnp.max(jnp.where(finite, grouped, -jnp.inf), axis=axis)
    has_finite = minimum <= maximum
    minimum = jnp.where(has_finite, minimum, 0.0)
    return minimum, jnp.where(has_finite, maximum, 0.0) - minimum


def _int4_tile(x, fmt: TileFormat, interpret):
    rows, head_dim = x.shape
    group = fmt.group_size
    stats = jnp.where(x == 0, 0.0, x)  # -0.0 counts as +0.0
    if fmt.axis == "channel":
        grouped = stats.reshape(rows // group, group, head_dim)
        minimum, span = _group_range(grouped, 1)
        scale = jnp.where(
            span >= MINIMUM_SPAN, divide_rn(span, jnp.full_like(span, 15.0), interpret=interpret), 1.0
        )
        codes = _int4_codes(
            x.reshape(rows // group, group, head_dim), minimum[:, None, :], scale[:, None, :], interpret
        ).reshape(rows, head_dim)
    else:
        group = min(group, head_dim)
        grouped = stats.reshape(rows, head_dim // group, group)
        minimum, span = _group_range(grouped, -1)
        scale = jnp.where(
            span >= MINIMUM_SPAN, divide_rn(span, jnp.full_like(span, 15.0), interpret=interpret), 1.0
        )
        codes = _int4_codes(
            x.reshape(rows, head_dim // group, group), minimum[:, :, None], scale[:, :, None], interpret
        ).reshape(rows, head_dim)
    return _pack_words(codes), _float16_value(scale), _float16_value(minimum)


def _e2m1_code(magnitude):
    one = jnp.int32(1)
    zero = jnp.int32(0)

    def step(condition):
        return jnp.where(condition, one, zero)

    return (
        step(magnitude > 0.25) + step(magnitude >= 0.75) + step(magnitude > 1.25)
        + step(magnitude >= 1.75) + step(magnitude > 2.5) + step(magnitude >= 3.5)
        + step(magnitude > 5.0)
    )


def _nvfp4_tile(x, interpret):
    rows, head_dim = x.shape
    finite = _is_finite(x)
    magnitude = jnp.where(finite, jnp.abs(x), 0.0)  # non-finite take no part in any amax
    amax = jnp.max(jnp.max(magnitude, axis=-1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
    global_scale = divide_rn(
        jnp.maximum(amax, jnp.float32(1e-12)), jnp.full_like(amax, 6.0 * 448.0), interpret=interpret
    )
    blocks = magnitude.reshape(rows, head_dim // 16, 16)
    block_amax = jnp.max(blocks, axis=-1)  # [rows, D/16]
    blocks = jnp.where(finite, jnp.abs(x), jnp.where(x == x, jnp.inf, 0.0)).reshape(rows, head_dim // 16, 16)
    six_global = jnp.float32(6.0) * global_scale
    local = divide_rn(block_amax, jnp.broadcast_to(six_global, block_amax.shape), interpret=interpret)
    local = _e4m3_round(jnp.clip(local, 2.0**-9, 448.0), interpret)
    denominator = local * global_scale
    quotient = divide_rn(blocks, jnp.broadcast_to(denominator[:, :, None], blocks.shape), interpret=interpret)
    sign = jnp.where(x == x, (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 31).astype(jnp.int32), 0)
    codes = _e2m1_code(quotient).reshape(rows, head_dim) | (sign << 3)
    return _pack_words(codes), _e4m3_bits(local), global_scale


def _write_tile(x, fmt: TileFormat, out_refs, interpret):
    """Encode one float32 ``[rows, D]`` tile into its three output refs."""
    x = _flush_subnormals(x)
    if fmt.format == "int4":
        words, scale, minimum = _int4_tile(x, fmt, interpret)
        payload_ref, scale_ref, minimum_ref = out_refs
        minimum_ref[...] = minimum
    else:
        words, scale, global_scale = _nvfp4_tile(x, interpret)
        payload_ref, scale_ref, global_ref = out_refs
        global_ref[...] = global_scale.reshape(global_ref.shape)
    payload_ref[...] = words
    scale_ref[...] = scale


def _encode_kernel(x_ref, *out_refs, fmt: TileFormat, interpret: bool):
    # x_ref: [rows, D] float32; outputs: payload [rows, D/8] uint32, metadata refs.
    _write_tile(x_ref[...], fmt, out_refs, interpret)


def _output_layout(fmt: TileFormat, rows: int, head_dim: int):
    """(names, [(shape, dtype)]) of one tile's outputs, payload first."""
    payload = ((rows, head_dim // 8), jnp.uint32)
    if fmt.format == "int4":
        group = fmt.group_size if fmt.axis == "channel" else min(fmt.group_size, head_dim)
        meta = (rows // group, head_dim) if fmt.axis == "channel" else (rows, head_dim // group)
        return ("payload", "scale", "minimum"), [payload, (meta, jnp.float16), (meta, jnp.float16)]
    meta = (rows, head_dim // 16)
    return ("payload", "scale", "global_scale"), [payload, (meta, jnp.uint8), ((1,), jnp.float32)]


def _tile_index_map(leading: int, trailing: int):
    """Block index map: the first ``leading`` grid indices, then ``trailing`` zeros."""
    def index_map(*grid):
        return tuple(grid[:leading]) + (0,) * trailing
    return index_map


def _finish(names, outputs):
    result = dict(zip(names, outputs, strict=True))
    if "global_scale" in result:
        result["global_scale"] = result["global_scale"][..., 0]
        # The kernel writes E4M3 bit patterns (portable: no float8 type in Triton).
        result["scale"] = jax.lax.bitcast_convert_type(result["scale"], jnp.float8_e4m3fn)
    return result


@functools.partial(jax.jit, static_argnames=("fmt", "num_warps", "interpret"))
def encode_tiles(x: jax.Array, fmt: TileFormat, *, num_warps: int = 4, interpret: bool = False):
    """Encode ``n`` tiles ``x`` float32 ``[n, rows, head_dim]``, one program per tile.

    ``rows`` and ``head_dim`` must be powers of two (``head_dim >= 16``);
    channel-axis groups must divide ``rows``.

    Returns a dict with ``payload`` uint32 ``[n, rows, head_dim / 8]`` and, for
    INT4, float16 ``scale`` and ``minimum`` (``[n, rows / group, head_dim]`` on the
    channel axis, ``[n, rows, head_dim / group]`` on the token axis); for NVFP4,
    float8_e4m3fn ``scale`` ``[n, rows, head_dim / 16]`` and float32
    ``global_scale`` ``[n]`` (from each tile's amax).
    """
    n, rows, head_dim = x.shape
    tile = pl.BlockSpec((None, rows, head_dim), lambda i: (i, 0, 0))
    names, layout = _output_layout(fmt, rows, head_dim)
    outputs = pl.pallas_call(
        functools.partial(_encode_kernel, fmt=fmt, interpret=interpret),
        grid=(n,),
        in_specs=[tile],
        out_specs=[pl.BlockSpec((None, *shape), _tile_index_map(1, len(shape))) for shape, _ in layout],
        out_shape=[jax.ShapeDtypeStruct((n, *shape), dtype) for shape, dtype in layout],
        compiler_params=pallas_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"jflashloop_encode_{fmt.format}_{fmt.axis}{fmt.group_size}_{rows}x{head_dim}",
    )(x.astype(jnp.float32))
    return _finish(names, outputs)


def _encode_pair_kernel(page_number_ref, keys_ref, values_ref, *out_refs,
                        key_format: TileFormat, value_format: TileFormat, sink_tokens: int, interpret: bool):
    # keys_ref, values_ref: [rows, D] float32 (one page of one KV head); page_number_ref: [1] int32.
    def masked(x_ref):
        x = x_ref[...]
        if sink_tokens == 0:
            return x
        rows = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
        sink = (page_number_ref[...] == 0)[None, :] & (rows < sink_tokens)  # [rows, 1]
        return jnp.where(sink, x_ref[pl.ds(sink_tokens, 1), :], x)

    _write_tile(masked(keys_ref), key_format, out_refs[:3], interpret)
    _write_tile(masked(values_ref), value_format, out_refs[3:], interpret)


@functools.partial(
    jax.jit, static_argnames=("key_format", "value_format", "sink_tokens", "num_warps", "interpret")
)
def encode_page_pairs(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    key_format: TileFormat,
    value_format: TileFormat,
    *,
    sink_tokens: int = 0,
    num_warps: int = 4,
    interpret: bool = False,
):
    """Encode the K and V tiles of whole pages in one kernel, read in place.

    Args:
      keys, values: float32 ``[pages, rows, kv_heads, head_dim]`` (token-major,
        as the cache's pages are assembled; no transpose is needed).
      page_numbers: int32 ``[pages]``, each page's index in its sequence.
      sink_tokens: rows ``< sink_tokens`` of pages with page number 0 are
        replaced by row ``sink_tokens`` before encoding (the sink rows live in
        the unquantized window and must not widen a group's range).
      ``rows`` and ``head_dim`` powers of two, ``head_dim >= 16``,
      ``sink_tokens < rows``.

    Returns:
      ``(key_outputs, value_outputs)``: dicts as :func:`encode_tiles`'s, each
      leaf head-major ``[kv_heads, pages, ...]`` (NVFP4 ``global_scale``
      ``[kv_heads, pages]``).
    """
    pages, rows, heads, head_dim = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {keys.shape}, got {values.shape}")
    if not 0 <= sink_tokens < rows:
        raise ValueError(f"sink_tokens must be in [0, rows={rows}), got {sink_tokens}")
    tile = pl.BlockSpec((None, rows, None, head_dim), lambda h, p: (p, 0, h, 0))
    page_number = pl.BlockSpec((None, 1), lambda h, p: (p, 0))
    names, shapes, specs = [], [], []
    for fmt in (key_format, value_format):
        fmt_names, layout = _output_layout(fmt, rows, head_dim)
        names.append(fmt_names)
        for shape, dtype in layout:
            shapes.append(jax.ShapeDtypeStruct((heads, pages, *shape), dtype))
            specs.append(pl.BlockSpec((None, None, *shape), _tile_index_map(2, len(shape))))
    outputs = pl.pallas_call(
        functools.partial(
            _encode_pair_kernel, key_format=key_format, value_format=value_format,
            sink_tokens=sink_tokens, interpret=interpret,
        ),
        grid=(heads, pages),
        in_specs=[page_number, tile, tile],
        out_specs=specs,
        out_shape=shapes,
        compiler_params=pallas_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"jflashloop_encode_pages_{key_format.format}_{value_format.format}_{rows}x{head_dim}",
    )(page_numbers.astype(jnp.int32).reshape(pages, 1), keys.astype(jnp.float32), values.astype(jnp.float32))
    return _finish(names[0], outputs[:3]), _finish(names[1], outputs[3:])
