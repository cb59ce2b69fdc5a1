"""Prototype: dense INT4 loop-1 decode, nibble planes, f16 products."""
import functools, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MASK = -1e30
ORIENT = __import__("os").environ.get("ORIENT", "A")
PDT = jnp.float16

def planes(words):
    return [((words >> jnp.uint32(4 * i)) & jnp.uint32(15)) for i in range(8)]

def as_float(codes):  # exact int -> f32 via magic number
    return jax.lax.bitcast_convert_type(codes | jnp.uint32(0x4B000000), jnp.float32) - 8388608.0

def kernel(q_ref, bt_ref, bounds_ref, kw_ref, ks_ref, km_ref, vw_ref, vs_ref, vm_ref, o_ref, l_ref, m_ref, *, P, W, R, pages_per_split):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qs = [q_ref[i].astype(PDT) for i in range(8)]  # [R, W]
    end = bounds_ref[b, 1]
    npages = pl.cdiv(end, P)
    first = s * pages_per_split
    count = jnp.clip(npages - first, 0, pages_per_split)
    t_in = jnp.arange(P, dtype=jnp.int32)
    wcol = jnp.arange(W, dtype=jnp.int32)
    def body(step, carry):
        accs, mx, sm = carry
        pi = first + step
        page = bt_ref[b, pi]
        kwords = kw_ref[h, page, :, :]  # [P, W]
        vwords = vw_ref[h, page, :, :]
        kp = planes(kwords); vp = planes(vwords)
        scores = None
        for i in range(8):
            sc = ks_ref.at[h, page, 0, wcol * 8 + i][...]  # [W]
            mn = km_ref.at[h, page, 0, wcol * 8 + i][...]
            k_i = (as_float(kp[i]) * sc[None, :].astype(jnp.float32) + mn[None, :].astype(jnp.float32)).astype(PDT)
            if ORIENT == "A":
                part = jnp.dot(qs[i], k_i.T, preferred_element_type=jnp.float32)  # [R, P]
            else:
                part = jnp.dot(k_i, qs[i].T, preferred_element_type=jnp.float32).T
            scores = part if scores is None else scores + part
        tok = pi * P + t_in
        valid = tok < end
        scores = jnp.where(valid[None, :], scores, MASK)
        nm = jnp.maximum(mx, jnp.max(scores, axis=1))
        corr = jnp.exp2(mx - nm)
        p = jnp.exp2(scores - nm[:, None])
        nsm = sm * corr + jnp.sum(p, axis=1)
        pw = p.astype(PDT)
        vsc = vs_ref.at[h, page, t_in[:, None], (wcol // (W // 2))[None, :]][...]  # [P, W] (G=64, D=128)
        vmn = vm_ref.at[h, page, t_in[:, None], (wcol // (W // 2))[None, :]][...]
        vsc = vsc.astype(jnp.float32); vmn = vmn.astype(jnp.float32)
        new = []
        for i in range(8):
            v_i = (as_float(vp[i]) * vsc + vmn).astype(PDT)
            if ORIENT == "A":
                upd = jnp.dot(pw, v_i, preferred_element_type=jnp.float32)  # [R, W]
            else:
                upd = jnp.dot(v_i.T, pw.T, preferred_element_type=jnp.float32).T
            new.append(accs[i] * corr[:, None] + upd)
        return tuple(new), nm, nsm
    init = (tuple(jnp.zeros((R, W), jnp.float32) for _ in range(8)), jnp.full((R,), MASK, jnp.float32), jnp.zeros((R,), jnp.float32))
    accs, mx, sm = jax.lax.fori_loop(0, count, body, init)
    for i in range(8):
        o_ref[i] = accs[i]
    l_ref[...] = sm
    m_ref[...] = mx

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
