"""Launch parameters of the Gluon page kernel: split-KV programs and pipeline depth.

:func:`split_count` chooses the programs per (sequence, KV head). The page
kernel holds 8 one-warp programs per SM for INT4 at head_dim 128 (its registers
and shared memory both limit it there: ncu, ``bench/RESULTS.md``), 1056 on an
H200 or H100, and 12 for one NVFP4 stream, fewer where its blocks' shared memory
holds fewer (128-token pages, head_dim 256, an sm_120: :func:`resident_programs`); a
program count just above a whole wave leaves most SMs idle for a second round
(1152 programs took 1.4x the time of 2048 at B8 Hq32 Hkv8 T32K), so
:func:`wave_fitted_splits` counts the rounds; each program pays a fixed start
(its query, the first page's latency, its partial).

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
from jflashloop_pallas_kernels.decode_attention import FUSED_FORMATS

TARGET_PROGRAMS = 2048  # about two waves of the page kernel on an H200 (132 SMs x 8 programs)
WAVE_PROGRAMS = 1024  # about one wave: fewer programs leave SMs idle
MIN_PAGES_PER_SPLIT = 8
PREFERRED_STAGES = 2  # one stream (bench/KERNEL_NOTES.md, H200)
CHAIN_STAGES = 1  # two or more streams (loops 2-4): the shared memory of a second stage halves the blocks per SM
ROTATED_MAXNREG = 255  # int4_rotated streams: ptxas allocates by need under a .maxnreg (preferred_maxnreg)
MERGE_REGISTERS = 64  # registers a thread gives the in-kernel merge's partials per round trip (gluon_decode)
OVERLAP_HEAD_DIMS = (256,)  # INT4, one stream: the next page's scores before this page's softmax by default,
OVERLAP_PAGE_SIZES = (64,)  # at these page sizes (measured there; ptxas spills more with it at 128 tokens)
OVERLAP_STAGES = 3  # the overlapped loop keeps a page in flight besides the two it works on
STAGGER = True  # one stage (chains): keys and values as two copy groups (gluon_decode; bench/KERNEL_NOTES.md)
PERSISTENT_BLOCKS_PER_SM = 8  # INT4, one stream, head_dim 128: 204-226 registers, 8 one-warp programs an SM
PERSISTENT_MIN_WAVES = 2  # persistent programs by default where the items fill at least this many waves
PERSISTENT_MIN_FILL = 0.95  # ... and share out evenly over programs that fill this much of a wave
RESIDENT_PROGRAMS = {("nvfp4", 128): 12, ("int4", 64): 12}  # one dense stream, two stages (resident_programs)
BLOCK_RESERVED_SHARED_BYTES = 1024  # shared memory the driver keeps a block (and an SM beyond a block's maximum)
WAVE_MIN_GAIN = 0.05  # a split plan moves to fit the waves for at least this share less time (wave_fitted_splits)
REGISTER_PARTITIONS = 4  # an SM's register file is allocated in four partitions, one per warp scheduler (sm_80-sm_120)
PARTITION_REGISTERS = 16384  # 32-bit registers a partition holds (64K an SM)
WARP_REGISTER_UNIT = 256  # a warp's registers are allocated in units of this many


SCALED_ROTATED = False  # int4_rotated values on the probabilities by default (gluon_decode; no faster on the H200)
SCALED_NVFP4 = False  # one NVFP4 stream's values on the probabilities by default (gluon_decode; no faster on the H200)
SCALED_NVFP4_PAIRS = True  # two dense NVFP4 streams' (residual chains): 3% fewer instructions, 1-3% less time (calls 72-73, H100)


def scaled_values(*, format: str, head_dim: int, value_group: int, group: int, row_blocks: int = 1,
                  lazy: bool = False, sparse_loops: int = 0, row_format: str = "int4") -> bool:
    """Whether the pipelined kernel can read values with their scales on the probabilities
    (``gluon_decode``, ``SCALED``): INT4 and int4_rotated values as subnormal codes (with INT4's
    minimums, int4_rotated's zero points beside the softmax sums), NVFP4's as plain E2M1. Each of a
    token's value scales takes a block of the products' 8 columns: a GQA group of at most ``8 /
    (head_dim / value_group)`` query rows for INT4, ``8 / (head_dim / 16)`` for NVFP4 (one at head_dim
    128), 8 for int4_rotated (one scale per token); one row block; no lazy rescaling (whose probabilities
    reach 2**8: times a float16 scale they could overflow); int4_rotated without sparse loops and NVFP4
    without them or with NVFP4 rows (``row_format``; the kernel adds those rows as values, which every
    column of a scaled product can take, not as codes)."""
    if lazy or row_blocks != 1:
        return False
    if format == "int4_rotated":
        return sparse_loops == 0 and group <= 8
    if format == "nvfp4":
        return ((sparse_loops == 0 or row_format == "nvfp4") and head_dim <= 128
                and group * (head_dim // 16) <= 8)
    return format == "int4" and value_group <= head_dim and group * (head_dim // value_group) <= 8


def preferred_scaled_values(*, streams: int = 1, **where) -> bool:
    """The pipelined kernel's default: :func:`scaled_values` (the same arguments; ``streams``: dense streams
    read, 1 or 2) for INT4, for int4_rotated where :data:`SCALED_ROTATED` says so and for NVFP4 where
    :data:`SCALED_NVFP4` (one stream) or :data:`SCALED_NVFP4_PAIRS` (two) does."""
    nvfp4 = SCALED_NVFP4_PAIRS if streams == 2 else SCALED_NVFP4
    preferred = {"int4": True, "int4_rotated": SCALED_ROTATED, "nvfp4": nvfp4}[where["format"]]
    return preferred and scaled_values(**where)


def padded_sparse_rows(rows: int) -> int:
    """Rows of a sparse loop's tile as the Gluon kernel holds them: a power of two >= 8 (the n of the
    products that take the rows on their n axis; those that take them on k pad 8 rows to 16 in registers)."""
    return max(8, 1 << (rows - 1).bit_length())


def pipelined_shared_bytes(*, head_dim: int, page_size: int, stages: int, format: str = "int4",
                           value_group: int = 64, streams: int = 1, sparse_rows: tuple[int, ...] = (),
                           row_format: str = "int4") -> int:
    """Shared memory of the pipelined Gluon kernel, bytes (its allocations, exactly).

    Args:
      head_dim, page_size, value_group: the kernel's ``D``, ``PAGE``, ``GV``.
      stages: ``STAGES``.
      format: ``"int4"`` (keys per channel, values per token in groups of
        ``value_group``), ``"nvfp4"`` or ``"int4_rotated"``.
      streams: dense loops read (1, or 2 for a dense chain).
      sparse_rows: stored rows per page of sparse loops 3-4.
      row_format: their format: ``"int2"`` (affine) rows take half the bytes of the others (a uint16
        halfword per INT4 word).
    """
    words = page_size * head_dim  # key and value words: page_size x head_dim / 8 uint32 each
    metadata = {
        "int4": 2 * head_dim * 2 + 2 * page_size * (head_dim // value_group) * 2,  # key scale/min, value scale/min
        "nvfp4": 2 * page_size * (head_dim // 16),  # E4M3 bytes of keys and values
        "int4_rotated": 2 * page_size * 4,  # one float32 per row, keys and values
    }[format]
    row_bytes = head_dim // 4 if row_format == "int2" else head_dim // 2  # a row's key (or value) codes
    sparse = sum(2 * padded_sparse_rows(rows) * row_bytes for rows in sparse_rows)  # key + value words
    return stages * (streams * (words + metadata) + sparse)


def split_count(pairs: int, max_pages: int, *, target_programs: int = TARGET_PROGRAMS,
                min_pages_per_split: int = MIN_PAGES_PER_SPLIT) -> int:
    """Split-KV programs per (sequence, KV head): about ``target_programs`` programs in all, at least
    ``min_pages_per_split`` pages each; twice those pages where the programs still fill a wave
    (:data:`WAVE_PROGRAMS`), so few long sequences pay fewer program starts and partials.

    Args:
      pairs: (sequence, KV head, block of query rows) triples the grid covers.
      max_pages: pages a sequence can hold (the block table's width).

    Returns:
      int >= 1 (measured: B1 Hq16 Hkv16 T64K 0.063 ms with 64 splits of 16 pages against 0.067 ms
      with 128 splits of 8; ``bench/RESULTS.md``).
    """
    if pairs < 1 or max_pages < 1 or target_programs < 1 or min_pages_per_split < 1:
        raise ValueError(f"split_count needs positive sizes, got pairs={pairs}, max_pages={max_pages}, "
                         f"target_programs={target_programs}, min_pages_per_split={min_pages_per_split}")
    wanted = -(-target_programs // pairs)
    splits = max(1, min(wanted, -(-max_pages // min_pages_per_split)))
    longer = -(-max_pages // (2 * min_pages_per_split))
    if longer < splits and pairs * longer >= WAVE_PROGRAMS:
        splits = longer
    return splits


def resident_programs(*, format: str = "int4", head_dim: int = 128, streams: int = 1,
                      sparse_rows: tuple[int, ...] = (), stages: int = PREFERRED_STAGES,
                      overlap: bool = False, page_size: int = 64, value_group: int = 64,
                      row_format: str = "int4", capability: int | None = None) -> int:
    """One-warp page-kernel programs an SM holds at once: the fewer of those its registers hold (the
    :data:`RESIDENT_PROGRAMS` entry of ``(format, head_dim)`` for one dense stream in the plain loop of
    :data:`PREFERRED_STAGES` stages, else :data:`PERSISTENT_BLOCKS_PER_SM`) and those its shared memory
    holds (:func:`shared_resident_programs` of the kernel's :func:`pipelined_shared_bytes`, with the 1 KB
    the driver reserves a block, on ``sm_<capability>``; None: sm_90).

    Measured (ncu, H100, ``bench/KERNEL_NOTES.md``): one NVFP4 stream at head_dim 128 takes 166 registers
    and 18.4 KB of shared memory with 64-token pages, 12 programs an SM; INT4's (224 registers, more shared
    memory) 8. INT4 at head_dim 64: 154 registers, 12 by registers (ncu, call 81). 128-token pages at
    head_dim 128 (35-37 KB a block) hold 6 an sm_90 SM, head_dim 256 with 64-token pages 6 (two stages) or
    4 (the overlapped loop's three), an sm_120's 100 KB 5 of 18.4 KB: the plans count that many there
    (INT4 at B8 Hq32 Hkv8 T32K with 128-token pages, H100: one round of 6 an SM, 12 splits, 0.132 ms
    against 0.146 for the 16 splits that counted 8). The compile tests check every entry against the
    compiled kernel's registers (:func:`register_resident_programs`) and shared memory.

    Args:
      format, head_dim, page_size, value_group, streams, sparse_rows, row_format, stages: the kernel's
        (:func:`pipelined_shared_bytes`).
      overlap: the overlapped loop (``gluon_decode``).
      capability: the GPU's compute capability (None: 90).

    Returns:
      int >= 1.

    Raises:
      ValueError: ``head_dim``, ``streams``, ``stages``, ``page_size`` or ``value_group`` below 1, or a
        ``format`` the page kernel does not read.
    """
    if min(head_dim, streams, stages, page_size, value_group) < 1:
        raise ValueError(f"resident_programs needs positive sizes, got head_dim={head_dim}, streams={streams}, "
                         f"stages={stages}, page_size={page_size}, value_group={value_group}")
    if format not in FUSED_FORMATS:
        raise ValueError(f"resident_programs reads 'int4', 'nvfp4' or 'int4_rotated' pages, got format={format!r}")
    plain = streams == 1 and not sparse_rows and stages == PREFERRED_STAGES and not overlap
    by_registers = (RESIDENT_PROGRAMS.get((format, head_dim)) if plain else None) or PERSISTENT_BLOCKS_PER_SM
    block = pipelined_shared_bytes(stages=stages, head_dim=head_dim, page_size=page_size, format=format,
                                   value_group=value_group, streams=streams, sparse_rows=sparse_rows,
                                   row_format=row_format)
    return max(1, min(by_registers, shared_resident_programs(block, capability)))


def shared_resident_programs(block_bytes: int, capability: int | None = None) -> int:
    """Blocks an SM of ``sm_<capability>`` (None: sm_90) holds by their dynamic shared memory alone,
    ``block_bytes`` each plus the :data:`BLOCK_RESERVED_SHARED_BYTES` the driver keeps a block (an SM holds
    that much beyond a block's maximum, :func:`jflashloop_pallas_kernels.launch.shared_memory_per_block`).
    Returns int >= 0; refuses a negative ``block_bytes`` (``ValueError``)."""
    if block_bytes < 0:
        raise ValueError(f"shared_resident_programs needs block_bytes >= 0, got {block_bytes}")
    per_sm = launch.shared_memory_per_block(capability or 90) + BLOCK_RESERVED_SHARED_BYTES
    return per_sm // (block_bytes + BLOCK_RESERVED_SHARED_BYTES)


def register_resident_programs(registers: int, *, warps: int = 1) -> int:
    """Blocks of ``warps`` warps an SM holds by their threads' ``registers`` alone (ptxas's count): each
    warp takes ``registers x 32`` rounded up to :data:`WARP_REGISTER_UNIT`, from one of the
    :data:`REGISTER_PARTITIONS` partitions of :data:`PARTITION_REGISTERS`, as the CUDA occupancy
    calculator counts them (sm_80 to sm_120).

    It reproduces every residency ncu measured for the page kernel (``bench/KERNEL_NOTES.md``): INT4 at
    head_dim 128 (224 registers) 8, one NVFP4 stream (166) 12, INT4 at head_dim 64 (154) 12, int4_rotated
    at GQA group 4 12 (3 warps a scheduler). The shared memory can hold fewer
    (:func:`shared_resident_programs`); the compile tests check :data:`RESIDENT_PROGRAMS` against both.

    Args:
      registers: 32-bit registers a thread takes (ptxas's count).
      warps: warps a block.

    Returns:
      int >= 0 (0: ``registers`` above 255 per thread cannot run).

    Raises:
      ValueError: ``registers`` or ``warps`` below 1.
    """
    if registers < 1 or warps < 1:
        raise ValueError(f"register_resident_programs needs positive sizes, got registers={registers}, "
                         f"warps={warps}")
    if registers > 255:
        return 0
    per_warp = -(-registers * 32 // WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT
    return (PARTITION_REGISTERS // per_warp) * REGISTER_PARTITIONS // warps


def programs_per_wave(sm_count: int, resident: int = PERSISTENT_BLOCKS_PER_SM) -> int:
    """Page-kernel programs resident at once on a GPU of ``sm_count`` SMs, ``resident`` an SM
    (:func:`resident_programs`): a wave."""
    return sm_count * resident


def wave_fitted_splits(pairs: int, max_pages: int, splits: int, *, sm_count: int | None,
                       min_pages_per_split: int = MIN_PAGES_PER_SPLIT,
                       resident: int = PERSISTENT_BLOCKS_PER_SM) -> int:
    """``splits`` (from :func:`split_count`), or the split count whose programs take the least time
    where ``pairs * splits`` programs pass one wave (:func:`programs_per_wave`, ``resident`` programs an
    SM). The programs run in rounds of a wave, each round as long as a program (pages per split), and a
    round that only part of the SMs' slots take lasts as long as a full one (one program alone reads
    at a fraction of the bandwidth a full SM draws): the time is ``rounds x pages per split``. Among
    the split counts from ``ceil(splits / 2)`` to ``2 * splits`` (at least ``min_pages_per_split``
    pages each) this takes the one of least ``ceil(pairs * count / wave) * ceil(max_pages / count)``,
    the nearest to ``splits`` among equals, then the fewer, where that is at least :data:`WAVE_MIN_GAIN`
    less than ``splits``' own. A plan within one wave stays (its programs all start at once), and so
    does every plan where ``sm_count`` is unknown (no GPU, emulation).

    Measured (H100, ``bench/RESULTS.md``, call 80, ms queued): one NVFP4 stream (12 programs an SM) at
    B8 Hq32 Hkv8 T32K with 32 splits (2048 programs: 1.3 waves of 1584) 0.142, with 24 (1536: one wave)
    0.119; INT4 (8 an SM) at B8 Hq16 Hkv16 T16K with 12 splits (1536: 1.5 waves of 1056) 0.130, with 16
    (two waves) 0.111 and 8 (one) 0.115.

    Args:
      pairs: (sequence, KV head, block of query rows) triples the grid covers.
      max_pages: pages a sequence can hold (the block table's width).
      splits: the split count to start from.
      sm_count: the GPU's streaming multiprocessors, or None.
      resident: the kernel's programs an SM (:func:`resident_programs`).

    Returns:
      int >= 1. Examples at 132 SMs: 304 pairs (19 sequences x 16 KV heads) at 520 pages and 8 an SM,
      7 splits (2128 programs, three rounds of 75 pages) -> 10 (3040: three rounds of 52); 64 pairs at 512
      pages, 12 an SM: 32 splits (two rounds of 16 pages) -> 24 (one round of 22); at 8 an SM 32 stay
      (two rounds of 16, as 16 splits' one round of 32).

    Raises:
      ValueError: ``pairs``, ``max_pages``, ``splits``, ``min_pages_per_split`` or ``resident`` below 1.
    """
    if pairs < 1 or max_pages < 1 or splits < 1 or min_pages_per_split < 1 or resident < 1:
        raise ValueError(f"wave_fitted_splits needs positive sizes, got pairs={pairs}, max_pages={max_pages}, "
                         f"splits={splits}, min_pages_per_split={min_pages_per_split}, resident={resident}")
    wave = programs_per_wave(sm_count, resident) if sm_count is not None and sm_count > 0 else 0
    if not wave or pairs * splits <= wave:
        return splits
    most = max(1, -(-max_pages // min_pages_per_split))

    def cost(count):
        return -(-pairs * count // wave) * -(-max_pages // count)

    candidates = range(max(1, -(-splits // 2)), min(2 * splits, most) + 1)
    best = min(candidates, key=lambda count: (cost(count), abs(count - splits), count), default=splits)
    return best if cost(best) <= (1 - WAVE_MIN_GAIN) * cost(splits) else splits


def preferred_target_programs(*, format: str, streams: int = 1) -> int:
    """Programs the pipelined kernel's split-KV plan aims at (:func:`split_count`): :data:`TARGET_PROGRAMS`
    for every format and chain.

    Measured on the H200 (``bench/RESULTS.md``, call 46, ms queued): one NVFP4 stream at 1024 programs (32
    pages a split) took 0.124 ms at B16 Hq16 Hkv16 T8K against 0.095 at 2048 (16 pages a split), and 0.096
    against 0.098 at B8 Hq32 Hkv8 T32K; at B1 Hq16 Hkv16 T64K both plans give 1024 programs. INT4 measured
    no faster at 1024 (``bench/KERNEL_NOTES.md``).
    """
    return TARGET_PROGRAMS


def preferred_stages(*, streams: int = 1, sparse_rows: tuple[int, ...] = (), overlap: bool = False) -> int:
    """The measured best ``STAGES`` (H200, ``bench/RESULTS.md``): :data:`PREFERRED_STAGES` for one
    stream (:data:`OVERLAP_STAGES` for the overlapped loop), :data:`CHAIN_STAGES` when a chain adds
    a dense residual or sparse loops (the kernel's registers already cap it at 8 warps per SM, and a
    second stage's shared memory lowered that to 5: 0.505 against 0.366 ms at loop 4, B8 Hq32 Hkv8
    T32K)."""
    if streams != 1 or sparse_rows:
        return CHAIN_STAGES
    return OVERLAP_STAGES if overlap else PREFERRED_STAGES


def preferred_overlap(*, format: str, head_dim: int, page_size: int, streams: int = 1,
                      sparse_rows: tuple[int, ...] = ()) -> bool:
    """Whether the pipelined kernel makes page ``n + 1``'s scores before page ``n``'s softmax by default
    (``overlap``): INT4, one dense stream, head_dim in :data:`OVERLAP_HEAD_DIMS` and pages in
    :data:`OVERLAP_PAGE_SIZES`.

    Measured on the H200 (``bench/RESULTS.md``, ``bench/KERNEL_NOTES.md``): at head_dim 256 with 64-token
    pages (B8 Hq8 Hkv1 T32K) 0.054 against 0.062 ms queued and a page kernel of 51.1 against 55.4 us
    (ptxas, sm_90a: 48 bytes of spill stores against 200); at head_dim 128 it gained 1-2% at T128K and
    lost up to 11% at B1 T64K, T4K and head_dim 64, and NVFP4 lost 20%. With 128-token pages at head_dim
    256 ptxas spills more with it (712 bytes against 492); 16- and 32-token pages spill neither way.
    """
    return (format == "int4" and head_dim in OVERLAP_HEAD_DIMS and page_size in OVERLAP_PAGE_SIZES
            and streams == 1 and not sparse_rows)


def preferred_persistent_programs(*, format: str, head_dim: int, streams: int, sparse_rows: tuple[int, ...],
                                  stages: int | None, overlap: bool, items: int, sm_count: int | None,
                                  resident: int = PERSISTENT_BLOCKS_PER_SM) -> int:
    """Persistent programs of the pipelined kernel by default (``persistent_programs``; 0: one program per
    item), for one INT4 stream at head_dim 128 in the plain loop of two stages, where the GPU's SM count is
    known and the ``items`` (sequences x row programs x slots) fill at least :data:`PERSISTENT_MIN_WAVES`
    waves of ``sm_count * resident`` programs (:func:`resident_programs`: 8 an SM with 64-token pages, 6 with
    128-token ones on an sm_90); else 0.

    Program ``p`` takes items ``p, p + P, p + 2P, ...``, so the programs are as many as share the items
    out evenly over the same number of rounds (``ceil(items / rounds)``), and persistence is used only
    where the items fill :data:`PERSISTENT_MIN_FILL` of those rounds' waves: a last round that only some
    programs take makes them the call's tail, which the hardware's own scheduling of one program per item
    avoids.

    Measured on the H200 (``bench/RESULTS.md``, calls 43-45): at B8 Hq32 Hkv8 T32K (2112 items: two
    rounds of 1056 programs) the page kernel took 82.4-83.7 us against 85.0-86.0 (0.089-0.091 against
    0.092-0.094 ms queued); at T128K 308.4 against 315.4 us; at B1 Hq16 Hkv16 T64K (1040 items, one
    a program) 42.3-42.4 against 41.7 us; at B16 Hq16 Hkv16 T8K (2304 items: 1056 programs left 192 of
    them a third item) 114.1 against 89.9 us, which this rule leaves out.

    Raises:
      ValueError: ``resident`` below 1.
    """
    if resident < 1:
        raise ValueError(f"preferred_persistent_programs needs resident >= 1, got {resident}")
    if (sm_count is None or format != "int4" or head_dim != 128 or streams != 1 or sparse_rows or stages != 2
            or overlap):
        return 0
    wave = programs_per_wave(sm_count, resident)
    rounds = -(-items // wave)
    if rounds < PERSISTENT_MIN_WAVES:
        return 0
    return -(-items // rounds) if items >= PERSISTENT_MIN_FILL * rounds * wave else 0


def preferred_maxnreg(format: str) -> int | None:
    """The register cap handed to ptxas for the pipelined kernel reading ``format`` streams, or None
    (no ``.maxnreg`` directive).

    int4_rotated: :data:`ROTATED_MAXNREG`. Without a directive ptxas gives that kernel (float32 query and
    windows) 146 registers at head_dim 128, with one 182 and the same instructions per page; the page
    kernel then ran 13% faster at B8 Hq32 Hkv8 T32K (80.9 against 93.3 us) and 7% at B1 Hq16 Hkv16 T64K
    (39.8 against 42.9 us; H200, ``bench/RESULTS.md``). int4 and nvfp4 compile to the same loop at head_dim
    128 either way: None.
    """
    return ROTATED_MAXNREG if format == "int4_rotated" else None


def pipelined_stages(*, capability: int, head_dim: int, page_size: int, format: str = "int4",
                     value_group: int = 64, streams: int = 1, sparse_rows: tuple[int, ...] = (),
                     overlap: bool = False, row_format: str = "int4") -> int:
    """``STAGES`` for ``sm_<capability>``: :func:`preferred_stages`, or fewer where it would not fit.

    Raises:
      ValueError: even one stage exceeds the GPU's shared memory per block.
    """
    budget = launch.shared_memory_per_block(capability)
    sizes = dict(head_dim=head_dim, page_size=page_size, format=format, value_group=value_group,
                 streams=streams, sparse_rows=sparse_rows, row_format=row_format)
    for stages in range(preferred_stages(streams=streams, sparse_rows=sparse_rows, overlap=overlap), 0, -1):
        if pipelined_shared_bytes(stages=stages, **sizes) <= budget:
            return stages
    raise ValueError(f"the pipelined Gluon kernel needs {pipelined_shared_bytes(stages=1, **sizes)} bytes of "
                     f"shared memory for {sizes}; sm_{capability} gives a block {budget}")
