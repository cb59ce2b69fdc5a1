"""The same inputs give the same bits on every run: codecs, appends, attention.

Runs on every backend. On GPU, ``encode`` uses the Pallas kernels and
``decode_attention`` the fused split-KV kernel, whose partial results are
merged in a fixed order in plain JAX (no atomics), so results are also
reproducible run to run there. Each check compiles afresh
(``jax.clear_caches``) and one also runs in a separate process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop
from jflashloop import CacheConfig, LoopStorage, paged_cache
from tests.bits import raw_bits

ON_GPU = jax.default_backend() == "gpu"
CONFIG = CacheConfig(
    num_layers=1, num_kv_heads=2, head_dim=32, num_pages=16, max_sequences=2, max_pages_per_sequence=6,
    page_size=16, recent_tokens=8,
    loops=(
        LoopStorage(jflashloop.CodecSpec("int4", "channel", 16), jflashloop.INT4_VALUES),
        LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4),
        LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 4),
    ),
)


def _digest(tree) -> str:
    """SHA-256 over the exact bits (and shapes and dtypes) of every leaf."""
    hasher = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        hasher.update(f"{leaf.dtype}{leaf.shape}".encode())
        hasher.update(np.ascontiguousarray(raw_bits(leaf)).tobytes())
    return hasher.hexdigest()


def _inputs(seed: int, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def codec_digests() -> dict[str, str]:
    x = jnp.asarray(_inputs(0, (96, 2, 40)) * 3.0)
    out = {}
    for name, spec, global_scale in [
        ("int4_keys", jflashloop.INT4_KEYS, None),
        ("int4_values", jflashloop.INT4_VALUES, None),
        ("nvfp4", jflashloop.NVFP4, None),
        ("nvfp4_given", jflashloop.NVFP4, 1e-3),
    ]:
        encode = jax.jit(lambda x, g, spec=spec: jflashloop.encode(x, spec, global_scale=g))
        packed = encode(x, global_scale)
        out[name] = _digest((packed, jflashloop.decode(packed)))
    return out


def build_cache():
    cache = paged_cache.create(CONFIG)
    shape = (1, 3, 70, 2, 32)
    cache = jax.jit(paged_cache.prefill)(cache, 0, _inputs(1, shape), _inputs(2, shape), 45)
    cache = jax.jit(paged_cache.prefill)(cache, 1, _inputs(3, shape), _inputs(4, shape), 70)
    append = jax.jit(paged_cache.append)
    for step in range(20):
        step_shape = (1, 3, 2, 2, 32)
        cache = append(cache, _inputs(100 + step, step_shape), _inputs(200 + step, step_shape))
    return cache


def _reference_attention(queries, cache, layer, loop):
    attend = jax.jit(jflashloop.decode_attention_reference, static_argnums=(2, 3),
                     static_argnames=("include_pending",))
    return attend(queries, cache, layer, loop, include_pending=False)


def attention_digests(cache) -> dict[str, str]:
    queries = jnp.asarray(_inputs(7, (2, 8, 32)))
    out = {}
    for loop in range(CONFIG.num_loops):
        out[f"reference_loop{loop}"] = _digest(_reference_attention(queries, cache, 0, loop))
    if ON_GPU:  # elsewhere the default decode_attention is the reference path
        for loop in range(CONFIG.num_loops):
            out[f"default_loop{loop}"] = _digest(
                jflashloop.decode_attention(queries, cache, 0, loop, include_pending=False)
            )
        from jflashloop_pallas_kernels.decode_attention import KernelConfig

        for splits in (1, 3):
            out[f"fused_{splits}_splits"] = _digest(
                jflashloop.decode_attention(
                    queries, cache, 0, 2, include_pending=False, implementation="pallas",
                    kernel_config=KernelConfig(num_splits=splits),
                )
            )
    return out


def all_digests() -> dict[str, str]:
    cache = build_cache()
    return {**codec_digests(), "cache": _digest(cache), **attention_digests(cache)}


def test_codecs_give_the_same_bits_every_run():
    first = codec_digests()
    jax.clear_caches()
    assert codec_digests() == first


def test_appends_and_attention_give_the_same_bits_every_run():
    cache = build_cache()
    first_cache, first_attention = _digest(cache), attention_digests(cache)
    assert attention_digests(cache) == first_attention
    jax.clear_caches()  # everything again, compiled from scratch
    again = build_cache()
    assert _digest(again) == first_cache
    assert attention_digests(again) == first_attention


def test_another_process_gets_the_same_bits():
    code = "import json, tests.test_determinism as t; print(json.dumps(t.all_digests()))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == all_digests()
