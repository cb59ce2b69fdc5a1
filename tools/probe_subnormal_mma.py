"""Does mma.sync (float16 operands, float32 accumulator) keep float16 subnormal operands?"""
import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def probe(a_ptr, b_ptr, c_ptr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    ar = gl.arange(0, 16, layout=gl.SliceLayout(1, A))
    ac = gl.arange(0, 16, layout=gl.SliceLayout(0, A))
    a = gl.load(a_ptr + gl.expand_dims(ar, 1) * 16 + gl.expand_dims(ac, 0))
    br = gl.arange(0, 16, layout=gl.SliceLayout(1, B))
    bc = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    b = gl.load(b_ptr + gl.expand_dims(br, 1) * 8 + gl.expand_dims(bc, 0))
    cr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    cc = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    c = mma_v2(a, b, gl.zeros([16, 8], gl.float32, layout=MMA))
    gl.store(c_ptr + gl.expand_dims(cr, 1) * 8 + gl.expand_dims(cc, 0), c)


rng = np.random.default_rng(0)
for case in ("B subnormal codes", "A subnormal codes", "both subnormal"):
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    if case != "A subnormal codes":
        b = (rng.integers(0, 256, (16, 8)).astype(np.uint16)).view(np.float16)  # n * 2**-24, n < 256
    if case != "B subnormal codes":
        a = (rng.integers(0, 256, (16, 16)).astype(np.uint16)).view(np.float16)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ta, tb = torch.tensor(a, device="cuda"), torch.tensor(b, device="cuda")
    tc = torch.zeros((16, 8), dtype=torch.float32, device="cuda")
    probe[(1,)](ta, tb, tc, num_warps=1)
    got = tc.cpu().numpy().astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{case}: max |ref| {np.abs(ref).max():.3e}, max relative error {err:.3e}, zeros {int((got == 0).sum())}")
