"""Every GPU kernel jflashloop ships compiles for consumer Blackwell (sm_120) and Hopper (sm_90).

    python tools/check_sm120.py [--quick] [--targets 120,90] [--jobs 2]

(about 3 CPU-minutes for the 56 rows, so 1.5-2 minutes with two processes
on two idle cores; ``--quick`` checks the subset tests/test_sm120.py runs
in CI.)

No GPU is needed. The Pallas-Triton kernels are lowered for CUDA on the CPU
(their Triton IR, :mod:`jflashloop_pallas_kernels.triton_ir`) and the Gluon
and plain Triton kernels are traced from source; the PyPI ``triton`` wheel
compiles both for ``GPUTarget("cuda", capability, 32)`` and its bundled
ptxas assembles the PTX (``.target sm_120a`` / ``sm_90a``). One row per
kernel and target: compiled or not, launch parameters, registers, spills,
shared memory per block (dynamic, from the compile metadata, plus static,
from ptxas) and the instruction families the PTX uses.

Exit status 1 when, for sm_120, a kernel fails to compile, uses an
instruction outside the portable set (see :data:`DISALLOWED`), or needs more
shared memory per block than an SM120 GPU gives (101,376 bytes = 99 KB: the
CUDA C++ Programming Guide, section 5.1 "Compute Capabilities", Table 30
"Technical Specifications per Compute Capability", row "Maximum amount of
shared memory per thread block", compute capability 12.x; NVIDIA CUTLASS
``include/cutlass/arch/arch.h``: ``sm120_smem_capacity_bytes = 101376``;
:mod:`jflashloop_pallas_kernels.launch`), or when any kernel fails to compile
for another target or exceeds that target's shared memory or register file
(64K 32-bit registers per block), or when the Gluon kernel's shared memory
differs from :func:`jflashloop_triton_kernels.launch.pipelined_shared_bytes`
(the formula its stage choice relies on).

What this does not show: the kernels have not run on an SM120 GPU. XLA
compiles the Pallas kernels' IR with its own bundled Triton, so registers and
shared memory there may differ from triton 3.6's figures here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import re
import sys
from collections.abc import Callable

TARGETS = (120, 90)
REGISTERS_PER_BLOCK = 65536  # 64K 32-bit registers per thread block (every capability >= 5.0)

# Instruction families counted in the PTX, as regular expressions.
FAMILIES = {
    "mma.sync": r"\bmma\.sync\.",
    "ldmatrix": r"\bldmatrix\.",
    "cp.async": r"\bcp\.async\.c[ag]\.",
    "wgmma": r"\bwgmma\.",
    "tcgen05": r"\btcgen05\.",
    "cp.async.bulk.tensor": r"\bcp\.async\.bulk\.tensor\.",
    "setmaxnreg": r"\bsetmaxnreg\.",
    "cvt.e2m1x2": r"\bcvt\.\S*e2m1x2\b",
}
# Not allowed in a kernel for sm_120. wgmma and tcgen05 do not exist there
# (ptxas 12.9 rejects both for sm_120 and sm_120a); TMA copies
# (cp.async.bulk.tensor) and setmaxnreg (sm_120a only) assemble, but they are
# Hopper-era features the kernels keep out, so that one PTX subset (sm_80's
# plus cp.async) runs from Ampere to consumer Blackwell.
DISALLOWED = ("wgmma", "tcgen05", "cp.async.bulk.tensor", "setmaxnreg")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What a compile produced: PTX and the launch it was compiled for."""

    ptx: str
    dynamic_shared: int  # bytes, the compile metadata's (allocated at launch)
    num_warps: int
    num_stages: int
    expected_shared: int | None = None  # bytes a launch formula predicts, where one does


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel to check: ``compile(capability)`` builds and compiles it for ``sm_<capability>``."""

    name: str
    compile: Callable[[int], Compiled]
    quick: bool = False  # part of the subset CI runs (tests/test_sm120.py)


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel on one target."""

    kernel: str
    capability: int
    compiled: bool
    error: str = ""
    num_warps: int = 0
    num_stages: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads, bytes per thread
    dynamic_shared: int = 0
    static_shared: int = 0
    families: dict[str, int] = dataclasses.field(default_factory=dict)
    expected_shared: int | None = None

    @property
    def shared(self) -> int:
        """Shared memory per block, bytes: dynamic + static."""
        return self.dynamic_shared + self.static_shared


def instruction_families(ptx: str) -> dict[str, int]:
    """Occurrences of each of :data:`FAMILIES` in ``ptx``."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in FAMILIES.items()}


def problems(row: Row) -> list[str]:
    """Why ``row`` fails the check (empty when it passes); see the module docstring."""
    from jflashloop_pallas_kernels import launch

    if not row.compiled:
        return [f"does not compile: {row.error}"]
    found = []
    if row.capability == 120:
        found += [f"uses {name} ({row.families[name]}x)" for name in DISALLOWED if row.families.get(name)]
    limit = launch.shared_memory_per_block(row.capability)
    if row.shared > limit:
        found.append(f"needs {row.shared} bytes of shared memory, sm_{row.capability} gives {limit}")
    if row.registers * 32 * row.num_warps > REGISTERS_PER_BLOCK:
        found.append(f"needs {row.registers * 32 * row.num_warps} registers per block")
    if row.expected_shared is not None and row.dynamic_shared != row.expected_shared:
        found.append(f"allocates {row.dynamic_shared} bytes of shared memory, the launch formula says "
                     f"{row.expected_shared}")
    return found


# --------------------------------------------------------------------------- the kernels

GQA_GROUP = 4  # query heads per KV head (score tiles of 8 rows)
LOOP_CLASSES = {"1 loop": 0, "dense chain": 1, "full chain": 3}  # loop index read: loops 1, 1-2, 1-4
FORMATS = ("int4", "nvfp4", "int4_rotated")


def _pallas(select: str, lowered: Callable[[int], object]) -> Callable[[int], Compiled]:
    """Compile the Pallas kernel named ``select*`` of ``lowered(capability)``."""

    def compile_for(capability: int) -> Compiled:
        from jflashloop_pallas_kernels import triton_ir
        from jflashloop_triton_kernels import compile_check

        (kernel,) = [k for k in triton_ir.triton_kernels(lowered(capability)) if k.name.startswith(select)]
        compiled = compile_check.compile_ir(kernel.ir, capability=capability, num_warps=kernel.num_warps,
                                            num_stages=kernel.num_stages)
        return Compiled(compiled.asm["ptx"], compiled.metadata.shared, kernel.num_warps, kernel.num_stages)

    return compile_for


def _cache_config(format: str, head_dim: int, page_size: int):
    """A one-layer FlashLoop cache (dense loops 1-2, sparse loops 3-4) in ``format``."""
    import jflashloop
    from jflashloop import CacheConfig, LoopStorage

    base = CacheConfig.flashloop(num_layers=1, num_kv_heads=2, head_dim=head_dim, num_pages=8, max_sequences=2,
                                 max_pages_per_sequence=4, num_loops=4, page_size=page_size)
    if format == "int4":
        return base
    spec = jflashloop.NVFP4 if format == "nvfp4" else jflashloop.int4_rotated(head_dim, seed=0)
    sparse = tuple(LoopStorage(spec, spec, loop.sparse_rows_per_page) for loop in base.loops[2:])
    return dataclasses.replace(base, loops=(LoopStorage(spec, spec), LoopStorage(spec, spec), *sparse))


def _decode_lowered(format: str, loop: int, head_dim: int, page_size: int, capability: int):
    """``paged_decode_attention`` over loops ``0..loop``, lowered for CUDA with the launch for ``capability``."""
    import jax
    import jax.numpy as jnp

    from jflashloop import paged_cache
    from jflashloop.ops import _decode_attention as attention
    from jflashloop_pallas_kernels import triton_ir
    from jflashloop_pallas_kernels.decode_attention import KernelConfig, paged_decode_attention

    config = _cache_config(format, head_dim, page_size)
    inputs = attention.kernel_inputs(paged_cache.create(config), 0, loop, include_pending=False)
    queries = jax.ShapeDtypeStruct((config.max_sequences, config.num_kv_heads * GQA_GROUP, head_dim), jnp.float32)
    attend = functools.partial(
        paged_decode_attention, loops=inputs["loops"], page_size=page_size, sink_tokens=config.sink_tokens,
        window_loop=inputs["window_loop"], scale=head_dim**-0.5, config=KernelConfig(capability=capability))
    arrays = [inputs[name] for name in ("block_tables", "bounds", "streams", "sink_keys", "sink_values",
                                        "ring_keys", "ring_values")]
    return triton_ir.lower_for_cuda(attend, queries, *arrays)


def _window_lowered(capability: int, *, head_dim: int = 128, sink: int = 4, ring: int = 64):
    import jax
    import jax.numpy as jnp

    from jflashloop_pallas_kernels import triton_ir
    from jflashloop_pallas_kernels.decode_attention import window_partials

    del capability  # one launch everywhere
    sequences, heads, rows = 2, 2, 8
    window = [jax.ShapeDtypeStruct((1, sequences, heads, tokens, head_dim), jnp.bfloat16)
              for tokens in (sink, sink, ring, ring)]
    return triton_ir.lower_for_cuda(
        functools.partial(window_partials, sink_tokens=sink, window_loop=0),
        jax.ShapeDtypeStruct((sequences, heads, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((sequences, 2), jnp.int32), *window)


def _page_pairs_lowered(format: str, capability: int, *, head_dim: int = 128, page_size: int = 64):
    import jax
    import jax.numpy as jnp

    from jflashloop_pallas_kernels import triton_ir
    from jflashloop_pallas_kernels.quantize import TileFormat, encode_page_pairs

    del capability
    keys = (TileFormat("int4", "channel", page_size), TileFormat("int4", "token", 64)) if format == "int4" else (
        TileFormat("nvfp4", "token", 16),) * 2
    tiles = jax.ShapeDtypeStruct((4, page_size, 2, head_dim), jnp.float32)
    return triton_ir.lower_for_cuda(
        functools.partial(encode_page_pairs, key_format=keys[0], value_format=keys[1], sink_tokens=4),
        tiles, tiles, jax.ShapeDtypeStruct((4,), jnp.int32))


def _tiles_lowered(capability: int, *, head_dim: int = 128, page_size: int = 64):
    import jax
    import jax.numpy as jnp

    from jflashloop_pallas_kernels import triton_ir
    from jflashloop_pallas_kernels.quantize import TileFormat, encode_tiles

    del capability
    return triton_ir.lower_for_cuda(functools.partial(encode_tiles, fmt=TileFormat("int4", "token", 64)),
                                    jax.ShapeDtypeStruct((4, page_size, head_dim), jnp.float32))


def _division_lowered(capability: int):
    import jax
    import jax.numpy as jnp

    from jflashloop_pallas_kernels import divide_correctly_rounded, triton_ir

    del capability
    x = jax.ShapeDtypeStruct((4096,), jnp.float32)
    return triton_ir.lower_for_cuda(divide_correctly_rounded, x, x)


def _gluon(kernel: str = "pipelined", **sizes) -> Callable[[int], Compiled]:
    """Compile a page kernel of ``jflashloop_triton_kernels`` (the pipelined one with the stages for the target)."""

    def compile_for(capability: int) -> Compiled:
        from jflashloop_triton_kernels import compile_check, launch

        if kernel != "pipelined":
            compiled = compile_check.compile_pages_kernel(kernel, capability=capability, **sizes)
            return Compiled(compiled.asm["ptx"], compiled.metadata.shared, compiled.metadata.num_warps,
                            compiled.metadata.num_stages if kernel == "triton" else 1)
        shape = dict(head_dim=sizes.get("head_dim", 128), page_size=sizes.get("page_size", 64),
                     format=sizes.get("format", "int4"), streams=sizes.get("streams", 1),
                     sparse_rows=sizes.get("sparse", ()), row_format=sizes.get("rows_format", "int4"))
        stages = launch.pipelined_stages(capability=capability, **shape)
        compiled = compile_check.compile_pages_kernel(kernel, capability=capability, stages=stages, **sizes)
        return Compiled(compiled.asm["ptx"], compiled.metadata.shared, compiled.metadata.num_warps, stages,
                        expected_shared=launch.pipelined_shared_bytes(stages=stages, **shape))

    return compile_for


def all_cases() -> tuple[Case, ...]:
    """Every kernel the project ships, at the production shape (head_dim 128, 64-token pages, GQA 4)
    and at the largest tiles whose launch depends on the target."""
    decode = [
        Case(f"pallas decode {format} {shape} D128 P64",
             _pallas("jflashloop_decode_loops", functools.partial(_decode_lowered, format, loop, 128, 64)))
        for format in FORMATS for shape, loop in LOOP_CLASSES.items()
    ]
    large = [
        Case(f"pallas decode int4 {shape} D256 P64",
             _pallas("jflashloop_decode_loops", functools.partial(_decode_lowered, "int4", loop, 256, 64)),
             quick=shape == "full chain")
        for shape, loop in LOOP_CLASSES.items()
    ]
    return (
        *decode,
        *large,
        Case("pallas decode windows D128", _pallas("jflashloop_decode_windows", _window_lowered), quick=True),
        Case("pallas encode page pairs int4 D128 P64",
             _pallas("jflashloop_encode_pages", functools.partial(_page_pairs_lowered, "int4")), quick=True),
        Case("pallas encode page pairs nvfp4 D128 P64",
             _pallas("jflashloop_encode_pages", functools.partial(_page_pairs_lowered, "nvfp4"))),
        Case("pallas encode tiles int4 D128 P64", _pallas("jflashloop_encode", _tiles_lowered)),
        Case("pallas exact division", _pallas("divide_correctly_rounded", _division_lowered), quick=True),
        Case("gluon pipelined int4 D128 P64", _gluon(), quick=True),
        Case("gluon pipelined int4 D128 P64 in-kernel merge", _gluon(merge=True)),
        Case("gluon pipelined nvfp4 D128 P64", _gluon(format="nvfp4")),
        Case("gluon pipelined int4_rotated D128 P64", _gluon(format="int4_rotated")),
        Case("gluon pipelined int4 dense chain D128 P64", _gluon(streams=2)),
        Case("gluon pipelined int4 full chain D128 P64", _gluon(streams=2, sparse=(16, 7))),
        Case("gluon pipelined nvfp4 full chain D128 P64",
             _gluon(format="nvfp4", rows_format="nvfp4", value_group=16, streams=2, sparse=(16, 7), group=1)),
        Case("gluon pipelined int4_rotated full chain D128 P64",
             _gluon(format="int4_rotated", rows_format="int4_rotated", value_group=128, streams=2, sparse=(16, 7),
                    window="*fp32")),
        Case("gluon pipelined int4 compact loops D128 P64",
             _gluon(rows_format="int2", streams=1, sparse=(24, 10), stagger=True, group=1)),
        Case("gluon pipelined int4 D64 P64", _gluon(head_dim=64)),
        Case("gluon pipelined int4 D256 P64", _gluon(head_dim=256)),
        Case("gluon pipelined int4 dense chain D256 P128", _gluon(head_dim=256, page_size=128, streams=2)),
        Case("gluon simple int4 D128 P64", _gluon("simple"), quick=True),
        Case("triton simple int4 D128 P64", _gluon("triton")),
    )


def check(name: str, capability: int) -> Row:
    """Compile case ``name`` for ``sm_<capability>``: its :class:`Row` (a failed compile is a row too)."""
    from jflashloop_triton_kernels import compile_check

    (case,) = [c for c in all_cases() if c.name == name]
    try:
        compiled = case.compile(capability)
    except Exception as error:  # a failed compile is a result, reported in the table
        message = " ".join(str(error).split())
        return Row(name, capability, compiled=False, error=f"{type(error).__name__}: {message[:300]}")
    resources = compile_check.ptxas_resources(compiled.ptx, f"sm_{capability}a")
    return Row(
        name, capability, compiled=True, num_warps=compiled.num_warps, num_stages=compiled.num_stages,
        registers=resources["registers"], spill_bytes=resources["spill_stores"] + resources["spill_loads"],
        dynamic_shared=compiled.dynamic_shared, static_shared=resources["shared"],
        families=instruction_families(compiled.ptx), expected_shared=compiled.expected_shared,
    )


def format_table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    columns = ["mma.sync", "ldmatrix", "cp.async", *DISALLOWED, "cvt.e2m1x2"]
    header = ["kernel", "target", "compiled", "warps/stages", "registers", "spills (B)", "shared (B) dyn+static",
              *columns, "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        found = problems(row)
        verdict = "ok" if not found else "FAIL: " + "; ".join(found)
        if not row.compiled:
            cells = [row.kernel, f"sm_{row.capability}", "no", *["-"] * (4 + len(columns)), verdict]
        else:
            cells = [row.kernel, f"sm_{row.capability}", "yes", f"{row.num_warps}/{row.num_stages}",
                     str(row.registers), str(row.spill_bytes),
                     f"{row.shared} ({row.dynamic_shared}+{row.static_shared})",
                     *[str(row.families[name]) for name in columns], verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(names: list[str], targets: tuple[int, ...], jobs: int) -> list[Row]:
    """:func:`check` every case on every target (``jobs`` processes), rows in case order."""
    tasks = [(name, capability) for name in names for capability in targets]
    if jobs <= 1:
        return [check(*task) for task in tasks]
    context = multiprocessing.get_context("spawn")  # jax and triton hold threads: do not fork
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        return list(pool.map(check, *zip(*tasks, strict=True)))


def main(argv: list[str] | None = None) -> int:
    """Print the table; 0 when every row passes, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the subset CI runs")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)),
                        help="compute capabilities, comma separated (default: 120,90)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile in this many processes (default: 2)")
    args = parser.parse_args(argv)
    targets = tuple(int(t) for t in args.targets.split(","))
    names = [case.name for case in all_cases() if case.quick or not args.quick]
    rows = run(names, targets, args.jobs)
    print(format_table(rows))
    failed = [row for row in rows if problems(row)]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows pass"
          + ("" if not failed else f"; failing: {', '.join(f'{r.kernel} (sm_{r.capability})' for r in failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
