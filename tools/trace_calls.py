"""The GPU kernels of a one-step decode trace (``bench/end_to_end.py --parts trace``), per attention call.

Prints, for a ``.xplane.pb`` trace of one decode step: the kernels' total time by name (numbers dropped from XLA's
fusion names), and, over the step's calls of the attention page kernel taken in order as ``loops`` x ``layers``
(loop by loop), the page kernel's mean time per loop and the mean time of the other kernels that run between one
call and the next, with the names that take most of it. Host-free: reads the trace file only.

Usage: ``python tools/trace_calls.py TRACE.xplane.pb [--loops 4] [--kernel pages_kernel] [--top 12]``
"""

from __future__ import annotations

import argparse
import collections
import re

import jax
import numpy as np


def gpu_kernels(path) -> list[tuple[float, float, str]]:
    """``(start us, end us, name)`` of every GPU kernel of an ``.xplane.pb`` trace, in start order."""
    return sorted((event.start_ns / 1e3, (event.start_ns + event.duration_ns) / 1e3, event.name)
                  for plane in jax.profiler.ProfileData.from_file(str(path)).planes
                  if plane.name.startswith("/device:GPU")
                  for line in plane.lines if line.name.startswith("Stream")
                  for event in line.events)


def kind(name: str) -> str:
    """A kernel's name without XLA's instance numbers (``gemm_fusion_dot_36`` -> ``gemm_fusion_dot``)."""
    return re.sub(r"[._]\d+", "", name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--loops", type=int, default=4, help="the attention calls' loops (calls = loops x layers)")
    parser.add_argument("--kernel", default="pages_kernel", help="a substring of the attention page kernel's name")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    kernels = gpu_kernels(args.trace)
    if not kernels:
        raise SystemExit(f"{args.trace}: no GPU kernels")
    busy = sum(end - start for start, end, _ in kernels) / 1e3
    span = (max(end for _, end, _ in kernels) - kernels[0][0]) / 1e3
    print(f"{len(kernels)} kernels, busy {busy:.3f} ms, span {span:.3f} ms\n")
    totals = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in kernels:
        totals[kind(name)][0] += 1
        totals[kind(name)][1] += (end - start) / 1e3
    print("| kernel | calls | ms |\n|---|---|---|")
    for name, (count, ms) in sorted(totals.items(), key=lambda item: -item[1][1])[:args.top]:
        print(f"| {name[:90]} | {count} | {ms:.3f} |")
    calls = [i for i, (_, _, name) in enumerate(kernels) if args.kernel in name]
    if not calls or len(calls) % args.loops:
        raise SystemExit(f"\n{len(calls)} calls of {args.kernel!r}: not a multiple of {args.loops} loops")
    layers = len(calls) // args.loops
    own = np.array([kernels[i][1] - kernels[i][0] for i in calls]).reshape(args.loops, layers)
    after = [kernels[a + 1:b] for a, b in zip(calls, [*calls[1:], len(kernels)], strict=True)]
    between = np.array([sum(end - start for start, end, _ in run) for run in after]).reshape(args.loops, layers)
    print(f"\n{len(calls)} attention calls ({args.loops} loops x {layers} layers), us a call:\n")
    print("| loop | page kernel | other kernels up to the next call | largest of them (us a call) |\n|---|---|---|---|")
    for loop in range(args.loops):
        named = collections.Counter()
        for run in after[loop * layers:(loop + 1) * layers]:
            for start, end, name in run:
                named[kind(name)] += (end - start) / layers
        largest = ", ".join(f"{name[:40]} {us:.1f}" for name, us in named.most_common(4))
        print(f"| {loop + 1} | {own[loop].mean():.1f} | {between[loop].mean():.1f} | {largest} |")


if __name__ == "__main__":
    main()
