"""Latency of the one-kernel page encoder by launch width (GPU), with a trivial kernel as the floor.

    python3 bench/prototypes/pack_warps_probe.py
"""
import functools
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jflashloop_pallas_kernels.quantize import TileFormat, encode_page_pairs


def device_ms(function, args, repeats=50):
    jax.block_until_ready(function(*args))
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            out = function(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / repeats)
    return sorted(samples)[3]


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


@jax.jit
def trivial(x):
    pages, rows, heads, d = x.shape
    return pl.pallas_call(
        copy_kernel, grid=(heads, pages),
        in_specs=[pl.BlockSpec((None, rows, None, d), lambda h, p: (p, 0, h, 0))],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda h, p: (h, p, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((heads, pages, rows, d), jnp.float32),
    )(x)


int4_k, int4_v = TileFormat("int4", "channel", 64), TileFormat("int4", "token", 64)
nvfp4 = TileFormat("nvfp4", "token", 16)
for pages in (1, 8):
    keys = jax.random.normal(jax.random.key(0), (pages, 64, 8, 128))
    values = jax.random.normal(jax.random.key(1), (pages, 64, 8, 128))
    numbers = jnp.arange(pages, dtype=jnp.int32)
    print(f"{pages} page(s): trivial kernel {device_ms(trivial, (keys,)):.3f} ms", flush=True)
    for name, kf, vf in (("int4/int4", int4_k, int4_v), ("nvfp4/nvfp4", nvfp4, nvfp4), ("int4/nvfp4", int4_k, nvfp4)):
        for warps in (1, 2, 4, 8, 16):
            f = jax.jit(functools.partial(encode_page_pairs, key_format=kf, value_format=vf,
                                          sink_tokens=4, num_warps=warps))
            try:
                ms = device_ms(f, (keys, values, numbers))
            except Exception as error:
                print(f"  {name} warps={warps}: failed {type(error).__name__} {str(error)[:100]}")
                continue
            print(f"  {name} warps={warps}: {ms:.3f} ms", flush=True)
