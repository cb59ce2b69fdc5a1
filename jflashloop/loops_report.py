"""A looped model end to end on the cross-loop 4-bit cache, against four BF16 caches.

The report runs the tiny byte-level Ouro-style model (:mod:`jflashloop.models.ouro`,
checkpoint ``jflashloop/models/data/ouro_tiny.npz`` by default) on held-out
bytes of the Python standard library (the split of
:mod:`jflashloop.models.stdlib_text` that ``bench/train_ouro.py`` trains on)
and measures:

1. how similar the K and V of successive loops are (cosine per layer);
2. KV bytes per token of four BF16 loop caches and of the cross-loop cache
   (:mod:`jflashloop.storage`);
3. the attention-output relative error of each loop, for the model's own
   queries, over the K/V the prefilled cache reconstructs;
4. logit KL divergence and next-token agreement between the two caches when
   the same tokens go through :func:`~jflashloop.models.ouro.decode_step`,
   teacher forced on held-out text, then on a greedy continuation;
5. held-out bits per byte through both caches;
6. what closed-loop residual encoding saves against open loop.

The cross-loop cache is :meth:`CacheConfig.flashloop`: loop 1 an INT4 base,
loop 2 a dense INT4 residual, loops 3 and 4 sparse INT4 residuals for 25 % and
10 % of each page's rows (rounded up). Pages hold 64 tokens: 64 is FlashLoop's
K group (per channel over 64 tokens), so every K group fills exactly one page
at 4.5 bits per element; 32-token pages would force 32-token K groups (5 bits
per element) and round 10 % of a page up to 4 rows (12.5 %). The tiny model's
head_dim of 64 is also exactly one V group.

Run it with ``jflashloop loops`` or ``python -m jflashloop.loops_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import paged_cache, storage
from .cache_config import CacheConfig
from .models import ouro
from .models.cache_hooks import looped_paged_attention_hook
from .models.checkpoint import Checkpoint, load_checkpoint
from .models.stdlib_text import HELD_OUT_EVERY, default_root, load_corpus
from .paged_cache import PagedKVCache
from .residual import decode_chain, encode_chain

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "models" / "data" / "ouro_tiny.npz"
PAGE_SIZE = 64

_forward = jax.jit(ouro.forward, static_argnames=("config", "loops"))
_decode_step = jax.jit(ouro.decode_step, static_argnames=("config", "attention_fn", "loops"))
_decode_step_donating = jax.jit(ouro.decode_step,
                                static_argnames=("config", "attention_fn", "loops"),
                                donate_argnames=("state",))
_prefill = jax.jit(paged_cache.prefill)


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """What the report runs.

    Attributes:
      tokens: held-out bytes per sequence fed through the model; one more byte
        is read as the target of the last one.
      prompt_tokens: the first ``prompt_tokens`` bytes are prefilled (from
        :func:`ouro.forward` K/V); the rest are decoded one at a time, teacher forced.
      generate: greedy steps after the text (tokens chosen by the BF16 run).
      sequences: held-out windows, decoded as one batch.
      seed: picks the windows' start offsets.
      query_positions: the last ``query_positions`` prompt positions give the
        queries of the attention-error measurement.
      page_size: tokens per page of the cross-loop cache.
    """

    tokens: int = 512
    prompt_tokens: int = 192
    generate: int = 32
    sequences: int = 4
    seed: int = 0
    query_positions: int = 8
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        if self.sequences < 1 or self.generate < 0 or self.query_positions < 1:
            raise ValueError("sequences and query_positions must be >= 1 and generate >= 0")
        if not self.query_positions < self.prompt_tokens < self.tokens:
            raise ValueError(
                f"need query_positions < prompt_tokens < tokens, got {self.query_positions}, "
                f"{self.prompt_tokens}, {self.tokens}")

    @property
    def total_tokens(self) -> int:
        """Tokens each sequence holds at the end: the text and the greedy continuation."""
        return self.tokens + self.generate


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def held_out_windows(held_out: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length`` bytes at random sorted offsets: int32 ``[count, length]``."""
    if held_out.size < length:
        raise ValueError(f"held-out data ({held_out.size} bytes) is shorter than a window")
    starts = np.sort(np.random.default_rng(seed).integers(0, held_out.size - length + 1, count))
    return np.stack([held_out[start:start + length] for start in starts]).astype(np.int32)


def cross_loop_cache_config(
    model: ouro.OuroConfig, sequences: int, max_tokens: int, page_size: int = PAGE_SIZE
) -> CacheConfig:
    """:meth:`CacheConfig.flashloop` for ``model``, with room for ``sequences`` x ``max_tokens``."""
    pages_per_sequence = math.ceil(max_tokens / page_size)
    return CacheConfig.flashloop(
        num_layers=model.layers, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
        num_loops=model.loops, num_pages=sequences * pages_per_sequence,
        max_sequences=sequences, max_pages_per_sequence=pages_per_sequence, page_size=page_size,
    )


def describe_sparse_rule(config: CacheConfig) -> str:
    """One paragraph: which rows the sparse loops store and which tokens stay unquantized."""
    sparse = [
        f"loop {index + 1}: {config.rows(index)} of {config.page_size} rows"
        for index, loop in enumerate(config.loops) if loop.is_sparse
    ]
    return (
        "Sparse rows: for every page and KV head, a sparse loop stores the rows with the largest "
        "residual energy |K_r - rec K_(r-1)|^2 + |V_r - rec V_(r-1)|^2 (summed over channels, "
        "against the reconstructed previous loop; ties to the lower position; sink rows excluded) "
        f"({'; '.join(sparse) or 'none'}); other rows inherit the previous loop. FlashLoop always "
        "includes the last prompt token; here that is automatic, because the most recent "
        f"{config.recent_tokens} tokens (and the page being filled) are read unquantized, in "
        f"every loop, from the {config.window_dtype} ring, and the first {config.sink_tokens} "
        "tokens from the sink."
    )


# --------------------------------------------------------------------------
# 1. Similarity of successive loops
# --------------------------------------------------------------------------


def successive_loop_cosine(x: jax.Array | np.ndarray) -> np.ndarray:
    """Cosine similarity between loop r and loop r + 1, per layer.

    Args:
      x: keys or values ``[loops, layers, B, T, kv_heads, head_dim]``.
    Returns:
      float64 ``[layers, loops - 1]``: the mean over sequences, tokens and heads
      of the cosine between the head vectors of consecutive loops.
    """
    x = np.asarray(x, np.float64)
    earlier, later = x[:-1], x[1:]
    norms = np.linalg.norm(earlier, axis=-1) * np.linalg.norm(later, axis=-1)
    cosine = np.sum(earlier * later, axis=-1) / np.maximum(norms, np.finfo(np.float64).tiny)
    return cosine.mean(axis=(2, 3, 4)).T


# --------------------------------------------------------------------------
# 2. Storage
# --------------------------------------------------------------------------


def storage_summary(config: CacheConfig, context_tokens: int) -> dict[str, Any]:
    """KV bytes per token of four BF16 loop caches and of ``config``, over all layers.

    Returns:
      ``bf16_bytes_per_token`` (int), ``cache_bytes_per_token`` (float, full
      pages), ``ratio`` (:class:`fractions.Fraction`, exact), ``table``
      (markdown from :func:`jflashloop.storage.storage_table`).
    """
    bf16 = storage.unquantized_bytes_per_token(config) * config.num_layers
    page_total = storage.page_bytes(config)["total"]
    shape = storage.ModelShape("Ouro tiny", config.num_layers, config.num_kv_heads,
                               config.head_dim, config.num_loops)
    table = storage.storage_table(shape, context_tokens, page_size=config.page_size,
                                  sink_tokens=config.sink_tokens,
                                  recent_tokens=config.recent_tokens)
    return {
        "bf16_bytes_per_token": bf16,
        "cache_bytes_per_token": storage.bytes_per_token(config) * config.num_layers,
        "ratio": Fraction(bf16 * config.page_size, page_total * config.num_layers),
        "table": table,
    }


# --------------------------------------------------------------------------
# 3. Attention error of each loop
# --------------------------------------------------------------------------


def _recording_attention(loop_index, layer_index, queries, new_keys, new_values, state):
    """:func:`ouro.dense_attention_fn` that also records the queries of every (loop, layer)."""
    cache, recorded = state
    out, cache = ouro.dense_attention_fn(loop_index, layer_index, queries, new_keys, new_values,
                                         cache)
    recorded = recorded.at[loop_index, layer_index].set(queries.astype(jnp.float32))
    return out, (cache, recorded)


def model_queries(params: ouro.Params, config: ouro.OuroConfig, token_ids: jax.Array,
                  count: int) -> jax.Array:
    """The model's own queries of the last ``count`` positions of ``token_ids``.

    The first ``T - count`` tokens are prefilled into a float32
    :class:`ouro.DenseLoopKVCache`; the last ``count`` are decoded, recording
    the query of every (loop, layer).

    Args:
      token_ids: int32 ``[B, T]``.
    Returns:
      float32 ``[loops, layers, B, count, heads, head_dim]`` (post-RoPE).
    """
    batch, tokens = token_ids.shape
    start = tokens - count
    _, keys, values, _ = _forward(params, config, token_ids[:, :start])
    cache = ouro.DenseLoopKVCache.from_prefill(keys, values, jnp.full((batch,), start, jnp.int32),
                                               max_tokens=tokens, dtype=jnp.float32)
    recorded = jnp.zeros((config.loops, config.layers, batch, config.heads, config.head_dim),
                         jnp.float32)
    per_position = []
    for position in range(start, tokens):
        _, (cache, recorded) = _decode_step(
            params, config, token_ids[:, position], jnp.full((batch,), position, jnp.int32),
            _recording_attention, (cache, recorded))
        per_position.append(recorded)
    return jnp.stack(per_position, axis=3)


def causal_attention_float64(queries, keys, values, query_positions) -> np.ndarray:
    """Softmax attention in float64; query ``i`` sees positions ``<= query_positions[i]``.

    Args:
      queries: ``[B, Q, heads, head_dim]``.
      keys, values: ``[B, T, kv_heads, head_dim]`` (query head ``h`` reads KV
        head ``h // (heads // kv_heads)``).
      query_positions: int ``[Q]``.
    Returns:
      float64 ``[B, Q, heads, head_dim]``.
    """
    queries = np.asarray(queries, np.float64)
    group = queries.shape[2] // keys.shape[2]
    keys = np.repeat(np.asarray(keys, np.float64), group, axis=2)
    values = np.repeat(np.asarray(values, np.float64), group, axis=2)
    scores = np.einsum("bqhd,bthd->bhqt", queries, keys) / math.sqrt(queries.shape[-1])
    visible = np.arange(keys.shape[1])[None, :] <= np.asarray(query_positions)[:, None]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhqt,bthd->bqhd", weights, values)


def relative_error(approximate: np.ndarray, exact: np.ndarray) -> float:
    """``||approximate - exact||_F / ||exact||_F`` in float64."""
    exact = np.asarray(exact, np.float64)
    difference = np.asarray(approximate, np.float64) - exact
    return float(np.linalg.norm(difference) / np.linalg.norm(exact))


def attention_errors(queries, exact_keys, exact_values, stored_keys, stored_values,
                     query_positions) -> np.ndarray:
    """Attention-output relative error of stored K/V against exact K/V, per loop and layer.

    Both outputs are float64 attention of the same ``queries``; only the K/V differ.

    Args:
      queries: ``[loops, layers, B, Q, heads, head_dim]``.
      exact_keys, exact_values, stored_keys, stored_values:
        ``[loops, layers, B, T, kv_heads, head_dim]``.
      query_positions: int ``[Q]``, the position of each query (``< T``).
    Returns:
      float64 ``[loops, layers]``: Frobenius relative error over sequences,
      query positions, heads and channels.
    """
    loops, layers = queries.shape[:2]
    errors = np.zeros((loops, layers))
    for loop in range(loops):
        for layer in range(layers):
            index = (loop, layer)
            exact = causal_attention_float64(queries[index], exact_keys[index],
                                             exact_values[index], query_positions)
            stored = causal_attention_float64(queries[index], stored_keys[index],
                                              stored_values[index], query_positions)
            errors[loop, layer] = relative_error(stored, exact)
    return errors


def bfloat16_round_trip(x: jax.Array) -> jax.Array:
    """What a BF16 cache stores, as float32."""
    return jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)


def bfloat16_dense_attention(loop_index, layer_index, queries, new_keys, new_values, cache):
    """:func:`ouro.dense_attention_fn` storing K/V rounded to bfloat16 in a float32 cache.

    It computes bit for bit what :func:`ouro.dense_attention_fn` computes over a
    bfloat16 :class:`ouro.DenseLoopKVCache` (both attend in float32 over the
    same bfloat16 values), but XLA on CPU reads float32 arrays several times
    faster than bfloat16 ones.

    Args:
      loop_index, layer_index: Python ints.
      queries: ``[B, heads, head_dim]``.
      new_keys, new_values: ``[B, kv_heads, head_dim]``.
      cache: a float32 :class:`ouro.DenseLoopKVCache` holding bfloat16-rounded K/V
        (see :func:`bfloat16_loop_caches`).
    Returns:
      ``(out, cache)`` as :func:`ouro.dense_attention_fn`.
    """
    return ouro.dense_attention_fn(loop_index, layer_index, queries, bfloat16_round_trip(new_keys),
                                   bfloat16_round_trip(new_values), cache)


def bfloat16_loop_caches(keys: jax.Array, values: jax.Array, max_tokens: int
                         ) -> ouro.DenseLoopKVCache:
    """The BF16 baseline for :func:`bfloat16_dense_attention`: one cache per loop.

    Args:
      keys, values: ``[loops, layers, B, T, kv_heads, head_dim]`` from :func:`ouro.forward`.
      max_tokens: slots per sequence.
    Returns:
      A float32 :class:`ouro.DenseLoopKVCache` of bfloat16-rounded K/V, lengths ``T``.
    """
    batch, tokens = keys.shape[2], keys.shape[3]
    return ouro.DenseLoopKVCache.from_prefill(
        bfloat16_round_trip(keys), bfloat16_round_trip(values),
        jnp.full((batch,), tokens, jnp.int32), max_tokens=max_tokens, dtype=jnp.float32)


# --------------------------------------------------------------------------
# The cross-loop cache
# --------------------------------------------------------------------------


def prefill_cross_loop_cache(config: CacheConfig, keys: jax.Array, values: jax.Array
                             ) -> PagedKVCache:
    """A new cache holding sequence ``b`` of ``keys``/``values`` in slot ``b``.

    Args:
      config: the cache configuration (``max_sequences >= B``).
      keys, values: ``[loops, layers, B, T, kv_heads, head_dim]`` as
        :func:`ouro.forward` returns them.
    Returns:
      The prefilled :class:`PagedKVCache` (full pages packed).
    """
    cache = paged_cache.create(config)
    for slot in range(keys.shape[2]):
        cache = _prefill(cache, slot, jnp.swapaxes(keys[:, :, slot], 0, 1),
                        jnp.swapaxes(values[:, :, slot], 0, 1))
    paged_cache.check(cache)
    return cache


@functools.partial(jax.jit, static_argnames=("sequences", "tokens"))
def reconstruct_every_loop(cache: PagedKVCache, sequences: int, tokens: int):
    """The K/V the cache serves (reference decode), for every loop, layer and sequence.

    Returns:
      float32 keys and values ``[loops, layers, sequences, tokens, kv_heads, head_dim]``
      (slots ``0 .. sequences - 1``, positions ``0 .. tokens - 1``).
    """
    config = cache.config
    slots = jnp.arange(sequences)
    keys, values = [], []
    for loop in range(config.num_loops):
        loop_keys, loop_values = [], []
        for layer in range(config.num_layers):
            def one_slot(slot, layer=layer, loop=loop):
                return paged_cache.reconstruct(cache, layer, loop, slot)[:2]
            slot_keys, slot_values = jax.vmap(one_slot)(slots)
            loop_keys.append(slot_keys[:, :tokens])
            loop_values.append(slot_values[:, :tokens])
        keys.append(jnp.stack(loop_keys))
        values.append(jnp.stack(loop_values))
    return jnp.stack(keys), jnp.stack(values)


def packed_positions(config: CacheConfig, length: int) -> np.ndarray:
    """bool ``[length]``: positions a sequence of ``length`` committed tokens reads from pages."""
    masks = paged_cache.window_mask(config, jnp.int32(length), jnp.int32(length), length)
    return np.asarray(masks["pages"])


def packed_pages_per_sequence(cache: PagedKVCache) -> np.ndarray:
    """int ``[max_sequences]``: pages each sequence holds in the pool."""
    return np.asarray(jnp.sum(cache.block_tables >= 0, axis=1))


# --------------------------------------------------------------------------
# 4, 5. Decoding through both caches
# --------------------------------------------------------------------------


def _progress(iterable, description: str, enabled: bool):
    """``tqdm(iterable)`` on stderr when enabled and tqdm is installed; else ``iterable``."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, file=sys.stderr, leave=False, disable=None)


def decode_tokens(params: ouro.Params, config: ouro.OuroConfig, attention_fn, state,
                  input_ids: jax.Array, first_position: int, *, donate_state: bool = False,
                  description: str = "decode", progress: bool = False) -> tuple[np.ndarray, Any]:
    """Feed ``input_ids`` one step at a time through :func:`ouro.decode_step`.

    Args:
      attention_fn, state: the attention hook and its state (a cache holding
        positions ``< first_position``).
      input_ids: int32 ``[B, steps]``, the token of each step.
      first_position: the position of ``input_ids[:, 0]``.
      donate_state: let each step update the state's buffers in place (the
        ``state`` passed in must not be used afterwards).
    Returns:
      ``(logits, state)``: float32 ``[steps, B, vocab]`` (step ``s`` predicts the
      token after ``input_ids[:, s]``) and the final state.
    """
    batch, steps = input_ids.shape
    step_function = _decode_step_donating if donate_state else _decode_step
    collected = []
    for step in _progress(range(steps), description, progress):
        positions = jnp.full((batch,), first_position + step, jnp.int32)
        logits, state = step_function(params, config, input_ids[:, step], positions, attention_fn,
                                      state)
        collected.append(logits)
    return np.asarray(jnp.stack(collected)), state


def greedy_tokens(params: ouro.Params, config: ouro.OuroConfig, attention_fn, state,
                  last_logits: np.ndarray, first_position: int, steps: int, *,
                  donate_state: bool = False, description: str = "generate",
                  progress: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, Any]:
    """Greedy continuation: each step feeds the argmax of the previous logits.

    Args:
      last_logits: float ``[B, vocab]``, the prediction for ``first_position``.
      steps: tokens to generate and feed.
      donate_state: as for :func:`decode_tokens`.
    Returns:
      ``(tokens, logits, state)``: int32 ``[B, steps]`` (the fed tokens), float32
      ``[steps, B, vocab]`` (the prediction after each) and the final state.
    """
    step_function = _decode_step_donating if donate_state else _decode_step
    token = np.argmax(last_logits, axis=-1).astype(np.int32)
    tokens, collected = [], []
    for step in _progress(range(steps), description, progress):
        tokens.append(token)
        positions = jnp.full(token.shape, first_position + step, jnp.int32)
        logits, state = step_function(params, config, jnp.asarray(token), positions, attention_fn,
                                      state)
        collected.append(logits)
        token = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
    if not steps:
        return np.zeros((token.shape[0], 0), np.int32), np.zeros((0, *last_logits.shape)), state
    return np.stack(tokens, axis=1), np.asarray(jnp.stack(collected)), state


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> np.ndarray:
    """``KL(softmax(reference) || softmax(candidate))`` in nats, per leading index.

    Args:
      reference_logits, candidate_logits: float ``[..., vocab]``.
    Returns:
      float64 ``[...]``.
    """
    reference, candidate = log_softmax(reference_logits), log_softmax(candidate_logits)
    return np.sum(np.exp(reference) * (reference - candidate), axis=-1)


def next_token_agreement(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> float:
    """Fraction of positions where both argmax tokens are the same."""
    return float(np.mean(np.argmax(reference_logits, -1) == np.argmax(candidate_logits, -1)))


def leading_agreement(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> np.ndarray:
    """int ``[B]``: steps before the first argmax disagreement (``[steps, B, vocab]`` inputs)."""
    same = np.argmax(reference_logits, -1) == np.argmax(candidate_logits, -1)  # [steps, B]
    return np.where(same.all(axis=0), same.shape[0], np.argmin(same, axis=0))


def bits_per_byte(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-byte cross-entropy in bits.

    Args:
      logits: float ``[steps, B, vocab]``.
      targets: int ``[steps, B]``.
    """
    picked = np.take_along_axis(log_softmax(logits), np.asarray(targets)[..., None], axis=-1)
    return float(-np.mean(picked) / math.log(2))


def compare_caches(params: ouro.Params, config: ouro.OuroConfig, windows: np.ndarray,
                   prompt_tokens: int, generate: int = 0, page_size: int = PAGE_SIZE, *,
                   progress: bool = False) -> dict[str, Any]:
    """Decode the same tokens through four BF16 loop caches and the cross-loop cache.

    The first ``prompt_tokens`` bytes of each window are prefilled from
    :func:`ouro.forward` K/V (:func:`bfloat16_loop_caches`;
    :func:`jflashloop.paged_cache.prefill`); the other text bytes are
    decoded teacher forced, then ``generate`` greedy tokens chosen by the
    BF16 run are fed to both. The cross-loop cache packs a page (``commit``)
    each time a sequence's length reaches a multiple of ``page_size``.

    Args:
      windows: int32 ``[B, tokens + 1]``; the last byte is only a target.
    Returns:
      A dict of numpy arrays: ``exact_logits``, ``bf16_logits``,
      ``cross_loop_logits`` (float32 ``[steps, B, vocab]``; the first
      ``tokens - prompt_tokens`` steps teacher forced, ``exact`` being
      :func:`ouro.forward` in float32 and only for those), ``targets`` (int
      ``[tokens - prompt_tokens, B]``), ``generated`` (int32 ``[B, generate]``),
      ``pages_after_prefill`` and ``pages_at_end`` (int ``[B]``), the
      ``cache_config``, and the prefilled ``cross_loop_cache``, ``keys`` and
      ``values`` (``ouro.forward`` K/V of the text,
      ``[loops, layers, B, tokens, kv_heads, head_dim]``).
    """
    batch, length = windows.shape
    tokens = length - 1
    token_ids = jnp.asarray(windows[:, :tokens])
    logits, keys, values, _ = _forward(params, config, token_ids)
    prompt_keys, prompt_values = keys[:, :, :, :prompt_tokens], values[:, :, :, :prompt_tokens]
    text_ids = token_ids[:, prompt_tokens:]
    first_position = prompt_tokens

    bf16_cache = bfloat16_loop_caches(prompt_keys, prompt_values, tokens + generate)
    bf16_logits, bf16_cache = decode_tokens(
        params, config, bfloat16_dense_attention, bf16_cache, text_ids, first_position,
        donate_state=True, description="BF16 caches, text", progress=progress)
    generated, bf16_generated_logits, _ = greedy_tokens(
        params, config, bfloat16_dense_attention, bf16_cache, bf16_logits[-1], tokens, generate,
        donate_state=True, description="BF16 caches, greedy", progress=progress)

    cache_config = cross_loop_cache_config(config, batch, tokens + generate, page_size)
    prefilled = prefill_cross_loop_cache(cache_config, prompt_keys, prompt_values)
    hook = looped_paged_attention_hook(config.layers, config.loops)
    cross_loop_inputs = jnp.concatenate([text_ids, jnp.asarray(generated)], axis=1)
    cross_loop_logits, final_cache = decode_tokens(
        params, config, hook, prefilled, cross_loop_inputs, first_position,
        description="cross-loop cache", progress=progress)
    paged_cache.check(final_cache)
    return {
        "exact_logits": np.asarray(jnp.swapaxes(logits[-1, :, prompt_tokens:], 0, 1)),
        "bf16_logits": np.concatenate([bf16_logits, bf16_generated_logits], axis=0),
        "cross_loop_logits": cross_loop_logits,
        "targets": windows[:, prompt_tokens + 1:].T,
        "generated": generated,
        "pages_after_prefill": packed_pages_per_sequence(prefilled)[:batch],
        "pages_at_end": packed_pages_per_sequence(final_cache)[:batch],
        "cache_config": cache_config,
        "cross_loop_cache": prefilled,
        "keys": keys,
        "values": values,
    }


def logit_metrics(comparison: dict[str, Any]) -> dict[str, dict[str, float]]:
    """KL, agreement and bits per byte from :func:`compare_caches` output.

    Returns:
      ``{"teacher_forced": {...}, "generated": {...}}``; each holds
      ``steps``, ``kl`` (mean nats, BF16 caches as reference), ``kl_max``,
      ``agreement``; teacher forced adds ``kl_bf16_vs_exact``,
      ``kl_cross_loop_vs_exact``, ``agreement_bf16_vs_exact``,
      ``agreement_cross_loop_vs_exact`` and ``bits_per_byte_exact``,
      ``bits_per_byte_bf16``, ``bits_per_byte_cross_loop``; generated adds
      ``identical_greedy_tokens`` (mean over sequences) and its minimum.
    """
    text_steps = comparison["targets"].shape[0]
    bf16, cross_loop = comparison["bf16_logits"], comparison["cross_loop_logits"]
    exact, targets = comparison["exact_logits"], comparison["targets"]
    text_part = slice(0, text_steps)
    kl_text = kl_divergence(bf16[text_part], cross_loop[text_part])
    teacher_forced = {
        "steps": text_steps,
        "kl": float(kl_text.mean()),
        "kl_max": float(kl_text.max()),
        "agreement": next_token_agreement(bf16[text_part], cross_loop[text_part]),
        "kl_bf16_vs_exact": float(kl_divergence(exact, bf16[text_part]).mean()),
        "kl_cross_loop_vs_exact": float(kl_divergence(exact, cross_loop[text_part]).mean()),
        "agreement_bf16_vs_exact": next_token_agreement(exact, bf16[text_part]),
        "agreement_cross_loop_vs_exact": next_token_agreement(exact, cross_loop[text_part]),
        "bits_per_byte_exact": bits_per_byte(exact, targets),
        "bits_per_byte_bf16": bits_per_byte(bf16[text_part], targets),
        "bits_per_byte_cross_loop": bits_per_byte(cross_loop[text_part], targets),
    }
    generate = comparison["generated"].shape[1]
    generated = {"steps": generate}
    if generate:
        generated_part = slice(text_steps, text_steps + generate)
        kl_generated = kl_divergence(bf16[generated_part], cross_loop[generated_part])
        # The greedy tokens came from the last text prediction and the first
        # generate - 1 generated steps.
        choices = slice(text_steps - 1, text_steps - 1 + generate)
        identical = leading_agreement(bf16[choices], cross_loop[choices])
        generated.update(
            kl=float(kl_generated.mean()), kl_max=float(kl_generated.max()),
            agreement=next_token_agreement(bf16[generated_part], cross_loop[generated_part]),
            identical_greedy_tokens=float(identical.mean()),
            identical_greedy_tokens_min=int(identical.min()))
    return {"teacher_forced": teacher_forced, "generated": generated}


# --------------------------------------------------------------------------
# 6. Closed-loop vs open-loop residual encoding
# --------------------------------------------------------------------------


def sparse_row_positions(energy: np.ndarray, rows: int, page_size: int) -> np.ndarray:
    """Per page, the ``rows`` positions of largest ``energy`` (ties to the lower position).

    Args:
      energy: float ``[tokens]`` with ``tokens`` a multiple of ``page_size``.
    Returns:
      int32 ``[pages * rows]``, sorted sequence positions.
    """
    pages = energy.reshape(-1, page_size)
    chosen = np.sort(np.argsort(-pages, axis=1, kind="stable")[:, :rows], axis=1)
    return (chosen + page_size * np.arange(pages.shape[0])[:, None]).reshape(-1).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("base_spec", "residual_specs", "closed_loop"))
def _chain_reconstructions(streams, positions, *, base_spec, residual_specs, closed_loop):
    """Encode and decode residual chains of many streams.

    Args:
      streams: float32 ``[N, loops, tokens, 1, head_dim]``.
      positions: per later loop, None (dense) or int32 ``[N, rows]``.
    Returns:
      float32 ``[N, loops, tokens, 1, head_dim]``: every loop's reconstruction.
    """
    def one_stream(loops, stream_positions):
        chain = encode_chain(list(loops), base_spec, residual_specs, list(stream_positions),
                             closed_loop=closed_loop)
        return jnp.stack([decode_chain(chain, loop) for loop in range(1, len(loops) + 1)])

    return jax.vmap(one_stream)(streams, positions)


def chain_errors(keys: jax.Array, values: jax.Array, config: CacheConfig,
                 closed_loop: bool) -> dict[str, np.ndarray]:
    """Reconstruction error of every loop when encoded as :func:`encode_chain` residual chains.

    Each (sequence, KV head) stream of each layer is one chain with the codecs
    of ``config`` (so K groups of 64 tokens align with pages). A sparse loop
    keeps, per page, the rows of largest exact loop-to-loop residual energy
    ``|K_r - K_(r-1)|^2 + |V_r - V_(r-1)|^2``: the same rows in both modes,
    so only the encoding differs.

    Args:
      keys, values: ``[loops, layers, B, T, kv_heads, head_dim]`` with ``T`` a
        multiple of ``config.page_size``.
      closed_loop: passed to :func:`encode_chain`.
    Returns:
      ``{"keys": ..., "values": ...}``: float64 ``[layers, loops]`` relative errors.
    """
    keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    loops, layers, batch, tokens, heads, head_dim = keys.shape
    errors = {"keys": np.zeros((layers, loops)), "values": np.zeros((layers, loops))}
    for layer in range(layers):
        # [B * heads, loops, T, 1, D]: one stream per (sequence, head).
        def streams(x, layer=layer):
            per_head = x[:, layer].transpose(1, 3, 0, 2, 4)  # [B, heads, loops, T, D]
            return per_head.reshape(batch * heads, loops, tokens, 1, head_dim)

        layer_keys, layer_values = streams(keys), streams(values)
        energy = (np.sum(np.diff(layer_keys, axis=1) ** 2, axis=(3, 4))
                  + np.sum(np.diff(layer_values, axis=1) ** 2, axis=(3, 4)))  # [N, loops - 1, T]
        positions = []
        for loop in range(1, loops):
            storage_of_loop = config.loops[loop]
            if not storage_of_loop.is_sparse:
                positions.append(None)
                continue
            positions.append(jnp.asarray(np.stack([
                sparse_row_positions(stream_energy, storage_of_loop.sparse_rows_per_page,
                                     config.page_size)
                for stream_energy in energy[:, loop - 1]])))
        for name, data, role in (("keys", layer_keys, "key_spec"),
                                 ("values", layer_values, "value_spec")):
            specs = [getattr(loop_storage, role) for loop_storage in config.loops]
            reconstructed = np.asarray(_chain_reconstructions(
                jnp.asarray(data), tuple(positions), base_spec=specs[0],
                residual_specs=tuple(specs[1:]), closed_loop=closed_loop))
            for loop in range(loops):
                errors[name][layer, loop] = relative_error(reconstructed[:, loop], data[:, loop])
    return errors


# --------------------------------------------------------------------------
# The whole report
# --------------------------------------------------------------------------


def prefilled_cache_errors(params: ouro.Params, config: ouro.OuroConfig, windows: np.ndarray,
                           comparison: dict[str, Any], prompt_tokens: int,
                           query_positions: int) -> dict[str, Any]:
    """Attention and reconstruction errors of the prefilled caches, per loop and layer.

    Args:
      windows: int32 ``[B, tokens + 1]``, as given to :func:`compare_caches`.
      comparison: the output of :func:`compare_caches` for ``windows``.
      prompt_tokens: the prefilled length.
      query_positions: how many of the last prompt positions give queries.
    Returns:
      ``attention_error``: ``{"bf16", "cross_loop"}`` float64 ``[loops, layers]``
      (:func:`attention_errors`); ``cache_reconstruction_error``:
      ``{"keys", "values"}`` float64 ``[loops, layers]``, relative error of the
      K/V the cross-loop cache serves at the positions it reads from pages (None
      when there are none); ``positions_from_pages``: their count.
    """
    batch = windows.shape[0]
    prompt = slice(0, prompt_tokens)
    exact_keys = np.asarray(comparison["keys"][:, :, :, prompt])
    exact_values = np.asarray(comparison["values"][:, :, :, prompt])
    stored_keys, stored_values = reconstruct_every_loop(comparison["cross_loop_cache"], batch,
                                                        prompt_tokens)
    stored_keys, stored_values = np.asarray(stored_keys), np.asarray(stored_values)
    queries = np.asarray(model_queries(params, config, jnp.asarray(windows[:, prompt]),
                                       query_positions))
    positions = np.arange(prompt_tokens - query_positions, prompt_tokens)
    attention = {
        "bf16": attention_errors(queries, exact_keys, exact_values,
                                 np.asarray(bfloat16_round_trip(exact_keys)),
                                 np.asarray(bfloat16_round_trip(exact_values)), positions),
        "cross_loop": attention_errors(queries, exact_keys, exact_values, stored_keys,
                                       stored_values, positions),
    }
    from_pages = packed_positions(comparison["cache_config"], prompt_tokens)
    reconstruction = None
    if from_pages.any():
        reconstruction = {
            name: np.array([[relative_error(stored[loop, layer][:, from_pages],
                                            exact[loop, layer][:, from_pages])
                             for layer in range(config.layers)] for loop in range(config.loops)])
            for name, stored, exact in (("keys", stored_keys, exact_keys),
                                        ("values", stored_values, exact_values))
        }
    return {"attention_error": attention, "cache_reconstruction_error": reconstruction,
            "positions_from_pages": int(from_pages.sum())}


def run_report(params: ouro.Params, config: ouro.OuroConfig, held_out: np.ndarray,
               settings: ReportSettings, *, progress: bool = False) -> dict[str, Any]:
    """Every measurement of the report (see the module docstring).

    Args:
      held_out: uint8 held-out bytes.
    Returns:
      A dict: ``settings``, ``cache_config``, ``cosine`` (``{"keys", "values"}``
      float64 ``[layers, loops - 1]``), ``storage`` (:func:`storage_summary`),
      the entries of :func:`prefilled_cache_errors`, ``logits``
      (:func:`logit_metrics`), ``pages_after_prefill``, ``pages_at_end``
      (int ``[B]``), ``chain_errors`` (``{"open", "closed"}`` of
      :func:`chain_errors`), ``chain_tokens``, ``seconds``.
    """
    start_time = time.perf_counter()
    windows = held_out_windows(held_out, settings.sequences, settings.tokens + 1, settings.seed)
    comparison = compare_caches(params, config, windows, settings.prompt_tokens,
                                settings.generate, settings.page_size, progress=progress)
    cache_config = comparison["cache_config"]
    keys, values = comparison["keys"], comparison["values"]
    whole_pages = (settings.tokens // settings.page_size) * settings.page_size
    page_keys, page_values = keys[:, :, :, :whole_pages], values[:, :, :, :whole_pages]
    return {
        "settings": settings,
        "cache_config": cache_config,
        "cosine": {"keys": successive_loop_cosine(keys), "values": successive_loop_cosine(values)},
        "storage": storage_summary(cache_config, settings.total_tokens),
        **prefilled_cache_errors(params, config, windows, comparison, settings.prompt_tokens,
                                 settings.query_positions),
        "logits": logit_metrics(comparison),
        "pages_after_prefill": comparison["pages_after_prefill"],
        "pages_at_end": comparison["pages_at_end"],
        "chain_errors": {
            "open": chain_errors(page_keys, page_values, cache_config, closed_loop=False),
            "closed": chain_errors(page_keys, page_values, cache_config, closed_loop=True),
        },
        "chain_tokens": whole_pages,
        "seconds": time.perf_counter() - start_time,
    }


def _row(cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


PAGE_SIZE_REASON = (
    "FlashLoop's 64-token K group: every K group (one channel over 64 tokens) fills exactly one "
    "page at 4.5 bits per element; 32-token pages would need 32-token K groups (5 bits per "
    "element) and would round loop 4's 10 % up to 4 of 32 rows (12.5 %)"
)


def _header_section(results: dict[str, Any], header_lines: list[str]) -> list[str]:
    settings: ReportSettings = results["settings"]
    config: CacheConfig = results["cache_config"]
    teacher_steps = settings.tokens - settings.prompt_tokens
    reason = (PAGE_SIZE_REASON if config.page_size == PAGE_SIZE
              else f"K groups of {config.loops[0].key_spec.group_size} tokens")
    packed_by_commit = results["pages_at_end"] - results["pages_after_prefill"]
    return [
        "# Looped model on the cross-loop 4-bit cache vs four BF16 caches", "", *header_lines,
        f"- run: {settings.sequences} sequences; the first {settings.prompt_tokens} bytes "
        f"prefilled (`paged_cache.prefill` of `ouro.forward` K/V), {teacher_steps} bytes decoded "
        f"teacher forced, then {settings.generate} greedy tokens chosen by the BF16 run and fed "
        "to both caches.",
        f"- cross-loop cache: `CacheConfig.flashloop`, page size {config.page_size} ({reason}); "
        f"{config.sink_tokens} sink + {config.recent_tokens} recent tokens unquantized. Pages per "
        f"sequence: {_per_sequence(results['pages_after_prefill'])} packed by prefill, "
        f"{_per_sequence(packed_by_commit)} packed by `commit` during decoding, "
        f"{_per_sequence(results['pages_at_end'])} at the end.",
        "- BF16 baseline: `ouro.DenseLoopKVCache` of bfloat16 K/V, one cache per loop "
        "(held in float32 arrays, which XLA on CPU reads faster: the logits are bit for bit "
        "those of a bfloat16 array).",
        f"- {describe_sparse_rule(config)}",
        "",
    ]


def _cosine_section(results: dict[str, Any]) -> list[str]:
    cosine = results["cosine"]
    layers, transitions = cosine["keys"].shape
    steps = [f"{loop}→{loop + 1}" for loop in range(1, transitions + 1)]
    lines = ["## 1. Successive loops: cosine similarity of K and V", "",
             f"Mean over sequences, all {results['settings'].tokens} text tokens and KV heads "
             "(real looped K/V of `ouro.forward`).", "",
             _row(["layer", *(f"K {step}" for step in steps), *(f"V {step}" for step in steps)]),
             _row(["---"] * (1 + 2 * transitions))]
    for layer in range(layers):
        lines.append(_row([layer + 1, *(f"{value:.3f}" for value in cosine["keys"][layer]),
                           *(f"{value:.3f}" for value in cosine["values"][layer])]))
    lines.append(_row(["mean", *(f"{value:.3f}" for value in cosine["keys"].mean(axis=0)),
                       *(f"{value:.3f}" for value in cosine["values"].mean(axis=0))]))
    return [*lines, ""]


def _storage_section(results: dict[str, Any]) -> list[str]:
    summary = results["storage"]
    ratio = summary["ratio"]
    return ["## 2. KV bytes per token (all layers, K and V, `jflashloop.storage`)", "",
            summary["table"], "",
            f"Full pages: {summary['bf16_bytes_per_token']:,} / "
            f"{summary['cache_bytes_per_token']:,.4f} bytes per token = exactly "
            f"{ratio.numerator}/{ratio.denominator} = {float(ratio):.4f}x smaller than four "
            "BF16 loop caches.", ""]


def _attention_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    attention = results["attention_error"]
    first_query = settings.prompt_tokens - settings.query_positions
    lines = ["## 3. Attention-output relative error per loop", "",
             f"Queries: the model's own, at the last {settings.query_positions} prompt positions "
             f"({first_query}..{settings.prompt_tokens - 1}); K/V: `paged_cache.reconstruct` of "
             "the prefilled cache (or bfloat16-rounded K/V); reference: float64 attention on the "
             "unquantized float32 K/V. Frobenius relative error, mean over layers.", "",
             _row(["loop", "four BF16 caches", "cross-loop cache"]), _row(["---"] * 3)]
    for loop in range(attention["bf16"].shape[0]):
        lines.append(_row([loop + 1, f"{attention['bf16'][loop].mean():.2e}",
                           f"{attention['cross_loop'][loop].mean():.2e}"]))
    reconstruction = results["cache_reconstruction_error"]
    if reconstruction is not None:
        per_loop = "; ".join(
            f"loop {loop + 1} K {reconstruction['keys'][loop].mean():.4f} "
            f"V {reconstruction['values'][loop].mean():.4f}"
            for loop in range(reconstruction["keys"].shape[0]))
        lines += ["", f"K/V reconstruction error of the cache at the "
                  f"{results['positions_from_pages']} prompt positions read from pages "
                  f"(mean over layers): {per_loop}."]
    return [*lines, ""]


def _logits_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    teacher_forced, generated = results["logits"]["teacher_forced"], results["logits"]["generated"]
    lines = ["## 4. Logits through the decode loop (`ouro.decode_step`)", "",
             "KL(BF16 caches ‖ cross-loop cache) in nats, mean over steps and sequences; "
             "agreement: same argmax next token.", "",
             _row(["steps", "count", "mean KL (nats)", "max KL", "next-token agreement"]),
             _row(["---"] * 5)]
    for name, metrics in (("teacher forced", teacher_forced), ("greedy generated", generated)):
        if metrics["steps"]:
            lines.append(_row([name, metrics["steps"] * settings.sequences,
                               f"{metrics['kl']:.2e}", f"{metrics['kl_max']:.2e}",
                               f"{metrics['agreement']:.2%}"]))
    if generated["steps"]:
        lines += ["", "Greedy continuation: the cross-loop cache's own greedy run repeats the "
                  f"BF16 run's first {generated['identical_greedy_tokens']:.1f} of "
                  f"{settings.generate} tokens on average (minimum "
                  f"{generated['identical_greedy_tokens_min']})."]
    lines += ["", "Against `ouro.forward` in float32 (no cache), teacher forced: KL "
              f"{teacher_forced['kl_bf16_vs_exact']:.2e} (BF16 caches) vs "
              f"{teacher_forced['kl_cross_loop_vs_exact']:.2e} (cross-loop cache) nats; "
              f"agreement {teacher_forced['agreement_bf16_vs_exact']:.2%} vs "
              f"{teacher_forced['agreement_cross_loop_vs_exact']:.2%}.", ""]
    return lines


def _bits_per_byte_section(results: dict[str, Any]) -> list[str]:
    settings: ReportSettings = results["settings"]
    teacher_forced = results["logits"]["teacher_forced"]
    bits = [teacher_forced[f"bits_per_byte_{name}"] for name in ("exact", "bf16", "cross_loop")]
    return ["## 5. Held-out bits per byte (teacher forced, through the decode loop)", "",
            "Cross-entropy in bits per byte (base 2; perplexity per byte = 2^bits) over the "
            f"{teacher_forced['steps'] * settings.sequences} teacher-forced predictions.", "",
            _row(["", "float32 forward (no cache)", "four BF16 caches", "cross-loop cache"]),
            _row(["---"] * 4),
            _row(["bits per byte", *(f"{value:.4f}" for value in bits)]),
            _row(["nats per byte", *(f"{value * math.log(2):.4f}" for value in bits)]),
            _row(["perplexity per byte", *(f"{2**value:.3f}" for value in bits)]), ""]


def _chain_section(results: dict[str, Any]) -> list[str]:
    chains = results["chain_errors"]
    lines = ["## 6. Closed-loop vs open-loop residual encoding", "",
             "`jflashloop.residual.encode_chain` on the real looped K/V of each layer (first "
             f"{results['chain_tokens']} text tokens, one chain per sequence and KV head, the "
             "cache's codecs: K groups fall on page boundaries). Sparse loops keep the same rows "
             "in both modes (per page, largest exact loop-to-loop residual energy). Open loop "
             "encodes each residual against the exact previous loop, closed loop against its "
             "reconstruction (what the cache does). Relative reconstruction error, mean over "
             "layers; saved = 1 - closed / open.", "",
             _row(["loop", "K open loop", "K closed loop", "V open loop", "V closed loop",
                   "K saved", "V saved"]),
             _row(["---"] * 7)]
    for loop in range(chains["open"]["keys"].shape[1]):
        open_loop = {name: chains["open"][name][:, loop].mean() for name in ("keys", "values")}
        closed = {name: chains["closed"][name][:, loop].mean() for name in ("keys", "values")}
        lines.append(_row([loop + 1,
                           f"{open_loop['keys']:.4f}", f"{closed['keys']:.4f}",
                           f"{open_loop['values']:.4f}", f"{closed['values']:.4f}",
                           f"{1 - closed['keys'] / open_loop['keys']:.1%}",
                           f"{1 - closed['values'] / open_loop['values']:.1%}"]))
    return [*lines, ""]


def format_report(results: dict[str, Any], header_lines: list[str]) -> str:
    """The report as markdown (``header_lines`` describe the checkpoint and text)."""
    lines = [
        *_header_section(results, header_lines),
        *_cosine_section(results),
        *_storage_section(results),
        *_attention_section(results),
        *_logits_section(results),
        *_bits_per_byte_section(results),
        *_chain_section(results),
        f"Report computed in {results['seconds']:.0f} s on {jax.default_backend()}.",
    ]
    return "\n".join(lines) + "\n"


def _per_sequence(values) -> str:
    values = [int(v) for v in np.asarray(values)]
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def describe_inputs(checkpoint: Checkpoint, path: Path, corpus_description: dict[str, Any],
                    settings: ReportSettings) -> list[str]:
    """Header lines: the checkpoint, its training and the held-out text."""
    config, info = checkpoint.config, checkpoint.info
    trained = info.get("data", {})
    losses = info.get("held_out_loss_nats_per_byte_by_loops", {})
    training = ", ".join(f"{key}={value}" for key, value in info.get("arguments", {}).items()
                         if key in ("steps", "batch", "seq", "lr", "compute_dtype"))
    lines = [
        f"- checkpoint: `{path}` (arrays sha256 {checkpoint.sha256[:16]}…), "
        f"{ouro.param_count(checkpoint.params):,} parameters, {config.layers} layers x "
        f"{config.loops} loops, {config.heads} heads / {config.kv_heads} KV heads of "
        f"{config.head_dim}; trained {training or 'with unrecorded settings'} on "
        f"{info.get('backend', '?')}.",
    ]
    if losses:
        lines.append("- its recorded held-out loss by loop count (nats/byte): " + ", ".join(
            f"{loops}: {float(loss):.4f}" for loops, loss in losses.items()) + ".")
    lines.append(
        f"- text: {settings.sequences} windows of {settings.tokens} (+1 target) bytes at random "
        f"offsets (seed {settings.seed}) of the held-out split (sorted standard-library .py "
        f"files with index % {HELD_OUT_EVERY} == 0; {corpus_description['held_out_files']} files, "
        f"{corpus_description['held_out_bytes']:,} bytes, Python "
        f"{corpus_description['python_version']}).")
    recorded = trained.get("held_out_sha256")
    if recorded and recorded != corpus_description["held_out_sha256"]:
        lines.append(
            f"- WARNING: these held-out bytes differ from the checkpoint's (trained on Python "
            f"{trained.get('python_version', '?')}): some may have been training data.")
    return lines


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ReportSettings()
    parser = argparse.ArgumentParser(
        prog="jflashloop loops",
        description="A looped model (tiny Ouro) on the cross-loop 4-bit cache vs four BF16 caches.")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="ouro checkpoint (.npz; default: the packaged ouro_tiny.npz)")
    parser.add_argument("--tokens", type=int, default=defaults.tokens,
                        help="held-out bytes per sequence (prompt + teacher-forced)")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens,
                        help="bytes prefilled into the caches before decoding")
    parser.add_argument("--generate", type=int, default=defaults.generate,
                        help="greedy tokens generated after the text")
    parser.add_argument("--sequences", type=int, default=defaults.sequences,
                        help="held-out windows decoded as one batch")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="picks the windows")
    parser.add_argument("--stdlib", type=Path, default=default_root(),
                        help="standard-library folder of the text (default: this Python's)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the report to this markdown file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        settings = ReportSettings(tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                                  generate=args.generate, sequences=args.sequences, seed=args.seed)
    except ValueError as error:
        print(f"jflashloop loops: {error}", file=sys.stderr)
        return 2
    if not args.checkpoint.exists():
        print(f"jflashloop loops: no checkpoint at {args.checkpoint}; train one with "
              "`python bench/train_ouro.py` or pass --checkpoint", file=sys.stderr)
        return 1
    checkpoint = load_checkpoint(args.checkpoint)
    if settings.total_tokens > checkpoint.config.max_position:
        print(f"jflashloop loops: {settings.total_tokens} tokens exceed max_position="
              f"{checkpoint.config.max_position}", file=sys.stderr)
        return 2
    corpus = load_corpus(args.stdlib)
    results = run_report(checkpoint.params, checkpoint.config, corpus.held_out, settings,
                         progress=not args.no_progress)
    report = format_report(results, describe_inputs(checkpoint, args.checkpoint,
                                                    corpus.description, settings))
    print(report, end="")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
