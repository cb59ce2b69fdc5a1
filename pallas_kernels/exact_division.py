"""Correctly rounded float32 division as a Pallas-Triton elementwise kernel.

XLA on NVIDIA GPUs and Triton's default ``/`` do not round float32 quotients
correctly in the last bit, which changes INT4/NVFP4 codes exactly at rounding
ties. This kernel issues PTX ``div.rn.f32`` (IEEE round-to-nearest-even) through
``elementwise_inline_asm``. In interpret mode (CPU) it uses ``/``, which XLA's
CPU backend rounds correctly when it is kept from becoming a reciprocal
multiply.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

BLOCK_ELEMENTS = 1024


def divide_rn(numerator: jax.Array, denominator: jax.Array, *, interpret: bool) -> jax.Array:
    """IEEE float32 quotient for use inside Pallas kernels.

    Args:
      numerator: float32 array (any shape).
      denominator: float32 array broadcastable to ``numerator``.
      interpret: True when the kernel runs in interpret mode (no inline PTX).
    Returns:
      float32 array, the correctly rounded quotient.
    """
    numerator, denominator = jnp.broadcast_arrays(numerator, denominator)
    if interpret:
        # XLA would turn a division by a broadcast into a reciprocal multiply;
        # the barrier keeps a true (correctly rounded on CPU) division.
        return numerator / jax.lax.optimization_barrier(denominator)
    (quotient,) = pallas_triton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[numerator, denominator],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(numerator.shape, jnp.float32)],
    )
    return quotient


def _division_kernel(numerator_ref, denominator_ref, quotient_ref, *, interpret):
    # numerator_ref, denominator_ref, quotient_ref: [BLOCK_ELEMENTS] float32
    quotient_ref[...] = divide_rn(numerator_ref[...], denominator_ref[...], interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def divide_correctly_rounded(
    numerator: jax.Array, denominator: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """Elementwise IEEE float32 ``numerator / denominator`` on any shape.

    Args:
      numerator: float32 array.
      denominator: float32 array broadcastable against ``numerator``.
      interpret: run the Pallas kernel in interpret mode (CPU, tests).
    Returns:
      float32 array of the broadcast shape: the correctly rounded quotient.
    """
    numerator = jnp.asarray(numerator, jnp.float32)
    denominator = jnp.asarray(denominator, jnp.float32)
    numerator, denominator = jnp.broadcast_arrays(numerator, denominator)
    shape = numerator.shape
    size = numerator.size
    if size == 0:
        return jnp.zeros(shape, jnp.float32)
    padded = pl.cdiv(size, BLOCK_ELEMENTS) * BLOCK_ELEMENTS
    flat_numerator = jnp.pad(numerator.reshape(-1), (0, padded - size))
    flat_denominator = jnp.pad(denominator.reshape(-1), (0, padded - size), constant_values=1.0)
    block = pl.BlockSpec((BLOCK_ELEMENTS,), lambda i: (i,))
    quotient = pl.pallas_call(
        functools.partial(_division_kernel, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((padded,), jnp.float32),
        grid=(padded // BLOCK_ELEMENTS,),
        in_specs=[block, block],
        out_specs=block,
        # Explicit: without Triton compiler parameters jax 0.10 lowers to Mosaic
        # GPU (its default jax_pallas_use_mosaic_gpu), which rejects this
        # kernel's 1024-element blocks ("Async copies only support copying
        # <=256 elements along each dimension").
        compiler_params=pallas_triton.CompilerParams(),
        interpret=interpret,
        name="divide_correctly_rounded",
    )(flat_numerator, flat_denominator)
    return quotient[:size].reshape(shape)
