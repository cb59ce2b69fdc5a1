"""Programs an SM of each Gluon page kernel, from its compiled registers and shared memory (no GPU).

    python tools/kernel_residency.py [--capability 90]

One Markdown row per kernel variant (format, head_dim, GQA group, page size, dense streams, sparse rows,
pipeline stages; the public call's query and window dtypes and register cap): ptxas's registers and spill
stores, the dynamic shared memory a block takes, the one-warp blocks an SM holds by registers
(``launch.register_resident_programs``) and by shared memory (``launch.shared_resident_programs``), the
smaller of the two, and what the split plans count (``launch.resident_programs``). Where the last two differ,
the plans count rounds of the wrong size (``launch.wave_fitted_splits``) for grids beyond one wave. About a
second a row on a CPU (triton's own ptxas, ``jflashloop_triton_kernels.compile_check``).
"""

from __future__ import annotations

import argparse

from jflashloop_triton_kernels import compile_check, launch

# (format, head_dim, group, page_size, dense streams, sparse rows, stages)
VARIANTS = [
    *[(format, head_dim, group, 64, 1, (), 2) for format in ("int4", "nvfp4", "int4_rotated")
      for head_dim, group in ((64, 3), (128, 1), (128, 4), (128, 8), (256, 1))],
    *[(format, 128, 4, page, 1, (), 2) for page in (16, 32, 128) for format in ("int4", "nvfp4")],
    ("int4", 128, 4, 64, 2, (), 1), ("int4", 128, 1, 64, 2, (16, 7), 1), ("nvfp4", 128, 1, 64, 2, (16, 7), 1),
    ("int4", 64, 3, 64, 2, (16, 7), 1),
]
HEADER = ("| format | head_dim | group | page | streams | rows | stages | registers | spill stores | shared bytes "
          "| by registers | by shared memory | resident | the plans count |\n" + "|---" * 14 + "|")


def row(format, head_dim, group, page_size, streams, sparse, stages, capability=90) -> str:
    """One Markdown row of :data:`HEADER` for one kernel variant compiled for ``sm_<capability>``."""
    value_group = 16 if format == "nvfp4" else 64
    options = dict(format=format, head_dim=head_dim, group=group, page_size=page_size, streams=streams,
                   sparse=sparse, stages=stages, value_group=value_group, capability=capability,
                   maxnreg=launch.preferred_maxnreg(format), stagger=stages == 1)
    if format == "int4_rotated":  # the public call's rotated float32 query and float16 moved windows
        options.update(query="*fp32", window="*fp16")
    compiled = compile_check.compile_pages_kernel(**options)
    target = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    resources = compile_check.ptxas_resources(compiled.asm["ptx"], target)
    by_registers = launch.register_resident_programs(resources["registers"])
    by_shared = launch.shared_resident_programs(compiled.metadata.shared, capability)
    planned = launch.resident_programs(format=format, head_dim=head_dim, streams=streams, sparse_rows=sparse,
                                       stages=stages, page_size=page_size, value_group=value_group,
                                       capability=capability)
    cells = (format, head_dim, group, page_size, streams, "/".join(map(str, sparse)) or "-", stages,
             resources["registers"], resources["spill_stores"], compiled.metadata.shared, by_registers, by_shared,
             min(by_registers, by_shared), planned)
    return "| " + " | ".join(map(str, cells)) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="compile for sm_<capability> (default 90)")
    args = parser.parse_args(argv)
    print(HEADER, flush=True)
    for variant in VARIANTS:
        print(row(*variant, capability=args.capability), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
