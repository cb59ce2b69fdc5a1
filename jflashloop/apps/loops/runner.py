"""Runs the looped model through the cross-loop cache and four BF16 caches.

The report's inputs (:class:`ReportSettings`, :func:`held_out_windows`), the
two caches (:func:`cross_loop_cache_config`, :func:`prefill_cross_loop_cache`;
:func:`bfloat16_loop_caches` with :func:`bfloat16_dense_attention`), decoding
through both (:func:`decode_tokens`, :func:`greedy_tokens`,
:func:`compare_caches`), the model's own queries (:func:`model_queries`) and
:func:`run_report`, which gathers every measurement of
:mod:`jflashloop.apps.loops.metrics`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import CacheConfig, paged_cache
from ...models import ouro
from ...models.cache_hooks import looped_paged_attention_hook
from ...models.checkpoint import PACKAGED_CHECKPOINT
from ...paged_cache import PagedKVCache
from ..float64_metrics import relative_error
from ..progress import iterate
from .metrics import (
    attention_errors,
    chain_errors,
    logit_metrics,
    packed_positions,
    storage_summary,
    successive_loop_cosine,
)

DEFAULT_CHECKPOINT = PACKAGED_CHECKPOINT
PAGE_SIZE = 64
RECENT_TOKENS = 16
"""The report's recent window (bench/LOOPS.md was measured with 4 sink + 16 recent tokens, which
leaves more positions to the pages than the library's default window of one page)."""

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
    model: ouro.OuroConfig, sequences: int, max_tokens: int, page_size: int = PAGE_SIZE,
    recent_tokens: int | None = RECENT_TOKENS,
) -> CacheConfig:
    """:meth:`CacheConfig.flashloop` for ``model``, with room for ``sequences`` x ``max_tokens``."""
    pages_per_sequence = math.ceil(max_tokens / page_size)
    return CacheConfig.flashloop(
        num_layers=model.layers, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
        num_loops=model.loops, num_pages=sequences * pages_per_sequence,
        max_sequences=sequences, max_pages_per_sequence=pages_per_sequence, page_size=page_size,
        recent_tokens=recent_tokens,
    )


# --------------------------------------------------------------------------
# The BF16 baseline and the cross-loop cache
# --------------------------------------------------------------------------


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


def packed_pages_per_sequence(cache: PagedKVCache) -> np.ndarray:
    """int ``[max_sequences]``: pages each sequence holds in the pool."""
    return np.asarray(jnp.sum(cache.block_tables >= 0, axis=1))


# --------------------------------------------------------------------------
# Decoding through both caches
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
    for step in iterate(range(steps), description, progress):
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
    for step in iterate(range(steps), description, progress):
        tokens.append(token)
        positions = jnp.full(token.shape, first_position + step, jnp.int32)
        logits, state = step_function(params, config, jnp.asarray(token), positions, attention_fn,
                                      state)
        collected.append(logits)
        token = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
    if not steps:
        return np.zeros((token.shape[0], 0), np.int32), np.zeros((0, *last_logits.shape)), state
    return np.stack(tokens, axis=1), np.asarray(jnp.stack(collected)), state


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
