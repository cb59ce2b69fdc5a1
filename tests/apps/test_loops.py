"""The looped-model report: its measurements on a small random model, and the real checkpoint."""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jflashloop import storage
from jflashloop.apps import loops
from jflashloop.models import ouro
from jflashloop.models.checkpoint import load_checkpoint, save_checkpoint
from jflashloop.models.stdlib_text import default_root, load_corpus

# One layer and grouped-query attention keep compilation short and cover GQA.
SMALL = dataclasses.replace(ouro.OuroConfig.tiny(), layers=1, kv_heads=2)
# The tests share these shapes, so each jitted function compiles once for the file.
SEQUENCES, TOKENS, PROMPT, GENERATE = 2, 136, 64, 4  # commit packs page 2 at token 128
QUERIES = loops.ReportSettings.query_positions

# Bounds for the trained checkpoint (jflashloop/models/data/ouro_tiny.npz): the
# cross-loop cache against four BF16 caches, teacher forced on CHECKPOINT_WINDOWS
# held-out windows of CHECKPOINT_TOKENS bytes (CHECKPOINT_PROMPT prefilled, so
# commit packs pages at 128 and 192). Reference values (window seeds 0-3) for the
# same model trained 150 steps of 8 x 128 bytes (held-out 2.07 nats/byte):
# mean KL 1.5e-4 to 2.0e-4 nats, agreement 98.8-99.2 %, +0.0001 to +0.006 bits
# per byte; 600 steps (1.51 nats/byte): mean KL 3.7e-4 to 7.3e-4, agreement
# 97.7-99.6 %, -0.001 to +0.004 bits per byte. The KL grows as the model
# sharpens, so the bounds leave a wide margin for the longer-trained checkpoint.
CHECKPOINT_WINDOWS, CHECKPOINT_TOKENS, CHECKPOINT_PROMPT = 2, 192, 64
MAX_MEAN_KL_NATS = 0.02
MIN_AGREEMENT = 0.9
MAX_EXTRA_BITS_PER_BYTE = 0.1


@functools.cache
def small_params() -> ouro.Params:
    return ouro.init_params(SMALL, jax.random.PRNGKey(0))


def random_windows(seed: int, count: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SMALL.vocab_size, (count, length)).astype(
        np.int32)


@functools.cache
def small_windows() -> np.ndarray:
    return random_windows(0, SEQUENCES, TOKENS + 1)


@pytest.fixture(scope="module")
def comparison():
    return loops.compare_caches(small_params(), SMALL, small_windows(), PROMPT, GENERATE)


@pytest.fixture(scope="module")
def prompt_queries():
    return loops.model_queries(small_params(), SMALL,
                                      jnp.asarray(small_windows()[:, :PROMPT]), QUERIES)


def test_settings_validate():
    with pytest.raises(ValueError, match="prompt_tokens"):
        loops.ReportSettings(tokens=64, prompt_tokens=64)
    with pytest.raises(ValueError, match="prompt_tokens"):
        loops.ReportSettings(tokens=64, prompt_tokens=8, query_positions=8)
    assert loops.ReportSettings().total_tokens == 512 + 32


def test_held_out_windows_are_slices(rng):
    held_out = rng.integers(0, 256, 1000).astype(np.uint8)
    windows = loops.held_out_windows(held_out, 3, 50, seed=7)
    assert windows.shape == (3, 50) and windows.dtype == np.int32
    text = held_out.tobytes()
    for window in windows:
        assert window.astype(np.uint8).tobytes() in text
    np.testing.assert_array_equal(windows, loops.held_out_windows(held_out, 3, 50, seed=7))


def test_successive_loop_cosine(rng):
    x = rng.standard_normal((1, 3, 2, 5, 2, 8))
    x = np.concatenate([x, x * 2.0, -x], axis=0)  # loops: x, 2x (cosine 1), -x (cosine -1)
    cosine = loops.successive_loop_cosine(x)
    assert cosine.shape == (3, 2)
    np.testing.assert_allclose(cosine[:, 0], 1.0, rtol=1e-12)
    np.testing.assert_allclose(cosine[:, 1], -1.0, rtol=1e-12)


def test_storage_summary_equals_the_storage_module():
    config = loops.cross_loop_cache_config(ouro.OuroConfig.tiny(), sequences=1,
                                                  max_tokens=512)
    summary = loops.storage_summary(config, context_tokens=512)
    bf16 = storage.unquantized_bytes_per_token(config) * config.num_layers
    cache = storage.bytes_per_token(config) * config.num_layers
    assert summary["bf16_bytes_per_token"] == bf16 == 4 * 4 * 2 * 4 * 64 * 2
    assert summary["cache_bytes_per_token"] == cache
    assert summary["ratio"] == Fraction(bf16) / Fraction(cache)
    # Per (page, head): loops 1 and 2 are 2 x (2048 codes + 256 metadata) bytes; loop 3
    # 16 rows x (32 + 4) x 2 + 16 positions; loop 4 7 x 36 x 2 + 7.
    assert summary["ratio"] == Fraction(16384 * 64, 4 * 4 * (2 * 4608 + 1168 + 511))
    assert f"{float(summary['ratio']):.2f}x" in summary["table"]


def test_sparse_row_positions_pick_the_largest_per_page():
    energy = np.array([0, 5, 1, 5, 9, 0, 0, 0], np.float32)  # two pages of 4
    positions = loops.sparse_row_positions(energy, rows=2, page_size=4)
    np.testing.assert_array_equal(positions, [1, 3, 4, 5])  # tie 0 = 0 = 0 -> lowest position


def test_bfloat16_hook_equals_a_bfloat16_cache(comparison):
    keys = comparison["keys"][:, :, :, :PROMPT]
    values = comparison["values"][:, :, :, :PROMPT]
    max_tokens = TOKENS + GENERATE
    lengths = jnp.full((SEQUENCES,), PROMPT, jnp.int32)
    bf16 = ouro.DenseLoopKVCache.from_prefill(keys, values, lengths, max_tokens=max_tokens,
                                              dtype=jnp.bfloat16)
    rounded = loops.bfloat16_loop_caches(keys, values, max_tokens=max_tokens)
    assert rounded.keys.dtype == jnp.float32
    inputs = jnp.asarray(small_windows()[:, PROMPT:PROMPT + 3])
    expected, _ = loops.decode_tokens(small_params(), SMALL, ouro.dense_attention_fn, bf16,
                                             inputs, PROMPT)
    np.testing.assert_array_equal(comparison["bf16_logits"][:3], expected)


def test_model_queries_are_the_first_layer_projection(prompt_queries):
    assert prompt_queries.shape == (SMALL.loops, SMALL.layers, SEQUENCES, QUERIES, SMALL.heads,
                                    SMALL.head_dim)
    first = PROMPT - QUERIES
    layer = small_params()["layers"][0]
    embedded = small_params()["embedding"][jnp.asarray(small_windows()[:, first:PROMPT])]
    normed = ouro.rms_norm(embedded, layer["pre_attention_norm"], SMALL.norm_eps)
    projected = (normed @ layer["attention"]["wq"]).reshape(SEQUENCES, QUERIES, SMALL.heads,
                                                            SMALL.head_dim)
    expected = ouro.apply_rope(projected, jnp.arange(first, PROMPT)[None, :], SMALL.rope_theta)
    np.testing.assert_allclose(prompt_queries[0, 0], expected, rtol=1e-5, atol=1e-5)


def test_compare_caches_shapes_and_pages(comparison):
    steps = TOKENS - PROMPT
    vocab = SMALL.vocab_size
    assert comparison["exact_logits"].shape == (steps, SEQUENCES, vocab)
    assert comparison["bf16_logits"].shape == (steps + GENERATE, SEQUENCES, vocab)
    assert comparison["cross_loop_logits"].shape == (steps + GENERATE, SEQUENCES, vocab)
    assert comparison["targets"].shape == (steps, SEQUENCES)
    assert comparison["generated"].shape == (SEQUENCES, GENERATE)
    assert comparison["keys"].shape == (SMALL.loops, SMALL.layers, SEQUENCES, TOKENS,
                                        SMALL.kv_heads, SMALL.head_dim)
    np.testing.assert_array_equal(comparison["pages_after_prefill"], [1, 1])
    np.testing.assert_array_equal(comparison["pages_at_end"], [2, 2])  # packed by commit
    assert np.isfinite(comparison["cross_loop_logits"]).all()


def test_logit_metrics(comparison):
    metrics = loops.logit_metrics(comparison)
    teacher_forced, generated = metrics["teacher_forced"], metrics["generated"]
    assert set(teacher_forced) == {
        "steps", "kl", "kl_max", "agreement", "kl_bf16_vs_exact", "kl_cross_loop_vs_exact",
        "agreement_bf16_vs_exact", "agreement_cross_loop_vs_exact", "bits_per_byte_exact",
        "bits_per_byte_bf16", "bits_per_byte_cross_loop"}
    assert set(generated) == {"steps", "kl", "kl_max", "agreement", "identical_greedy_tokens",
                              "identical_greedy_tokens_min"}
    assert teacher_forced["steps"] == TOKENS - PROMPT and generated["steps"] == GENERATE
    assert 0 <= teacher_forced["kl"] <= teacher_forced["kl_max"]
    assert 0 <= teacher_forced["agreement"] <= 1
    assert 0 <= generated["identical_greedy_tokens_min"] <= generated["identical_greedy_tokens"]
    assert generated["identical_greedy_tokens"] <= GENERATE
    # A random byte model is close to uniform: about 8 bits per byte.
    assert 6 < teacher_forced["bits_per_byte_exact"] < 10


def test_leading_agreement():
    reference = np.zeros((4, 2, 3))
    reference[:, :, 0] = 1
    candidate = reference.copy()
    candidate[2, 0] = [0, 1, 0]  # sequence 0 disagrees at step 2; sequence 1 never
    np.testing.assert_array_equal(loops.leading_agreement(reference, candidate), [2, 4])


def test_closed_loop_beats_open_loop(comparison):
    config = loops.cross_loop_cache_config(SMALL, SEQUENCES, TOKENS)
    keys, values = comparison["keys"][:, :, :, :128], comparison["values"][:, :, :, :128]
    closed = loops.chain_errors(keys, values, config, closed_loop=True)
    opened = loops.chain_errors(keys, values, config, closed_loop=False)
    for name in ("keys", "values"):
        assert closed[name].shape == (SMALL.layers, SMALL.loops)
        np.testing.assert_array_equal(closed[name][:, 0], opened[name][:, 0])  # same base
        assert (closed[name][:, 1:] < opened[name][:, 1:]).all(), (name, closed, opened)


def test_errors_of_the_prefilled_cache(comparison):
    errors = loops.prefilled_cache_errors(small_params(), SMALL, small_windows(),
                                                 comparison, PROMPT, QUERIES)
    shape = (SMALL.loops, SMALL.layers)
    for name in ("bf16", "cross_loop"):
        assert errors["attention_error"][name].shape == shape
    # bfloat16 rounding alone is far below 4-bit storage.
    assert (errors["attention_error"]["bf16"] < 0.01).all()
    assert (errors["attention_error"]["cross_loop"] > errors["attention_error"]["bf16"]).all()
    assert (errors["attention_error"]["cross_loop"] < 0.5).all()
    for name in ("keys", "values"):
        reconstruction = errors["cache_reconstruction_error"][name]
        assert reconstruction.shape == shape and (reconstruction > 0).all()
    # Page 0 minus the 4 sink tokens and the 16 most recent tokens (read from the ring).
    assert errors["positions_from_pages"] == PROMPT - 4 - 16


def test_attention_errors_vanish_for_exact_kv(comparison, prompt_queries):
    exact_keys = np.asarray(comparison["keys"][:, :, :, :PROMPT])
    exact_values = np.asarray(comparison["values"][:, :, :, :PROMPT])
    errors = loops.attention_errors(np.asarray(prompt_queries), exact_keys, exact_values,
                                           exact_keys, exact_values,
                                           np.arange(PROMPT - QUERIES, PROMPT))
    np.testing.assert_array_equal(errors, 0.0)


def test_cache_serves_windows_unquantized(comparison):
    cache = comparison["cross_loop_cache"]
    stored_keys, _ = loops.reconstruct_every_loop(cache, SEQUENCES, PROMPT)
    from_pages = loops.packed_positions(cache.config, PROMPT)
    assert not from_pages[:4].any() and not from_pages[-16:].any() and from_pages[4:48].all()
    exact_keys = comparison["keys"][:, :, :, :PROMPT]
    rounded = np.asarray(loops.bfloat16_round_trip(exact_keys))
    np.testing.assert_array_equal(np.asarray(stored_keys)[:, :, :, ~from_pages],
                                  rounded[:, :, :, ~from_pages])


def test_main_writes_the_report(tmp_path, capsys):
    checkpoint = tmp_path / "small.npz"
    save_checkpoint(checkpoint, small_params(), SMALL, {"steps": 0})
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    # Sorted file 0 is held out.
    held_out_text = "".join(f"def function_{index}(x):\n    return x * {index}\n"
                            for index in range(40))
    (stdlib / "a.py").write_text(held_out_text)
    (stdlib / "b.py").write_text("print('training')\n")
    markdown = tmp_path / "report.md"
    status = loops.main([
        "--checkpoint", str(checkpoint), "--stdlib", str(stdlib), "--tokens", str(TOKENS),
        "--prompt-tokens", str(PROMPT), "--generate", str(GENERATE), "--sequences",
        str(SEQUENCES), "--markdown", str(markdown), "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert markdown.read_text() == printed
    for expected in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.",
                     "largest residual energy", "bits per byte", "x smaller"):
        assert expected in printed


def test_main_without_checkpoint(tmp_path, capsys):
    assert loops.main(["--checkpoint", str(tmp_path / "missing.npz")]) == 1
    assert "bench/train_ouro.py" in capsys.readouterr().err


@pytest.mark.skipif(not loops.DEFAULT_CHECKPOINT.exists(),
                    reason="no trained checkpoint jflashloop/models/data/ouro_tiny.npz")
def test_trained_checkpoint_on_the_cross_loop_cache():
    checkpoint = load_checkpoint(loops.DEFAULT_CHECKPOINT)
    corpus = load_corpus(default_root())
    windows = loops.held_out_windows(corpus.held_out, CHECKPOINT_WINDOWS,
                                            CHECKPOINT_TOKENS + 1, seed=0)
    comparison = loops.compare_caches(checkpoint.params, checkpoint.config, windows,
                                             CHECKPOINT_PROMPT)
    assert (comparison["pages_at_end"] > comparison["pages_after_prefill"]).all()
    teacher_forced = loops.logit_metrics(comparison)["teacher_forced"]
    assert teacher_forced["kl"] < MAX_MEAN_KL_NATS, teacher_forced
    assert teacher_forced["agreement"] > MIN_AGREEMENT, teacher_forced
    extra_bits = (teacher_forced["bits_per_byte_cross_loop"]
                  - teacher_forced["bits_per_byte_bf16"])
    assert extra_bits < MAX_EXTRA_BITS_PER_BYTE, teacher_forced
