"""Public codec entry points: :func:`encode` and :func:`decode`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import numerics
from .codec_spec import CodecSpec
from .int4 import decode_int4, encode_int4
from .nvfp4 import decode_nvfp4, encode_nvfp4
from .packed import Packed

SUPPORTED_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_input(x, spec) -> None:
    if not isinstance(spec, CodecSpec):
        raise TypeError(f"spec must be a CodecSpec, got {type(spec).__name__}")
    if x.ndim != 3:
        raise ValueError(
            f"x must have rank 3 [tokens, kv_heads, channels], got shape {tuple(x.shape)}"
        )
    if any(size == 0 for size in x.shape):
        raise ValueError(f"x must have no empty axis, got shape {tuple(x.shape)}")
    if x.dtype not in [np.dtype(d) for d in SUPPORTED_INPUT_DTYPES]:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")


def encode(
    x: jax.Array,
    spec: CodecSpec,
    *,
    global_scale: jax.Array | float | None = None,
    implementation: str | None = None,
) -> Packed:
    """Encode a ``[tokens, kv_heads, channels]`` tensor into a 4-bit :class:`Packed`.

    Works under ``jit`` (``spec`` and ``implementation`` are static: pass them
    with ``static_argnames`` or close over them) and ``vmap``.

    Args:
      x: float32, bfloat16 or float16 ``[tokens, kv_heads, channels]``.
      spec: the format (:class:`CodecSpec`).
      global_scale: NVFP4 only: float32 scalar decode multiplier to use instead
        of the tensor's own ``max(amax(|x|), 1e-12) / (6 * 448)`` (for a
        streamed cache whose amax is not known in advance). Values beyond what
        it can represent saturate to +-6 * 448 * global_scale.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"xla"`` or
        ``"pallas"``. Both are bit-exact on CPU; on GPU only ``"pallas"`` is,
        because XLA's GPU float32 division is not correctly rounded.
    Returns:
      :class:`Packed` with uint8 payload ``[tokens, kv_heads, ceil(channels/2)]``.

    Example:
      >>> import jax.numpy as jnp, jflashloop
      >>> x = jnp.linspace(-1, 1, 2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
      >>> packed = jflashloop.encode(x, jflashloop.INT4_VALUES)
      >>> packed.payload.shape, packed.payload.dtype
      ((2, 3, 4), dtype('uint8'))
      >>> bool(jnp.abs(jflashloop.decode(packed) - x).max() < 0.07)
      True
    """
    _check_input(x, spec)
    implementation = numerics.resolve_implementation(implementation)
    if spec.format == "int4":
        if global_scale is not None:
            raise ValueError("global_scale applies to NVFP4 only; INT4 stores per-group scales")
        return encode_int4(x, spec, implementation)
    if global_scale is not None and not isinstance(global_scale, jax.core.Tracer):
        value = np.asarray(global_scale, dtype=np.float64)
        if value.shape not in ((), (1,)) or not (
            np.isfinite(value).all() and (value >= np.finfo(np.float32).tiny).all()
        ):
            raise ValueError(
                "global_scale must be one finite positive float32 normal number (>= 2**-126), "
                f"got {np.asarray(global_scale)!r}"
            )
    return encode_nvfp4(x, spec, implementation, global_scale)


def decode(packed: Packed, dtype=jnp.float32) -> jax.Array:
    """Decode a :class:`Packed` back to ``[tokens, kv_heads, channels]``.

    Values are computed in float32 (INT4: ``code * scale + min``; NVFP4:
    ``e2m1 * scale * global_scale``) and cast to ``dtype`` (RNE).

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
    if packed.spec.format == "int4":
        decoded = decode_int4(packed)
    else:
        decoded = decode_nvfp4(packed)
    return decoded.astype(dtype)
