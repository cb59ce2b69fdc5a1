"""What one decode-attention call costs besides its bytes (GPU): the launch floor.

Usage: ``python bench/call_overhead.py`` (``JFLASHLOOP_TRITON_TARGET=ffi`` for the typed-FFI
custom-call target instead of jax_triton's legacy one)

Times the public call (and each formulation named) on a cache of one
sequence, one KV head and one page, where the kernels have nothing to
read: 12 calls inside one jitted function, as ``kernel_formulations.py
--device-time`` times them. Also prints the size of each custom call's
``backend_config`` in the lowered module (the launch descriptor the runtime
receives per call).
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode as bench
import kernel_formulations as formulations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", default="public,gluon2-s2w-mx,gluon2-s2w-m,pallas,xla")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    config = bench.make_config(1, 1, args.tokens, 1, head_dim=128)
    cache = bench.random_cache(config, args.tokens, 0)
    queries = jax.random.normal(jax.random.key(7), (1, 4, 128), jnp.bfloat16)
    from jflashloop_triton_kernels import call

    print(f"custom-call target: {'triton_kernel_call_ffi' if call.USE_FFI_TARGET else 'triton_kernel_call'}")
    print("| formulation | ms per call (12 in one jit) | custom calls | backend_config bytes |")
    print("|---|---|---|---|")
    for name in args.names.split(","):
        run = bench.ours(0, implementation="xla") if name == "xla" else formulations.formulation(name)
        text = jax.jit(run).lower(queries, cache).as_text()
        configs = re.findall(r'backend_config\s*=\s*"((?:[^"\\]|\\.)*)"', text)
        calls = text.count("stablehlo.custom_call")
        ms = formulations.device_ms(run, queries, [(cache,)])
        print(f"| {name} | {ms:.4f} | {calls} | {', '.join(str(len(c)) for c in configs)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
