def run(q, bt, bounds, kw, ks, km, vw, vs, vm, *, splits, interpret=False, warps=4, stages=1):
    B, Hk, _, R, W = q.shape
    P = kw.shape[2]
    maxp = bt.shape[1]
    pps = -(-maxp // splits)
    full = pl.BlockSpec()
    k = functools.partial(kernel, P=P, W=W, R=R, pages_per_split=pps)
    return pl.pallas_call(
        k, grid=(B, Hk, splits),
        in_specs=[pl.BlockSpec((None, None, 8, R, W), lambda b, h, s: (b, h, 0, 0, 0))] + [full] * 8,
        out_specs=[pl.BlockSpec((None, None, None, 8, R, W), lambda b, h, s: (b, h, s, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, splits, 8, R, W), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, splits, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, splits, R), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="proto")(q, bt, bounds, kw, ks, km, vw, vs, vm)

def example(B=2, Hk=2, T=1024, R=16, D=128, P=64):
    W = D // 8; pages = T // P
    key = jax.random.split(jax.random.key(0), 8)
    q = jax.random.normal(key[0], (B, Hk, 8, R, W))
    bt = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    bounds = jnp.full((B, 2), T, jnp.int32)
    kw = jax.random.bits(key[1], (Hk, B * pages, P, W), jnp.uint32)
    vw = jax.random.bits(key[2], (Hk, B * pages, P, W), jnp.uint32)
    ks = jax.random.uniform(key[3], (Hk, B * pages, 1, D)).astype(jnp.float16)
    km = jax.random.uniform(key[4], (Hk, B * pages, 1, D)).astype(jnp.float16)
    vs = jax.random.uniform(key[5], (Hk, B * pages, P, 2)).astype(jnp.float16)
    vm = jax.random.uniform(key[6], (Hk, B * pages, P, 2)).astype(jnp.float16)
    return q, bt, bounds, kw, ks, km, vw, vs, vm
