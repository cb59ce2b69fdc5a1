"""The kernels' inline PTX, executed (tests/ptx.py) against the arithmetic the CPU tests use instead.

The emulated Gluon kernel tests (tests/test_gluon_decode.py) substitute a
numpy function for each inline PTX block, and the Pallas kernel in interpret
mode decodes with jax.numpy where compiled it runs PTX; these tests run each
block's PTX text on fresh random inputs and the hard cases, and require the
same bits, so that the CPU tests speak for the compiled kernels' decode too.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests import ptx

pytest.importorskip("triton.experimental.gluon")

from jflashloop_triton_kernels import emulate, gluon_decode

N = 4096


def _words(rng, n=N):
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    words[:22] = [0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x11111111, 0x99999999, 0x0F0F0F0F, 0xF0F0F0F0,
                  0x01234567, 0x89ABCDEF, 0xFEDCBA98, 0x76543210, 0x80000000, 0x00000008, 0x80808080, 0x08080808,
                  0x01010101, 0x8E8E8E8E, 0x71717171, 0x00000001, 0x01000000, 0xFEFEFEFE]
    return words


def _halfwords(rng, n=N):
    """Random uint16 halfwords after the hard cases (all codes 0 or 3, alternating, single codes), as the
    float16 an ``h`` input takes: their bits, not their values."""
    bits = rng.integers(0, 1 << 16, n).astype(np.uint16)
    bits[:22] = [0, 0xFFFF, 0x5555, 0xAAAA, 0x00FF, 0xFF00, 0x0F0F, 0xF0F0, 0x3333, 0xCCCC, 0x0001, 0x8000,
                 0x0003, 0xC000, 0x1B1B, 0xE4E4, 0x0102, 0x4080, 0x7FFF, 0xFFFE, 0x00C0, 0x0300]
    return bits.view(np.float16)


def _half(rng, low, high, n=N):
    return rng.uniform(low, high, n).astype(np.float16)


def _e4m3_scales(rng, n=N):
    """Float16 values of E4M3 scales (all 127 non-negative finite codes, subnormals included)."""
    bits = rng.integers(0, 127, n).astype(np.uint16)
    bits[:127] = np.arange(127)
    return ((bits << 7).view(np.float16).astype(np.float64) * 256).astype(np.float16)


def _ratio_scales(rng, n=N):
    """E4M3 scales times a ratio of two tile scales in [2**-10, 1] (float16, rounded): the smaller stream's scales
    where two NVFP4 value streams add into one tile (gluon_decode._nvfp4_pair_terms)."""
    ratios = 2.0 ** rng.uniform(-10, 0, n)
    return (_e4m3_scales(rng, n).astype(np.float64) * ratios).astype(np.float16)


def _zero_points(rng, n=N):
    zp = rng.integers(0, 16, n)
    return (1024 + zp).astype(np.float16), (-64 - zp).astype(np.float16)


def _one_hot_inputs(rng):
    positions = rng.integers(0, 1024, (2, N)).astype(np.uint32)  # float16 subnormals' bits
    positions[0, :64] = 0xFFFF  # a padding row's -1
    a = positions[0] | (positions[1] << 16)
    b = np.where(rng.random(N) < 0.5, a, _words(rng))
    return [a, b]


def _cases(rng):
    scale, minimum = _half(rng, -2, 2), _half(rng, -8, 8)
    scales = [_half(rng, 1e-3, 3) for _ in range(2)]
    mins = [_half(rng, -4, 4) for _ in range(2)]
    low, high = _zero_points(rng)
    low_odd, high_odd = _zero_points(rng)
    pair = "=h," * 16 + "r,r"
    keys = "=h," * 8 + "r"
    return {
        "_KEY_CODES_ASM": (keys, [_words(rng)]),
        "_HALVES_ASM": ("=h,=h,r", [_words(rng)]),
        "_VALUE_PAIR_ASM": (pair + ",h,h,h,h", [_words(rng), _words(rng), *scales, *mins]),
        "_VALUE_PAIR_ASM_V2": (pair + ",h,h,h,h", [_words(rng), _words(rng), *scales, *mins]),
        "_VALUE_CODES_ASM": (pair, [_words(rng), _words(rng)]),
        "_E2M1_KEY_ASM": (keys + ",h", [_words(rng), _e4m3_scales(rng)]),
        "_E2M1_VALUE_PAIR_ASM": (pair + ",h,h", [_words(rng), _words(rng), _e4m3_scales(rng), _e4m3_scales(rng)]),
        "_E2M1_VALUE_CODES_ASM": (pair, [_words(rng), _words(rng)]),
        "_E2M1_VALUE_PAIR_SUM_ASM": (pair + ",r,r,h,h,h,h", [_words(rng), _words(rng), _words(rng), _words(rng),
                                                            _e4m3_scales(rng), _e4m3_scales(rng), _ratio_scales(rng),
                                                            _ratio_scales(rng)]),
        "_ROTATED_KEY_ASM": (keys + ",h,h", [_words(rng), low, high]),
        "_ROTATED_VALUE_PAIR_ASM": (pair + ",h,h,h,h", [_words(rng), _words(rng), low, low_odd, high, high_odd]),
        "_ROW_KEY_ASM": (keys + ",h,h", [_words(rng), scale, minimum]),
        "_ROW_KEY_INT2_ASM": ("=h," * 8 + "h,h,h", [_halfwords(rng), scale, minimum]),
        "_INT2_VALUE_CODES_ASM": ("=h," * 16 + "h,h", [_halfwords(rng), _halfwords(rng)]),
        "_SCATTER_ONE_HOT_ASM": ("=h,=h,r,r", _one_hot_inputs(rng)),
        "_GATHER_ONE_HOT_ASM": ("=h,=h,r,r", _one_hot_inputs(rng)),
    }


NAMES = sorted(_cases(np.random.default_rng(0)))


PACKED = ["_E4M3_PAIR_ASM"]  # blocks that take two elements at once (pack=2): tested on their own below
WORDS = ["_INT2_ROW_WORD_ASM"]  # blocks with a uint32 output: tested on their own below


def test_every_emulated_block_is_executed_here():
    emulated = set(emulate._asm_table())
    covered = {getattr(gluon_decode, name).value for name in [*NAMES, *PACKED, *WORDS]}
    assert emulated == covered


def test_int2_row_word_block_matches_its_emulation_and_the_packers():
    """Every uint16 halfword of affine INT2 codes (channel i at bits 2i) -> the INT4 word of the same codes
    (channel i at bits 4i), as the library's own packers lay both out."""
    import jax.numpy as jnp

    from jflashloop.codecs import pack_nibbles, unpack_crumbs

    halfwords = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    (actual,) = ptx.run(gluon_decode._INT2_ROW_WORD_ASM.value, "=r,h", [halfwords.view(np.float16)])
    emulated = emulate._asm_table()[gluon_decode._INT2_ROW_WORD_ASM.value](halfwords)
    np.testing.assert_array_equal(actual, np.asarray(emulated))
    # the library's byte layouts (little-endian words): a halfword's 2 bytes of crumbs, a word's 4 of nibbles
    codes = unpack_crumbs(jnp.asarray(halfwords.view(np.uint8).reshape(-1, 2)), 8)
    int4_words = np.asarray(pack_nibbles(codes)).view(np.uint32).reshape(-1)
    np.testing.assert_array_equal(actual, int4_words)
    assert actual[0xFFFF] == 0x33333333 and actual[0b10_01] == 0x21


def test_e4m3_pair_block_matches_its_emulation():
    """Two E4M3 bytes in one 16-bit register -> their float16 pair; every non-negative finite code in
    either byte, subnormals included."""
    rng = np.random.default_rng(3)
    codes = np.arange(127, dtype=np.uint8)
    low = np.concatenate([np.repeat(codes, 127), rng.integers(0, 127, N).astype(np.uint8)])
    high = np.concatenate([np.tile(codes, 127), rng.integers(0, 127, N).astype(np.uint8)])
    pairs = (low.astype(np.uint16) | (high.astype(np.uint16) << 8)).view(np.float16)
    (actual,) = ptx.run(gluon_decode._E4M3_PAIR_ASM.value, "=r,h", [pairs])
    expected = [emulate._asm_table()[gluon_decode._E4M3_PAIR_ASM.value](b).view(np.uint16) for b in (low, high)]
    assert_equal = np.testing.assert_array_equal
    assert_equal(actual & 0xFFFF, expected[0])
    assert_equal(actual >> 16, expected[1])
    # The emulation is the format's own float16 values (e.g. 448, 2**-9).
    assert emulate._e4m3_float16(np.array([0x7E, 0x01], np.uint8)).tolist() == [448.0, 2.0**-9]


@pytest.mark.parametrize("name", NAMES)
def test_inline_ptx_matches_its_emulation(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    constraints, args = _cases(rng)[name]
    asm = getattr(gluon_decode, name).value
    actual = ptx.run(asm, constraints, args)
    expected = emulate._asm_table()[asm](*args)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a_bits = np.asarray(a, np.float16).view(np.uint16)
        e_bits = np.asarray(e, np.float16).view(np.uint16)
        bad = np.flatnonzero(a_bits != e_bits)
        first = [hex(int(np.asarray(x).reshape(-1)[bad[0]].view(np.uint16 if np.asarray(x).dtype == np.float16
                                                               else np.uint32))) for x in args] if bad.size else []
        assert bad.size == 0, (f"output {i}: {bad.size} of {a_bits.size} differ; first at inputs {first}: "
                               f"{a_bits[bad[0]]:#06x} against {e_bits[bad[0]]:#06x}")


def test_the_evaluator_can_fail():
    """A block that drops a sign bit differs from the emulation of the block it imitates."""
    asm = gluon_decode._E2M1_KEY_ASM.value.replace("0x8E8E8E8E", "0x0E0E0E0E", 1)
    rng = np.random.default_rng(1)
    args = [_words(rng), _e4m3_scales(rng)]
    actual = ptx.run(asm, "=h," * 8 + "r,h", args)
    expected = emulate._e2m1_keys(*args)
    assert any((np.asarray(a).view(np.uint16) != np.asarray(e).view(np.uint16)).any()
               for a, e in zip(actual, expected, strict=True))


def _pallas_cases(rng):
    """The Pallas kernel's blocks (compiled only, float16 products): name -> (extra inputs, expected planes)."""
    from jflashloop_pallas_kernels import decode_attention as pallas
    from jflashloop_pallas_kernels import nvfp4_pages

    words = _words(rng)
    scale, minimum = _half(rng, -2, 2), _half(rng, -8, 8)
    e4m3 = _e4m3_scales(rng)
    return {
        "_CODES_ASM": (pallas._CODES_ASM, [], emulate._key_codes(words)),
        "_DEQUANTIZE_ASM": (pallas._DEQUANTIZE_ASM, [scale, minimum], emulate._row_keys(words, scale, minimum)),
        # e2m1 * scale, exact in float16; the Pallas kernel decodes words in the codec's order (it maps
        # the tiles' page order back first), the emulation reads page order
        "_E2M1_ASM": (pallas._E2M1_ASM, [e4m3], tuple((v * e4m3.astype(np.float64)).astype(np.float16)
                                                      for v in emulate._e2m1(nvfp4_pages.to_page_order(words)))),
    }, words


@pytest.mark.parametrize("name", ["_CODES_ASM", "_DEQUANTIZE_ASM", "_E2M1_ASM"])
def test_pallas_inline_ptx_matches_its_interpret_arithmetic(name):
    """The Pallas kernel decodes with these blocks only compiled (interpret mode computes the same values
    with jax.numpy): nibble ``i`` of each word as ``code``, ``code * scale + min`` (one rounding) and
    ``e2m1 * scale``."""
    cases, words = _pallas_cases(np.random.default_rng(zlib.crc32(name.encode())))
    asm, extra, expected = cases[name]
    actual = ptx.run(asm, "=h," * 8 + "r" + ",h" * len(extra), [words, *extra])
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a_bits, e_bits = np.asarray(a).view(np.uint16), np.asarray(e, np.float16).view(np.uint16)
        assert (a_bits == e_bits).all(), (name, i, int((a_bits != e_bits).sum()))
