"""Sharded cache checks, run in a subprocess with 8 simulated CPU devices.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_checks.py
Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop import CacheConfig, paged_cache, sharding

AUTO = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto)
COLLECTIVES = re.compile(r"all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter")
MOVING_DATA = re.compile(r"all-gather|collective-permute|all-to-all|reduce-scatter")


def only_counter_all_reduces(hlo: str, model: int) -> tuple[bool, list[str]]:
    """True when the program moves no cache data: at most all-reduces of int32 flag/counter words."""
    lines = [line for line in hlo.splitlines() if COLLECTIVES.search(line) and "=" in line]
    if MOVING_DATA.search(hlo):
        return False, lines
    reduces = [line for line in lines if "all-reduce" in line]
    if model == 1:
        return not reduces, reduces
    return all("s32[" in line for line in reduces), reduces


def config():
    return CacheConfig.flashloop(
        num_layers=2, num_kv_heads=8, head_dim=16, num_pages=64, max_sequences=8,
        max_pages_per_sequence=8, num_loops=4, page_size=16,
    )


def tokens(rng, shape):
    base = rng.standard_normal((*shape[:1], 1, *shape[2:]))
    loops = base + 0.2 * rng.standard_normal(shape)
    return jnp.asarray(loops, jnp.float32)


def check(name, condition):
    print(("ok   " if condition else "FAIL ") + name, flush=True)
    if not condition:
        sys.exit(1)


LENGTHS = [37, 5, 70, 16, 1, 64, 33, 50]
APPEND_STEPS = 20
CHECKED = [(slot, layer, loop) for slot in (0, 2, 7) for layer, loop in ((0, 0), (1, 3))]


def make_inputs(seed: int):
    """Prompts, append steps (the last one with a NaN in sequence 5's last KV head) and queries."""
    rng = np.random.default_rng(seed)
    prompts = [(tokens(rng, (2, 4, 72, 8, 16)), tokens(rng, (2, 4, 72, 8, 16))) for _ in LENGTHS]
    steps = [(tokens(rng, (2, 4, 8, 8, 16)), tokens(rng, (2, 4, 8, 8, 16))) for _ in range(APPEND_STEPS)]
    nan_step = np.array(tokens(rng, (2, 4, 8, 8, 16)))
    nan_step[0, 0, 5, 7, 3] = np.nan
    steps.append((jnp.asarray(nan_step), jnp.asarray(nan_step)))
    queries = jnp.asarray(rng.standard_normal((8, 16, 16)), jnp.float32)  # GQA 2 per KV head
    return prompts, steps, queries


def single_device_reference(inputs):
    """The same history on one device (computed once, compared against every mesh)."""
    prompts, steps, queries = inputs
    cache = paged_cache.create(config())
    prefill = jax.jit(paged_cache.prefill)
    for slot, ((keys, values), length) in enumerate(zip(prompts, LENGTHS, strict=True)):
        cache = prefill(cache, jnp.int32(slot), keys, values, jnp.int32(length))
    append = jax.jit(paged_cache.append)
    for keys, values in steps[:-1]:
        cache = append(cache, keys, values)
    before_nan = cache
    cache = append(cache, *steps[-1])
    reconstruct = jax.jit(paged_cache.reconstruct, static_argnums=(1, 2))
    attention = jax.jit(jflashloop.decode_attention, static_argnums=(2, 3), static_argnames=("include_pending",))
    return {
        "lengths": np.asarray(before_nan.lengths),
        "counts": np.asarray(cache.nonfinite_counts),
        "flags": np.asarray(cache.error_flags),
        "reconstructions": {
            key: [np.asarray(x) for x in reconstruct(cache, key[1], key[2], jnp.int32(key[0]))[:2]]
            for key in CHECKED
        },
        "attention": {loop: attention(queries, cache, 1, loop, include_pending=False) for loop in (0, 3)},
    }


def run_mesh(data: int, model: int, inputs, single) -> None:
    prompts, steps, queries = inputs
    rng = np.random.default_rng(data)
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=AUTO)
    c = config()
    sharded = sharding.create(c, mesh)
    for slot, ((keys, values), length) in enumerate(zip(prompts, LENGTHS, strict=True)):
        sharded = sharding.prefill(sharded, mesh, slot, keys, values, length)
    for keys, values in steps[:-1]:
        sharded = sharding.append(sharded, mesh, keys, values)
    label = f"mesh {data}x{model}"
    check(f"{label}: lengths", np.array_equal(np.asarray(sharded.lengths), single["lengths"]))
    check(f"{label}: no error flags", not np.asarray(sharded.error_flags).any())
    sharded = sharding.append(sharded, mesh, *steps[-1])
    check(f"{label}: a NaN in one head's shard is counted for its sequence",
          np.array_equal(np.asarray(sharded.nonfinite_counts), single["counts"])
          and np.array_equal(np.asarray(sharded.error_flags), single["flags"])
          and int(single["counts"][5]) == 2)
    for slot, layer, loop in CHECKED:
        a = sharding.reconstruct(sharded, mesh, layer, loop, slot)
        b = single["reconstructions"][(slot, layer, loop)]
        same = all(np.array_equal(np.asarray(x).view(np.uint32), y.view(np.uint32))
                   for x, y in zip(a[:2], b, strict=True))
        check(f"{label}: slot {slot} layer {layer} loop {loop + 1} reconstruction bit-identical", same)
    for loop in (0, 3):
        out = sharding.decode_attention_sharded(queries, sharded, mesh, 1, loop, include_pending=False)
        expected = single["attention"][loop]
        error = float(jnp.max(jnp.linalg.norm(out - expected, axis=(1, 2)) / jnp.linalg.norm(expected, axis=(1, 2))))
        check(f"{label}: attention loop {loop + 1} matches single device (max rel. error {error:.1e})", error < 1e-5)
        spec = (*tuple(out.sharding.spec), None, None)
        check(f"{label}: attention output stays sharded {out.sharding.spec}",
              spec[0] == "data" and (model == 1 or spec[1] == "model"))
    # No hidden resharding: the compiled programs contain no collectives.
    keys, values = tokens(rng, (2, 4, 8, 8, 16)), tokens(rng, (2, 4, 8, 8, 16))
    local = sharding.local_config(c, mesh)
    run = sharding._append_function(mesh, local, c, sharding.MeshAxes(), None)
    hlo = run.lower(sharded, keys, values).compile().as_text()
    ok, found = only_counter_all_reduces(hlo, model)
    check(f"{label}: append moves no cache data ({len(found)} int32 flag/counter all-reduce ops)", ok)
    prefill = sharding._prefill_function(mesh, local, c, sharding.MeshAxes(), None)
    prompt = tokens(rng, (2, 4, 72, 8, 16))  # the prompts' shape: the program compiled for them above
    hlo = prefill.lower(sharded, jnp.int32(3), prompt, prompt, jnp.int32(32)).compile().as_text()
    ok, found = only_counter_all_reduces(hlo, model)
    check(f"{label}: prefill moves no cache data ({len(found)} int32 flag/counter all-reduce ops)", ok)
    attention = sharding._attention_function(mesh, local, c, sharding.MeshAxes(), 1, 3, True, None, None)
    hlo = attention.lower(queries, sharded).compile().as_text()
    found = sorted(set(COLLECTIVES.findall(hlo)))
    check(f"{label}: attention compiles without collectives {found}", not found)
    leaf = sharded.layers[0].loops[0].keys.payload
    check(f"{label}: pool payload sharded over (model, data)", tuple(leaf.sharding.spec)[:2] == ("model", "data"))


def run_codec_checks() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((256, 8, 64)), jnp.float32)
    placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model")))
    for spec in (jflashloop.INT4_VALUES, jflashloop.NVFP4, jflashloop.CodecSpec("int4", "channel", 64)):
        encode = jax.jit(lambda x, spec=spec: jflashloop.encode(x, spec, implementation="xla"))
        a, b = encode(placed), encode(x)
        same = all(np.array_equal(np.atleast_1d(np.asarray(p)).view(np.uint8), np.atleast_1d(np.asarray(q)).view(np.uint8))
                   for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
        check(f"codec {spec.format}/{spec.axis}: sharded encode bit-identical", same)


def run_error_checks() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
    bad = CacheConfig.flashloop(num_layers=1, num_kv_heads=6, head_dim=16, num_pages=8, max_sequences=2,
                                max_pages_per_sequence=4, num_loops=1, page_size=16)
    try:
        sharding.create(bad, mesh)
    except ValueError as error:
        check(f"6 heads on a model axis of 4: {error}", "num_kv_heads=6" in str(error))
    else:
        check("6 heads on a model axis of 4 raises", False)


def run_fork_checks() -> None:
    """A fork within a data shard equals the single-device fork; across shards it raises.

    On the 2x4 mesh of :func:`run_mesh` (its sharded prefill is compiled once for both): slots 4-7 are
    data shard 1, so the fork of slot 5 into slot 7 is local slot 1 into 3 of a shard other than the first.
    """
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
    rng = np.random.default_rng(5)
    keys, values = tokens(rng, (2, 4, 72, 8, 16)), tokens(rng, (2, 4, 72, 8, 16))
    # Jitted like the single-device reference's calls (same shapes, so their compilations are shared).
    single = jax.jit(paged_cache.prefill)(paged_cache.create(config()), jnp.int32(5), keys, values, jnp.int32(70))
    single = jax.jit(paged_cache.fork)(single, jnp.int32(5), jnp.int32(7), jnp.int32(40))
    reconstruct = jax.jit(paged_cache.reconstruct, static_argnums=(1, 2))
    sharded = sharding.prefill(sharding.create(config(), mesh), mesh, 5, keys, values, 70)
    sharded = sharding.fork(sharded, mesh, 5, 7, 40)
    check("fork within a data shard: same page references",
          np.array_equal(np.asarray(sharded.page_refs).sum(), np.asarray(single.page_refs).sum()))
    for layer, loop in ((0, 0), (1, 3)):
        got = sharding.reconstruct(sharded, mesh, layer, loop, 7)
        want = reconstruct(single, layer, loop, jnp.int32(7))
        check(f"fork within a data shard: slot 7 layer {layer} loop {loop} as on one device",
              all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got[:2], want[:2], strict=True)))
    try:
        sharding.fork(sharded, mesh, 5, 2)
    except ValueError as error:
        check(f"a fork across data shards raises: {error}", "within a data shard" in str(error))
    else:
        check("a fork across data shards raises", False)


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    run_codec_checks()
    run_error_checks()
    run_fork_checks()
    inputs = make_inputs(0)
    single = single_device_reference(inputs)
    for data, model in ((8, 1), (2, 4)):  # no model axis, and the widest one (the codec checks use 4x2)
        run_mesh(data, model, inputs, single)
    print("all sharding checks passed")
