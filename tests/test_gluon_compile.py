"""The Gluon page kernels compile for sm_90 on any machine (triton's own ptxas, no GPU).

What this checks without a GPU: every layout conversion the kernels assert
to be trivial is trivial (so the decoded tiles never go through shared
memory), the matrix products are portable ``mma.sync`` (no wgmma), shared
memory is written only by cp.async copies of the packed pages, and the
register budget holds without spills at head_dim <= 128. The numerics run on
the GPU (tests/test_gluon_decode.py).
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from jflashloop_triton_kernels import compile_check, launch  # noqa: E402


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("head_dim, page_size", [(64, 64), (128, 16), (128, 64), (128, 128), (256, 16)])
def test_pipelined_kernel_compiles_with_register_fragments(head_dim, page_size):
    compiled = compile_check.compile_pages_kernel("pipelined", head_dim=head_dim, page_size=page_size)
    ptx = compiled.asm["ptx"]
    assert _count(ptx, r"mma\.sync\.aligned\.m16n8k16") > 0
    assert _count(ptx, r"wgmma") == 0
    assert _count(ptx, r"cp\.async\.cg\.shared\.global") > 0
    assert _count(ptx, r"st\.shared") == 0  # shared memory holds packed pages only (cp.async)
    stage_bytes = page_size * head_dim + 4 * head_dim + 4 * page_size * (head_dim // 64)  # K+V words, metadata
    assert compiled.metadata.shared == 2 * stage_bytes
    resources = compile_check.ptxas_resources(ptx, "sm_90a")
    assert resources["registers"] <= 255
    if head_dim <= 128 and page_size <= 64:  # the default (float16 query pairs) fits the registers without spills
        assert resources["spill_stores"] == 0


def test_pipelined_kernel_reads_a_dense_chain():
    compiled = compile_check.compile_pages_kernel("pipelined", streams=2)
    ptx = compiled.asm["ptx"]
    single = compile_check.compile_pages_kernel("pipelined", streams=1)
    assert compiled.metadata.shared == 2 * single.metadata.shared  # both loops' pages in flight
    assert _count(ptx, r"st\.shared") == 0


def test_pipelined_kernel_reads_the_full_flashloop_chain():
    compiled = compile_check.compile_pages_kernel("pipelined", streams=2, sparse=(16, 7))
    ptx = compiled.asm["ptx"]
    assert _count(ptx, r"st\.shared") == 0
    assert _count(ptx, r"wgmma") == 0
    assert compile_check.ptxas_resources(ptx, "sm_90a")["registers"] <= 255


def test_staggered_copies_need_no_more_shared_memory():
    """One stage with a page's keys and values copied as two groups: the plain stage's shared memory,
    registers within 255 without spills for the full FlashLoop chain (ptxas, sm_90a)."""
    for streams, sparse in ((1, ()), (2, (16, 7))):
        plain = compile_check.compile_pages_kernel("pipelined", streams=streams, sparse=sparse, stages=1)
        staggered = compile_check.compile_pages_kernel("pipelined", streams=streams, sparse=sparse, stages=1,
                                                       stagger=True)
        assert staggered.metadata.shared == plain.metadata.shared
        ptx = staggered.asm["ptx"]
        assert _count(ptx, r"cp\.async\.commit_group") > _count(plain.asm["ptx"], r"cp\.async\.commit_group")
        resources = compile_check.ptxas_resources(ptx, "sm_90a")
        assert resources["registers"] <= 255 and resources["spill_stores"] == 0, resources


@pytest.mark.parametrize("streams, sparse, chunk, format", [(1, (), 32, "int4"), (2, (16, 7), None, "int4"),
                                                       (1, (), None, "int4_rotated"), (1, (), 32, "nvfp4")])
def test_scaled_values_drop_the_value_decode(streams, sparse, chunk, format):
    """Values against probabilities times their scales (head_dim 128, a GQA group of 4, of 1 for NVFP4;
    32-token chunks of 64-token pages, and whole pages): the layouts hold, the same shared memory,
    registers within 255, and no float16 multiply(-add) applies a value pair's scale (those left are the
    sparse keys' and int4_rotated's keys', NVFP4's keys': at most half as many)."""
    options = dict(group=1 if format == "nvfp4" else 4, streams=streams, sparse=sparse, chunk=chunk,
                   stages=2 if streams == 1 else 1, format=format,
                   **({"window": "*fp32", "maxnreg": 255} if format == "int4_rotated" else {}))
    plain = compile_check.compile_pages_kernel("pipelined", scaled=False, **options)
    scaled = compile_check.compile_pages_kernel("pipelined", scaled=True, **options)
    assert scaled.metadata.shared == plain.metadata.shared
    decode = r"mul\.rn\.f16x2" if format == "nvfp4" else r"fma\.rn\.f16x2"
    fmas = [_count(k.asm["ptx"], decode) - _scale_pair_multiplies(k.asm["ptx"]) for k in (plain, scaled)]
    assert fmas[1] <= fmas[0] / 2, fmas
    assert _count(scaled.asm["ptx"], r"st\.shared") == 0
    assert compile_check.ptxas_resources(scaled.asm["ptx"], "sm_90a")["registers"] <= 255


@pytest.mark.parametrize("format", ["nvfp4", "int4_rotated"])
def test_pipelined_kernel_compiles_for_other_formats(format):
    ptx = compile_check.compile_pages_kernel("pipelined", format=format).asm["ptx"]
    assert _count(ptx, r"mma\.sync\.aligned\.m16n8k16") > 0 and _count(ptx, r"st\.shared") == 0


@pytest.mark.parametrize("format, group, streams, scaled", [
    ("nvfp4", 1, 1, None), ("int4_rotated", 4, 1, None), ("nvfp4", 1, 2, True)])
def test_sparse_rows_of_the_dense_format_stay_in_registers(format, group, streams, scaled):
    """A direct chain's loop 4 in NVFP4 or int4_rotated (one dense stream, two sparse loops of rows in the
    same format, one staggered stage, as the library launches it), and NVFP4's residual chain with its
    values on the probabilities: no decoded tile through shared memory, no spills (ptxas, sm_90a)."""
    compiled = compile_check.compile_pages_kernel(
        "pipelined", format=format, rows_format=format, streams=streams, sparse=(16, 7), stages=1, stagger=True,
        group=group, value_group=16 if format == "nvfp4" else 128, scaled=scaled)
    ptx = compiled.asm["ptx"]
    assert _count(ptx, r"st\.shared") == 0 and _count(ptx, r"wgmma") == 0
    resources = compile_check.ptxas_resources(ptx, "sm_90a")
    assert resources["registers"] <= 255 and resources["spill_stores"] == 0, resources


def _scale_pair_multiplies(ptx: str) -> int:
    """The ``x 256`` of each E4M3 scale pair's conversion (``gluon_decode._E4M3_PAIR_ASM``), one a block."""
    return _count(ptx, r"0x5C005C00")


def test_e2m1_nibbles_are_placed_four_at_a_time():
    """NVFP4's decode places four nibbles' float16 high bytes with each shift-and-mask sequence, from the
    tiles' page order (5 instructions for a word's 8 nibbles: one ``and`` for the even ones; then one
    ``prmt`` per pair), not a pair at a time (4 a pair) nor from the codec's order (7 a word): the shifts
    and logic ops stay below 1.5 per value multiply (one a float16 pair)."""
    ptx = compile_check.compile_pages_kernel("pipelined", format="nvfp4").asm["ptx"]
    multiplies = _count(ptx, r"mul\.rn\.f16x2") - _scale_pair_multiplies(ptx)
    assert multiplies >= 256  # keys and values of a 64-token page at head_dim 128: 8192 pairs over 32 threads
    assert _count(ptx, r"shl\.b32|shr\.u32|lop3\.b32|and\.b32") <= 1.5 * multiplies
    assert _count(ptx, r"0x8E8E8E8E") >= multiplies / 4  # the even nibbles: one mask a word


def test_simple_kernel_uses_no_shared_memory():
    compiled = compile_check.compile_pages_kernel("simple")
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared == 0
    assert _count(ptx, r"ld\.shared|st\.shared|ldmatrix") == 0
    assert _count(ptx, r"mma\.sync\.aligned\.m16n8k16") == 96  # 64 score + 32 value products per page


def test_pipelined_kernel_reads_more_query_rows_in_blocks_of_eight():
    """Chunk attention's 16-32 query rows per KV head: the same register-only kernel, no spills."""
    single = compile_check.compile_pages_kernel("pipelined", group=4)
    for row_blocks, group in ((2, 16), (4, 27)):
        compiled = compile_check.compile_pages_kernel("pipelined", group=group, row_blocks=row_blocks)
        ptx = compiled.asm["ptx"]
        assert _count(ptx, r"st\.shared") == 0 and compiled.metadata.shared == single.metadata.shared
        assert compile_check.ptxas_resources(ptx, "sm_90a")["spill_stores"] == 0


@pytest.mark.parametrize("group", [1, 2, 3])
def test_in_kernel_merge_keeps_the_warps_per_sm_at_head_dim_64(group):
    """The merge's slots per round trip grow for small groups, within the registers the page loop holds
    anyway: at head_dim 64 the page kernel fits 3 warps per scheduler (168 registers at most); a merge
    holding 128 registers of partials (195 in all) would cost a third of them."""
    merged = compile_check.compile_pages_kernel("pipelined", head_dim=64, group=group, merge=True)
    alone = compile_check.compile_pages_kernel("pipelined", head_dim=64, group=group)
    merged_registers = compile_check.ptxas_resources(merged.asm["ptx"], "sm_90a")["registers"]
    alone_registers = compile_check.ptxas_resources(alone.asm["ptx"], "sm_90a")["registers"]
    assert alone_registers <= 168
    assert merged_registers <= 168


@pytest.mark.parametrize("head_dim", [64, 128])
def test_overlapped_page_loop_keeps_eight_warps_per_sm(head_dim):
    """Page ``p + 1``'s scores held across page ``p``'s softmax: still no spills, registers and the three
    stages' shared memory for 8 one-warp blocks per SM (64 K registers, 227 KB)."""
    compiled = compile_check.compile_pages_kernel("pipelined", head_dim=head_dim, stages=3, overlap=True)
    resources = compile_check.ptxas_resources(compiled.asm["ptx"], "sm_90a")
    assert resources["spill_stores"] == 0
    assert 8 * 32 * resources["registers"] <= 65536
    assert 8 * compiled.metadata.shared <= 227 * 1024
    assert _count(compiled.asm["ptx"], r"st\.shared") == 0


def test_rotated_kernel_under_its_register_directive():
    """int4_rotated reads a float32 query and float32 windows: under its ``.maxnreg`` directive ptxas gives it
    more registers than without one (146 at head_dim 128), no spills, and at least 8 warps per SM; the
    page loop's products are the same."""
    from jflashloop_triton_kernels import launch

    cap = launch.preferred_maxnreg("int4_rotated")
    kwargs = dict(format="int4_rotated", query="*fp32", window="*fp32")
    capped = compile_check.compile_pages_kernel("pipelined", maxnreg=cap, **kwargs)
    plain = compile_check.compile_pages_kernel("pipelined", **kwargs)
    capped_resources = compile_check.ptxas_resources(capped.asm["ptx"], "sm_90a")
    plain_resources = compile_check.ptxas_resources(plain.asm["ptx"], "sm_90a")
    assert capped_resources["spill_stores"] == 0
    assert capped_resources["registers"] > plain_resources["registers"]
    assert 8 * 32 * capped_resources["registers"] <= 65536
    products = r"mma\.sync\.aligned\.m16n8k16"
    assert _count(capped.asm["ptx"], products) == _count(plain.asm["ptx"], products)


def test_merge_with_more_registers_keeps_eight_warps_per_sm():
    """At head_dim 128 the in-kernel merge can hold 128 registers of partials (8 slots of a group of 4
    per round trip instead of 4): no spills, still 8 one-warp blocks per SM."""
    compiled = compile_check.compile_pages_kernel("pipelined", group=4, merge=True, merge_registers=128)
    resources = compile_check.ptxas_resources(compiled.asm["ptx"], "sm_90a")
    assert resources["spill_stores"] == 0
    assert 8 * 32 * resources["registers"] <= 65536



def test_persistent_programs_keep_eight_warps_per_sm():
    """Persistent programs (the B8 Hq32 Hkv8 plan: group 4, 1056 programs) hold the next item's entry,
    length and query rows across an item: still no spills, registers for 8 one-warp blocks per SM
    (``launch.PERSISTENT_BLOCKS_PER_SM``), and no decoded tile through shared memory."""
    from jflashloop_triton_kernels import launch

    compiled = compile_check.compile_pages_kernel("pipelined", group=4, persist=1056)
    resources = compile_check.ptxas_resources(compiled.asm["ptx"], "sm_90a")
    assert resources["spill_stores"] == 0
    assert launch.PERSISTENT_BLOCKS_PER_SM * 32 * resources["registers"] <= 65536
    assert _count(compiled.asm["ptx"], r"st\.shared") == 0


@pytest.mark.parametrize("format, head_dim, group, page_size", [
    ("int4", 128, 4, 64), ("int4", 128, 1, 64), ("nvfp4", 128, 4, 64), ("nvfp4", 128, 1, 64), ("int4", 64, 3, 64),
    ("int4", 128, 4, 128), ("nvfp4", 128, 4, 128)])
def test_resident_programs_match_the_compiled_kernels(format, head_dim, group, page_size):
    """The programs an SM the split plans count (``launch.resident_programs``: the measured table or 8, at most
    what the shared memory holds) are the compiled kernel's (one dense stream, two stages, the public call's
    query and windows; 128-token pages hold 6 by shared memory):
    its ptxas registers (``launch.register_resident_programs``) and shared memory (with the 1 KB the driver
    keeps a block) both hold that many. A kernel change that moves a kernel across a residency boundary
    fails here, before its plans count rounds of the wrong size on a GPU."""
    compiled = compile_check.compile_pages_kernel(
        format=format, head_dim=head_dim, group=group, stages=2, value_group=16 if format == "nvfp4" else 64,
        page_size=page_size, maxnreg=launch.preferred_maxnreg(format))
    registers = compile_check.ptxas_resources(compiled.asm["ptx"], "sm_90a")["registers"]
    by_shared = launch.shared_resident_programs(compiled.metadata.shared, 90)
    resident = launch.resident_programs(format=format, head_dim=head_dim, stages=2, page_size=page_size,
                                        value_group=16 if format == "nvfp4" else 64)
    assert min(launch.register_resident_programs(registers), by_shared) == resident, (registers, by_shared)


# Page-loop instructions of the default kernels (triton 3.6, sm_90a; bench/KERNEL_NOTES.md, "Where NVFP4's chain
# spends its instructions"), each with about 3% of headroom: a change that makes the decode or the softmax longer
# fails here before it costs time on a GPU.
LOOP_BUDGETS = {("int4", 1): 1160, ("nvfp4", 1): 1510, ("int4", 2): 2015, ("nvfp4", 2): 2680}


@pytest.mark.parametrize("format, streams", sorted(LOOP_BUDGETS))
def test_page_loop_stays_within_its_instruction_budget(format, streams):
    """The page loop of one stream (two stages) and of a dense chain (one staggered stage), GQA group 4:
    machine instructions within the budget, its products on the tensor cores (``HMMA``: at least 64 for a
    page's keys and 32 for its values), no local memory."""
    options = dict(stages=2) if streams == 1 else dict(stages=1, stagger=True)
    compiled = compile_check.compile_pages_kernel(format=format, value_group=16 if format == "nvfp4" else 64,
                                                  streams=streams, group=4, **options)
    mix = compile_check.loop_instructions(compiled.asm["cubin"])
    assert sum(mix.values()) <= LOOP_BUDGETS[format, streams], mix.most_common(8)
    assert mix["HMMA"] >= 96 and mix["LDL"] == mix["STL"] == 0, mix.most_common(8)


def test_loop_instructions_needs_a_loop():
    compiled = compile_check.compile_merge_kernel(slots=8)
    with pytest.raises(ValueError, match="no loop"):
        compile_check.loop_instructions(compiled.asm["cubin"])


@pytest.mark.parametrize("head_dim, sparse", [(64, (24, 10)), (128, (16, 7))])
def test_affine_int2_rows_compile_as_int4_words(head_dim, sparse):
    """A direct chain's loop 4 with affine INT2 rows (uint16 halfwords, one per INT4 word, widened in registers
    to INT4 words): no tile through shared memory, no spills where INT4 rows have none (ptxas, sm_90a), the
    rows' shared memory 1/2 of INT4 rows' (the dense page's stays)."""
    options = dict(format="int4", streams=1, sparse=sparse, stages=1, stagger=True, group=4, head_dim=head_dim)
    int2 = compile_check.compile_pages_kernel("pipelined", rows_format="int2", **options)
    int4 = compile_check.compile_pages_kernel("pipelined", rows_format="int4", **options)
    ptx = int2.asm["ptx"]
    assert _count(ptx, r"st\.shared") == 0 and _count(ptx, r"wgmma") == 0
    assert _count(ptx, r"cp\.async") > 0
    resources = compile_check.ptxas_resources(ptx, "sm_90a")
    assert resources["registers"] <= 255 and resources["spill_stores"] == 0, resources
    rows = sum(launch.padded_sparse_rows(r) * head_dim for r in sparse)  # bytes of INT4 rows, keys and values
    assert int4.metadata.shared - int2.metadata.shared == rows // 2


def test_kernel_residency_tool_reports_both_bounds():
    """``tools/kernel_residency.py``'s row for one NVFP4 stream at head_dim 128: 166-167 registers (12 an SM),
    18 KB of shared memory (12 an SM), 12 resident, 12 counted by the plans; as many cells as the header."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "kernel_residency.py"
    spec = importlib.util.spec_from_file_location("kernel_residency", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cells = [cell.strip() for cell in tool.row("nvfp4", 128, 4, 64, 1, (), 2).strip("|").split("|")]
    assert len(cells) == tool.HEADER.splitlines()[0].count("|") - 1
    assert cells[:7] == ["nvfp4", "128", "4", "64", "1", "-", "2"]
    assert 160 < int(cells[7]) <= 168 and cells[8] == "0" and cells[10:] == ["12", "12", "12", "12"], cells
