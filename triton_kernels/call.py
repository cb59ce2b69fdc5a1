"""Calling Triton and Gluon kernels from JAX, through ``jax_triton``.

``jax_triton.triton_call`` compiles a ``triton.jit`` kernel and runs it as an
XLA custom call under ``jax.jit``. Releases before 0.4 compile only Triton
(``tt``) kernels; :func:`triton_call` here also accepts a ``gluon.jit``
kernel by compiling it with ``triton.compile`` (the same stages Triton's own
launcher runs) and handing the result to jax_triton's custom call. Everything
else (arguments, grid, aliasing, the custom call) is jax_triton's, except
the custom call's target on jaxlib >= 0.10.1: releases before 0.4 lower to
the legacy ``triton_kernel_call``, whose runtime finds the kernel by hashing
the whole compressed kernel image on every call and which CUDA graphs cannot
capture; :func:`_install_ffi_lowering` can lower them to the typed-FFI
target ``triton_kernel_call_ffi`` instead (as jax_triton 0.4 does), which
resolves the kernel once when the executable is initialized and which XLA
can put in its command buffers (``USE_FFI_TARGET``, the default;
``JFLASHLOOP_TRITON_TARGET=legacy`` keeps jax_triton's own target).

Importing this module needs a CUDA build of jaxlib, ``triton`` and
``jax_triton``: :func:`available` says whether they are there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import types


@functools.cache
def available() -> bool:
    """Whether ``jax_triton`` (and a GPU jaxlib) can be imported."""
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _without_line_info():
    """PTX without ``.loc`` lines and debug sections: the kernel image travels in every custom call's
    descriptor (31 KB -> 25 KB compressed for the page kernel), and the runtime hashes it per call."""
    import triton

    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is None or not hasattr(compilation, "disable_line_info"):
        yield
        return
    saved = compilation.disable_line_info
    compilation.disable_line_info = True
    try:
        yield
    finally:
        compilation.disable_line_info = saved


@contextlib.contextmanager
def _triton_cache_dir():
    """jax_triton clears ``TRITON_CACHE_DIR`` (it keeps its own cache); ``triton.compile`` needs one."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    if not saved:
        os.environ["TRITON_CACHE_DIR"] = _cache_dir()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


@functools.cache
def _cache_dir() -> str:
    return tempfile.mkdtemp(prefix="jflashloop-triton-")


def _compile_gluon(fn, arg_dtypes, scalar_args, *, num_warps, num_ctas, compute_capability, metaparams, lib,
                   maxnreg=None):
    """Compile a Gluon kernel for ``compute_capability``: (TritonKernel, specialization attrs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    backend = lib.get_cuda_backend(0, compute_capability)
    signature = {fn.arg_names[i]: v for i, v in enumerate(arg_dtypes)}
    alignments = [16] * len(arg_dtypes)  # jax buffers are 16-byte aligned (as jax_triton assumes)
    for i, _, _ in scalar_args:
        alignments[i] = 0
    specialization = [
        lib._triton.native_specialize_impl(
            backend, types.SimpleNamespace(data_ptr=lambda a=a: a, dtype=t.removeprefix("*")), False, True, a > 0)
        for t, a in zip(arg_dtypes, alignments, strict=True)
    ]
    attrs = {(i,): backend.parse_attr(attr) for i, (_, attr) in enumerate(specialization)}
    constants = dict(metaparams)
    # jax_triton specializes scalar arguments equal to 1 (and passes them no parameter).
    constants.update({fn.arg_names[i]: 1 for i, _, v in scalar_args if v == 1})
    for name in constants:
        signature[name] = "constexpr"
    source = GluonASTSource(fn, signature, constants, attrs)
    with _triton_cache_dir(), _without_line_info():
        options = {"num_warps": num_warps, "num_ctas": num_ctas}
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32), options=options)
    kernel = lib.triton_kernel_call_lib.TritonKernel(
        compiled.metadata.name, num_warps, num_ctas, compiled.metadata.shared, compiled.asm["ptx"],
        "", compute_capability)
    return kernel, attrs


@functools.cache
def _install_gluon_support() -> None:
    from jax_triton import triton_lib as lib

    original = lib.get_or_create_triton_kernel
    cache = {}

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps, num_stages,
                      num_ctas, compute_capability, enable_fp_fusion, metaparams, dump):
        if not (hasattr(fn, "is_gluon") and fn.is_gluon()):
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                            num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                            enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
        if compute_capability is None:
            compute_capability = lib.triton_kernel_call_lib.get_compute_capability(0)
        num_warps = 4 if num_warps is None else num_warps
        metaparams = dict(metaparams)
        maxnreg = metaparams.pop(MAXNREG, None)
        key = (fn, tuple(arg_dtypes), tuple(scalar_args), num_warps, num_ctas, compute_capability,
               tuple(sorted(metaparams.items())), maxnreg)
        if key not in cache:
            cache[key] = _compile_gluon(fn, arg_dtypes, scalar_args, num_warps=num_warps, num_ctas=num_ctas,
                                        compute_capability=compute_capability, metaparams=metaparams, lib=lib,
                                        maxnreg=maxnreg)
        return cache[key]

    lib.get_or_create_triton_kernel = get_or_create


MAXNREG = "_jflashloop_maxnreg"
# The calls lower to ``triton_kernel_call_ffi`` where jaxlib has it (measured: bench/KERNEL_NOTES.md, "The
# typed-FFI target by default"); JFLASHLOOP_TRITON_TARGET=legacy keeps jax_triton's legacy target.
USE_FFI_TARGET = os.environ.get("JFLASHLOOP_TRITON_TARGET", "ffi") != "legacy"


def _ffi_target_available() -> bool:
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()) >= (0, 10, 1)


@functools.cache
def _install_ffi_lowering() -> None:
    """Lower jax_triton < 0.4's custom calls to ``triton_kernel_call_ffi`` (api_version 4, ``opaque`` attribute)."""
    import jax
    import jax_triton
    from jax._src.interpreters import mlir
    from jax_triton import triton_lib as lib

    if not USE_FFI_TARGET or jax_triton.__version_info__ >= (0, 4) or not _ffi_target_available():
        return
    original = jax.ffi.ffi_lowering

    def ffi_lowering(name, *, api_version=2, backend_config=None, **kwargs):
        if name == "triton_kernel_call":
            rule = original("triton_kernel_call_ffi", api_version=4, **kwargs)
            return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)
        return original(name, api_version=api_version, backend_config=backend_config, **kwargs)

    class _Jax(types.ModuleType):  # jax, with the FFI lowering above
        def __getattr__(self, name):
            return getattr(jax, name)

    shim = _Jax("jax")
    shim.ffi = types.SimpleNamespace(ffi_lowering=ffi_lowering)
    lowering = lib.triton_kernel_call_lowering
    # The copy's globals are a snapshot of the module's: the kernel lookup stays the module's current one
    # (the Gluon support below replaces it).
    globals_ = {**lowering.__globals__, "jax": shim,
                "get_or_create_triton_kernel": lambda *a, **k: lib.get_or_create_triton_kernel(*a, **k)}
    patched = types.FunctionType(lowering.__code__, globals_, lowering.__name__,
                                 lowering.__defaults__, lowering.__closure__)
    patched.__kwdefaults__ = lowering.__kwdefaults__
    mlir.register_lowering(lib.triton_kernel_call_p, functools.partial(patched, lib.get_cuda_backend),
                           platform="cuda")


def triton_call(*args, kernel, maxnreg: int | None = None, **kwargs):
    """``jax_triton.triton_call`` that also takes ``gluon.jit`` kernels (same arguments).

    ``maxnreg`` (Gluon kernels only): a register cap per thread, passed to ptxas.
    """
    import jax_triton

    _install_gluon_support()  # Gluon kernels (also for jax_triton >= 0.4: the register cap travels through it)
    _install_ffi_lowering()
    if hasattr(kernel, "is_gluon") and kernel.is_gluon():
        if maxnreg is not None:
            kwargs[MAXNREG] = maxnreg
    elif maxnreg is not None:
        raise ValueError("maxnreg applies to Gluon kernels")
    return jax_triton.triton_call(*args, kernel=kernel, **kwargs)
