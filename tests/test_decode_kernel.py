"""The fused Pallas decode-attention and quantize-on-write kernels.

On CPU the kernels run in interpret mode (the kernel logic; inline PTX is
replaced by jnp with the same values); on a GPU the same tests run compiled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from jflashloop.attention import decode_attention
from jflashloop.cache_config import LoopStorage
from jflashloop.paged_stream import encode_tiles
from jflashloop_pallas_kernels import quantize
from jflashloop_pallas_kernels.decode_attention import KernelConfig
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    build,
    hole_cache,
    lost_page_cache,
    lost_page_config,
    nvfp4_residual_config,
    oracle_sequence,
    small_config,
    tiny_config,
)
from tests.cases import CASES

ON_GPU = jax.default_backend() == "gpu"
# Kernel vs the reference path on the same codes. In interpret mode the logic
# tests use float32 products (exact, so an indexing or algebra mistake shows
# far above rounding); on the GPU they use the default float16 products at
# the documented 2e-3, which test_kernel_default_float16_products also checks
# in interpret mode.
PRODUCTS = "float16" if ON_GPU else "float32"
KERNEL_TOLERANCE = 2e-3 if ON_GPU else 1e-5
FLOAT16_TOLERANCE = 2e-3


def relative_errors(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected, axis=(-2, -1)) / np.linalg.norm(expected, axis=(-2, -1))


def run_kernel(queries, cache, layer, loop, *, include_pending=False, **config):
    config.setdefault("products", PRODUCTS)
    config.setdefault("num_splits", 2)  # few programs: interpret mode runs them one by one
    return decode_attention(
        queries, cache, layer, loop, include_pending=include_pending, implementation="pallas",
        kernel_config=KernelConfig(**config), poison_for_tests=True,
    )


CONFIGS = {
    "int4": lambda: small_config(),
    "nvfp4_residuals": lambda: nvfp4_residual_config(),
    "nvfp4_base": lambda: dataclasses.replace(
        small_config(num_loops=2),
        loops=(LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4), LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4)),
    ),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_matches_reference_every_loop(rng, config_name, group):
    config = CONFIGS[config_name]()
    # Lengths: partial last pages, one shorter than the sink + recent windows,
    # and a page boundary; 3 appends leave unfilled pages in the ring.
    cache, _ = build(rng, config, prompt_lengths=[37, 5, 64], steps=3)
    queries = jnp.asarray(rng.standard_normal((3, config.num_kv_heads * group, HEAD_DIM)) * 2, jnp.float32)
    for loop in range(config.num_loops):
        expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=False)
        actual = run_kernel(queries, cache, 1, loop, num_splits=2)
        errors = relative_errors(actual, expected)
        assert (errors < KERNEL_TOLERANCE).all(), (loop, errors)


@pytest.mark.parametrize("num_splits, num_warps", [(1, 4), (3, 2), (20, 8), (None, 2)])
def test_kernel_split_and_warp_choices(rng, num_splits, num_warps):
    config = small_config()
    cache, _ = build(rng, config, prompt_lengths=[150, 81, 16], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.float32)
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 3, include_pending=False)
    actual = run_kernel(queries, cache, 0, 3, num_splits=num_splits, num_warps=num_warps)
    assert (relative_errors(actual, expected) < KERNEL_TOLERANCE).all()


@pytest.mark.parametrize("config_name", ["int4", "nvfp4_residuals"])
def test_kernel_default_float16_products(rng, config_name):
    config = CONFIGS[config_name]()
    cache, _ = build(rng, config, prompt_lengths=[100, 33, 16], steps=1)
    queries = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.float32)
    for loop in (0, 3):
        expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=False)
        actual = run_kernel(queries, cache, 0, loop, products="float16")
        errors = relative_errors(actual, expected)
        assert (errors < FLOAT16_TOLERANCE).all(), errors
        assert (errors[:2] > 1e-6).all()  # packed pages: the operands really were rounded to float16
    with pytest.raises(ValueError, match="products"):
        KernelConfig(products="fp8")


def _single_loop_config(key_spec, value_spec, **overrides):
    return dataclasses.replace(small_config(num_loops=2, **overrides),
                               loops=(LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec)))


@pytest.mark.parametrize(
    "key_spec, value_spec",
    [
        (jflashloop.CodecSpec("int4", "channel", 8), jflashloop.CodecSpec("int4", "token", 8)),  # 2 K groups per page, 2 V groups per row
        (jflashloop.CodecSpec("int4", "channel", 16), jflashloop.CodecSpec("int4", "channel", 16)),  # V grouped per channel
        (jflashloop.CodecSpec("int4", "channel", 4), jflashloop.NVFP4),
    ],
    ids=["k8-v8", "v-channel", "k4-nvfp4"],
)
def test_kernel_group_layouts(rng, key_spec, value_spec):
    config = _single_loop_config(key_spec, value_spec)
    cache, _ = build(rng, config, prompt_lengths=[45, 16, 70], steps=2)
    queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    for loop in range(2):
        expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=False)
        actual = run_kernel(queries, cache, 0, loop, num_splits=3)
        assert (relative_errors(actual, expected) < KERNEL_TOLERANCE).all()


@pytest.mark.parametrize("head_dim", [64])
def test_kernel_wider_heads(rng, head_dim):
    config = small_config(head_dim=head_dim, num_kv_heads=1, page_size=32)
    cache, _ = build(rng, config, prompt_lengths=[75, 40, 7], steps=1)
    queries = jnp.asarray(rng.standard_normal((3, 2, head_dim)), jnp.float32)
    for loop in (0, 3):
        expected = jflashloop.decode_attention_reference(queries, cache, 1, loop, include_pending=False)
        actual = run_kernel(queries, cache, 1, loop)
        assert (relative_errors(actual, expected) < KERNEL_TOLERANCE).all()


def test_kernel_rejects_layouts_it_cannot_read(rng):
    config = _single_loop_config(jflashloop.CodecSpec("int4", "channel", 16),
                                 jflashloop.CodecSpec("int4", "token", 4))
    cache, _ = build(rng, config, prompt_lengths=[30], steps=0)
    queries = jnp.asarray(rng.standard_normal((3, 2, HEAD_DIM)), jnp.float32)
    with pytest.raises(NotImplementedError, match="token-axis INT4 groups"):
        run_kernel(queries, cache, 0, 0)
    automatic = jflashloop.decode_attention(queries, cache, 0, 0)  # the reference path
    assert_bits_equal(automatic, jflashloop.decode_attention_reference(queries, cache, 0, 0), "fallback")


def test_pair_order_matches_the_unpacking():
    from jflashloop_pallas_kernels import decode_attention as kernel

    order = kernel.pair_order(32)
    assert sorted(order.tolist()) == list(range(32))
    words = jnp.asarray(np.random.default_rng(3).integers(0, 2**32, (4, 4), dtype=np.uint64).astype(np.uint32))
    joined = np.asarray(kernel._codes(words, jnp.float32, use_asm=False))
    codes = (np.asarray(words)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    natural = codes.reshape(4, 32).astype(np.float32)
    np.testing.assert_array_equal(joined, natural[:, order])


def test_kernel_against_float64_oracle_with_pending_token(rng):
    config = small_config(sink_tokens=4, recent_tokens=16)
    cache, history = build(rng, config, prompt_lengths=[47, 64, 20], steps=0)
    step_k = jnp.asarray(rng.standard_normal((2, 4, 3, 2, HEAD_DIM)), jnp.float32)
    for layer in range(2):
        for loop in range(4):
            cache = jflashloop.paged_cache.write_token(cache, layer, loop, step_k[layer, loop], step_k[layer, loop])
    rounded = np.asarray(step_k.astype(jnp.bfloat16).astype(jnp.float32))
    history.append(rounded, rounded, np.ones(3, bool))
    history.lengths -= 1
    queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    for loop in (0, 3):
        actual = np.asarray(run_kernel(queries, cache, 1, loop, include_pending=True))
        for slot in range(3):
            keys, values = oracle_sequence(cache, history.keys, history.values, 1, loop, slot, include_pending=True)
            expected = reference.attention.decode_attention(np.asarray(queries[slot]), keys, values, keys.shape[0])
            error = np.linalg.norm(actual[slot] - expected) / np.linalg.norm(expected)
            assert error < KERNEL_TOLERANCE, (loop, slot, error)


def test_kernel_empty_sequences_give_zeros(rng):
    config = small_config()
    cache, _ = build(rng, config, prompt_lengths=[20], steps=0)  # slots 1 and 2 are empty
    queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    out = np.asarray(run_kernel(queries, cache, 0, 1))
    assert np.isfinite(out).all()
    assert not out[1:].any()


def test_kernel_freed_slot_attends_to_nothing_even_with_a_pending_token(rng):
    config = tiny_config()
    cache, _ = build(rng, config, prompt_lengths=[20, 33], steps=0)
    cache = jflashloop.paged_cache.free(cache, 0)
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    out = np.asarray(run_kernel(queries, cache, 0, 1, include_pending=True))
    assert not out[0].any()
    expected = jflashloop.decode_attention_reference(queries, cache, 0, 1, include_pending=True)
    assert (relative_errors(out[1:], expected[1:]) < KERNEL_TOLERANCE).all()


def test_kernel_never_reads_lost_pages(rng):
    config = lost_page_config()
    seed = int(rng.integers(2**31))
    (cache, _), (other, _) = (lost_page_cache(np.random.default_rng(seed), config, s) for s in (1, 2))
    hole, _ = hole_cache(rng, config)
    queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    for loop in (0, 2):
        mine = np.asarray(run_kernel(queries, cache, 0, loop))
        assert_bits_equal(mine[1], np.asarray(run_kernel(queries, other, 0, loop))[1], "slot 1 attention")
        for state, out in ((cache, mine), (hole, np.asarray(run_kernel(queries, hole, 0, loop)))):
            expected = jflashloop.decode_attention_reference(queries, state, 0, loop, include_pending=False)
            errors = relative_errors(out[1:], expected[1:])  # slot 1 (the hole cache's slot 0 is free)
            assert (errors < KERNEL_TOLERANCE).all(), (loop, errors)


def test_public_dispatch_picks_the_backend(rng):
    config = small_config()
    cache, _ = build(rng, config, prompt_lengths=[20], steps=0)
    queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    auto = jflashloop.decode_attention(queries, cache, 0, 0)
    chosen = "xla"
    if ON_GPU:
        from jflashloop.attention import gluon_is_default

        chosen = "gluon" if gluon_is_default(queries, cache, 0) else "pallas"
    explicit = jflashloop.decode_attention(queries, cache, 0, 0, implementation=chosen)
    assert_bits_equal(auto, explicit, "auto dispatch")
    with pytest.raises(ValueError, match="implementation"):
        jflashloop.decode_attention(queries, cache, 0, 0, implementation="cuda")
    if not ON_GPU:
        with pytest.raises(NotImplementedError, match="CUDA GPUs"):
            jflashloop.decode_attention(queries, cache, 0, 0, implementation="gluon")


def _oracle_tile(tile, spec):
    if spec.format == "int4":
        return reference.encode_int4(tile[:, None, :], spec.axis, spec.group_size)
    return reference.encode_nvfp4(tile[:, None, :])


def _assert_stream_matches_oracle(stream, tiles, spec):
    """``tiles``: float numpy ``[heads, pages, rows, D]`` (already sink-masked)."""
    payload = np.asarray(jflashloop.paged_stream.bytes_from_words(stream.payload))
    heads, pages = tiles.shape[:2]
    for head in range(heads):
        for page in range(pages):
            expected = _oracle_tile(tiles[head, page], spec)
            assert_bits_equal(payload[head, page], expected["payload"][:, 0], "payload")
            assert_bits_equal(np.asarray(stream.scale[head, page]), expected["scale"][:, 0], "scale")
            if spec.format == "int4":
                assert_bits_equal(np.asarray(stream.minimum[head, page]), expected["minimum"][:, 0], "minimum")
            else:
                assert_bits_equal(
                    np.asarray(stream.global_scale[head, page]), np.float32(expected["global_scale"]), "global"
                )


TILE_SPECS = [
    (jflashloop.CodecSpec("int4", "channel", 16), 16),
    (jflashloop.CodecSpec("int4", "channel", 8), 16),
    (jflashloop.INT4_VALUES, 16),
    (jflashloop.INT4_VALUES, 7),
    (jflashloop.CodecSpec("int4", "token", 16), 4),
    (jflashloop.NVFP4, 16),
    (jflashloop.NVFP4, 5),
]


@pytest.mark.parametrize("spec, rows", TILE_SPECS, ids=lambda v: str(v) if isinstance(v, int) else f"{v.format}-{v.axis}{v.group_size}")
@pytest.mark.parametrize("case", ["random", "int4_division_ties", "nvfp4_division_ties", "zero_span", "negative_zero",
                                  "huge", "tiny", "nonfinite", "subnormal"])
def test_quantize_kernel_is_bit_exact_with_oracle(rng, spec, rows, case):
    x = CASES[case](rng, (2 * rows, 2, 32)).reshape(2, rows, 2, 32)
    tiles = encode_tiles(jnp.asarray(x), spec, "pallas")
    _assert_stream_matches_oracle(tiles, x.transpose(2, 0, 1, 3), spec)


def test_quantize_kernel_direct_call(rng):
    x = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32)
    out = quantize.encode_tiles(x, quantize.TileFormat("int4", "channel", 64), interpret=not ON_GPU)
    assert out["payload"].shape == (3, 64, 16) and out["payload"].dtype == jnp.uint32
    assert out["scale"].shape == (3, 1, 128) and out["minimum"].dtype == jnp.float16


PAIR_SPECS = {
    "int4_int4": (jflashloop.CodecSpec("int4", "channel", 16), jflashloop.INT4_VALUES),
    "int4_nvfp4": (jflashloop.CodecSpec("int4", "channel", 8), jflashloop.NVFP4),
    "nvfp4_nvfp4": (jflashloop.NVFP4, jflashloop.NVFP4),
}


@pytest.mark.parametrize("pair", list(PAIR_SPECS))
@pytest.mark.parametrize("sink_tokens", [0, 3])
@pytest.mark.parametrize("case", ["random", "int4_division_ties", "nonfinite"])
def test_page_pair_kernel_is_bit_exact_with_oracle(rng, pair, sink_tokens, case):
    """The one-kernel K+V page encoder (read in place, sink rows masked inside)."""
    key_spec, value_spec = PAIR_SPECS[pair]
    rows, heads, head_dim = 16, 2, 32
    page_numbers = np.array([0, 5, 0], np.int32)  # two sequences' first pages and a later page
    keys = CASES[case](rng, (3 * rows, heads, head_dim)).reshape(3, rows, heads, head_dim)
    values = CASES["random"](rng, (3 * rows, heads, head_dim)).reshape(3, rows, heads, head_dim)
    key_stream, value_stream = jflashloop.paged_stream.encode_page_pairs(
        jnp.asarray(keys), jnp.asarray(values), jnp.asarray(page_numbers), key_spec, value_spec, sink_tokens
    )

    def masked(x):
        x = np.array(x, np.float32)
        for page, number in enumerate(page_numbers):
            if number == 0 and sink_tokens:
                x[page, :sink_tokens] = x[page, sink_tokens]
        return x.transpose(2, 0, 1, 3)  # [heads, pages, rows, D]

    _assert_stream_matches_oracle(key_stream, masked(keys), key_spec)
    _assert_stream_matches_oracle(value_stream, masked(values), value_spec)


def test_page_pair_kernel_rejects_bad_arguments():
    fmt = quantize.TileFormat("int4", "channel", 16)
    x = jnp.zeros((1, 16, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="sink_tokens"):
        quantize.encode_page_pairs(x, x, jnp.zeros(1, jnp.int32), fmt, fmt, sink_tokens=16, interpret=True)
    with pytest.raises(ValueError, match="values must have the shape"):
        quantize.encode_page_pairs(x, x[:, :8], jnp.zeros(1, jnp.int32), fmt, fmt, interpret=True)


def test_pack_pages_kernel_path_equals_jax_path(rng):
    """A chain with sinks: the fused loop-1 path (and the loop after it) gives the JAX codec's bits."""
    from jflashloop.page_chain import pack_pages

    config = small_config(num_loops=2)
    shape = (config.num_loops, 3, config.page_size, config.num_kv_heads, HEAD_DIM)
    keys = jnp.asarray(rng.standard_normal(shape) * 3 + 1, jnp.float32)
    values = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    pages = jnp.array([0, 1, 0], jnp.int32)
    fused = pack_pages(keys, values, pages, config, "pallas")
    plain = pack_pages(keys, values, pages, config, "xla")
    for loop, (a, b) in enumerate(zip(fused, plain, strict=True)):
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert_bits_equal(np.asarray(leaf_a), np.asarray(leaf_b), f"loop {loop + 1}")
