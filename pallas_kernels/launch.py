"""Launch parameters that depend on the GPU: shared memory per thread block.

The H200 (sm_90) gives a thread block up to 227 KB of shared memory;
consumer Blackwell (sm_120, RTX 50xx) only 99 KB, the figure of the
CUDA C++ Programming Guide, section 5.1 "Compute Capabilities", Table 30
"Technical Specifications per Compute Capability" (maximum amount of shared
memory per thread block, 12.x: 99 KB) at
https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html,
recorded in bytes by NVIDIA's CUTLASS as ``sm120_smem_capacity_bytes =
101376`` (``include/cutlass/arch/arch.h``, beside ``sm100_smem_capacity_bytes
= 232448``). A unified 128 KB data cache of which at most 100 KB is shared
memory, 1 KB of it reserved for the system, as on sm_86 (the guide's
compute capability 8.x section: "allows a single thread block to address up
to 99 KB of shared memory").

A pipelined kernel that fits the H200 can therefore fail to launch on an
RTX 50xx: :func:`stages_that_fit` lowers the Pallas page kernel's stage count
until an upper bound on its shared memory fits the target.
"""

from __future__ import annotations

import functools

import jax

# Maximum shared memory per thread block (the opt-in maximum), bytes, by
# compute capability (major * 10 + minor): the guide's table, in bytes as
# NVIDIA's CCCL (``cudax`` arch traits: per-SM capacity less the 1 KB the
# driver reserves) and CUTLASS record them.
SHARED_MEMORY_PER_BLOCK = {
    80: 166912,  # 163 KB (A100)
    86: 101376,  # 99 KB
    90: 232448,  # 227 KB (H100, H200)
    100: 232448,  # 227 KB (B200)
    120: 101376,  # 99 KB (RTX 50xx)
}
# Every kernel here needs sm_80 or newer (mma.sync.m16n8k16, cp.async).
MINIMUM_CAPABILITY = 80


def shared_memory_per_block(capability: int) -> int:
    """Bytes of shared memory one thread block may use on ``sm_<capability>``.

    A capability missing from :data:`SHARED_MEMORY_PER_BLOCK` (a newer GPU)
    gets the smallest figure of the table, 99 KB.

    Raises:
      ValueError: ``capability`` below 80 (the kernels need sm_80).
    """
    if capability < MINIMUM_CAPABILITY:
        raise ValueError(f"the kernels need compute capability >= {MINIMUM_CAPABILITY}, got {capability}")
    return SHARED_MEMORY_PER_BLOCK.get(capability, min(SHARED_MEMORY_PER_BLOCK.values()))


def local_capability() -> int | None:
    """Compute capability of the first local GPU (e.g. 90), or None without one."""
    try:
        device, *_ = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    capability = getattr(device, "compute_capability", None)
    return int(str(capability).replace(".", "")) if capability else None


@functools.cache
def local_sm_count() -> int | None:
    """Streaming multiprocessors of the first local GPU (e.g. 132 on an H200), or None without one or
    where neither jax (the device's ``core_count``) nor triton's driver reports it."""
    try:
        device, *_ = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    count = getattr(device, "core_count", None)
    if not count:
        try:
            from triton.runtime import driver

            count = driver.active.utils.get_device_properties(device.local_hardware_id)["multiprocessor_count"]
        except Exception:  # no triton, or a driver without the query: unknown
            return None
    return int(count)


def page_kernel_shared_bytes(stages: int, *, page_bytes: int, tile_bytes: int) -> int:
    """Upper bound on the Pallas page kernel's shared memory, bytes.

    Triton's software pipeliner keeps at most ``stages - 1`` copies of each
    pipelined load in flight, and the matrix products stage one decoded tile
    at a time through shared memory (``ldmatrix``).

    Args:
      stages: ``num_stages`` (1: no pipelining).
      page_bytes: bytes loaded per page by one program (every stream of every
        loop read, sparse rows padded as the kernel loads them).
      tile_bytes: bytes of one decoded ``[page_size, head_dim]`` operand tile.
    """
    return max(stages - 1, 0) * page_bytes + tile_bytes


def stages_that_fit(stages: int, *, capability: int, page_bytes: int, tile_bytes: int) -> int:
    """``stages``, lowered (to 1 at the least) until :func:`page_kernel_shared_bytes` fits ``sm_<capability>``.

    The bound overestimates triton 3.6's allocation (it gives the page loads,
    which follow a block-table load, fewer buffers than ``stages - 1``), so
    the stage count drops only for large tiles. At the benchmarked shape
    (head_dim 128, 64-token pages) nothing changes on any GPU; on sm_120
    residual chains with ``head_dim * page_size >= 16384`` get 2 stages
    instead of 4-5 (also the full chain at head_dim 256 with 32-token pages:
    3), and one loop at head_dim 256 with 128-token pages 1-2; on sm_90 only
    chains at head_dim 256 with 128-token pages change (2-3 stages).
    ``tools/check_sm120.py`` compiles such choices and reports their real
    shared memory.
    """
    budget = shared_memory_per_block(capability)
    while stages > 1 and page_kernel_shared_bytes(stages, page_bytes=page_bytes, tile_bytes=tile_bytes) > budget:
        stages -= 1
    return stages
