"""Looped (Ouro-style) model: shapes, decode/prefill agreement, checkpoints, training script."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jflashloop.models import ouro
from jflashloop.models.checkpoint import (
    CheckpointError,
    flatten_params,
    load_checkpoint,
    save_checkpoint,
)

CONFIG = ouro.OuroConfig.tiny()
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]

jitted_forward = jax.jit(ouro.forward, static_argnames=("config", "loops"))
jitted_decode_step = jax.jit(ouro.decode_step, static_argnames=("config", "attention_fn", "loops"))


@functools.cache
def tiny_params() -> ouro.Params:
    return ouro.init_params(CONFIG, jax.random.PRNGKey(0))


def random_tokens(rng: np.random.Generator, batch: int, tokens: int) -> jax.Array:
    return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (batch, tokens)), jnp.int32)


def test_tiny_config_size():
    assert CONFIG.head_dim * CONFIG.heads == CONFIG.hidden
    assert 2_000_000 < ouro.param_count(tiny_params()) < 5_000_000
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(tiny_params()))


def test_presets_have_the_published_widths():
    small, large = ouro.OuroConfig.ouro_1_4b(), ouro.OuroConfig.ouro_2_6b()
    assert (small.layers, small.hidden, small.heads, small.kv_heads, small.head_dim,
            small.loops) == (24, 2048, 16, 16, 128, 4)
    assert dataclasses.replace(large, layers=24) == small and large.layers == 48


def test_forward_shapes(rng):
    batch, tokens = 2, 10
    logits, keys, values, hidden = jitted_forward(tiny_params(), CONFIG,
                                                  random_tokens(rng, batch, tokens))
    kv_shape = (CONFIG.loops, CONFIG.layers, batch, tokens, CONFIG.kv_heads, CONFIG.head_dim)
    assert logits.shape == (CONFIG.loops, batch, tokens, CONFIG.vocab_size)
    assert logits.dtype == jnp.float32
    assert keys.shape == kv_shape and values.shape == kv_shape
    assert hidden.shape == (CONFIG.loops, batch, tokens, CONFIG.hidden)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_fewer_loops_are_a_prefix_and_differ(rng):
    token_ids = random_tokens(rng, 2, 8)
    four = jitted_forward(tiny_params(), CONFIG, token_ids)
    one = jitted_forward(tiny_params(), CONFIG, token_ids, loops=1)
    assert one[0].shape[0] == 1 and one[1].shape[0] == 1
    np.testing.assert_allclose(one[0][0], four[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one[1][0], four[1][0], rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(four[0][-1] - one[0][-1]))) > 0.1
    # Keys of a later loop differ from the first loop's (different inputs, shared weights).
    assert float(jnp.max(jnp.abs(four[1][-1] - four[1][0]))) > 0.1


def test_causality(rng):
    token_ids = random_tokens(rng, 1, 8)
    changed = token_ids.at[0, 5].set((token_ids[0, 5] + 1) % CONFIG.vocab_size)
    before = jitted_forward(tiny_params(), CONFIG, token_ids)[0]
    after = jitted_forward(tiny_params(), CONFIG, changed)[0]
    np.testing.assert_array_equal(before[:, :, :5], after[:, :, :5])
    assert float(jnp.max(jnp.abs(before[:, :, 5:] - after[:, :, 5:]))) > 0


@pytest.mark.parametrize("loops", [4, 2])
def test_decode_matches_forward_token_by_token(rng, loops):
    batch, tokens = 2, 9
    token_ids = random_tokens(rng, batch, tokens)
    expected = jitted_forward(tiny_params(), CONFIG, token_ids, loops=loops)[0][-1]
    cache = ouro.DenseLoopKVCache.create(CONFIG, batch, max_tokens=12, loops=loops,
                                         dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(expected)))
    for position in range(tokens):
        logits, cache = jitted_decode_step(
            tiny_params(), CONFIG, token_ids[:, position], jnp.full((batch,), position, jnp.int32),
            ouro.dense_attention_fn, cache, loops=loops)
        np.testing.assert_allclose(logits, expected[:, position], rtol=0, atol=1e-4 * scale)
    np.testing.assert_array_equal(cache.lengths, [tokens] * batch)


def test_decode_after_prefill_with_ragged_lengths(rng):
    batch, tokens, prefill = 2, 10, 6
    token_ids = random_tokens(rng, batch, tokens)
    logits, keys, values, _ = jitted_forward(tiny_params(), CONFIG, token_ids)
    # Row 0 resumes after 6 cached tokens, row 1 after 4 (its slots 4, 5 are overwritten).
    lengths = jnp.array([prefill, 4], jnp.int32)
    cache = ouro.DenseLoopKVCache.from_prefill(keys[:, :, :, :prefill], values[:, :, :, :prefill],
                                               lengths, max_tokens=16, dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(logits)))
    for _ in range(3):
        positions = cache.lengths
        step_logits, cache = jitted_decode_step(
            tiny_params(), CONFIG, token_ids[jnp.arange(batch), positions], positions,
            ouro.dense_attention_fn, cache)
        wanted = logits[-1][jnp.arange(batch), positions]
        np.testing.assert_allclose(step_logits, wanted, rtol=0, atol=1e-4 * scale)
    np.testing.assert_array_equal(cache.lengths, [prefill + 3, 7])


def test_bfloat16_cache_stays_close(rng):
    token_ids = random_tokens(rng, 1, 6)
    expected = jitted_forward(tiny_params(), CONFIG, token_ids)[0][-1]
    cache = ouro.DenseLoopKVCache.create(CONFIG, 1, max_tokens=8)
    assert cache.keys.dtype == jnp.bfloat16
    for position in range(6):
        logits, cache = jitted_decode_step(tiny_params(), CONFIG, token_ids[:, position],
                                           jnp.array([position], jnp.int32),
                                           ouro.dense_attention_fn, cache)
    probabilities = jax.nn.softmax(logits)
    reference = jax.nn.softmax(expected[:, -1])
    assert float(jnp.max(jnp.abs(probabilities - reference))) < 0.05


def test_losses(rng):
    batch = random_tokens(rng, 2, 9)
    per_loop = ouro.loss_per_loop(tiny_params(), CONFIG, batch)
    assert per_loop.shape == (CONFIG.loops,)
    np.testing.assert_allclose(ouro.loss_fn(tiny_params(), CONFIG, batch), per_loop[-1])
    total, _ = ouro.multi_exit_loss(tiny_params(), CONFIG, batch)
    np.testing.assert_allclose(total, jnp.mean(per_loop), rtol=1e-6)
    weighted, _ = ouro.multi_exit_loss(tiny_params(), CONFIG, batch, loop_weights=(0, 0, 0, 2))
    np.testing.assert_allclose(weighted, per_loop[-1], rtol=1e-6)


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "model.npz"
    info = {"seed": 0, "steps": 7, "held_out_loss_nats_per_byte_by_loops": {"1": 2.5}}
    checksum = save_checkpoint(path, tiny_params(), CONFIG, info)
    loaded = load_checkpoint(path)
    assert loaded.config == CONFIG and loaded.info == info and loaded.sha256 == checksum
    original, restored = flatten_params(tiny_params()), flatten_params(loaded.params)
    assert original.keys() == restored.keys()
    assert "layers/0/attention/wq" in restored
    for name, array in original.items():
        assert restored[name].dtype == array.dtype
        assert restored[name].tobytes() == array.tobytes(), name
    assert jax.tree_util.tree_structure(loaded.params) == jax.tree_util.tree_structure(
        tiny_params())


def test_corrupted_checkpoint_raises(tmp_path):
    path = tmp_path / "model.npz"
    save_checkpoint(path, tiny_params(), CONFIG)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # inside the weight bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_modified_array_fails_checksum(tmp_path):
    path = tmp_path / "model.npz"
    save_checkpoint(path, tiny_params(), CONFIG)
    with np.load(path) as archive:
        entries = {name: archive[name] for name in archive.files}
    entries["final_norm"] = entries["final_norm"] + 1.0
    with open(path, "wb") as file:
        np.savez(file, **entries)
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path)


def test_shape_mismatch_raises(tmp_path):
    bigger = dataclasses.replace(CONFIG, mlp_hidden=CONFIG.mlp_hidden + 8)
    with pytest.raises(CheckpointError, match="shape"):
        save_checkpoint(tmp_path / "model.npz", tiny_params(), bigger)


def test_training_script_runs_on_cpu(tmp_path):
    output = tmp_path / "ouro.npz"
    command = [sys.executable, str(REPOSITORY_ROOT / "bench" / "train_ouro.py"),
               "--steps", "5", "--batch", "2", "--seq", "32", "--loops", "2",
               "--eval-windows", "4", "--log-every", "5", "--out", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPOSITORY_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loops=2:" in result.stdout and "steps/s" in result.stdout
    loaded = load_checkpoint(output)
    assert loaded.config.loops == 2
    assert loaded.info["steps"] == 5
    assert set(loaded.info["held_out_loss_nats_per_byte_by_loops"]) == {"1", "2"}
