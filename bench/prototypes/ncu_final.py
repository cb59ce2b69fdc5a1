import sys, os
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import decode as bench
loops = int(sys.argv[1])
config = bench.make_config(8, 8, 32768, loops)
cache = bench.random_cache(config, 32768, 0)
q = jax.random.normal(jax.random.key(7), (8, 32, 128), jnp.bfloat16)
f = bench.ours(loops - 1)
for _ in range(3):
    jax.block_until_ready(f(q, cache))
print("done")
