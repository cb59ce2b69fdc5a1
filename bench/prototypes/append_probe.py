"""Where the time of a page pack goes: kernels per call, dispatch vs device time.

    python3 bench/prototypes/append_probe.py        # on the GPU machine
"""
import functools
import sys
import time

sys.path.insert(0, "bench")
import jax
import jax.numpy as jnp

from decode import HEAD_DIM, SHAPES, make_config, median_ms, ours, random_cache
from jflashloop.page_chain import pack_pages


def kernels_in(compiled_text):
    lines = [l for l in compiled_text.splitlines() if "ENTRY" not in l]
    fusions = sum(" fusion(" in l or "= fusion" in l for l in lines)
    customs = sum("custom-call(" in l for l in lines)
    return fusions, customs


def in_jit_ms(function, keys, values, pages, repeats=20):
    """Device time per pack: ``repeats`` packs of distinct inputs inside one jit."""
    key_sets = [keys * (1.0 + 2.0**-10 * i) for i in range(repeats)]
    value_sets = [values * (1.0 + 2.0**-10 * i) for i in range(repeats)]

    @jax.jit
    def many(key_sets, value_sets):
        return [function(k, v, pages) for k, v in zip(key_sets, value_sets)]

    jax.block_until_ready(many(key_sets, value_sets))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(many(key_sets, value_sets))
        samples.append((time.perf_counter() - start) * 1e3 / repeats)
    return sorted(samples)[2]


for sequences, loops in ((1, 1), (8, 1), (1, 4)):
    config = make_config(sequences, 8, 4096, loops)
    shape = (loops, sequences, config.page_size, 8, HEAD_DIM)
    keys = jax.random.normal(jax.random.key(0), shape).astype(jnp.bfloat16).astype(jnp.float32)
    values = jax.random.normal(jax.random.key(1), shape)
    pages = jnp.arange(sequences, dtype=jnp.int32) + 3
    raw = functools.partial(pack_pages, config=config, implementation="pallas")
    pack = jax.jit(raw)
    text = pack.lower(keys, values, pages).compile().as_text()
    fusions, customs = kernels_in(text)
    ms = median_ms(pack, [(keys, values, pages)])
    print(f"pack {sequences} page(s), {loops} loop(s): {fusions} fusions, {customs} custom calls; "
          f"per call {ms:.3f} ms; inside one jit {in_jit_ms(raw, keys, values, pages):.3f} ms", flush=True)
    if loops == 1 and sequences == 1:
        print(text[:200000], file=open("/tmp/pack_hlo.txt", "w"))

name, sequences, q_heads, kv_heads, tokens = SHAPES[0]
config = make_config(sequences, kv_heads, tokens, 1)
cache = random_cache(config, tokens, 0)
queries = jax.random.normal(jax.random.key(7), (sequences, q_heads, HEAD_DIM), jnp.bfloat16)
decode = ours(0)
text = decode.lower(queries, cache).compile().as_text()
fusions, customs = kernels_in(text)
print(f"decode {name} loop 1: {fusions} fusions, {customs} custom calls; per call "
      f"{median_ms(decode, [(queries, cache)]):.3f} ms", flush=True)
