"""Encode/decode throughput of the codecs under jit.

Usage: python bench/codec_speed.py [--tokens 32768 --kv-heads 8 --head-dim 128]
Prints median wall time (block_until_ready) over repeated calls, per format
and implementation, for a bfloat16 ``[tokens, kv_heads, head_dim]`` tensor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop


def median_ms(function, *args, repeats: int) -> float:
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = (args.tokens, args.kv_heads, args.head_dim)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.bfloat16)
    implementations = ["xla", "pallas"] if jax.default_backend() == "gpu" else ["xla"]
    print(f"backend={jax.default_backend()} devices={jax.devices()} shape={shape} bfloat16")
    print(f"{'format':28s} {'impl':7s} {'encode ms':>10s} {'decode ms':>10s}")
    for name, spec in [("int4 channel G64 (K)", jflashloop.INT4_KEYS),
                       ("int4 token G64 (V)", jflashloop.INT4_VALUES),
                       ("nvfp4", jflashloop.NVFP4)]:
        for implementation in implementations:
            encode = jax.jit(lambda x, spec=spec, implementation=implementation:
                             jflashloop.encode(x, spec, implementation=implementation))
            decode = jax.jit(lambda p: jflashloop.decode(p, jnp.bfloat16))
            packed = encode(x)
            encode_ms = median_ms(encode, x, repeats=args.repeats)
            decode_ms = median_ms(decode, packed, repeats=args.repeats)
            print(f"{name:28s} {implementation:7s} {encode_ms:10.2f} {decode_ms:10.2f}")


if __name__ == "__main__":
    main()
