import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import gpu_protos as g
name, file, layout = sys.argv[1], sys.argv[2], sys.argv[3]
splits, warps, stages = map(int, sys.argv[4:7])
env = dict(kv.split("=") for kv in sys.argv[7:])
mod = g.load(name, file, env)
big = g.make(8, 8, 32768, 16, seed=2)
fn = g.runner(mod, layout, big, splits, warps, stages)
for _ in range(3):
    jax.block_until_ready(fn())
print("done")
