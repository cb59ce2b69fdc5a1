"""Inline PTX with several outputs per element, for Pallas-Triton kernels.

``jax.experimental.pallas.triton.elementwise_inline_asm`` lowers to Triton's
``tt.elementwise_inline_asm`` but returns only one result. Unpacking 4-bit
codes wants one 32-bit word in and eight float16 values out, so this module
registers a small primitive with the same semantics and a lowering that
returns every result. It uses jax's Triton lowering registry (a private
interface); where that is unavailable, :data:`AVAILABLE` is False and the
kernels use their plain-jnp unpacking instead (same values, slower).

Nothing here runs in interpret mode: callers branch on ``interpret`` first.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

try:  # private jax interfaces: keep every use inside this guard
    from jax._src import core as _jax_core
    from jax._src.interpreters import mlir as _mlir
    from jax._src.lib.triton import dialect as _tt_dialect
    from jax._src.pallas.triton import lowering as _triton_lowering

    multiple_output_inline_asm_p = _jax_core.Primitive("jflashloop_multiple_output_inline_asm")
    multiple_output_inline_asm_p.multiple_results = True

    @multiple_output_inline_asm_p.def_abstract_eval
    def _abstract_eval(*avals, result_shape_dtypes, **_):
        del avals
        return [_jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]

    def _result_types(ctx):
        try:  # jax >= 0.11
            return [_mlir.aval_to_ir_type(aval) for aval in ctx.avals_out]
        except TypeError:  # jax 0.10
            return [_mlir.aval_to_ir_type(ctx.context.mlir_ctx, aval) for aval in ctx.avals_out]

    @_triton_lowering.register_lowering(multiple_output_inline_asm_p)
    def _lowering(ctx, *args, asm, constraints, pack, result_shape_dtypes):
        del result_shape_dtypes
        op = _tt_dialect.ElementwiseInlineAsmOp(
            _result_types(ctx), asm, constraints=constraints, pure=True, packed_element=pack, args=args
        )
        return list(op.results)

    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the jax build
    multiple_output_inline_asm_p = None
    AVAILABLE = False


def multiple_output_inline_asm(
    asm: str,
    *,
    args: Sequence[jax.Array],
    constraints: str,
    result_shape_dtypes: Sequence[jax.ShapeDtypeStruct],
    pack: int = 1,
) -> list[jax.Array]:
    """Elementwise inline PTX returning ``len(result_shape_dtypes)`` arrays.

    Args:
      asm: PTX text; outputs are ``$0 .. $(n-1)``, inputs follow.
      args: input arrays, all of one shape.
      constraints: LLVM constraints, outputs first (``"=h,=h,r"``).
      result_shape_dtypes: one ``ShapeDtypeStruct`` per output (the inputs' shape).
      pack: elements per asm instance.
    Returns:
      The outputs, one array each.
    """
    if not AVAILABLE:
        raise NotImplementedError("this jax build does not expose Triton's lowering registry")
    return multiple_output_inline_asm_p.bind(
        *args, asm=asm, constraints=constraints, pack=pack,
        result_shape_dtypes=tuple(result_shape_dtypes),
    )
