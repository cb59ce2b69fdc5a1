"""Run a Llama-style model's decode step on a BF16 dense cache or a jflashloop cache.

Both start from the exact K/V of a prompt prefix (one :func:`llama.prefill`)
and then decode one token at a time, so pages of the jflashloop cache are
packed by quantize-on-write as they fill, exactly as in serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import Policy, paged_cache
from . import cache_hooks, llama

Decoder = Callable[[jax.Array, jax.Array, object], tuple[jax.Array, object]]


@dataclasses.dataclass(frozen=True)
class CachedModel:
    """A loaded model and the capacity of the caches built for it."""

    params: dict
    config: llama.LlamaConfig
    max_tokens: int

    def _prefix_kv(self, token_ids, prefix: int):
        _, keys, values, _ = llama.prefill(self.params, self.config, jnp.asarray(token_ids[:prefix], jnp.int32))
        return keys, values  # [layers, prefix, kv_heads, D]

    def dense(self, token_ids, prefix: int, dtype=jnp.bfloat16) -> tuple[Decoder, llama.DenseKVCache]:
        """A decoder over an unquantized ``dtype`` cache holding ``token_ids[:prefix]``."""
        keys, values = self._prefix_kv(token_ids, prefix)
        state = llama.DenseKVCache.from_prefill(keys, values, self.max_tokens, dtype)

        def decode(token, position, state):
            return llama.decode_step(self.params, self.config, token, position, llama.dense_attention_fn, state)

        return decode, state

    def paged(
        self, policy: Policy, token_ids, prefix: int, *, implementation: str | None = None,
        prefill_chunk: int | None = None,
    ) -> tuple[Decoder, paged_cache.PagedKVCache]:
        """A decoder over a jflashloop cache (``policy``) holding ``token_ids[:prefix]``.

        ``prefill_chunk``: build the cache by chunked prefill (chunks of that
        many tokens through :func:`llama.chunk_step` and
        :func:`jflashloop.chunk_attention`, each appended with
        ``append_tokens``), as a server does; None: one exact prefill.
        """
        config = policy.cache_config(
            num_layers=self.config.num_layers, num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim, max_tokens=self.max_tokens,
        )
        if prefill_chunk is None:
            keys, values = self._prefix_kv(token_ids, prefix)
            state = jax.jit(cache_hooks.prefill_one_loop)(paged_cache.create(config), 0, keys, values, prefix)
        else:
            state = chunked_prefill(self.params, self.config, paged_cache.create(config), token_ids[:prefix],
                                    prefill_chunk, implementation=implementation)
        hook = cache_hooks.paged_attention_hook(self.config.num_layers, implementation)

        def decode(token, position, state):
            return llama.decode_step(self.params, self.config, token, position, hook, state)

        return decode, state


def chunked_prefill(params, config: llama.LlamaConfig, cache: paged_cache.PagedKVCache, token_ids, chunk: int,
                    *, implementation: str | None = None) -> paged_cache.PagedKVCache:
    """Put ``token_ids`` into slot 0 of an empty one-loop ``cache`` in chunks of ``chunk`` tokens.

    Each chunk attends over what the cache holds (packed pages and windows)
    and itself (:func:`jflashloop.chunk_attention`), then is appended
    (``append_tokens``); the last chunk is padded to ``chunk`` tokens, its
    padding never stored. One compilation serves every chunk.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    c = cache.config
    empty = jnp.zeros((c.num_layers, 1, 1, c.num_kv_heads, c.head_dim), jnp.float32)
    cache = paged_cache.prefill(cache, 0, empty, empty, 0)  # slot 0 active, no tokens
    hook = cache_hooks.paged_chunk_attention_hook(implementation)

    @jax.jit
    def step(cache, tokens, start, count):
        batch = c.max_sequences
        ids = jnp.zeros((batch, chunk), jnp.int32).at[0].set(tokens)
        counts = jnp.zeros((batch,), jnp.int32).at[0].set(count)
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
        _, keys, values = llama.chunk_step(params, config, ids, positions, hook, (cache, counts))
        return cache_hooks.append_chunk_one_loop(cache, keys, values, counts, implementation=implementation)

    token_ids = np.asarray(token_ids, np.int32)
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        padded = np.zeros((chunk,), np.int32)
        padded[: len(piece)] = piece
        cache = step(cache, jnp.asarray(padded), jnp.int32(start), jnp.int32(len(piece)))
    return cache


def greedy_continuation(
    decode: Decoder, state, prompt_ids, prefix: int, steps: int, *, progress: Callable | None = None
) -> tuple[list[int], np.ndarray]:
    """Feed ``prompt_ids[prefix:]``, then choose ``steps`` tokens greedily.

    Returns:
      ``(generated, logits)``: the token ids and float32 ``[steps, vocab]``
      logits each was chosen from.
    """
    logits = None
    for position in range(prefix, len(prompt_ids)):
        token = jnp.asarray([prompt_ids[position]], jnp.int32)
        logits, state = decode(token, jnp.asarray([position], jnp.int32), state)
    generated, rows = [], []
    position = len(prompt_ids)
    for index in range(steps):
        rows.append(np.asarray(logits[0], np.float32))
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        generated.append(int(token[0]))
        if index + 1 < steps:
            logits, state = decode(token, jnp.asarray([position], jnp.int32), state)
            position += 1
        if progress is not None:
            progress()
    return generated, np.stack(rows)


def ngram_draft(context, count: int, *, longest: int = 3) -> list[int]:
    """Up to ``count`` draft tokens: what followed the latest earlier occurrence of the context's last
    ``n`` tokens (``n = longest .. 1``, the longest that occurred); ``[]`` when none did."""
    context = list(context)
    for n in range(min(longest, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + count]
    return []


def speculative_greedy(params, config: llama.LlamaConfig, cache: paged_cache.PagedKVCache, prompt_ids, steps: int,
                       *, draft_tokens: int = 4, draft: Callable | None = None,
                       implementation: str | None = None) -> tuple[list[int], list[int]]:
    """Greedy decoding with drafted tokens verified in one chunk per step (slot 0 of a one-loop cache).

    ``cache`` holds ``prompt_ids[:-1]``. Each step runs the last token and
    ``draft_tokens`` drafted ones (``draft(context, count)``, default
    :func:`ngram_draft`) through :func:`llama.chunk_step` over the cache,
    keeps the drafts that equal the greedy choice, adds the greedy token
    after them, and appends only the kept tokens (``append_tokens``), so
    rejected drafts never touch the cache. Every token emitted is the
    argmax of the model's logits after its predecessors: the output is greedy
    decoding's, up to the rounding of the chunk's own K/V (bfloat16 windows).

    Returns:
      ``(generated, accepted)``: ``steps`` token ids, and the drafts kept at each step.
    """
    draft = ngram_draft if draft is None else draft
    chunk = draft_tokens + 1
    c = cache.config
    hook = cache_hooks.paged_chunk_attention_hook(implementation)

    @jax.jit
    def verify(cache, tokens, start):
        ids = jnp.zeros((c.max_sequences, chunk), jnp.int32).at[0].set(tokens)
        counts = jnp.zeros((c.max_sequences,), jnp.int32).at[0].set(chunk)
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (c.max_sequences, chunk))
        logits, keys, values = llama.chunk_step(params, config, ids, positions, hook, (cache, counts))
        return jnp.argmax(logits[0], axis=-1).astype(jnp.int32), keys, values

    @jax.jit
    def keep(cache, keys, values, kept):
        counts = jnp.zeros((c.max_sequences,), jnp.int32).at[0].set(kept)
        return cache_hooks.append_chunk_one_loop(cache, keys, values, counts, implementation=implementation)

    context = [int(t) for t in prompt_ids]
    generated, accepted = [], []
    while len(generated) < steps:
        proposal = (list(draft(context, draft_tokens)) + [0] * draft_tokens)[:draft_tokens]
        tokens = jnp.asarray([context[-1], *proposal], jnp.int32)
        choices, keys, values = verify(cache, tokens, jnp.int32(len(context) - 1))
        choices = [int(t) for t in np.asarray(choices)]
        kept = 0
        while kept < draft_tokens and proposal[kept] == choices[kept]:
            kept += 1
        new = [*proposal[:kept], choices[kept]]
        cache = keep(cache, keys, values, jnp.int32(kept + 1))  # the last token and the kept drafts
        context += new
        generated += new
        accepted.append(kept)
    return generated[:steps], accepted
