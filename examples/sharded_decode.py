"""Sharded decode on a jax.sharding.Mesh: one host or many.

Single host (any number of local devices, e.g. one GPU -> a 1x1 mesh):
    python examples/sharded_decode.py --data 1 --model 1

Simulated devices on a CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_decode.py --data 4 --model 2

Several hosts: start the same command on every host with
    JFLASHLOOP_COORDINATOR=host0:1234 JFLASHLOOP_PROCESS_COUNT=2 JFLASHLOOP_PROCESS_ID=<0 or 1> \\
    python examples/sharded_decode.py --data 2 --model 8
``jax.distributed.initialize`` then joins the processes and ``jax.devices()``
lists every host's devices; the mesh below spans all of them (data across
hosts, heads within a host, so the model axis stays on the fast local links).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=int, default=1, help="mesh size over sequences")
    parser.add_argument("--model", type=int, default=1, help="mesh size over KV heads")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if "JFLASHLOOP_COORDINATOR" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JFLASHLOOP_COORDINATOR"],
            num_processes=int(os.environ["JFLASHLOOP_PROCESS_COUNT"]),
            process_id=int(os.environ["JFLASHLOOP_PROCESS_ID"]),
        )
    from jflashloop import CacheConfig, paged_cache, sharding

    auto = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto)
    mesh = jax.make_mesh((args.data, args.model), ("data", "model"), axis_types=auto)
    sequences, kv_heads, q_heads, head_dim, page_size = 2 * args.data, 8 * args.model, 32 * args.model, 128, 64
    pages = -(-(args.tokens + args.steps) // page_size)
    config = CacheConfig.flashloop(
        num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, num_pages=sequences * pages,
        max_sequences=sequences, max_pages_per_sequence=pages, num_loops=4, page_size=page_size,
    )
    print(f"{jax.process_count()} process(es), {len(jax.devices())} device(s) "
          f"({jax.devices()[0].device_kind}); mesh {dict(mesh.shape)}")
    local = sharding.local_config(config, mesh)
    print(f"global: {config.max_sequences} sequences x {config.num_kv_heads} KV heads, {config.num_pages} pages; "
          f"per shard: {local.max_sequences} sequences x {local.num_kv_heads} KV heads, {local.num_pages} pages")
    cache = sharding.create(config, mesh)
    rng = np.random.default_rng(0)
    for slot in range(sequences):
        base = rng.standard_normal((1, 1, args.tokens, kv_heads, head_dim)).astype(np.float32)
        keys = jnp.asarray(base + 0.1 * rng.standard_normal((1, 4, args.tokens, kv_heads, head_dim)), jnp.float32)
        cache = sharding.prefill(cache, mesh, slot, keys, keys)
    queries = jnp.asarray(rng.standard_normal((sequences, q_heads, head_dim)), jnp.float32)
    out = None
    start = time.perf_counter()
    for _ in range(args.steps):
        step = jnp.asarray(rng.standard_normal((1, 4, sequences, kv_heads, head_dim)), jnp.float32)
        cache = sharding.append(cache, mesh, step, step)
        for loop in range(4):
            out = sharding.decode_attention_sharded(queries, cache, mesh, 0, loop)
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    paged_cache.check(cache)
    print(f"{args.steps} steps x (append + 4 loops of attention) in {elapsed:.3f} s; "
          f"lengths {np.asarray(cache.lengths).tolist()}; output {out.shape} sharded {out.sharding.spec}; "
          f"finite: {bool(jnp.isfinite(out).all())}")


if __name__ == "__main__":
    main()
