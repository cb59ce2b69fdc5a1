"""Time decode-kernel prototypes against cuDNN on the GPU (one call)."""
import importlib.util, os, sys, time, statistics, json, traceback
import numpy as np
import jax, jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))

def load(name, file, env):
    os.environ.update(env)
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def pair_perm(D):
    cols = np.arange(D); w, r = cols // 8, cols % 8
    return 8 * w + 2 * (r // 4) + (r // 2) % 2 + 4 * (r % 2)

def make(B, Hk, T, R, D=128, P=64, seed=0):
    W = D // 8; pages = T // P
    k = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(k[0], (B, Hk, R, D), jnp.float32) * 0.3
    bt = jax.random.permutation(k[7], B * pages).astype(jnp.int32).reshape(B, pages)
    bt = jnp.pad(bt, ((0, 0), (0, 8)))
    bounds = jnp.full((B, 2), T, jnp.int32)
    kw = jax.random.bits(k[1], (Hk, B * pages, P, W), jnp.uint32)
    vw = jax.random.bits(k[2], (Hk, B * pages, P, W), jnp.uint32)
    ks = jax.random.uniform(k[3], (Hk, B * pages, 1, D), minval=0.01, maxval=0.1).astype(jnp.float16)
    km = jax.random.uniform(k[4], (Hk, B * pages, 1, D), minval=-0.8, maxval=-0.1).astype(jnp.float16)
    vs = jax.random.uniform(k[5], (Hk, B * pages, P, 2), minval=0.01, maxval=0.1).astype(jnp.float16)
    vm = jax.random.uniform(k[6], (Hk, B * pages, P, 2), minval=-0.8, maxval=-0.1).astype(jnp.float16)
    return dict(q=q, bt=bt, bounds=bounds, kw=kw, ks=ks, km=km, vw=vw, vs=vs, vm=vm)

def reference(d):
    """float32 attention over the decoded tiles, natural channel order: [B, Hk, R, D]."""
    q, kw, vw = d["q"], d["kw"], d["vw"]
    bt = d["bt"][:, :d["bt"].shape[1] - 8]
    Hk, NP, P, W = kw.shape; D = 8 * W
    shifts = 4 * jnp.arange(8, dtype=jnp.uint32)
    def codes(w):  # [..., W] -> [..., D]
        return ((w[..., None] >> shifts) & 15).reshape(*w.shape[:-1], D).astype(jnp.float32)
    K = codes(kw) * d["ks"].astype(jnp.float32) + d["km"].astype(jnp.float32)  # [Hk, NP, P, D]
    g = jnp.arange(D) // 64
    V = codes(vw) * d["vs"].astype(jnp.float32)[..., g] + d["vm"].astype(jnp.float32)[..., g]
    Ks = K[:, bt].transpose(1, 0, 2, 3, 4).reshape(bt.shape[0], Hk, -1, D)  # [B, Hk, T, D]
    Vs = V[:, bt].transpose(1, 0, 2, 3, 4).reshape(bt.shape[0], Hk, -1, D)
    s = jnp.einsum("bhrd,bhtd->bhrt", q, Ks, precision="highest")
    p = jnp.exp2(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhrt,bhtd->bhrd", p, Vs, precision="highest") / p.sum(-1)[..., None]

def merge(o, l, m):
    top = m.max(2, keepdims=True); w = jnp.exp2(m - top)
    return (o * w[..., None]).sum(2) / (l * w).sum(2)[..., None]

def runner(mod, layout, d, splits, warps, stages):
    D = d["q"].shape[-1]; W = D // 8; perm = pair_perm(D)
    q = d["q"]
    if layout in ("planes", "planes_pair"):
        q = q.reshape(*q.shape[:-1], W, 8).transpose(0, 1, 4, 2, 3)  # [B, Hk, 8, R, W]
    elif layout == "pair":
        q = q[..., perm]
    args = (q, d["bt"], d["bounds"], d["kw"], d["ks"], d["km"], d["vw"], d["vs"], d["vm"])
    def call(*a):
        o, l, m = mod.run(*a, splits=splits, warps=warps, stages=stages)
        if layout == "planes":  # [B, Hk, S, 8, R, W] -> [B, Hk, S, R, D]
            o = o.transpose(0, 1, 2, 4, 5, 3).reshape(*o.shape[:3], o.shape[4], D)
        out = merge(o, l, m)
        if layout in ("pair", "planes_pair"):
            out = jnp.zeros_like(out).at[..., perm].set(out)
        return out
    f = jax.jit(call)
    return lambda: f(*args)

def timeit(fn, reps=20, batches=5):
    jax.block_until_ready(fn()); jax.block_until_ready(fn())
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(reps):
            r = fn()
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times) * 1e3

VARIANTS = [("v4h", "v4h.py", {}, "pair"), ("v6", "v6.py", {}, "planes_pair")]
CONFIGS = [(16, 4, 1), (16, 4, 5), (16, 2, 5), (32, 2, 5)]
if os.environ.get("VARIANTS"):
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["VARIANTS"].split(",")]

SHAPES = [("B8 Hq32 Hkv8 T32K", 8, 32, 8, 32768), ("B1 Hq16 Hkv16 T64K", 1, 16, 16, 65536)]
if os.environ.get("SHAPES"):
    SHAPES = [x for x in SHAPES if x[0] in os.environ["SHAPES"].split(",")]

def main():
    out = os.environ.get("OUT", ".")
    results = []
    ROWS = int(os.environ.get('ROWS', 16))
    small = make(2, 2, 1024, ROWS, seed=1)
    ref_small = reference(small)
    x = jnp.ones((2**29,), jnp.float32)
    cp = jax.jit(lambda x: x + 1.0)
    t_copy = timeit(lambda: cp(x), reps=10)
    print(f"copy 2 GiB r+w: {2 * 2**31 / t_copy / 1e9:.2f} TB/s", flush=True)
    del x
    errs = {}
    for shape, B, Hq, Hk, T in SHAPES:
        big = make(B, Hk, T, ROWS, seed=2)
        qb = jax.random.normal(jax.random.key(5), (B, Hq, 128), jnp.bfloat16)
        kb = jax.random.normal(jax.random.key(6), (B, T, Hk, 128), jnp.bfloat16)
        vb = jax.random.normal(jax.random.key(7), (B, T, Hk, 128), jnp.bfloat16)
        cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn"))
        t_cudnn = timeit(lambda: cud(qb, kb, vb))
        del kb, vb
        print(f"== {shape}: cudnn {t_cudnn:.3f} ms", flush=True)
        results.append(dict(shape=shape, name="cudnn", ms=t_cudnn))
        nbytes = sum(big[k].nbytes for k in ("kw", "vw", "ks", "km", "vs", "vm"))
        base_splits = max(1, 1024 // (B * Hk))
        for name, file, env, layout in VARIANTS:
            try:
                mod = load(name, file, env)
                if name not in errs:
                    got = runner(mod, layout, small, 4, 4, 1)()
                    errs[name] = float(jnp.linalg.norm(got - ref_small) / jnp.linalg.norm(ref_small))
                err = errs[name]
            except Exception as e:
                traceback.print_exc(); print(name, "failed"); continue
            for splits, warps, stages in CONFIGS:
                splits = splits * base_splits // 16
                try:
                    ms = timeit(runner(mod, layout, big, splits, warps, stages))
                except Exception as e:
                    print(name, splits, warps, stages, "failed:", str(e)[:200]); continue
                row = dict(shape=shape, name=name, splits=splits, warps=warps, stages=stages, ms=ms, err=err,
                           tbps=nbytes / ms / 1e9, vs_cudnn=t_cudnn / ms)
                results.append(row)
                print(f"{name:10s} splits={splits:3d} warps={warps} stages={stages}: {ms:.3f} ms  {row['tbps']:.2f} TB/s  {row['vs_cudnn']:.2f}x cuDNN  err={err:.2e}", flush=True)
        del big
    json.dump(results, open(os.path.join(out, "protos.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
