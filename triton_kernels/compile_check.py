"""Compile the project's GPU kernels for a GPU target without a GPU (triton's own ptxas).

Used by the tests (layouts: every ``assert_trivial`` conversion must hold, so
no decoded tile goes through shared memory), by ``tools/check_sm120.py`` and
by the resource reports: :func:`compile_pages_kernel` compiles a Gluon (or
plain Triton) page kernel, :func:`compile_ir` any Triton IR (the Pallas
kernels' IR, :mod:`jflashloop_pallas_kernels.triton_ir`); both return the
CompiledKernel (PTX in ``asm["ptx"]``, dynamic shared memory in
``metadata.shared``), and :func:`ptxas_resources` gives the registers, spills
and static shared memory ptxas reports.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile

POINTERS = ["*fp32", "*i32", "*i32"]
OUTPUTS = ["*fp32", "*fp32", "*fp32"]
MERGE_OUTPUTS = ["*fp32", "*i32"]


@contextlib.contextmanager
def _fresh_cache():
    """A private, empty triton cache for the duration (so every call really compiles)."""
    with tempfile.TemporaryDirectory() as cache:
        saved = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


def compile_pages_kernel(kernel: str = "pipelined", *, head_dim: int = 128, page_size: int = 64,
                         value_group: int = 64, sink_tokens: int = 4, ring: int = 64, stages: int = 2,
                         chunk: int | None = None, capability: int = 90, maxnreg: int | None = None,
                         streams: int = 1, format: str = "int4", sparse: tuple[int, ...] = (),
                         merge: bool = False, precise: bool = True, group: int = 8, query: str = "*bf16",
                         row_blocks: int = 1, lazy: bool = False, overlap: bool = False, window: str = "*bf16",
                         merge_registers: int | None = None, stagger: bool = False, scaled: bool | None = None,
                         persist: int = 0, rows_format: str = "int4"):
    """``triton.compile`` one page kernel for ``sm_<capability>``: the CompiledKernel.

    ``kernel``: ``"pipelined"`` or ``"simple"`` (Gluon, 1 warp) or
    ``"triton"`` (the simple kernel in plain Triton, 4 warps and 2 stages as
    ``decode_attention.page_partials`` launches it); ``merge``: the pipelined
    kernel merges the splits itself; ``group`` and ``query``: the pipelined
    kernel's query rows per KV head and their pointer type (it scales and
    pads the caller's queries); ``row_blocks``: blocks of 8 of those rows;
    ``window``: the windows' pointer type (``"*fp32"`` where rotated
    streams rotate them in float32); ``merge_registers``: the in-kernel
    merge's registers per round trip (None: ``launch.MERGE_REGISTERS``);
    ``scaled``: INT4 values as subnormal codes against scaled probabilities
    (None: ``launch.preferred_scaled_values``); ``persist``: that many persistent programs (``PERSIST``);
    ``rows_format``: the sparse rows' format (``"int4"``, ``"int2"`` (affine, halfwords), or ``format``
    itself: ``ROWS_FORMAT``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import gluon_decode, launch, triton_decode

    pipelined = kernel == "pipelined"
    fn = {"pipelined": gluon_decode.int4_pages_kernel_v2, "simple": gluon_decode.int4_pages_kernel,
          "triton": triton_decode.int4_pages_kernel}[kernel]
    formats = {"int4": ["*u32", "*fp16", "*fp16"], "nvfp4": ["*u32", "*u8", "*fp32"],
               "int4_rotated": ["*u32", "*fp32", "*fp32"], "int2": ["*u16", "*fp16", "*fp16"]}
    stream = formats[format] * 2
    sparse_stream = formats[rows_format] * 2 + ["*i8"]
    windows = stream + sparse_stream * 2 + [window] * 4 if pipelined else []
    if not pipelined:
        stream = ["*u32", "*fp16", "*fp16"] * 2
    scalars = ["i32"] * (8 if pipelined else 5)
    constants = {"D": head_dim, "PAGE": page_size, "GV": value_group, "SINK": sink_tokens}
    if pipelined:
        constants.update(STAGES=stages, RING=ring, WINDOWS=True, CHUNK=chunk or page_size, STREAMS=streams)
    if pipelined:
        constants["FORMAT"] = {"int4": 0, "nvfp4": 1, "int4_rotated": 2}[format]
        constants.update(SPARSE=len(sparse), R3=sparse[0] if sparse else 16, R4=sparse[1] if len(sparse) > 1 else 16,
                         ROWS_FORMAT={"int4": 0, "nvfp4": 1, "int4_rotated": 2, "int2": 3}[rows_format])
    outputs = OUTPUTS + (MERGE_OUTPUTS if pipelined else [])
    if pipelined:
        constants.update(MERGE=merge, GROUP=group, PRECISE=precise, QSCALE=0.12753, PENDING=1, CAPACITY=1 << 20,
                         RECENT=64, RB=row_blocks, LAZY=lazy, OVERLAP=overlap, STAGGER=stagger,
                         SCALED=launch.preferred_scaled_values(
                             streams=streams, format=format, head_dim=head_dim, value_group=value_group, group=group,
                             row_blocks=row_blocks, lazy=lazy, sparse_loops=len(sparse), row_format=rows_format)
                         if scaled is None else scaled,
                         MERGE_REGS=launch.MERGE_REGISTERS if merge_registers is None else merge_registers,
                         PERSIST=persist)
    heads = [query, "*i32", "*i32", "*i1"] if pipelined else POINTERS  # query, table, (lengths, active | bounds)
    types = heads + stream + windows + scalars + outputs + ["constexpr"] * len(constants)
    signature = dict(zip(fn.arg_names, types, strict=True))
    pointers = [i for i, t in enumerate(types) if t.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    options = {"num_warps": 4, "num_stages": 2} if kernel == "triton" else {"num_warps": 1}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    source = (ASTSource if kernel == "triton" else GluonASTSource)(fn, signature, constants, attrs)
    with _fresh_cache():
        return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def compile_merge_kernel(*, head_dim: int = 128, group: int = 8, slots: int = 33, capability: int = 90):
    """``triton.compile`` the split-merge kernel (its launch configuration in ``decode_attention``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import decode_attention, gluon_decode

    launch = decode_attention.merge_launch(head_dim, slots, group)
    constants = dict(D=head_dim, GROUP=group, SLOTS=slots, SB=launch["SB"], DB=launch["DB"], WARPS=launch["WARPS"])
    types = ["*fp32"] * 4 + ["constexpr"] * len(constants)
    fn = gluon_decode.merge_kernel
    signature = dict(zip(fn.arg_names, types, strict=True))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = GluonASTSource(fn, signature, constants, attrs)
    with _fresh_cache():
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": launch["WARPS"]})


def compile_ir(ir: str, *, capability: int, num_warps: int, num_stages: int):
    """``triton.compile`` Triton IR text (``tt`` dialect) for ``sm_<capability>``: the CompiledKernel.

    Args:
      ir: e.g. :attr:`jflashloop_pallas_kernels.triton_ir.TritonKernel.ir`.
      capability: e.g. 120 or 90.
      num_warps, num_stages: launch parameters, as the kernel was lowered with.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as folder, _fresh_cache():
        source = os.path.join(folder, "kernel.ttir")  # triton.compile reads IR from a file named *.ttir
        with open(source, "w") as handle:
            handle.write(ir)
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_resources(ptx: str, arch: str) -> dict[str, int]:
    """Registers, spill bytes and static shared memory of ``ptx`` for ``arch`` (e.g. ``"sm_90a"``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        report = subprocess.run([ptxas, f"-arch={arch}", "-v", source, "-o", os.path.join(folder, "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern):
        match = re.search(pattern, report)
        return int(match.group(1)) if match else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared": number(r"(\d+) bytes smem")}


def loop_instructions(cubin: bytes) -> collections.Counter:
    """The SASS opcodes of the longest loop of a compiled kernel (``CompiledKernel.asm["cubin"]``), counted
    once each as they appear in the loop's body (static counts: one iteration of a page loop).

    The loop is the longest stretch from a backward branch's target to the branch (triton's own
    ``cuobjdump``); opcodes drop their modifiers (``IMAD.SHL.U32`` counts as ``IMAD``) and predicates.

    Raises:
      ValueError: ``cubin`` is not a cubin (an ELF image), or the kernel has no loop.
    """
    if not isinstance(cubin, (bytes, bytearray)) or not bytes(cubin[:4]) == b"\x7fELF":
        head = bytes(cubin[:4]) if isinstance(cubin, (bytes, bytearray)) else type(cubin).__name__
        raise ValueError(f"loop_instructions needs a cubin (an ELF image: CompiledKernel.asm['cubin']), got {head!r}")
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2).strip())
             for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    index = {address: i for i, (address, _) in enumerate(lines)}
    body: list[str] = []
    for i, (address, text) in enumerate(lines):
        branch = re.search(r"\bBRA (?:!?U?P\w+, )?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in index:
            loop = [t for _, t in lines[index[int(branch.group(1), 16)]: i + 1]]
            body = loop if len(loop) > len(body) else body
    if not body:
        raise ValueError("the kernel has no loop")
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body)
