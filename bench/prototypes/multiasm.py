import jax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

multi_asm_p = jax_core.Primitive("jflashloop_multiple_output_inline_asm")
multi_asm_p.multiple_results = True

@multi_asm_p.def_abstract_eval
def _abstract(*avals, result_shape_dtypes, **kwargs):
    return [jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]

@triton_lowering.register_lowering(multi_asm_p)
def _lower(ctx, *args, asm, constraints, pack, result_shape_dtypes):
    try:
        types = [mlir.aval_to_ir_type(aval) for aval in ctx.avals_out]
    except TypeError:
        types = [mlir.aval_to_ir_type(ctx.context.mlir_ctx, aval) for aval in ctx.avals_out]
    op = tt_dialect.ElementwiseInlineAsmOp(types, asm, constraints=constraints, pure=True, packed_element=pack, args=args)
    return list(op.results)

def multi_asm(asm, *, args, constraints, pack, result_shape_dtypes):
    return multi_asm_p.bind(*args, asm=asm, constraints=constraints, pack=pack, result_shape_dtypes=tuple(result_shape_dtypes))
