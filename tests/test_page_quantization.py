"""Page quantization (quantize on write): the Pallas kernels against the oracle, and both paths alike.

On CPU the kernels run in interpret mode (the kernel logic); on a GPU the
same tests run compiled. Decode attention's kernels: ``test_decode_attention.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
import jflashloop_reference as reference
from jflashloop.cache._layout import bytes_from_words
from jflashloop.ops._page_quantization import encode_pages, encode_tiles
from jflashloop_pallas_kernels import quantize
from tests.bits import assert_bits_equal
from tests.builders import (
    HEAD_DIM,
    small_config,
)
from tests.cases import CASES

ON_GPU = jax.default_backend() == "gpu"


def _oracle_tile(tile, spec):
    if spec.format == "int4":
        return reference.encode_int4(tile[:, None, :], spec.axis, spec.group_size)
    if spec.format in ("int3", "int2"):
        encode = reference.encode_int3 if spec.format == "int3" else reference.encode_int2
        return encode(tile[:, None, :], spec.axis, spec.group_size)
    return reference.encode_nvfp4(tile[:, None, :])


def _assert_stream_matches_oracle(stream, tiles, spec):
    """``tiles``: float numpy ``[heads, pages, rows, D]`` (already sink-masked); NVFP4 bytes in page order."""
    payload = np.asarray(bytes_from_words(stream.payload))
    heads, pages = tiles.shape[:2]
    for head in range(heads):
        for page in range(pages):
            expected = _oracle_tile(tiles[head, page], spec)
            expected_payload = expected["payload"][:, 0]
            if spec.format == "nvfp4":
                expected_payload = reference.paged_cache.nvfp4_page_bytes(expected_payload)
            assert_bits_equal(payload[head, page], expected_payload, "payload")
            assert_bits_equal(np.asarray(stream.scale[head, page]), expected["scale"][:, 0], "scale")
            if spec.format in ("int4", "int3", "int2"):
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
    key_stream, value_stream = encode_pages(
        jnp.asarray(keys), jnp.asarray(values), jnp.asarray(page_numbers), key_spec, value_spec, sink_tokens,
        implementation="pallas",
    )

    def masked(x):
        x = np.array(x, np.float32)
        for page, number in enumerate(page_numbers):
            if number == 0 and sink_tokens:
                x[page, :sink_tokens] = x[page, sink_tokens]
        return x.transpose(2, 0, 1, 3)  # [heads, pages, rows, D]

    _assert_stream_matches_oracle(key_stream, masked(keys), key_spec)
    _assert_stream_matches_oracle(value_stream, masked(values), value_spec)


@pytest.mark.parametrize("fmt", ["int3", "int2"])
def test_small_affine_tiles_take_the_codec_path_on_every_implementation(rng, fmt):
    """No quantize kernel reads INT3 or INT2: "pallas" falls back to the codec, whose bits match the oracle."""
    key_spec, value_spec = jflashloop.CodecSpec(fmt, "channel", 16), jflashloop.CodecSpec(fmt, "token", 32)
    keys = rng.standard_normal((2, 16, 2, 32)).astype(np.float32) * 3 + 1  # [pages, rows, heads, D]
    values = rng.standard_normal((2, 16, 2, 32)).astype(np.float32)
    pages = jnp.array([0, 1], jnp.int32)
    streams = {implementation: encode_pages(jnp.asarray(keys), jnp.asarray(values), pages, key_spec, value_spec, 0,
                                            implementation) for implementation in ("pallas", "xla")}
    for stream, x, spec in zip(streams["pallas"], (keys, values), (key_spec, value_spec), strict=True):
        _assert_stream_matches_oracle(stream, x.transpose(2, 0, 1, 3), spec)
    for a, b in zip(jax.tree.leaves(streams["pallas"]), jax.tree.leaves(streams["xla"]), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "pallas request against xla")


def test_page_pair_kernel_rejects_bad_arguments():
    fmt = quantize.TileFormat("int4", "channel", 16)
    x = jnp.zeros((1, 16, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="sink_tokens"):
        quantize.encode_page_pairs(x, x, jnp.zeros(1, jnp.int32), fmt, fmt, sink_tokens=16, interpret=True)
    with pytest.raises(ValueError, match="values must have the shape"):
        quantize.encode_page_pairs(x, x[:, :8], jnp.zeros(1, jnp.int32), fmt, fmt, interpret=True)


def test_pack_pages_kernel_path_equals_jax_path(rng):
    """A chain with sinks: the fused loop-1 path (and the loop after it) gives the JAX codec's bits."""
    from jflashloop.cache._pages import pack_pages

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


def test_nvfp4_page_order_is_the_oracles_and_inverts(rng):
    """``nvfp4_pages`` (numpy and jax) against the oracle's bit map, on every byte in every position."""
    from jflashloop_pallas_kernels import nvfp4_pages

    every_byte = np.arange(256, dtype=np.uint32)
    words = np.concatenate([every_byte << np.uint32(8 * k) for k in range(4)]
                           + [rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    expected = reference.paged_cache.nvfp4_page_bytes(words.view(np.uint8)).view(np.uint32)
    for module in (np, jnp):
        page = nvfp4_pages.to_page_order(module.asarray(words))
        assert page.dtype == np.uint32
        assert_bits_equal(np.asarray(page), expected, f"{module.__name__} page order")
        assert_bits_equal(np.asarray(nvfp4_pages.from_page_order(page)), words, f"{module.__name__} inverse")
    for bad in (words.astype(np.int32), jnp.asarray(words.astype(np.int32)), words.astype(np.uint64)):
        with pytest.raises(TypeError, match="uint32"):
            nvfp4_pages.to_page_order(bad)
        with pytest.raises(TypeError, match="uint32"):
            nvfp4_pages.from_page_order(bad)
    # The kernels' reading of page order: the even channel's float16 high byte is one mask.
    codes = words.view(np.uint8)
    assert_bits_equal((expected.view(np.uint8) & 0x8E), ((codes & 8) << 4) | ((codes & 7) << 1), "even channels")
