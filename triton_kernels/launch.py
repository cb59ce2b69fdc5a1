"""Pipeline depth of the Gluon page kernel for the target GPU's shared memory.

The pipelined kernel (``gluon_decode.int4_pages_kernel_v2``) allocates its
shared memory explicitly: ``STAGES`` copies of each stream's page tile (key
and value words and their metadata) and of each sparse loop's padded rows.
Two stages are the measured best on the H200 for one loop, one stage for
chains (:func:`preferred_stages`). Two stages fit an H200's 227 KB per block
everywhere, but not an RTX 50xx's 99 KB (sm_120,
:data:`jflashloop_pallas_kernels.launch.SHARED_MEMORY_PER_BLOCK`) for dense
and full chains at head_dim 256 with 128-token pages; there
:func:`pipelined_stages` gives one stage (each page's copies are waited for
before its products).
"""

from __future__ import annotations

from jflashloop_pallas_kernels import launch

PREFERRED_STAGES = 2  # one stream (bench/KERNEL_NOTES.md, H200)
CHAIN_STAGES = 1  # two or more streams (loops 2-4): the shared memory of a second stage halves the blocks per SM


def _padded_sparse_rows(rows: int) -> int:
    """Rows of a sparse loop's shared tile (as the kernel pads them: a power of two >= 16)."""
    return max(16, 1 << (rows - 1).bit_length())


def pipelined_shared_bytes(*, head_dim: int, page_size: int, stages: int, format: str = "int4",
                           value_group: int = 64, streams: int = 1, sparse_rows: tuple[int, ...] = ()) -> int:
    """Shared memory of the pipelined Gluon kernel, bytes (its allocations, exactly).

    Args:
      head_dim, page_size, value_group: the kernel's ``D``, ``PAGE``, ``GV``.
      stages: ``STAGES``.
      format: ``"int4"`` (keys per channel, values per token in groups of
        ``value_group``), ``"nvfp4"`` or ``"int4_rotated"``.
      streams: dense loops read (1, or 2 for a dense chain).
      sparse_rows: stored rows per page of sparse loops 3-4.
    """
    words = page_size * head_dim  # key and value words: page_size x head_dim / 8 uint32 each
    metadata = {
        "int4": 2 * head_dim * 2 + 2 * page_size * (head_dim // value_group) * 2,  # key scale/min, value scale/min
        "nvfp4": 2 * page_size * (head_dim // 16),  # E4M3 bytes of keys and values
        "int4_rotated": 2 * page_size * 4,  # one float32 per row, keys and values
    }[format]
    sparse = sum(2 * _padded_sparse_rows(rows) * head_dim // 2 for rows in sparse_rows)  # key + value words
    return stages * (streams * (words + metadata) + sparse)


def preferred_stages(*, streams: int = 1, sparse_rows: tuple[int, ...] = ()) -> int:
    """The measured best ``STAGES`` (H200, ``bench/RESULTS.md``): :data:`PREFERRED_STAGES` for one
    stream, :data:`CHAIN_STAGES` when a chain adds a dense residual or sparse loops (the
    kernel's registers already cap it at 8 warps per SM, and a second stage's shared memory
    lowered that to 5: 0.505 against 0.366 ms at loop 4, B8 Hq32 Hkv8 T32K)."""
    return PREFERRED_STAGES if streams == 1 and not sparse_rows else CHAIN_STAGES


def pipelined_stages(*, capability: int, head_dim: int, page_size: int, format: str = "int4",
                     value_group: int = 64, streams: int = 1, sparse_rows: tuple[int, ...] = ()) -> int:
    """``STAGES`` for ``sm_<capability>``: :func:`preferred_stages`, or fewer where it would not fit.

    Raises:
      ValueError: even one stage exceeds the GPU's shared memory per block.
    """
    budget = launch.shared_memory_per_block(capability)
    sizes = dict(head_dim=head_dim, page_size=page_size, format=format, value_group=value_group,
                 streams=streams, sparse_rows=sparse_rows)
    for stages in range(preferred_stages(streams=streams, sparse_rows=sparse_rows), 0, -1):
        if pipelined_shared_bytes(stages=stages, **sizes) <= budget:
            return stages
    raise ValueError(f"the pipelined Gluon kernel needs {pipelined_shared_bytes(stages=1, **sizes)} bytes of "
                     f"shared memory for {sizes}; sm_{capability} gives a block {budget}")
