"""Exact division: correctly rounded float32 ``numerator / denominator``.

Two backends (:mod:`jflashloop.ops._dispatch` chooses):

* ``"xla"``: :func:`divide_without_reciprocal`, XLA's float32 division
  behind an optimization barrier. Correctly rounded on CPU; XLA's GPU
  division is not, so it is not bit-exact there.
* ``"pallas"``: the Pallas-Triton kernel
  (``jflashloop_pallas_kernels.exact_division``: PTX ``div.rn.f32`` on a
  GPU, the same values in interpret mode elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jflashloop_pallas_kernels import divide_correctly_rounded

from . import _dispatch


def divide(
    numerator: jax.Array, denominator: jax.Array, implementation: str | _dispatch.Implementation | None
) -> jax.Array:
    """Correctly rounded float32 ``numerator / denominator`` (elementwise).

    Args:
      numerator, denominator: float32 arrays of broadcastable shapes.
      implementation: ``"xla"`` (exact on CPU, not on GPU), ``"pallas"``
        (exact everywhere) or a resolved :class:`~jflashloop.ops.Implementation`.
    Returns:
      float32 array of the broadcast shape.
    """
    return _dispatch.call(implementation, {
        "xla": lambda _: divide_without_reciprocal(numerator, denominator),
        "pallas": lambda chosen: divide_correctly_rounded(numerator, denominator, interpret=chosen.interpret),
    })


def divide_without_reciprocal(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """XLA float32 division that XLA cannot turn into a reciprocal multiply.

    XLA rewrites ``a / broadcast(b)`` as ``a * broadcast(1 / b)`` (two
    roundings). Stacking both operands behind an optimization barrier hides
    any broadcast, including the one ``vmap`` inserts for an unbatched
    operand, so XLA keeps a true elementwise division, which its CPU backend
    rounds correctly.
    """
    numerator, denominator = jnp.broadcast_arrays(numerator, denominator)
    operands = jax.lax.optimization_barrier(jnp.stack([numerator, denominator]))
    return operands[0] / operands[1]
