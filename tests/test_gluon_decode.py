"""The Gluon INT4 page kernels against the reference path.

On a GPU (with jax_triton) the kernels run compiled; elsewhere the same tests
run the kernels' own bodies through the numpy emulation
(``jflashloop_triton_kernels.emulate``: same indexing, masks and float16
rounding; no layouts), on fewer shapes. Layouts and resources are checked by
tests/test_gluon_compile.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import LoopStorage
from jflashloop.ops._decode_attention import (
    kernel_inputs,
    loop_formats,
    rotated_inputs,
    unrotated_output,
)
from tests.bits import assert_bits_equal
from tests.builders import build, hole_cache, lost_page_cache, small_config

pytest.importorskip("triton.experimental.gluon")

ON_GPU = jax.default_backend() == "gpu"


def _compiled() -> bool:
    if not ON_GPU:
        return False
    from jflashloop_triton_kernels import call

    return call.available()


COMPILED = _compiled()
EMULATE = not COMPILED
if ON_GPU and not COMPILED:
    pytest.skip("a GPU without jax_triton: the compiled kernels cannot run", allow_module_level=True)
TOLERANCE = 2e-3
VERSIONS = {1: dict(kernel="simple"), 2: dict(kernel="pipelined", fused_windows=False), 3: {},  # 3: the default
            4: dict(stages=1),  # no page in flight ahead (shared memory of small GPUs)
            5: dict(precise=False),  # one float16 query (the pairs are the default)
            6: dict(lazy=True),  # the running softmax state rescaled only when a maximum grows by > 2**8
            7: dict(stages=3, overlap=True),  # each page's scores made before the previous page's softmax
            8: dict(stages=3),
            9: dict(stages=1, stagger=True)}  # one stage, a page's keys and its values copied as two groups


def gpu_only(*values):
    """Parameter values that run compiled only (the emulation is slow at these sizes)."""
    skip = pytest.mark.skipif(EMULATE, reason="compiled runs only")
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=skip) for v in values]


def one_loop_config(head_dim, page_size, value_group=64, **overrides):
    base = small_config(num_loops=1, head_dim=head_dim, page_size=page_size, **overrides)
    loop = LoopStorage(jflashloop.CodecSpec("int4", "channel", page_size),
                       jflashloop.CodecSpec("int4", "token", value_group))
    return dataclasses.replace(base, loops=(loop,))


def gluon_attention(queries, cache, layer, *, include_pending=False, splits=None, version=3, loop=0, options=None):
    from jflashloop_triton_kernels import decode_attention as gluon

    c = cache.config
    inputs = kernel_inputs(cache, layer, loop, include_pending)
    queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs)
    output = gluon.paged_decode_attention(
        queries, inputs["block_tables"], inputs["bounds"], inputs["streams"], windows["sink_keys"],
        windows["sink_values"], windows["ring_keys"], windows["ring_values"], state=inputs["state"],
        limits=inputs["limits"], loops=inputs["loops"], page_size=c.page_size, sink_tokens=c.sink_tokens,
        window_loop=window_loop, scale=1 / math.sqrt(c.head_dim), splits=splits, emulate=EMULATE,
        **(VERSIONS[version] if options is None else options))
    return unrotated_output(output, value_seed)


def assert_loops_match_reference(queries, cache, layer, loops):
    """The Gluon kernel's output for each of ``loops`` (pending tokens included) within TOLERANCE of the
    reference path's, per sequence."""
    for loop in loops:
        expected = jflashloop.decode_attention_reference(queries, cache, layer, loop, include_pending=True)
        actual = gluon_attention(queries, cache, layer, include_pending=True, loop=loop)
        assert (relative_errors(actual, expected) < TOLERANCE).all(), (loop, relative_errors(actual, expected))


def test_lazy_rescaling_matches_the_reference(rng):
    """Rescaling only when a row's maximum grows by more than 2**8 gives the reference's result (sharp
    queries over many 16-token pages: the running maximum moves often, by small and large steps)."""
    config = one_loop_config(128, 16, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[37, 5, 300], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, 128)) * 6, jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 1, 0, include_pending=False)
    errors = relative_errors(gluon_attention(queries, cache, 1, splits=2, version=6), expected)
    assert (errors < TOLERANCE).all(), errors


@pytest.mark.parametrize("loops, format, page_size, chunk", [
    (1, "int4", 16, None), (4, "int4", 64, 32), (2, "nvfp4", 32, None),
    *gpu_only((4, "int4", 64, None), (1, "int4_rotated", 16, None), (2, "int4", 32, None), (4, "int4", 16, None))])
def test_staggered_copies_give_the_same_bits(rng, loops, format, page_size, chunk):
    """Copying a page's keys and its values as two groups (the next page's keys behind this page's
    softmax and values) reorders copies, not arithmetic: the same bits as one plain stage for one loop,
    dense and FlashLoop chains, whole pages and smaller chunks, many pages per program and none; a
    copy landing too early or too late in the emulation (synchronous copies) or on a GPU changes them."""
    codec = {"int4": None, "nvfp4": (jflashloop.NVFP4,) * 2,
             "int4_rotated": (jflashloop.int4_rotated(64, 3), jflashloop.int4_rotated(64, 4))}[format]
    config = small_config(num_loops=loops, page_size=page_size, head_dim=64, max_pages_per_sequence=12,
                          num_pages=48, max_sequences=4)
    if codec is not None:
        config = dataclasses.replace(config, loops=(LoopStorage(*codec),) * loops)
    cache, _ = build(rng, config, prompt_lengths=[5 * page_size + 9, 3, 2 * page_size, page_size + 1], steps=2)
    queries = jnp.asarray(rng.standard_normal((4, 8, 64)) * 3, jnp.float32)
    loop = loops - 1
    expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=True)
    options = {} if chunk is None else {"chunk": chunk}
    for splits in (1, 9):
        plain = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, loop=loop,
                                           options=dict(stages=1, stagger=False, **options)))
        staggered = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, loop=loop,
                                               options=dict(stages=1, stagger=True, **options)))
        assert_bits_equal(staggered, plain, f"{splits} splits")
        errors = relative_errors(staggered, expected)
        assert (errors < TOLERANCE).all(), (splits, errors)


@pytest.mark.parametrize("format, page_size", [("int4", 16), ("int4", 64), ("nvfp4", 32), ("int4_rotated", 16)])
def test_overlapped_pages_give_the_same_bits(rng, format, page_size):
    """Making page ``p + 1``'s scores before page ``p``'s softmax reorders the work, not the arithmetic:
    the same bits as the plain loop with the same stages, at one page per program, many, none (more
    splits than pages) and a lost page; and within the reference's tolerance."""
    codec = {"int4": None, "nvfp4": (jflashloop.NVFP4,) * 2,
             "int4_rotated": (jflashloop.int4_rotated(64, 3), jflashloop.int4_rotated(64, 4))}[format]
    config = one_loop_config(64, page_size, max_pages_per_sequence=12, num_pages=48, max_sequences=4)
    if codec is not None:
        config = dataclasses.replace(config, loops=(LoopStorage(*codec),))
    cache, _ = build(rng, config, prompt_lengths=[5 * page_size + 9, 3, 2 * page_size, page_size + 1], steps=2)
    queries = jnp.asarray(rng.standard_normal((4, 8, 64)) * 3, jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=True)
    for splits in (1, 2, 9):
        plain = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, version=8))
        overlapped = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, version=7))
        assert_bits_equal(overlapped, plain, f"{splits} splits")
        assert (relative_errors(overlapped, expected) < TOLERANCE).all(), (splits, relative_errors(overlapped, expected))
    lost_config = small_config(num_layers=1, head_dim=64, page_size=16, num_pages=3, max_pages_per_sequence=3,
                               max_sequences=2, num_loops=1, recent_tokens=16)
    if format == "int4" and page_size == 16:
        lost, _ = lost_page_cache(rng, lost_config, 1)
        lost_queries = queries[:2, :4]
        assert_bits_equal(np.asarray(gluon_attention(lost_queries, lost, 0, splits=2, version=7)),
                          np.asarray(gluon_attention(lost_queries, lost, 0, splits=2, version=8)), "lost page")


@pytest.mark.parametrize("loops, format, page_size, persistent, group", [
    (1, "int4", 16, 1, 8), (1, "nvfp4", 32, 3, 2), (2, "int4", 16, 5, 4),
    *gpu_only((1, "int4", 64, 7, 4), (1, "int4_rotated", 16, 2, 8), (4, "int4", 32, 3, 8), (1, "int4", 16, 4, 16))])
def test_persistent_programs_give_the_same_bits(rng, loops, format, page_size, persistent, group):
    """Persistent programs taking the split-KV items in turn, each item's first page copied during the
    item before it, move copies and programs, not arithmetic: the same bits as one program per item for
    one loop, a dense and a FlashLoop chain (two stages), GQA groups of 2-16 (two row blocks), the merge
    in the kernel and in XLA, one page per item, many (items of an odd count of pages in a row: the next
    item's first page lands in the other stage), none (more splits than pages), a program that takes every
    item, and a lost page."""
    codec = {"int4": None, "nvfp4": (jflashloop.NVFP4,) * 2,
             "int4_rotated": (jflashloop.int4_rotated(64, 3), jflashloop.int4_rotated(64, 4))}[format]
    config = small_config(num_loops=loops, page_size=page_size, head_dim=64, max_pages_per_sequence=12,
                          num_pages=48, max_sequences=4)
    if loops == 1:
        config = one_loop_config(64, page_size, max_pages_per_sequence=12, num_pages=48, max_sequences=4)
    if codec is not None:
        config = dataclasses.replace(config, loops=(LoopStorage(*codec),) * loops)
    cache, _ = build(rng, config, prompt_lengths=[5 * page_size + 9, 3, 2 * page_size, page_size + 1], steps=2)
    queries = jnp.asarray(rng.standard_normal((4, 2 * group, 64)) * 3, jnp.float32)
    loop = loops - 1
    expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=True)
    for splits, merge in ((1, "xla"), (4, "kernel"), (9, "xla")):  # 4: items of 3 pages in a row
        if group > 8 and merge == "kernel":
            continue  # the in-kernel merge reads one block of 8 rows
        plain, persistent_bits = (
            np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, loop=loop,
                                       options=dict(stages=2, merge=merge, persistent_programs=programs)))
            for programs in (None, persistent))
        assert_bits_equal(persistent_bits, plain, f"{splits} splits, merge {merge}")
        errors = relative_errors(persistent_bits, expected)
        assert (errors < TOLERANCE).all(), (splits, merge, errors)
    if loops == 1 and format == "int4" and page_size == 16:
        lost_config = small_config(num_layers=1, head_dim=64, page_size=16, num_pages=3, max_pages_per_sequence=3,
                                   max_sequences=2, num_loops=1, recent_tokens=16)
        lost, _ = lost_page_cache(rng, lost_config, 1)
        assert_bits_equal(*(np.asarray(gluon_attention(queries[:2, :4], lost, 0, splits=2,
                                                       options=dict(stages=2, persistent_programs=programs)))
                            for programs in (persistent, None)), "lost page")


def test_where_programs_are_persistent_by_default():
    """One INT4 stream at head_dim 128, two stages, at least two waves of items, a known SM count."""
    from jflashloop_triton_kernels import launch

    where = dict(format="int4", head_dim=128, streams=1, sparse_rows=(), stages=2, overlap=False, sm_count=132)
    wave = 132 * launch.PERSISTENT_BLOCKS_PER_SM
    assert launch.preferred_persistent_programs(**where, items=2112) == wave  # B8 Hq32 Hkv8 T32K
    assert launch.preferred_persistent_programs(**where, items=1040) == 0  # B1 Hq16 Hkv16 T64K: one wave
    # B16 Hq16 Hkv16 T8K: 2304 items are three rounds of 768 programs, too few for the wave
    assert launch.preferred_persistent_programs(**where, items=2304) == 0
    assert launch.preferred_persistent_programs(**where, items=2 * 1030) == 1030  # even rounds of 97.5% of a wave
    assert launch.preferred_persistent_programs(**where, items=2 * 1030 + 1) == 1031  # one program an item less
    assert launch.preferred_persistent_programs(**where, items=2 * 990) == 0  # rounds of 94% of a wave
    assert launch.preferred_persistent_programs(**where, items=3 * wave) == wave
    for change in (dict(format="nvfp4"), dict(head_dim=64), dict(streams=2), dict(sparse_rows=(16,)),
                   dict(stages=1), dict(overlap=True), dict(sm_count=None)):
        assert launch.preferred_persistent_programs(**{**where, **change}, items=4 * wave) == 0, change


def test_persistent_programs_refuse_what_they_cannot_run():
    """Persistent programs hand each item's first page to the plain two-stage loop."""
    config = one_loop_config(64, 16, num_kv_heads=1, max_pages_per_sequence=4, num_pages=8)
    cache, _ = build(np.random.default_rng(0), config, prompt_lengths=[40], steps=1)
    for options in (dict(stages=1, persistent_programs=4), dict(stages=3, overlap=True, persistent_programs=4)):
        with pytest.raises(ValueError, match="two stages"):
            gluon_attention(jnp.ones((1, 8, 64), jnp.float32), cache, 0, options=options)
    with pytest.raises(ValueError, match="persistent must be"):
        gluon_attention(jnp.ones((1, 8, 64), jnp.float32), cache, 0, options=dict(stages=2, persistent_programs=-1))


def test_overlap_is_the_default_for_int4_at_head_dim_256(rng, monkeypatch):
    """INT4 at head_dim 256 with 64-token pages takes the overlapped loop by default (3 stages;
    ``launch.preferred_overlap``): the default call gives the bits of ``overlap=True, stages=3``, with
    the splits merged inside the kernel (few partials) and by XLA; with one stage the default stays the
    plain loop."""
    from jflashloop_triton_kernels import decode_attention as gluon
    from jflashloop_triton_kernels import launch as gluon_launch

    launched = []
    page_partials = gluon.page_partials

    def spy(*args, **kwargs):
        launched.append((kwargs["overlap"], kwargs["stages"]))
        return page_partials(*args, **kwargs)

    monkeypatch.setattr(gluon, "page_partials", spy)
    assert gluon_launch.preferred_overlap(format="int4", head_dim=256, page_size=64)
    assert not gluon_launch.preferred_overlap(format="int4", head_dim=256, page_size=128)
    assert not gluon_launch.preferred_overlap(format="int4", head_dim=128, page_size=64)
    assert not gluon_launch.preferred_overlap(format="nvfp4", head_dim=256, page_size=64)
    assert not gluon_launch.preferred_overlap(format="int4", head_dim=256, page_size=64, streams=2)
    assert gluon_launch.preferred_stages(overlap=True) == gluon_launch.OVERLAP_STAGES
    config = one_loop_config(256, 64, max_pages_per_sequence=4, num_pages=8, max_sequences=2)
    cache, _ = build(rng, config, prompt_lengths=[2 * 64 + 5, 64], steps=1)
    queries = jnp.asarray(rng.standard_normal((2, 8, 256)) * 3, jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=True)
    for splits in (2, 20):  # in-kernel merge; more partials than KERNEL_MERGE_SLOTS: merged apart (preferred_merge)
        default = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, version=3))
        assert_bits_equal(default, np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=splits, version=7)),
                          f"{splits} splits")
        assert (relative_errors(default, expected) < TOLERANCE).all(), relative_errors(default, expected)
    one_stage = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=2, version=4))
    assert (relative_errors(one_stage, expected) < TOLERANCE).all()
    assert launched == [(True, gluon_launch.OVERLAP_STAGES), (True, 3)] * 2 + [(False, 1)]


def test_overlap_refuses_chains():
    # test_gluon_kernel_dense_residual_chain[16]'s cache shapes: its compiled builder serves here too
    config = small_config(num_loops=2, page_size=16, head_dim=64, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(np.random.default_rng(0), config, prompt_lengths=[89, 3, 32], steps=2)
    with pytest.raises(ValueError, match="one dense stream"):
        gluon_attention(jnp.ones((3, 8, 64), jnp.float32), cache, 1, loop=1, version=7)


def test_stagger_refuses_more_than_one_stage():
    """The staggered copies split one stage's copy; with more stages there is nothing to split."""
    config = one_loop_config(64, 16, num_kv_heads=1, max_pages_per_sequence=4, num_pages=8)
    cache, _ = build(np.random.default_rng(0), config, prompt_lengths=[40], steps=1)
    with pytest.raises(ValueError, match="one stage"):
        gluon_attention(jnp.ones((1, 8, 64), jnp.float32), cache, 0, options=dict(stages=2, stagger=True))


@pytest.mark.parametrize("head_dim, group, loops, value_scale, format", [
    (128, 4, 1, 1e-3, "int4"), (64, 8, 1, 1.0, "int4"), (64, 8, 1, 1.0, "int4_rotated"), (64, 2, 1, 1.0, "nvfp4"),
    *gpu_only((128, 4, 1, 1.0, "int4"), (64, 2, 4, 1.0, "int4"), (256, 2, 2, 1.0, "int4"),
              (128, 8, 2, 1.0, "int4_rotated"), (128, 1, 1, 1e-3, "nvfp4"), (128, 1, 2, 1.0, "nvfp4"))])
def test_values_scaled_on_the_probabilities(rng, head_dim, group, loops, value_scale, format):
    """INT4 value codes as float16 subnormals against probabilities times the value scales (the default
    where the GQA group leaves a block of columns per value group; the chain tests above take it too):
    within the reference's tolerance, like the codes decoded in registers, and not the same bits (the
    path switch changes the arithmetic). Small values (``value_scale`` 1e-3) put many scaled
    probabilities below float16's normal range. int4_rotated (one scale per token, its zero point's terms
    beside the softmax's sums) and NVFP4 (16-channel scales: one query row at head_dim 128, two at 64; the
    E2M1 values placed, not multiplied) take the same path only when asked."""
    config = small_config(num_loops=loops, page_size=16, head_dim=head_dim, max_pages_per_sequence=40,
                          num_pages=128, num_kv_heads=2)
    if loops == 1:  # test_gluon_kernel_matches_reference's cache
        config = one_loop_config(head_dim, 16, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    if format == "int4_rotated":
        codecs = (jflashloop.int4_rotated(head_dim, 3), jflashloop.int4_rotated(head_dim, 4))  # whole heads
        config = dataclasses.replace(config, loops=(LoopStorage(*codecs),) * loops)
    if format == "nvfp4":
        config = dataclasses.replace(config, loops=(LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4),) * loops)
    cache, _ = build(rng, config, prompt_lengths=[37, 5, 8 * 16 + 3], steps=2, value_scale=value_scale)
    queries = jnp.asarray(rng.standard_normal((3, 2 * group, head_dim)) * 2, jnp.float32)
    loop = loops - 1
    expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=True)
    results = {}
    for scaled in (True, False):
        results[scaled] = np.asarray(gluon_attention(queries, cache, 0, include_pending=True, splits=3, loop=loop,
                                                     options=dict(scaled_values=scaled)))
        errors = relative_errors(results[scaled], expected)
        assert (errors < TOLERANCE).all(), (scaled, errors)
    assert not np.array_equal(results[True], results[False])


@pytest.mark.parametrize("head_dim, group, direct", [(64, 2, False), *gpu_only((128, 1, False), (128, 1, True))])
def test_nvfp4_chains_scaled_on_the_probabilities_with_nvfp4_rows(rng, head_dim, group, direct):
    """NVFP4 chains whose sparse rows are NVFP4 too take the scaled values: the dense streams' E2M1 values
    against the probabilities times their block scales, each row added as values to every column of the
    products (the query's rows repeat in each block). Within the reference's tolerance, not the decoded
    path's bits, and the rows count (without loop 4's residual rows the output moves by more)."""
    base = small_config(num_loops=4, page_size=64, head_dim=head_dim, max_pages_per_sequence=40, num_pages=128,
                        num_kv_heads=2, direct_loop=direct)
    config = _format_chain(base, (jflashloop.NVFP4,) * 2, (jflashloop.NVFP4,) * 2)
    cache, _ = build(rng, config, prompt_lengths=[5 * 64 + 9, 3, 2 * 64], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 2 * group, head_dim)) * 2, jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 1, 3, include_pending=True)
    results = {}
    for scaled in (True, False):
        results[scaled] = np.asarray(gluon_attention(queries, cache, 1, include_pending=True, loop=3,
                                                     options=dict(scaled_values=scaled)))
        errors = relative_errors(results[scaled], expected)
        assert (errors < TOLERANCE).all(), (scaled, errors)
    assert not np.array_equal(results[True], results[False])
    without = jflashloop.decode_attention_reference(queries, cache, 1, 2, include_pending=True)
    assert (relative_errors(without, expected) > 10 * relative_errors(results[True], expected)).any()


def test_scaled_values_refuse_what_they_cannot_read():
    """Lazy rescaling: its probabilities reach 2**8, and times a value scale they could overflow float16."""
    config = one_loop_config(64, 16, num_kv_heads=1, max_pages_per_sequence=4, num_pages=8)
    cache, _ = build(np.random.default_rng(0), config, prompt_lengths=[40], steps=1)
    with pytest.raises(ValueError, match="scaled values need"):
        gluon_attention(jnp.ones((1, 8, 64), jnp.float32), cache, 0, options=dict(scaled_values=True, lazy=True))


def test_scaled_values_refuse_nvfp4_chains_with_rows_of_another_format(rng):
    """INT4 rows enter scaled products as codes in the INT4 units NVFP4's chain does not restore: an NVFP4 chain
    with INT4 rows cannot take scaled values, even where its GQA group could."""
    base = small_config(num_loops=4, page_size=64, head_dim=128, max_pages_per_sequence=8, num_pages=32,
                        num_kv_heads=2)
    config = _format_chain(base, (jflashloop.NVFP4,) * 2, (jflashloop.CodecSpec("int4", "token", 16),) * 2)
    cache, _ = build(rng, config, prompt_lengths=[70], steps=1)
    with pytest.raises(ValueError, match="scaled values need"):
        gluon_attention(jnp.ones((1, 2, 128), jnp.float32), cache, 1, loop=3, options=dict(scaled_values=True))


def test_where_values_can_be_scaled_on_the_probabilities():
    """Each value group takes a block of 8 / groups columns: the GQA group must fit in it."""
    from jflashloop_triton_kernels import launch

    def can(group, head_dim=128, value_group=64, **options):
        return launch.scaled_values(format=options.pop("format", "int4"), head_dim=head_dim,
                                    value_group=value_group, group=group, **options)

    assert can(4) and can(1) and not can(5) and not can(8)
    assert can(8, head_dim=64) and can(2, head_dim=256) and not can(3, head_dim=256)
    assert can(8, value_group=128) and can(2, value_group=32) and not can(3, value_group=32)
    assert not can(2, value_group=16) and can(1, value_group=16)
    assert not can(4, lazy=True) and not can(4, row_blocks=2)
    assert not can(4, format="nvfp4") and can(8, format="int4_rotated") and not can(9, format="int4_rotated")
    assert can(1, format="nvfp4") and not can(2, format="nvfp4") and can(2, head_dim=64, format="nvfp4")
    assert not can(1, head_dim=256, format="nvfp4") and not can(1, format="nvfp4", sparse_loops=1)
    assert can(1, format="nvfp4", sparse_loops=2, row_format="nvfp4")
    assert not can(2, format="nvfp4", sparse_loops=2, row_format="nvfp4")
    assert not can(1, format="nvfp4", sparse_loops=2, row_format="int2")
    assert not can(4, format="int4_rotated", sparse_loops=2) and not can(4, format="int4_rotated", lazy=True)
    assert launch.preferred_scaled_values(format="int4", head_dim=128, value_group=64, group=4)
    assert (launch.preferred_scaled_values(format="int4_rotated", head_dim=128, value_group=64, group=4)
            == launch.SCALED_ROTATED)
    assert (launch.preferred_scaled_values(format="nvfp4", head_dim=128, value_group=64, group=1)
            == launch.SCALED_NVFP4)
    assert (launch.preferred_scaled_values(streams=2, format="nvfp4", head_dim=128, value_group=64, group=1,
                                           sparse_loops=2, row_format="nvfp4") == launch.SCALED_NVFP4_PAIRS)
    assert not launch.preferred_scaled_values(streams=2, format="nvfp4", head_dim=128, value_group=64, group=4)


def test_merge_registers_must_be_positive():
    config = one_loop_config(64, 16, num_kv_heads=1, max_pages_per_sequence=4, num_pages=8)
    cache, _ = build(np.random.default_rng(0), config, prompt_lengths=[40], steps=1)
    from jflashloop_triton_kernels import decode_attention as gluon

    inputs = kernel_inputs(cache, 0, 0, True)
    with pytest.raises(ValueError, match="merge_registers must be positive"):
        gluon.paged_decode_attention(
            jnp.ones((1, 4, 64), jnp.float32), inputs["block_tables"], inputs["bounds"], inputs["streams"],
            inputs["sink_keys"], inputs["sink_values"], inputs["ring_keys"], inputs["ring_values"],
            state=inputs["state"], limits=inputs["limits"], loops=inputs["loops"], page_size=16,
            sink_tokens=config.sink_tokens, window_loop=0, scale=0.125, emulate=EMULATE, merge="kernel",
            merge_registers=0)


def relative_errors(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected, axis=(-2, -1)) / np.linalg.norm(expected, axis=(-2, -1))


# Emulated: each head_dim at both page sizes and both groups (one each); compiled: every combination.
_EMULATED_SHAPES = [(64, 16, 4), (64, 64, 1), (128, 16, 1), (128, 64, 4), (256, 16, 4), (256, 64, 1)]


@pytest.mark.parametrize("head_dim, page_size, group", [
    *_EMULATED_SHAPES,
    *gpu_only(*[(d, p, g) for d in (64, 128, 256) for p in (16, 64, 128) for g in (1, 4, 3, 8)
                if (d, p, g) not in _EMULATED_SHAPES])])
@pytest.mark.parametrize("version", [3])
def test_gluon_kernel_matches_reference(rng, head_dim, page_size, group, version):
    config = one_loop_config(head_dim, page_size, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[37, 5, 8 * page_size + 3], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 2 * group, head_dim)) * 2, jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 1, 0, include_pending=False)
    for splits in (1, 3, None) if COMPILED else (3,):
        actual = gluon_attention(queries, cache, 1, splits=splits, version=version)
        errors = relative_errors(actual, expected)
        assert (errors < TOLERANCE).all(), (splits, errors)


@pytest.mark.parametrize("head_dim, value_group, version",
                         [(128, 16, 1), (128, 16, 2), (128, 16, 3), (128, 16, 4), (256, 16, 3), (64, 16, 3),
                          *gpu_only((128, 32, 3), (128, 128, 3), (256, 32, 1))])
def test_gluon_kernel_value_groups(rng, head_dim, value_group, version):
    config = one_loop_config(head_dim, 64, value_group=value_group)
    cache, _ = build(rng, config, prompt_lengths=[300, 64, 129], steps=1)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=False)
    assert (relative_errors(gluon_attention(queries, cache, 0, version=version), expected) < TOLERANCE).all()


@pytest.mark.parametrize("sink, recent", [(0, 16), (4, 100), (20, 16)])
def test_gluon_kernel_window_policies(rng, sink, recent):
    config = one_loop_config(128, 32, sink_tokens=sink, recent_tokens=recent, max_pages_per_sequence=40,
                             num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[300, 7, 33], steps=3)
    queries = jnp.asarray(rng.standard_normal((3, 8, 128)), jnp.float32)
    for pending in (False, True):
        expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=pending)
        actual = gluon_attention(queries, cache, 0, include_pending=pending, version=3)
        assert (relative_errors(actual, expected) < TOLERANCE).all(), (pending, relative_errors(actual, expected))


@pytest.mark.parametrize("recent", [16, 0])
def test_gluon_kernel_never_reads_lost_pages(rng, recent):
    """Pool exhaustion: slot 1's second page is lost (or, in the hole cache, its first, and the second
    is then not stored); the kernel works the regions out itself and reads none of slot 0's pages.
    Without a recent window the ring holds tokens of the lost page, which the window program must read."""
    config = small_config(num_layers=1, head_dim=64, page_size=16, num_pages=3, max_pages_per_sequence=3,
                          max_sequences=2, num_loops=3, recent_tokens=recent)
    seed = int(rng.integers(2**31))
    (cache, _), (other, _) = (lost_page_cache(np.random.default_rng(seed), config, s) for s in (1, 2))
    hole, _ = hole_cache(rng, config)
    queries = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    for loop in (0, 2):
        mine = np.asarray(gluon_attention(queries, cache, 0, loop=loop))
        assert_bits_equal(mine[1], np.asarray(gluon_attention(queries, other, 0, loop=loop))[1], "slot 1")
        for state, out in ((cache, mine), (hole, np.asarray(gluon_attention(queries, hole, 0, loop=loop)))):
            expected = jflashloop.decode_attention_reference(queries, state, 0, loop, include_pending=False)
            assert (relative_errors(out[1:], expected[1:]) < TOLERANCE).all(), loop


def outlier_key_errors(rng, head_dim, version):
    """Relative errors ``[3]`` of kernel ``version`` against the reference on a cache of outlier keys:
    6 channels 10x the rest plus per-channel offsets 3x the spread, 64-token pages, 700 / 65 / 1000 tokens."""
    config = one_loop_config(head_dim, 64, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache = jflashloop.paged_cache.create(config)
    for slot, length in enumerate([700, 65, 1000]):
        keys = rng.standard_normal((config.num_layers, 1, 1024, 2, head_dim))
        keys[..., :6] *= 10
        keys += rng.standard_normal((1, 1, 1, 2, head_dim)) * 3
        values = rng.standard_normal((config.num_layers, 1, 1024, 2, head_dim))
        cache = jflashloop.paged_cache.prefill(cache, slot, jnp.asarray(keys, jnp.float32),
                                               jnp.asarray(values, jnp.float32), length)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=True)
    actual = gluon_attention(queries, cache, 0, include_pending=True, version=version)
    return relative_errors(actual, expected)


# One float16 query on keys with outlier channels: up to 2.84e-3 over 100 random caches at head_dim 128
# (11 of them above 2e-3), 2.16e-3 at 256; the float16 pairs (the default): at most 2.6e-4
# (bench/KERNEL_NOTES.md).
OUTLIER_TOLERANCE = {"pair": 1e-3, "single": 4e-3}


@pytest.mark.parametrize("head_dim, version", [(128, 2), (128, 3), (64, 3), (256, 3), (128, 5),
                                               *gpu_only((128, 1), (256, 5))])
def test_gluon_kernel_outlier_channels_and_pending_token(rng, head_dim, version):
    """Keys with a few channels 10x the rest and large per-channel offsets (real-model K)."""
    errors = outlier_key_errors(rng, head_dim, version)
    pair = VERSIONS[version].get("precise", VERSIONS[version].get("kernel") != "simple")
    assert (errors < OUTLIER_TOLERANCE["pair" if pair else "single"]).all(), errors


@pytest.mark.parametrize("page_size", [16, 64])
def test_gluon_kernel_dense_residual_chain(rng, page_size):
    """Loop 1 of the FlashLoop policy: the base and a dense residual, both INT4."""
    config = small_config(num_loops=2, page_size=page_size, head_dim=64, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[5 * page_size + 9, 3, 2 * page_size], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 1, (0, 1))


@pytest.mark.parametrize("head_dim, page_size, loops", [(128, 64, 1), (64, 16, 2), *gpu_only((256, 32, 1))])
def test_gluon_kernel_nvfp4(rng, head_dim, page_size, loops):
    """NVFP4 keys and values (16-channel E4M3 blocks, a float32 scale per page tile)."""
    base = small_config(num_loops=loops, head_dim=head_dim, page_size=page_size, max_pages_per_sequence=40,
                        num_pages=128)
    nvfp4 = jflashloop.NVFP4
    config = dataclasses.replace(base, loops=tuple(LoopStorage(nvfp4, nvfp4) for _ in range(loops)))
    cache, _ = build(rng, config, prompt_lengths=[4 * page_size + 5, 9, 2 * page_size], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 0, range(loops))


def _scaled_tiles(stream, factors):
    """``stream`` (a PagedStream) with its tiles' float32 scales times ``factors`` ``[kv_heads, pages]``."""
    return dataclasses.replace(stream, global_scale=stream.global_scale * jnp.asarray(factors, jnp.float32))


@pytest.mark.parametrize("base_factor, residual_factor", [(0.0, 1.0), (1.0, 10.0), (1.0, 1000.0), (1e-3, 1.0)])
def test_gluon_kernel_nvfp4_pair_of_tile_scales(rng, base_factor, residual_factor):
    """Two dense NVFP4 streams share one key accumulator and one value tile per page, each tile's scale over the
    larger of the two entering its E4M3 scales as a multiplier: pages whose base tile is zero, whose residual
    tile's scale passes the base's (the residual then keeps its exact bits), or whose base is far below the
    residual match the reference path."""
    base = small_config(num_loops=2, head_dim=64, page_size=16, max_pages_per_sequence=40, num_pages=128)
    nvfp4 = jflashloop.NVFP4
    config = dataclasses.replace(base, loops=(LoopStorage(nvfp4, nvfp4),) * 2)
    cache, _ = build(rng, config, prompt_lengths=[4 * 16 + 5, 9, 2 * 16], steps=2)
    pool = cache.layers[0]
    shape = pool.loops[0].keys.global_scale.shape  # [kv_heads, pages]
    changed = (np.arange(shape[1]) % 2 == 0)[None, :] & (np.arange(shape[0]) == 0)[:, None]  # head 0, even pages
    first = np.where(changed, base_factor, 1.0)
    second = np.where(changed, residual_factor, 1.0)
    loops = (dataclasses.replace(pool.loops[0], keys=_scaled_tiles(pool.loops[0].keys, first),
                                 values=_scaled_tiles(pool.loops[0].values, first)),
             dataclasses.replace(pool.loops[1], keys=_scaled_tiles(pool.loops[1].keys, second),
                                 values=_scaled_tiles(pool.loops[1].values, second)))
    cache = dataclasses.replace(cache, layers=(dataclasses.replace(pool, loops=loops), *cache.layers[1:]))
    queries = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    assert_loops_match_reference(queries, cache, 0, (1,))


@pytest.mark.parametrize("head_dim, loops", [(128, 1), (64, 2)])
def test_gluon_kernel_int4_rotated(rng, head_dim, loops):
    """vLLM-style rotated INT4 (queries and windows rotated outside, the output unrotated)."""
    base = small_config(num_loops=loops, head_dim=head_dim, page_size=32, max_pages_per_sequence=40, num_pages=128)
    keys, values = jflashloop.int4_rotated(head_dim, 3), jflashloop.int4_rotated(head_dim, 4)
    config = dataclasses.replace(base, loops=tuple(LoopStorage(keys, values) for _ in range(loops)))
    cache, _ = build(rng, config, prompt_lengths=[5 * 32 + 7, 12, 64], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 0, range(loops))


@pytest.mark.parametrize("page_size", [64, *gpu_only(16)])
def test_gluon_kernel_full_flashloop_chain(rng, page_size):
    """Loops 2 and 3 of the FlashLoop policy: sparse residual rows (25% and 10% of each page)."""
    config = small_config(num_loops=4, page_size=page_size, head_dim=64, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[5 * page_size + 9, 3, 2 * page_size], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 1, (2, 3))


def _format_chain(base, dense, rows=None):
    """``base`` (a FlashLoop chain) with every dense loop in ``dense`` (K and V) and every sparse loop's rows
    in ``rows`` (default: ``dense``), the loops' counts and kinds kept."""
    rows = dense if rows is None else rows
    return dataclasses.replace(base, loops=tuple(
        dataclasses.replace(loop, key_spec=rows[0] if loop.is_sparse else dense[0],
                            value_spec=rows[1] if loop.is_sparse else dense[1]) for loop in base.loops))


@pytest.mark.parametrize("format, rows, direct", [
    ("nvfp4", "nvfp4", False), ("int4_rotated", "int4_rotated", False), ("nvfp4", "int4", True),
    *gpu_only(("nvfp4", "nvfp4", True), ("int4_rotated", "int4_rotated", True), ("nvfp4", "int4", False))])
def test_gluon_kernel_sparse_rows_of_each_format(rng, format, rows, direct):
    """Chains of NVFP4 or int4_rotated streams with sparse rows of their own format, and NVFP4 streams with
    INT4 rows (16-channel groups): each row's residual at its token, in the dense streams' units (INT4's
    scores are in units of KEY_UNIT, the others' are scores)."""
    base = small_config(num_loops=4, page_size=64, head_dim=64, max_pages_per_sequence=40, num_pages=128,
                        direct_loop=direct)
    codecs = {"nvfp4": (jflashloop.NVFP4,) * 2, "int4": (jflashloop.CodecSpec("int4", "token", 16),) * 2,
              "int4_rotated": (jflashloop.int4_rotated(64, 3), jflashloop.int4_rotated(64, 4))}
    config = _format_chain(base, codecs[format], codecs[rows])
    cache, _ = build(rng, config, prompt_lengths=[5 * 64 + 9, 3, 2 * 64], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 1, (2, 3))


def _affine_int2_rows(config):
    """``config`` (a chain) with every sparse loop's rows in affine INT2 grouped like the dense values."""
    rows = jflashloop.CodecSpec("int2", "token", config.loops[0].value_spec.group_size)
    return _format_chain(config, (config.loops[0].key_spec, config.loops[0].value_spec), (rows, rows))


@pytest.mark.parametrize("dense, head_dim, direct, scaled", [
    ("int4", 64, True, None), ("int4", 128, False, False), ("nvfp4", 64, False, None),
    *gpu_only(("int4", 64, False, None), ("int4", 128, True, None), ("int4", 256, True, None),
              ("int4", 64, True, False), ("nvfp4", 128, True, None))])
def test_gluon_kernel_affine_int2_rows(rng, dense, head_dim, direct, scaled):
    """Sparse rows in affine INT2 (the ``"int2"`` format, grouped like the dense values) after INT4 or NVFP4
    streams, with and without a direct loop 2: read as INT4 words of the same codes, on the INT4 rows' path
    (values scaled on the probabilities or decoded, ``scaled``)."""
    base = small_config(num_loops=4, page_size=64, head_dim=head_dim, max_pages_per_sequence=40, num_pages=128,
                        direct_loop=direct)
    if dense == "nvfp4":
        base = _format_chain(base, (jflashloop.NVFP4,) * 2)
    config = _affine_int2_rows(base)
    assert {loop.key_spec.format for loop in config.loops if loop.is_sparse} == {"int2"}
    cache, _ = build(rng, config, prompt_lengths=[5 * 64 + 9, 3, 2 * 64], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
    for loop in (2, 3):
        expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=True)
        actual = gluon_attention(queries, cache, 1, include_pending=True, loop=loop,
                                 options=None if scaled is None else dict(scaled_values=scaled))
        errors = relative_errors(actual, expected)
        assert (errors < TOLERANCE).all(), (loop, errors)
        # the rows count: without loop 4's (or 3's) residual rows the output moves by more than the tolerance
        without = jflashloop.decode_attention_reference(queries, cache, 1, loop - 1, include_pending=True)
        assert (relative_errors(without, expected) > 10 * errors).any(), (loop, errors)


def test_gluon_kernel_chain_after_a_direct_loop(rng):
    """A direct loop 2 (stored on its own) and the sparse loops after it: the kernel reads one dense stream
    and the sparse rows (loops 2-4 read no base)."""
    config = small_config(num_loops=4, page_size=64, head_dim=64, max_pages_per_sequence=40, num_pages=128,
                          direct_loop=True)
    cache, _ = build(rng, config, prompt_lengths=[5 * 64 + 9, 3, 2 * 64], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
    assert_loops_match_reference(queries, cache, 1, (1, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="the public Gluon path runs on a GPU with jax_triton")
def test_public_call_takes_the_pairs_for_float32_products(rng):
    from jflashloop_pallas_kernels.decode_attention import KernelConfig

    config = one_loop_config(128, 64, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[300, 70], steps=3)
    queries = jnp.asarray(rng.standard_normal((config.max_sequences, 8, 128)), jnp.float32)
    public = jflashloop.decode_attention(queries, cache, 0, 0, implementation="gluon",
                                         kernel_config=KernelConfig(products="float32"))
    pairs = gluon_attention(queries, cache, 0, include_pending=True, version=3)  # the default: the pairs
    np.testing.assert_allclose(np.asarray(public), np.asarray(pairs), rtol=1e-6, atol=1e-7)


def test_gluon_kernel_reads_only_what_it_supports():
    from jflashloop_triton_kernels.decode_attention import unsupported_reason

    chain = small_config(num_loops=4, page_size=64, head_dim=128)
    cache = jflashloop.paged_cache.create(chain)
    formats = loop_formats(cache.config, 3)
    assert unsupported_reason(formats, chain.head_dim, 64, 4) is None
    assert unsupported_reason(formats[:2], chain.head_dim, 64, 4) is None
    assert unsupported_reason(formats[:1] + formats[2:], chain.head_dim, 64, 4) is None  # after a direct loop
    assert "up to two sparse" in unsupported_reason(formats + formats[2:3], chain.head_dim, 64, 4)
    assert "dense" in unsupported_reason(formats[:2], chain.head_dim, 64, 4, kernel="simple")
    assert "at most 8" in unsupported_reason(formats[:1], chain.head_dim, 64, 16)


def test_gluon_kernel_reads_sparse_rows_of_one_format():
    """Sparse rows: INT4 grouped like the dense values (after INT4 or NVFP4 streams, not after int4_rotated ones,
    whose basis differs), or the dense streams' own format and grouping; both sparse loops alike."""
    from jflashloop_triton_kernels.decode_attention import unsupported_reason

    base = small_config(num_loops=4, page_size=64, head_dim=128)
    int4_rows = (jflashloop.CodecSpec("int4", "token", 16),) * 2
    nvfp4 = (jflashloop.NVFP4,) * 2
    rotated = (jflashloop.int4_rotated(128, 3), jflashloop.int4_rotated(128, 4))

    def reason(dense, rows, last_rows=None):
        config = _format_chain(base, dense, rows)
        if last_rows is not None:
            last = dataclasses.replace(config.loops[3], key_spec=last_rows[0], value_spec=last_rows[1])
            config = dataclasses.replace(config, loops=(*config.loops[:3], last))
        return unsupported_reason(loop_formats(config, 3), 128, 64, 4)

    assert reason(nvfp4, nvfp4) is None and reason(nvfp4, int4_rows) is None and reason(rotated, rotated) is None
    assert "one format" in reason(nvfp4, (jflashloop.CodecSpec("int4", "token", 64),) * 2)  # not the values' groups
    assert "one format" in reason(rotated, (jflashloop.CodecSpec("int4", "token", 128),) * 2)  # another basis
    assert "one format" in reason(nvfp4, nvfp4, last_rows=int4_rows)  # loops 3 and 4 differ
    int2_rows = (jflashloop.CodecSpec("int2", "token", 16),) * 2  # affine INT2, grouped like NVFP4's values
    assert reason(nvfp4, int2_rows) is None
    assert "one format" in reason(nvfp4, int2_rows, last_rows=int4_rows)
    assert "one format" in reason(rotated, (jflashloop.CodecSpec("int2", "token", 128),) * 2)  # another basis
    assert "one format" in reason(nvfp4, (jflashloop.NVFP4, jflashloop.CodecSpec("int4", "token", 16)))


@pytest.mark.parametrize("group, merge, splits, registers", [
    (4, "kernel", 3, None), (3, "kernel", 3, None), (3, "gluon", 3, None), (1, "gluon", 3, None),
    (3, "xla", 3, None),
    (1, "kernel", 20, None), (2, "kernel", 20, None),  # 21 partials: more than one round trip of the merge
    (4, "kernel", 20, 128),  # 8 slots per round trip instead of 4
    (2, "gluon", 20, None),  # the merge kernel: 21 slots in one block
    (8, "gluon", 39, None),  # 40 slots in two blocks of 32: the second block rescales the first's sums
])
def test_gluon_kernel_merges_the_splits(rng, group, merge, splits, registers):
    config = one_loop_config(128, 64, num_kv_heads=2, max_pages_per_sequence=40, num_pages=128)
    cache, _ = build(rng, config, prompt_lengths=[400, 5, 129], steps=1)
    queries = jnp.asarray(rng.standard_normal((3, 2 * group, 128)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 0, include_pending=True)
    from jflashloop_triton_kernels import decode_attention as gluon

    c = cache.config
    inputs = kernel_inputs(cache, 0, 0, True)
    actual = gluon.paged_decode_attention(
        queries, inputs["block_tables"], inputs["bounds"], inputs["streams"], inputs["sink_keys"],
        inputs["sink_values"], inputs["ring_keys"], inputs["ring_values"], state=inputs["state"],
        limits=inputs["limits"], loops=inputs["loops"], page_size=c.page_size, sink_tokens=c.sink_tokens,
        window_loop=0, scale=1 / math.sqrt(c.head_dim), splits=splits, emulate=EMULATE, merge=merge,
        merge_registers=registers)
    assert actual.shape == expected.shape
    assert (relative_errors(actual, expected) < TOLERANCE).all()


def test_default_merge_by_partials():
    """In the page kernel up to KERNEL_MERGE_SLOTS partials, XLA's single fusion up to GLUON_MERGE_SLOTS,
    the one-pass merge kernel beyond; groups past 8 rows (row blocks) merge in XLA."""
    from jflashloop_triton_kernels.decode_attention import (
        GLUON_MERGE_SLOTS,
        KERNEL_MERGE_SLOTS,
        preferred_merge,
    )

    assert preferred_merge(KERNEL_MERGE_SLOTS, in_kernel=True) == "kernel"
    assert preferred_merge(KERNEL_MERGE_SLOTS, in_kernel=False) == "xla"
    assert preferred_merge(KERNEL_MERGE_SLOTS + 1, in_kernel=True) == "xla"
    assert preferred_merge(GLUON_MERGE_SLOTS, in_kernel=True) == "xla"
    assert preferred_merge(GLUON_MERGE_SLOTS + 1, in_kernel=True) == "gluon"
    assert preferred_merge(GLUON_MERGE_SLOTS + 1, in_kernel=False) == "gluon"
    assert preferred_merge(GLUON_MERGE_SLOTS + 1, in_kernel=True, row_blocks=2) == "xla"
    assert preferred_merge(2, in_kernel=True, row_blocks=2) == "xla"
    for sizes in (dict(slots=0), dict(slots=40, row_blocks=0)):
        with pytest.raises(ValueError, match="positive sizes"):
            preferred_merge(**sizes, in_kernel=True)


def test_emulation_refuses_unknown_inline_ptx():
    from jflashloop_triton_kernels import emulate

    with pytest.raises(NotImplementedError, match="inline PTX"):
        emulate._inline_asm("mov.b32 $0, $1;", "=r,r", [np.zeros(2, np.uint32)], None, True, 1)
