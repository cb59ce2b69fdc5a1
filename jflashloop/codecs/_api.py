"""The codec entry points: :func:`encode`, :func:`decode` and the encode statistics.

Each checks its arguments, resolves ``implementation`` once
(:mod:`jflashloop.ops._dispatch`) and dispatches on ``spec.format``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import _dispatch
from . import _rotated as rotated
from ._floats import cast_saturating
from ._int4 import affine_statistics, decode_affine, encode_affine, encode_affine_with_statistics
from ._nvfp4 import (
    MINIMUM_GIVEN_GLOBAL_SCALE,
    decode_nvfp4,
    encode_nvfp4,
    encode_nvfp4_with_statistics,
)
from ._packed import Packed
from ._spec import AFFINE_FORMATS, FITTED_FORMATS, CodecSpec
from ._statistics import EncodeStatistics

SUPPORTED_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_ROTATED_ENCODERS = {
    "int4_rotated": rotated.encode_int4_rotated,
    "int2_lloyd_max": rotated.encode_int2_lloyd_max,
    "int3_lloyd_max": rotated.encode_int3_lloyd_max,
    "e8": rotated.encode_e8,
    "int4_group_rotated": rotated.encode_int4_group_rotated,
}
_ROTATED_DECODERS = {
    "int4_rotated": rotated.decode_int4_rotated,
    "int2_lloyd_max": rotated.decode_int2_lloyd_max,
    "int3_lloyd_max": rotated.decode_int3_lloyd_max,
    "e8": rotated.decode_e8,
    "int4_group_rotated": rotated.decode_int4_group_rotated,
}


def check_input(x, spec, name: str = "x") -> None:
    if not isinstance(spec, CodecSpec):
        raise TypeError(f"spec must be a CodecSpec, got {type(spec).__name__}")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array [tokens, kv_heads, channels], got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(
            f"{name} must have rank 3 [tokens, kv_heads, channels], got shape {tuple(x.shape)}"
        )
    if any(size == 0 for size in x.shape):
        raise ValueError(f"{name} must have no empty axis, got shape {tuple(x.shape)}")
    if x.dtype not in [np.dtype(d) for d in SUPPORTED_INPUT_DTYPES]:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _as_float32(global_scale) -> np.ndarray:
    """A concrete value as the float32 the encoder uses (1e39 becomes inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(global_scale).astype(np.float32)


def check_global_scale(global_scale, spec: CodecSpec) -> None:
    if global_scale is None:
        return
    if spec.format != "nvfp4":
        raise ValueError(f"global_scale applies to NVFP4 only; {spec.format} stores per-group scales")
    if np.size(global_scale) != 1 or np.ndim(global_scale) > 1:
        raise ValueError(
            f"global_scale must be a scalar (shape () or (1,)), got shape {tuple(np.shape(global_scale))}"
        )
    if isinstance(global_scale, jax.core.Tracer):
        return
    value = _as_float32(global_scale).reshape(())
    if not (np.isfinite(value) and value >= MINIMUM_GIVEN_GLOBAL_SCALE):
        given = np.asarray(global_scale).reshape(()).item()
        as_float32 = f" ({value.item()} as a float32)" if np.isinf(value) and np.isfinite(given) else ""
        raise ValueError(
            "global_scale must be one finite positive float32 number >= 2**-116 "
            f"(so no scale product is subnormal), got {given}{as_float32}"
        )


STATISTICS_FORMATS = ("int4", "int3", "int2", "int_mixed", "int4_scaled", "nvfp4", "int4_rotated")


def _checked_arguments(x, spec, global_scale, implementation, *, statistics: bool = False):
    """Every argument check of :func:`encode` (and the statistics), then the resolved implementation."""
    check_input(x, spec)
    if statistics and spec.format not in STATISTICS_FORMATS:
        raise ValueError(f"encode statistics are defined for the formats {STATISTICS_FORMATS}, got {spec.format!r}")
    if statistics or spec.format in FITTED_FORMATS:
        spec.check_shape(tuple(x.shape))
    check_global_scale(global_scale, spec)
    return _dispatch.resolve(implementation)


def encode(
    x: jax.Array,
    spec: CodecSpec,
    *,
    global_scale: jax.Array | float | None = None,
    implementation: str | None = None,
) -> Packed:
    """Encode a ``[tokens, kv_heads, channels]`` tensor into a low-bit :class:`Packed`.

    Works under ``jit`` (``spec`` and ``implementation`` are static: pass them
    with ``static_argnames`` or close over them) and ``vmap``.

    Args:
      x: float32, bfloat16 or float16 ``[tokens, kv_heads, channels]``.
      spec: the format (:class:`CodecSpec`).
      global_scale: NVFP4 only: float32 scalar decode multiplier to use instead
        of the tensor's own ``max(amax(|x|), 1e-12) / (6 * 448)`` (for a
        streamed cache whose amax is not known in advance); at least
        ``2**-116`` and finite *as a float32* (so ``1e39``, which rounds to
        inf, is refused). Values beyond what it can represent saturate to
        +-6 * 448 * global_scale (counted by :func:`encode_with_statistics`).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"xla"`` or
        ``"pallas"`` (or a :class:`jflashloop.ops.Implementation`, e.g. to run
        the kernels in interpret mode on a GPU). Both are bit-exact on CPU; on
        GPU only ``"pallas"`` is, because XLA's GPU float32 division is not
        correctly rounded.
    Returns:
      :class:`Packed` with uint8 payload ``[tokens, kv_heads,
      spec.payload_bytes_per_row(channels)]`` (``ceil(channels/2)`` for the
      4-bit formats, ``ceil(3 * channels / 8)`` for INT3, ``ceil(channels / 4)`` for INT2).

    Edge values never produce NaN or Inf in the stored data: NaN/+-inf inputs
    take no part in any group statistic and are stored as the saturated code
    of their sign (+-inf) or as the code of 0.0 (NaN); float32 subnormal inputs
    are read as zeros; metadata beyond its format saturates. Use
    :func:`encode_with_statistics` to count these elements, or
    :func:`jflashloop.checked.encode` to reject them.

    Example:
      >>> import jax.numpy as jnp, jflashloop
      >>> x = jnp.linspace(-1, 1, 2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
      >>> packed = jflashloop.encode(x, jflashloop.INT4_VALUES)
      >>> packed.payload.shape, packed.payload.dtype
      ((2, 3, 4), dtype('uint8'))
      >>> bool(jnp.abs(jflashloop.decode(packed) - x).max() < 0.07)
      True
    """
    implementation = _checked_arguments(x, spec, global_scale, implementation)
    if spec.format in _ROTATED_ENCODERS:
        spec.check_shape(tuple(x.shape))
        return _ROTATED_ENCODERS[spec.format](x, spec, implementation)
    if spec.format in AFFINE_FORMATS:
        return encode_affine(x, spec, implementation)
    return encode_nvfp4(x, spec, implementation, global_scale)


def encode_with_statistics(
    x: jax.Array,
    spec: CodecSpec,
    *,
    global_scale: jax.Array | float | None = None,
    implementation: str | None = None,
) -> tuple[Packed, EncodeStatistics]:
    """:func:`encode`, plus the counts of elements it could not store faithfully.

    Same arguments and the same :class:`Packed` as :func:`encode` (bit for
    bit). The :class:`EncodeStatistics` count the NaN/+-inf elements and the
    finite elements stored beyond the format's range (``docs/reliability.md``
    defines both); they are computed in the same ``jit``, from values the
    encode already has. Defined for ``int4``, ``int3``, ``int2``, ``int_mixed``, ``int4_scaled`` (counted on
    ``x / s``), ``nvfp4`` and ``int4_rotated``.

    Returns:
      ``(packed, statistics)``; both counts are int32 ``[]``.

    Example:
      >>> import jax.numpy as jnp, jflashloop
      >>> from jflashloop.codecs import encode_with_statistics
      >>> x = jnp.array([[[1.0, jnp.nan, 1e6, -2.0]]])
      >>> _, stats = encode_with_statistics(x, jflashloop.CodecSpec("int4", "token", 4))
      >>> int(stats.nonfinite), int(stats.saturated)
      (1, 3)
    """
    implementation = _checked_arguments(x, spec, global_scale, implementation, statistics=True)
    if spec.format in AFFINE_FORMATS:
        return encode_affine_with_statistics(x, spec, implementation)
    if spec.format == "int4_rotated":
        return rotated.encode_int4_rotated_with_statistics(x, spec, implementation)
    return encode_nvfp4_with_statistics(x, spec, implementation, global_scale)


def count_saturations(
    x: jax.Array,
    spec: CodecSpec,
    *,
    global_scale: jax.Array | float | None = None,
    implementation: str | None = None,
) -> EncodeStatistics:
    """The :class:`EncodeStatistics` that :func:`encode` of ``x`` would have.

    The affine formats compute only the group statistics (no codes); ``int4_rotated``
    only its input rule; NVFP4 needs the quotients, so it encodes and drops
    the payload (free under ``jit``).
    """
    implementation = _checked_arguments(x, spec, global_scale, implementation, statistics=True)
    if spec.format in AFFINE_FORMATS:
        return affine_statistics(x, spec, implementation)
    if spec.format == "int4_rotated":
        return rotated.int4_rotated_statistics(x)
    return encode_nvfp4_with_statistics(x, spec, implementation, global_scale)[1]


def _check_packed(packed: Packed) -> None:
    """Leaf dtypes and trailing shapes must match the packed's spec and logical shape.

    Checked for the affine (INT4, INT3, INT2) and NVFP4 layouts; other formats check their own.
    """
    spec, shape = packed.spec, packed.shape
    if not isinstance(spec, CodecSpec) or len(shape) != 3:
        raise ValueError(f"packed.spec must be a CodecSpec and packed.shape a 3-tuple, got {spec!r}, {shape!r}")
    if spec.format not in (*AFFINE_FORMATS, "nvfp4"):
        return
    spec.check_shape(shape)
    payload_shape = (shape[0], shape[1], spec.payload_bytes_per_row(shape[2]))
    if packed.payload.dtype != np.uint8 or tuple(packed.payload.shape[-3:]) != payload_shape:
        raise ValueError(
            f"packed.payload must be uint8 [..., {payload_shape[0]}, {payload_shape[1]}, {payload_shape[2]}] "
            f"for shape {shape}, got {packed.payload.dtype} {tuple(packed.payload.shape)}"
        )
    if spec.format in AFFINE_FORMATS:
        metadata_shape = spec.metadata_shape(shape)
        for name in ("scale", "minimum"):
            leaf = getattr(packed, name)
            if leaf is None or leaf.dtype != np.float16 or tuple(leaf.shape[-3:]) != metadata_shape:
                got = None if leaf is None else f"{leaf.dtype} {tuple(leaf.shape)}"
                raise ValueError(f"packed.{name} must be float16 [..., {metadata_shape}] for "
                                 f"{spec.format.upper()}, got {got}")
        return
    metadata_shape = spec.metadata_shape(shape)
    if packed.scale.dtype != jnp.float8_e4m3fn or tuple(packed.scale.shape[-3:]) != metadata_shape:
        raise ValueError(
            f"packed.scale must be float8_e4m3fn [..., {metadata_shape}] for NVFP4, "
            f"got {packed.scale.dtype} {tuple(packed.scale.shape)}"
        )
    if packed.global_scale is None or packed.global_scale.dtype != np.float32:
        raise ValueError("packed.global_scale must be a float32 scalar for NVFP4")


def decode(packed: Packed, dtype=jnp.float32) -> jax.Array:
    """Decode a :class:`Packed` back to ``[tokens, kv_heads, channels]``.

    Values are computed in float32 (INT4, INT3, INT2: ``code * scale + min``; NVFP4:
    ``e2m1 * scale * global_scale``) and cast to ``dtype`` (RNE), saturating:
    a finite value beyond ``dtype``'s range decodes to its largest finite
    value of the same sign. (INT4 of a float16 group spanning -65504..65504
    decodes its top code to 65536 in float32, which float16 would round to
    inf: it decodes to 65504, the input's own value.)

    Args:
      packed: the output of :func:`encode`.
      dtype: float32, bfloat16 or float16.
    Returns:
      ``dtype`` array of shape ``packed.shape``.
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"packed must be a Packed, got {type(packed).__name__}")
    if np.dtype(dtype) not in [np.dtype(d) for d in SUPPORTED_INPUT_DTYPES]:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {np.dtype(dtype)}")
    _check_packed(packed)
    if packed.spec.format in _ROTATED_DECODERS:
        decoded = _ROTATED_DECODERS[packed.spec.format](packed)
    elif packed.spec.format in AFFINE_FORMATS:
        decoded = decode_affine(packed)
    else:
        decoded = decode_nvfp4(packed)
    if np.dtype(dtype) == np.float32:
        return decoded
    return cast_saturating(decoded, dtype)[0]
