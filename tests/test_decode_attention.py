"""Decode attention, one backend-agnostic test class run on every backend.

:class:`DecodeAttentionTest` holds the tests; each subclass names a backend:

* :class:`TestReference`: the reference path (``implementation="xla"``);
* :class:`TestPallasKernel`: the Pallas kernel compiled (GPU only), with its
  default float16 products at the documented 2e-3;
* :class:`TestPallasKernelInterpret`: the same kernel in interpret mode (on
  every host, a GPU host too), with float32 products, which are exact there:
  an indexing or algebra mistake shows far above rounding.

Each test compares the backend with the reference path on the same cache
(the kernel's error alone), or with the float64 oracle over the oracle's
reconstruction. The Gluon kernel has its own tests (``test_gluon_decode.py``:
compiled on a GPU, its numpy emulation elsewhere).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from jflashloop import LoopStorage
from jflashloop.ops import arg_specs
from jflashloop.ops._decode_attention import (
    float16_windows,
    gluon_is_default,
    gluon_unsupported_reason,
)
from jflashloop_pallas_kernels.decode_attention import KernelConfig
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    HEADS,
    build,
    hole_cache,
    lost_page_cache,
    lost_page_config,
    nvfp4_residual_config,
    oracle_sequence,
    small_config,
    tiny_config,
)

ON_GPU = jax.default_backend() == "gpu"
FLOAT16_TOLERANCE = 2e-3


def relative_errors(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected, axis=(-2, -1)) / np.linalg.norm(expected, axis=(-2, -1))


def _single_loop_config(key_spec, value_spec, **overrides):
    return dataclasses.replace(small_config(num_loops=2, **overrides),
                               loops=(LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec)))


def _rotated_config(key_spec, value_spec):
    base = small_config(head_dim=64, num_loops=3)
    loops = (LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec), LoopStorage(key_spec, value_spec, 4))
    return dataclasses.replace(base, loops=loops)


CONFIGS = {
    "int4": lambda: small_config(),
    "nvfp4_residuals": lambda: nvfp4_residual_config(),
    "nvfp4_base": lambda: dataclasses.replace(
        small_config(num_loops=2),
        loops=(LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4), LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4)),
    ),
}
GROUP_LAYOUTS = {
    "k8-v8": (jflashloop.CodecSpec("int4", "channel", 8), jflashloop.CodecSpec("int4", "token", 8)),  # 2 K groups per page, 2 V groups per row
    "v-channel": (jflashloop.CodecSpec("int4", "channel", 16), jflashloop.CodecSpec("int4", "channel", 16)),  # V grouped per channel
    "k4-nvfp4": (jflashloop.CodecSpec("int4", "channel", 4), jflashloop.NVFP4),
}


class DecodeAttentionTest:
    """The tests, for the backend the subclass names (not collected itself)."""

    IMPLEMENTATION = "xla"
    INTERPRET: bool | None = None
    PRODUCTS = "float32"  # the Pallas kernel's matrix-product operands
    TOLERANCE = 1e-5  # relative error per sequence, against the reference path or the float64 oracle

    @pytest.fixture(autouse=True)
    def _needs_a_gpu_when_compiled(self):
        if self.IMPLEMENTATION != "xla" and self.INTERPRET is False and not ON_GPU:
            pytest.skip("the compiled kernel runs on a GPU")

    def attend(self, queries, cache, layer, loop, *, include_pending=False, **config):
        """This backend's ``decode_attention`` (the kernel with few programs: interpret mode runs them one by one)."""
        kernel_config = None
        if self.IMPLEMENTATION == "pallas":
            config.setdefault("products", self.PRODUCTS)
            config.setdefault("num_splits", 2)
            kernel_config = KernelConfig(**config)
        return jflashloop.decode_attention(
            queries, cache, layer, loop, include_pending=include_pending, implementation=self.IMPLEMENTATION,
            interpret=self.INTERPRET, kernel_config=kernel_config, poison_for_tests=self.IMPLEMENTATION == "pallas",
        )

    def assert_matches_reference(self, queries, cache, layer, loop, *, include_pending=False, where=None, **config):
        expected = jflashloop.decode_attention_reference(queries, cache, layer, loop, include_pending=include_pending)
        actual = self.attend(queries, cache, layer, loop, include_pending=include_pending, **config)
        errors = relative_errors(actual, expected)
        assert (errors < self.TOLERANCE).all(), (where, loop, errors)

    @pytest.mark.parametrize("config_name", list(CONFIGS))
    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_matches_reference_every_loop(self, rng, config_name, group):
        config = CONFIGS[config_name]()
        # Lengths: partial last pages, one shorter than the sink + recent windows,
        # and a page boundary; 3 appends leave unfilled pages in the ring.
        cache, _ = build(rng, config, prompt_lengths=[37, 5, 64], steps=3)
        queries = jnp.asarray(rng.standard_normal((3, config.num_kv_heads * group, HEAD_DIM)) * 2, jnp.float32)
        for loop in range(config.num_loops):
            self.assert_matches_reference(queries, cache, 1, loop, num_splits=2)

    @pytest.mark.parametrize("layout", list(GROUP_LAYOUTS))
    def test_group_layouts(self, rng, layout):
        config = _single_loop_config(*GROUP_LAYOUTS[layout])
        cache, _ = build(rng, config, prompt_lengths=[45, 16, 70], steps=2)
        queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
        for loop in range(2):
            self.assert_matches_reference(queries, cache, 0, loop, num_splits=3)

    @pytest.mark.parametrize("head_dim", [64])
    def test_wider_heads(self, rng, head_dim):
        config = small_config(head_dim=head_dim, num_kv_heads=1, page_size=32)
        cache, _ = build(rng, config, prompt_lengths=[75, 40, 7], steps=1)
        queries = jnp.asarray(rng.standard_normal((3, 2, head_dim)), jnp.float32)
        for loop in (0, 3):
            self.assert_matches_reference(queries, cache, 1, loop)

    @pytest.mark.parametrize("shape", arg_specs.distinct_layouts(), ids=lambda shape: shape.name)
    def test_benchmark_layouts(self, rng, shape):
        """Each (GQA group, head_dim) that ``bench/decode.py`` times, on one KV head and 2 sequences."""
        small = shape.scaled(sequences=2, kv_heads=1, tokens=70)
        config = small_config(num_loops=2, head_dim=small.head_dim, num_kv_heads=small.kv_heads,
                              max_sequences=small.sequences)
        cache, _ = build(rng, config, prompt_lengths=[small.tokens, 37], steps=1)
        queries = jnp.asarray(rng.standard_normal((small.sequences, small.q_heads, small.head_dim)), jnp.float32)
        for loop in range(2):
            self.assert_matches_reference(queries, cache, 0, loop, include_pending=True, where=small.name)

    def test_int4_rotated_chain(self, rng):
        """vLLM-style rotated INT4 (queries and windows rotated, the output unrotated), 3 loops."""
        config = _rotated_config(jflashloop.int4_rotated(64, 1), jflashloop.int4_rotated(64, 2))
        cache, _ = build(rng, config, prompt_lengths=[70, 23, 64], steps=2)
        queries = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
        for loop in range(3):
            self.assert_matches_reference(queries, cache, 0, loop, include_pending=True)

    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_gqa_matches_float64_oracle(self, rng, group):
        config = small_config()  # slot 2 stays empty; prompts padded to 64 like the other small_config builds
        cache, history = build(rng, config, prompt_lengths=[45, 23], steps=3, padded_tokens=64)
        queries = jnp.asarray(rng.standard_normal((3, HEADS * group, HEAD_DIM)) * 2, jnp.float32)
        out = np.asarray(self.attend(queries, cache, 0, 3))
        for slot in range(2):
            keys, values = oracle_sequence(cache, history.keys, history.values, 0, 3, slot)
            expected = reference.attention.decode_attention(np.asarray(queries[slot]), keys, values, keys.shape[0])
            error = np.linalg.norm(out[slot] - expected) / np.linalg.norm(expected)
            assert error < self.TOLERANCE, (slot, error)

    def test_float64_oracle_with_pending_token(self, rng):
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
            actual = np.asarray(self.attend(queries, cache, 1, loop, include_pending=True))
            for slot in range(3):
                keys, values = oracle_sequence(cache, history.keys, history.values, 1, loop, slot, include_pending=True)
                expected = reference.attention.decode_attention(np.asarray(queries[slot]), keys, values, keys.shape[0])
                error = np.linalg.norm(actual[slot] - expected) / np.linalg.norm(expected)
                assert error < self.TOLERANCE, (loop, slot, error)

    def test_empty_sequences_give_zeros(self, rng):
        config = small_config()
        cache, _ = build(rng, config, prompt_lengths=[20], steps=0, padded_tokens=64)  # slots 1 and 2 are empty
        queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
        out = np.asarray(self.attend(queries, cache, 0, 1))
        assert np.isfinite(out).all()
        assert not out[1:].any()

    def test_freed_slot_attends_to_nothing_even_with_a_pending_token(self, rng):
        config = tiny_config()
        cache, _ = build(rng, config, prompt_lengths=[20, 33], steps=0)
        cache = jflashloop.paged_cache.free(cache, 0)
        queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
        out = np.asarray(self.attend(queries, cache, 0, 1, include_pending=True))
        assert not out[0].any()
        expected = jflashloop.decode_attention_reference(queries, cache, 0, 1, include_pending=True)
        assert (relative_errors(out[1:], expected[1:]) < self.TOLERANCE).all()

    def test_never_reads_lost_pages(self, rng):
        config = lost_page_config()
        seed = int(rng.integers(2**31))
        (cache, _), (other, _) = (lost_page_cache(np.random.default_rng(seed), config, s) for s in (1, 2))
        hole, _ = hole_cache(rng, config)
        queries = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
        for loop in (0, 2):
            mine = np.asarray(self.attend(queries, cache, 0, loop))
            assert_bits_equal(mine[1], np.asarray(self.attend(queries, other, 0, loop))[1], "slot 1 attention")
            for state, out in ((cache, mine), (hole, np.asarray(self.attend(queries, hole, 0, loop)))):
                expected = jflashloop.decode_attention_reference(queries, state, 0, loop, include_pending=False)
                errors = relative_errors(out[1:], expected[1:])  # slot 1 (the hole cache's slot 0 is free)
                assert (errors < self.TOLERANCE).all(), (loop, errors)


class TestReference(DecodeAttentionTest):
    IMPLEMENTATION = "xla"


class TestPallasKernel(DecodeAttentionTest):
    """The Pallas kernel compiled (GPU), and the kernel-only checks."""

    IMPLEMENTATION = "pallas"
    INTERPRET = False
    PRODUCTS = "float16"
    TOLERANCE = FLOAT16_TOLERANCE

    @pytest.mark.parametrize("num_splits, num_warps", [(1, 4), (3, 2), (20, 8), (None, 2)])
    def test_split_and_warp_choices(self, rng, num_splits, num_warps):
        config = small_config()
        cache, _ = build(rng, config, prompt_lengths=[150, 81, 16], steps=2)
        queries = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.float32)
        self.assert_matches_reference(queries, cache, 0, 3, num_splits=num_splits, num_warps=num_warps)

    @pytest.mark.parametrize("config_name", ["int4", "nvfp4_residuals"])
    def test_default_float16_products(self, rng, config_name):
        config = CONFIGS[config_name]()
        cache, _ = build(rng, config, prompt_lengths=[100, 33, 16], steps=1)
        queries = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.float32)
        for loop in (0, 3):
            expected = jflashloop.decode_attention_reference(queries, cache, 0, loop, include_pending=False)
            actual = self.attend(queries, cache, 0, loop, products="float16")
            errors = relative_errors(actual, expected)
            assert (errors < FLOAT16_TOLERANCE).all(), errors
            assert (errors[:2] > 1e-6).all()  # packed pages: the operands really were rounded to float16
        with pytest.raises(ValueError, match="products"):
            KernelConfig(products="fp8")

    @pytest.mark.parametrize(
        "key_spec, value_spec, message",
        [
            (jflashloop.CodecSpec("int4", "channel", 16), jflashloop.CodecSpec("int4", "token", 4), "token-axis INT4 groups"),
            (jflashloop.E8_KEYS, jflashloop.INT4_GROUP_ROTATED_VALUES, "e8"),
            (jflashloop.CodecSpec("int3", "channel", 16), jflashloop.CodecSpec("int3", "token", 32), "'int3'"),
            (jflashloop.CodecSpec("int2", "channel", 16), jflashloop.CodecSpec("int2", "token", 32), "'int2'"),
        ],
        ids=["token-groups-of-4", "rk2v4-e8", "int3", "int2"],
    )
    def test_rejects_layouts_it_cannot_read(self, rng, key_spec, value_spec, message):
        config = (_rotated_config(key_spec, value_spec) if key_spec.format == "e8"
                  else _single_loop_config(key_spec, value_spec, head_dim=32 if key_spec.format in ("int3", "int2") else HEAD_DIM))
        cache, _ = build(rng, config, prompt_lengths=[30], steps=0)
        queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
        with pytest.raises(NotImplementedError, match=message):
            self.attend(queries, cache, 0, 0)
        automatic = jflashloop.decode_attention(queries, cache, 0, 0, interpret=self.INTERPRET)  # the reference path
        assert_bits_equal(automatic, jflashloop.decode_attention_reference(queries, cache, 0, 0), "fallback")


    def test_rejects_affine_int2_rows(self, rng):
        """Affine INT2 sparse rows: the Gluon kernel's row path reads them, the Pallas kernel does not (it says
        so, and the automatic choice falls back)."""
        base = small_config(num_loops=4, head_dim=32, page_size=16)
        rows = jflashloop.CodecSpec("int2", "token", 32)
        config = dataclasses.replace(base, loops=tuple(
            dataclasses.replace(loop, key_spec=rows, value_spec=rows) if loop.is_sparse else loop
            for loop in base.loops))
        assert jflashloop.ops._decode_attention.kernel_plan(config, 3).loops[2].keys.format == "int2"
        cache, _ = build(rng, config, prompt_lengths=[40], steps=0)
        queries = jnp.asarray(rng.standard_normal((3, 8, config.head_dim)), jnp.float32)
        with pytest.raises(NotImplementedError, match="'int2'"):
            self.attend(queries, cache, 0, 3)
        automatic = jflashloop.decode_attention(queries, cache, 0, 3, interpret=self.INTERPRET)
        # the reference path (the Gluon kernel reads head_dim 64, 128 and 256 only)
        assert_bits_equal(automatic, jflashloop.decode_attention_reference(queries, cache, 0, 3), "fallback")


class TestPallasKernelInterpret(TestPallasKernel):
    INTERPRET = True
    PRODUCTS = "float32"
    TOLERANCE = 1e-5


def test_pair_order_matches_the_unpacking():
    from jflashloop_pallas_kernels import decode_attention as kernel

    order = kernel.pair_order(32)
    assert sorted(order.tolist()) == list(range(32))
    words = jnp.asarray(np.random.default_rng(3).integers(0, 2**32, (4, 4), dtype=np.uint64).astype(np.uint32))
    joined = np.asarray(kernel._codes(words, jnp.float32, use_asm=False))
    codes = (np.asarray(words)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    natural = codes.reshape(4, 32).astype(np.float32)
    np.testing.assert_array_equal(joined, natural[:, order])


def test_public_dispatch_picks_the_backend(rng):
    config = small_config()
    cache, _ = build(rng, config, prompt_lengths=[20], steps=0, padded_tokens=64)
    queries = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    auto = jflashloop.decode_attention(queries, cache, 0, 0)
    chosen = "xla"
    if ON_GPU:
        gluon = gluon_is_default(cache.config, 0) and gluon_unsupported_reason(queries, cache, 0) is None
        chosen = "gluon" if gluon else "pallas"
    explicit = jflashloop.decode_attention(queries, cache, 0, 0, implementation=chosen)
    assert_bits_equal(auto, explicit, "auto dispatch")
    with pytest.raises(ValueError, match="implementation"):
        jflashloop.decode_attention(queries, cache, 0, 0, implementation="cuda")
    if not ON_GPU:
        with pytest.raises(NotImplementedError, match="CUDA GPUs"):
            jflashloop.decode_attention(queries, cache, 0, 0, implementation="gluon")


def test_float32_windows_reach_the_gluon_kernel_as_its_loads_round_them():
    """Moved (float32) windows become float16 as the Gluon kernel's window loads make them (clamped to +-65504,
    rounded to nearest even), so the kernel computes the same bits from half the bytes; other dtypes and absent
    windows pass unchanged."""
    rng = np.random.default_rng(7)
    moved = rng.standard_normal((1, 2, 2, 16, 64)).astype(np.float32) * np.float32(3e4)
    moved[0, 0, 0, :4, 0] = [1e6, -1e6, 65519.0, 1.0 + 2.0 ** -11]  # clamped, clamped, rounds down to 65504, tie
    bf16 = jnp.asarray(moved[..., :4, :], jnp.bfloat16)
    out = float16_windows({"sink_keys": None, "ring_keys": jnp.asarray(moved), "sink_values": bf16})
    want = np.clip(moved, -65504.0, 65504.0).astype(np.float16)
    assert out["ring_keys"].dtype == jnp.float16
    assert_bits_equal(out["ring_keys"], want, "float16 windows")
    assert out["sink_keys"] is None and out["sink_values"] is bf16
    assert np.asarray(out["ring_keys"])[0, 0, 0, 3, 0] == np.float16(1.0)  # the tie goes to the even neighbour


@pytest.mark.parametrize("window_dtype, rotated, head_dim", [("bfloat16", "both", 128), ("float32", "both", 64),
                                                             ("bfloat16", "keys", 64), ("float32", "values", 128)])
def test_rotated_windows_in_one_product_match_float64(rng, window_dtype, rotated, head_dim):
    """int4_rotated streams read this loop's four windows rotated into their basis by one product
    (``rotated_inputs``; the unrotated kind by the identity): each window within 2e-6 of its float64 rotation
    (bfloat16 windows against the matrix split in two bfloat16 halves, which at head_dim 128 both count; float32
    at full precision), the other
    loops' windows not passed, the query rotated only with rotated keys."""
    from jflashloop.codecs import rotation_matrix
    from jflashloop.ops._decode_attention import kernel_inputs, kernel_plan, rotated_inputs

    plain = jflashloop.CodecSpec("int4", "token", 64)
    keys = jflashloop.int4_rotated(head_dim, 5) if rotated in ("both", "keys") else plain
    values = jflashloop.int4_rotated(head_dim, 6) if rotated in ("both", "values") else plain
    config = dataclasses.replace(_single_loop_config(keys, values, head_dim=head_dim), window_dtype=window_dtype)
    cache, _ = build(rng, config, prompt_lengths=[70, 23, 64], steps=2)
    inputs = kernel_inputs(cache, 0, 1, True)
    plan = kernel_plan(config.layer(0), 1)
    queries = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.float32)
    rotated_queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, 1, inputs, plan)
    assert window_loop == 0 and value_seed == plan.value_seed
    for name, seed in (("sink_keys", plan.key_seed), ("ring_keys", plan.key_seed), ("sink_values", plan.value_seed),
                       ("ring_values", plan.value_seed)):
        source = np.asarray(inputs[name][1:2].astype(jnp.float32), np.float64)
        matrix = np.eye(head_dim) if seed is None else rotation_matrix(seed, head_dim).astype(np.float64)
        want = source @ matrix
        assert windows[name].dtype == jnp.float32 and windows[name].shape == want.shape, name
        error = np.max(np.abs(np.asarray(windows[name], np.float64) - want)) / np.max(np.abs(want))
        assert error < 2e-6, (name, error)
    want_queries = (np.asarray(queries, np.float64) @ rotation_matrix(plan.key_seed, head_dim).astype(np.float64)
                    if plan.key_seed is not None else np.asarray(queries))
    np.testing.assert_allclose(np.asarray(rotated_queries, np.float64), want_queries, rtol=0, atol=2e-5)
