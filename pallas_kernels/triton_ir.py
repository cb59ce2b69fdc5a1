"""The Triton IR of Pallas-Triton kernels, obtained on any machine (no GPU).

Lowering a jitted function for CUDA (``jax.jit(f).trace(*args).lower(
lowering_platforms=("cuda",))``) works on a CPU-only jaxlib: every
``pl.pallas_call`` with Triton compiler parameters becomes a custom call
``__gpu$xla.gpu.triton`` whose backend config holds the kernel's Triton IR as
MLIR bytecode, with its name, ``num_warps`` and ``num_stages``. XLA compiles
that IR on the GPU; :func:`triton_kernels` returns it as text so that another
Triton (the PyPI ``triton`` wheel) can compile it for any target.

The bytecode itself is not portable across Triton versions (jaxlib 0.10.2
writes it with MLIR 23, and triton 3.6's reader rejects it: ``expected
DenseArrayAttr<int32_t>``), so it is parsed with jaxlib's own Triton dialect
and printed as text, which triton 3.6 reads. The custom call's layout is
jaxlib's (checked with jaxlib 0.10.2; later versions that compile the kernel
while lowering emit ``triton_kernel_call_ffi`` instead, which carries no IR:
:func:`triton_kernels` then raises ``NotImplementedError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
COMPILED_CALL_TARGET = "triton_kernel_call_ffi"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas-Triton kernel as XLA would compile it.

    Attributes:
      name: the kernel's name (its ``pallas_call`` name).
      ir: Triton IR (``tt`` dialect), MLIR text.
      num_warps, num_stages: the launch parameters the kernel was lowered with.
    """

    name: str
    ir: str
    num_warps: int
    num_stages: int


def lower_for_cuda(fn: Callable, *args) -> jax.stages.Lowered:
    """``fn`` jitted and lowered for CUDA (works without a GPU); ``args`` may be ShapeDtypeStructs."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _custom_calls(operation):
    """Every ``stablehlo.custom_call`` nested in ``operation``, in program order."""
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                if op.operation.name == "stablehlo.custom_call":
                    yield op
                yield from _custom_calls(op.operation)


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Pallas-Triton kernels of a function lowered for CUDA, in program order.

    Args:
      lowered: e.g. ``lower_for_cuda(f, *args)``.
    Returns:
      One :class:`TritonKernel` per Triton custom call.
    Raises:
      NotImplementedError: the jaxlib compiled the kernels while lowering
        (no IR in the module) or does not expose its Triton dialect.
    """
    try:  # private jaxlib interfaces, as in inline_asm.py
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as triton_dialect
    except ImportError as error:  # pragma: no cover - depends on the jax build
        raise NotImplementedError(f"this jaxlib does not expose its Triton dialect: {error}") from error

    module = lowered.compiler_ir("stablehlo")
    context = mlir.make_ir_context()
    triton_dialect.register_dialect(context)
    kernels = []
    for call in _custom_calls(module.operation):
        target = ir.StringAttr(call.attributes["call_target_name"]).value
        if target == COMPILED_CALL_TARGET:
            raise NotImplementedError("this jaxlib compiles Triton kernels while lowering; no IR to read")
        if target != TRITON_CALL_TARGET:
            continue
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with context:
            kernel_module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            text = kernel_module.operation.get_asm(enable_debug_info=False)
        kernels.append(TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            ir=text,
            num_warps=ir.IntegerAttr(config["num_warps"]).value,
            num_stages=ir.IntegerAttr(config["num_stages"]).value,
        ))
    return kernels
