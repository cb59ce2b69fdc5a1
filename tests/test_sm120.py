"""Consumer Blackwell (sm_120): launch choices by compute capability, and the compile check.

The launch tests are pure. ``test_kernels_compile_for_sm120`` runs
``tools/check_sm120.py --quick --targets 120`` (needs triton): the Pallas
full chain at head_dim 256 (its stage count chosen for sm_120), the window,
page-packing and division kernels, the pipelined and simple Gluon kernels;
the script itself checks every kernel on sm_120 and sm_90.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jflashloop import paged_cache
from jflashloop.ops import _decode_attention as attention
from jflashloop_pallas_kernels import launch
from jflashloop_pallas_kernels.decode_attention import KernelConfig, page_bytes
from jflashloop_triton_kernels import launch as gluon_launch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "check_sm120.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("check_sm120", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its process pool pickles functions by module name
    spec.loader.exec_module(module)
    return module


check_sm120 = _load_script()


def test_shared_memory_per_block():
    assert launch.shared_memory_per_block(120) == 101376 == 99 * 1024
    assert launch.shared_memory_per_block(90) == 232448 == 227 * 1024
    assert launch.shared_memory_per_block(130) == 101376  # an unknown, newer GPU: the smallest figure
    with pytest.raises(ValueError, match="80"):
        launch.shared_memory_per_block(75)
    with pytest.raises(ValueError, match="capability"):
        KernelConfig(capability=75)


def _loops_and_bytes(format, head_dim, page_size, loop):
    cache = paged_cache.create(check_sm120._cache_config(format, head_dim, page_size))
    inputs = attention.kernel_inputs(cache, 0, loop, include_pending=False)
    return inputs["loops"], page_bytes(inputs["streams"], inputs["loops"])


def test_page_bytes_count_every_array_loaded_per_page():
    _, one_loop = _loops_and_bytes("int4", 128, 64, 0)
    # K and V words 2 x 64 x 16 x 4, K scale + minimum 2 x 128 x 2, V scale + minimum 2 x 64 x 2 x 2
    assert one_loop == 8192 + 512 + 512
    _, full_chain = _loops_and_bytes("int4", 128, 64, 3)
    # + loop 2, and sparse loops of 16 and 7 rows, each padded to 16 rows, with their int8 positions
    sparse_loop = 2 * (16 * 16 * 4 + 16 * 2 * 2 * 2) + 16
    assert full_chain == 2 * one_loop + 2 * sparse_loop


@pytest.mark.parametrize(
    "head_dim, loop, capability, stages",
    [
        (128, 0, 120, 3), (128, 1, 120, 5), (128, 3, 120, 4),  # the benchmarked shape: the H200 defaults
        (128, 1, 90, 5), (256, 1, 90, 5), (256, 3, 90, 4),
        (256, 0, 120, 3), (256, 1, 120, 2), (256, 3, 120, 2),  # chains of 256-channel pages: fewer stages
    ],
)
def test_pallas_stages_fit_the_target(head_dim, loop, capability, stages):
    loops, per_page = _loops_and_bytes("int4", head_dim, 64, loop)
    tile = 64 * head_dim * 2
    _, chosen = KernelConfig().launch_for(loops, page_bytes=per_page, tile_bytes=tile, capability=capability)
    assert chosen == stages
    bound = launch.page_kernel_shared_bytes(chosen, page_bytes=per_page, tile_bytes=tile)
    assert bound <= launch.shared_memory_per_block(capability)
    _, default = KernelConfig().launch_for(loops)  # no target: the H200-measured default
    if chosen < default:  # lowered no further than needed: one more stage would not fit
        bound = launch.page_kernel_shared_bytes(chosen + 1, page_bytes=per_page, tile_bytes=tile)
        assert bound > launch.shared_memory_per_block(capability)


def test_explicit_stages_and_no_target_are_kept():
    loops, per_page = _loops_and_bytes("int4", 256, 64, 1)
    assert KernelConfig(num_stages=5).launch_for(loops, page_bytes=per_page, tile_bytes=32768, capability=120) == (2, 5)
    assert KernelConfig().launch_for(loops, page_bytes=per_page, tile_bytes=32768) == (2, 5)


def test_gluon_stages_fit_the_target():
    one = dict(head_dim=256, page_size=128)
    assert gluon_launch.pipelined_stages(capability=90, **one) == 2
    assert gluon_launch.pipelined_shared_bytes(stages=2, **one) == 71680
    chain = dict(one, streams=2)
    assert gluon_launch.pipelined_shared_bytes(stages=2, **chain) == 143360 > 101376
    for capability in (90, 120):  # one loop keeps two stages; chains take one (the measured best)
        assert gluon_launch.pipelined_stages(capability=capability, head_dim=128, page_size=64) == 2
        assert gluon_launch.pipelined_stages(capability=capability, **chain) == 1
        assert gluon_launch.pipelined_stages(capability=capability, head_dim=128, page_size=64, streams=2,
                                             sparse_rows=(16, 7)) == 1
        assert gluon_launch.pipelined_stages(capability=capability, head_dim=128, page_size=64,
                                             sparse_rows=(16,)) == 1
    with pytest.raises(ValueError, match="shared memory"):
        gluon_launch.pipelined_stages(capability=120, sparse_rows=(128, 128), **chain)
    # affine INT2 rows: half the rows' bytes (compact_loops: one dense stream, 24 and 10 rows padded to 32 and 16)
    compact = dict(head_dim=128, page_size=64, stages=1, sparse_rows=(24, 10))
    dense = gluon_launch.pipelined_shared_bytes(head_dim=128, page_size=64, stages=1)
    assert gluon_launch.pipelined_shared_bytes(**compact) - dense == 48 * 2 * 64  # INT4 rows: 64 bytes a row
    assert gluon_launch.pipelined_shared_bytes(**compact, row_format="int2") - dense == 48 * 2 * 32


PTX = """
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r9];
    cp.async.cg.shared.global [ %r10 + 0 ], [ %rd1 + 0 ], 0x10, %r11;
    cp.async.commit_group;
    cp.async.wait_group 1;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2, {%r2, %r3}], [%r4];
    wgmma.fence.sync.aligned;
    cvt.rn.f16x2.e2m1x2 %r1, %rs1;
"""


def test_instruction_families():
    counts = check_sm120.instruction_families(PTX)
    assert counts == {"mma.sync": 2, "ldmatrix": 1, "cp.async": 1, "wgmma": 1, "tcgen05": 0,
                      "cp.async.bulk.tensor": 1, "setmaxnreg": 0, "cvt.e2m1x2": 1}


def test_problems():
    Row = check_sm120.Row
    clean = dict(compiled=True, num_warps=2, num_stages=2, registers=128,
                 families=dict.fromkeys(check_sm120.FAMILIES, 0))
    assert check_sm120.problems(Row("k", 120, **clean)) == []
    hopper = {**clean, "families": {**clean["families"], "wgmma": 3, "setmaxnreg": 1}}
    assert check_sm120.problems(Row("k", 120, **hopper)) == ["uses wgmma (3x)", "uses setmaxnreg (1x)"]
    assert check_sm120.problems(Row("k", 90, **hopper)) == []  # wgmma is the H200's own
    assert "shared memory" in check_sm120.problems(Row("k", 120, dynamic_shared=100000, static_shared=1377,
                                                       **clean))[0]
    assert check_sm120.problems(Row("k", 90, dynamic_shared=101377, **clean)) == []
    assert "registers" in check_sm120.problems(Row("k", 120, **{**clean, "registers": 255, "num_warps": 16}))[0]
    assert "launch formula" in check_sm120.problems(Row("k", 120, dynamic_shared=8, expected_shared=4,
                                                        **clean))[0]
    assert check_sm120.problems(Row("k", 120, compiled=False, error="boom")) == ["does not compile: boom"]


def test_kernels_compile_for_sm120(capsys):
    pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    status = check_sm120.main(["--quick", "--targets", "120", "--jobs", "1"])
    table = capsys.readouterr().out
    assert status == 0, table
    quick = [case.name for case in check_sm120.all_cases() if case.quick]
    assert len(quick) >= 6
    for name in quick:
        assert f"| {name} | sm_120 | yes |" in table and table.count(f"| {name} |") == 1, table
    assert table.count("| ok |") == len(quick), table


@pytest.mark.parametrize("pairs, max_pages, expected", [
    (64, 512, 32),  # B8 Hkv8 T32K: 2048 programs of 16 pages
    (16, 1024, 64),  # B1 Hkv16 T64K: 16 pages per split still fill a wave (1024 programs)
    (64, 64, 8),  # B8 Hkv8 T4K: 8 pages per split; 16 would leave 256 programs
    (24, 512, 64),  # B8 Hkv3 T32K: 16-page splits would give 768 programs, under a wave
    (1, 3, 1),  # one short sequence
    (4096, 100, 1),  # more pairs than programs wanted
])
def test_split_count(pairs, max_pages, expected):
    assert gluon_launch.split_count(pairs, max_pages) == expected


@pytest.mark.parametrize("pairs, max_pages, splits, resident, expected", [
    (304, 520, 7, 8, 10),  # B19 Hkv16 T32K: 2128 programs (three rounds of 75 pages) -> 3040 (three of 52)
    (152, 520, 14, 8, 20),  # 2128 -> 3040
    (64, 512, 32, 8, 32),  # B8 Hkv8 T32K: 2048, two rounds of 16 pages (as 16 splits' one round of 32)
    (16, 1024, 64, 8, 64),  # B1 Hkv16 T64K: 1024, within one wave
    (96, 256, 16, 8, 11),  # B32 Hkv3 T16K: 1536 (a second wave 45% full) -> 1056, one wave of 24 pages
    (96, 520, 22, 8, 22),  # 2112: exactly two waves
    (1203, 513, 2, 8, 4),  # 2406: three rounds of 257 pages -> 4812, five of 129
    (1, 3, 1, 8, 1),
    (64, 512, 32, 12, 24),  # one NVFP4 stream (12 an SM), B8 Hkv8 T32K: 2048 (1.3 waves of 1584) -> 1536
    (128, 256, 16, 12, 12),  # B8 Hkv16 T16K: 2048 -> 1536
    (16, 1024, 64, 12, 64),  # within one wave
    (64, 2048, 32, 8, 32),  # B8 Hkv8 T128K: 33 splits would save 1.6% (below WAVE_MIN_GAIN)
])
def test_wave_fitted_splits_counts_the_rounds(pairs, max_pages, splits, resident, expected):
    assert gluon_launch.split_count(pairs, max_pages) == splits
    fitted = gluon_launch.wave_fitted_splits(pairs, max_pages, splits, sm_count=132, resident=resident)
    assert fitted == expected
    wave = gluon_launch.programs_per_wave(132, resident)
    assert wave == 132 * resident

    def time(count):  # rounds x pages per split
        return -(-pairs * count // wave) * -(-max_pages // count)

    assert fitted == splits or time(fitted) <= (1 - gluon_launch.WAVE_MIN_GAIN) * time(splits)
    for count in range(max(1, -(-splits // 2)), min(2 * splits, -(-max_pages // gluon_launch.MIN_PAGES_PER_SPLIT)) + 1):
        assert fitted == splits or time(fitted) <= time(count)  # none of the candidates is faster
    assert gluon_launch.wave_fitted_splits(pairs, max_pages, splits, sm_count=None, resident=resident) == splits


def test_resident_programs():
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128) == 12
    assert gluon_launch.resident_programs(format="int4", head_dim=128) == gluon_launch.PERSISTENT_BLOCKS_PER_SM == 8
    assert gluon_launch.resident_programs(format="int4", head_dim=64) == 12
    # chains (one stage), sparse loops, other pipeline depths and the overlapped loop: 8 by registers
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, streams=2, stages=1) == 8
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, sparse_rows=(16,), stages=1) == 8
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, stages=3) == 8
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, overlap=True) == 8
    assert gluon_launch.resident_programs(format="int4_rotated", head_dim=128) == 8
    # the SM's shared memory holds fewer: 128-token pages (35-37 KB a block) 6 on an sm_90, an sm_120's 100 KB
    # 5 of 18.4 KB, head_dim 256 6 (two stages) or 4 (the overlapped loop's three), a chain of two stages 6
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, page_size=32) == 12
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, page_size=128) == 6
    assert gluon_launch.resident_programs(format="int4", head_dim=128, page_size=128) == 6
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, capability=120) == 5
    assert gluon_launch.resident_programs(format="int4", head_dim=128, capability=120) == 5
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, capability=90) == 12
    assert gluon_launch.resident_programs(format="int4", head_dim=64, page_size=128) == 12
    assert gluon_launch.resident_programs(format="int4", head_dim=256) == 6
    assert gluon_launch.resident_programs(format="int4", head_dim=256, stages=3, overlap=True) == 4
    assert gluon_launch.resident_programs(format="nvfp4", head_dim=128, streams=2) == 6
    # int2 sparse rows take half an INT4 row's bytes
    int2 = gluon_launch.resident_programs(format="int4", head_dim=256, streams=2, stages=1, sparse_rows=(64, 64),
                                          row_format="int2")
    int4 = gluon_launch.resident_programs(format="int4", head_dim=256, streams=2, stages=1, sparse_rows=(64, 64))
    assert (int2, int4) == (4, 3)


def test_plans_count_the_blocks_shared_memory_holds():
    """INT4 at B8 Hq32 Hkv8 T32K with 128-token pages (64 pairs of 256 pages; 6 blocks an SM by shared memory):
    one round of 12 splits (measured 0.132 ms on an H100 against 0.146 for the 16 splits that counted 8 an SM,
    and 24 splits' two rounds 0.146); B1 Hq16 Hkv16 T64K 49 splits (one round) where 64 take two."""
    resident = gluon_launch.resident_programs(format="int4", head_dim=128, page_size=128)
    assert gluon_launch.wave_fitted_splits(64, 256, gluon_launch.split_count(64, 256), sm_count=132,
                                           resident=resident) == 12
    assert gluon_launch.wave_fitted_splits(16, 512, gluon_launch.split_count(16, 512), sm_count=132,
                                           resident=resident) == 49
    assert gluon_launch.wave_fitted_splits(64, 256, 16, sm_count=132, resident=8) == 16  # one wave of 8 an SM
    # persistent programs: no more than a wave of the blocks an SM holds
    where = dict(format="int4", head_dim=128, streams=1, sparse_rows=(), stages=2, overlap=False, sm_count=132)
    assert gluon_launch.preferred_persistent_programs(**where, items=2 * 792, resident=6) == 792
    assert gluon_launch.preferred_persistent_programs(**where, items=2 * 1056, resident=6) == 0  # 2.7 rounds of 792
    assert gluon_launch.preferred_persistent_programs(**where, items=2 * 1056) == 1056


def test_register_resident_programs_counts_partitions():
    """Warps take registers from one of an SM's four partitions of 16K in units of 256: ncu's residencies
    (INT4 at head_dim 128, 224 registers: 8; one NVFP4 stream, 166: 12; INT4 at head_dim 64, 154: 12). 224
    registers would fit 9 warps in the whole file (65536 / 7168), but only 2 in a partition."""
    count = gluon_launch.register_resident_programs
    assert (count(224), count(166), count(154)) == (8, 12, 12)
    assert (count(168), count(169), count(128), count(129), count(255), count(256)) == (12, 8, 16, 12, 8, 0)
    assert count(64) == 32 and count(168, warps=4) == 3 and count(224, warps=2) == 4


def test_shared_resident_programs_keeps_the_drivers_kilobyte():
    """Blocks an SM by shared memory, 1 KB the driver keeps each: 18 KB (64-token pages, head_dim 128) 12 on an
    sm_90's 228 KB and 5 on an sm_120's 100 KB; 36 KB (128-token pages) 6; no shared memory: 228."""
    count = gluon_launch.shared_resident_programs
    assert (count(18432), count(18432, 120), count(36864), count(0)) == (12, 5, 6, 228)


def test_wave_fitted_splits_keeps_whole_pages_per_split():
    # 2 pages a sequence, at least 8 pages a split: one split whatever the waves say
    assert gluon_launch.wave_fitted_splits(1060, 2, 1, sm_count=132) == 1
    # fewer pages per split than min_pages_per_split are never chosen
    assert gluon_launch.wave_fitted_splits(304, 56, 7, sm_count=132, min_pages_per_split=8) <= 7


def test_wave_fitted_splits_rejects_empty_sizes():
    with pytest.raises(ValueError, match="positive sizes"):
        gluon_launch.wave_fitted_splits(304, 520, 0, sm_count=132)
    with pytest.raises(ValueError, match="resident=0"):
        gluon_launch.wave_fitted_splits(304, 520, 7, sm_count=132, resident=0)


def test_split_count_rejects_empty_sizes():
    with pytest.raises(ValueError, match="positive sizes"):
        gluon_launch.split_count(0, 10)


def test_preferred_target_programs_are_two_waves_for_every_format():
    for where in (dict(format="int4"), dict(format="int4_rotated"), dict(format="nvfp4"),
                  dict(format="nvfp4", streams=2), dict(format="nvfp4", streams=3)):
        assert gluon_launch.preferred_target_programs(**where) == gluon_launch.TARGET_PROGRAMS == 2048, where
    # B8 Hkv8 T32K: 32 splits of 16 pages; B16 Hkv16 T8K: 8 splits of 16 pages
    assert gluon_launch.split_count(64, 512, target_programs=gluon_launch.TARGET_PROGRAMS) == 32
    assert gluon_launch.split_count(256, 128, target_programs=gluon_launch.TARGET_PROGRAMS) == 8


def test_preferred_maxnreg_caps_only_rotated_streams():
    assert gluon_launch.preferred_maxnreg("int4_rotated") == gluon_launch.ROTATED_MAXNREG
    assert gluon_launch.preferred_maxnreg("int4") is None
    assert gluon_launch.preferred_maxnreg("nvfp4") is None
