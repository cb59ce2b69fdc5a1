"""Old module paths and names: importable for one release, each with a DeprecationWarning.

Everywhere else the tests use the new paths (``pyproject.toml`` turns these
warnings into errors outside ``pytest.warns``).
"""

from __future__ import annotations

import importlib
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import storage
from tests.bits import assert_bits_equal


def _chain():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8, 2, 16)), jnp.float32)
    return jflashloop.encode_chain(list(x), jflashloop.INT4_KEYS, [jflashloop.INT4_VALUES] * 2, [None] * 2)


def test_decode_chain_with_a_loop_keeps_its_1_based_meaning_and_warns():
    chain = _chain()
    for one_based in (1, 2, 3):
        with pytest.warns(DeprecationWarning, match="decode_loop\\(chain, loop - 1\\)"):
            old = jflashloop.decode_chain(chain, one_based)
        assert_bits_equal(old, jflashloop.decode_loop(chain, one_based - 1), f"loop {one_based}")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="loop must be in \\[1, 3\\], got 0"):
        jflashloop.decode_chain(chain, 0)
    assert_bits_equal(jflashloop.decode_chain(chain), jflashloop.decode_loop(chain, 2), "the last loop")


def test_page_bytes_old_keys_warn_and_keep_their_meaning():
    config = storage.config_for(storage.OURO_1_4B)
    page = storage.page_bytes(config)
    assert page.total == sum(page.loops) and len(page.loops) == config.num_loops
    for index, value in enumerate(page.loops):
        with pytest.warns(DeprecationWarning, match=f"\\.loops\\[{index}\\]"):
            assert page[f"loop{index + 1}"] == value
    with pytest.warns(DeprecationWarning, match="\\.total"):
        assert page["total"] == page.total
    old = {f"loop{index + 1}": value for index, value in enumerate(page.loops)}
    with pytest.warns(DeprecationWarning, match="PageBytes"):
        assert page == {**old, "total": page.total}
    with pytest.raises(KeyError):
        page["loop0"]


# old path -> (new home, names that must be the same objects)
OLD_MODULES = {
    "jflashloop.attention": ("jflashloop.ops._decode_attention",
                             ["decode_attention", "decode_attention_reference", "kernel_inputs", "rotated_inputs",
                              "unrotated_output", "gluon_unsupported_reason", "FUSED_FORMATS"]),
    "jflashloop.codec_spec": ("jflashloop.codecs", ["CodecSpec", "INT4_KEYS", "INT4_VALUES", "NVFP4", "E8_KEYS",
                                                   "INT4_GROUP_ROTATED_VALUES", "int4_rotated", "int2_lloyd_max"]),
    "jflashloop.nibbles": ("jflashloop.codecs", ["pack_nibbles", "unpack_nibbles"]),
    "jflashloop.paged_stream": ("jflashloop.paged_cache", ["PagedStream"]),
    "jflashloop.residual": ("jflashloop", ["Chain", "Residual", "encode_chain", "decode_chain", "encode_residual",
                                           "decode_residual"]),
    "jflashloop.rotated_codecs": ("jflashloop.codecs", ["rotate", "unrotate"]),
}


@pytest.mark.parametrize("old", list(OLD_MODULES))
def test_old_module_paths_warn_and_give_the_new_objects(old):
    new, names = OLD_MODULES[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
        module = importlib.import_module(old)
    home = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(home, name), name
    attribute = old.rsplit(".", 1)[1]
    delattr(jflashloop, attribute)
    sys.modules.pop(old)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
        assert getattr(jflashloop, attribute).__name__ == old  # the old attribute of the package


def test_old_helpers_keep_working():
    with warnings.catch_warnings():  # warned once, when first imported (above)
        warnings.simplefilter("ignore", DeprecationWarning)
        from jflashloop import attention, paged_stream
    config = storage.config_for(storage.OURO_1_4B)
    from jflashloop.ops._decode_attention import loop_formats

    cache_like = type("CacheLike", (), {"config": config})()
    assert attention.kernel_inputs_formats(cache_like, 3) == loop_formats(config, 3)
    assert paged_stream.can_encode_page_pairs(64, 128, jflashloop.INT4_KEYS, jflashloop.INT4_VALUES, "pallas")
    assert not paged_stream.can_encode_page_pairs(64, 128, jflashloop.E8_KEYS, jflashloop.INT4_VALUES, "pallas")
    assert not paged_stream.can_encode_page_pairs(64, 128, jflashloop.INT4_KEYS, jflashloop.INT4_VALUES, "xla")
