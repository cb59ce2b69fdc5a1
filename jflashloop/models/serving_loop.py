"""Many decode steps in one compiled call: the model, its KV cache and sampling, all on the device.

:func:`generate` runs ``steps`` decode steps inside one ``jax.lax.scan``.
Each step runs every layer of the model through its attention hook (the
hook writes the token's K/V into the cache and attends: for a
:class:`~jflashloop.PagedKVCache`, :func:`jflashloop.models.cache_hooks.paged_attention_hook`
writes with ``write_token``, attends with :func:`jflashloop.decode_attention`
and commits once per step), samples the next token of every sequence on
the device (greedy, or categorical with a key) and feeds it to the next
step. The :class:`DecodeState` is donated, so the cache is updated in place,
and nothing returns to the host between tokens.

A decoder over a paged cache (:meth:`LlamaDecoder.paged`,
:meth:`OuroDecoder.paged`) commits each step's token at the start of the
next step, before any attention reads the page pool
(:func:`jflashloop.models.cache_hooks.commit_pending`; the module docstring
of :mod:`jflashloop.models.cache_hooks` says why: a commit after the reads
makes XLA copy the pool every step). Between steps the cache therefore holds
one written, uncommitted token (``DecodeState.pending``); :func:`generate`
returns a settled state (:func:`settle`).

A decoder is a frozen (hashable) description of the model's decode step:
:class:`LlamaDecoder` wraps :func:`jflashloop.models.llama.decode_step`,
:class:`OuroDecoder` wraps :func:`jflashloop.models.ouro.decode_step`; each
takes the attention hook of its cache. Equal decoders share one compilation.

Example (greedy, 16 tokens of a one-loop model over a paged cache)::

    decoder = LlamaDecoder.paged(config)
    state = DecodeState.start(last_prompt_tokens, prompt_lengths - 1, cache)
    state, tokens = generate(params, state, decoder=decoder, steps=16)   # tokens int32 [16, B]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import cache_hooks, llama, ouro

CommitFn = Callable[[Any, jax.Array], Any]


@dataclasses.dataclass(frozen=True)
class LlamaDecoder:
    """:func:`jflashloop.models.llama.decode_step` with a fixed config and attention hook.

    Attributes:
      config: the model's :class:`~jflashloop.models.llama.LlamaConfig`.
      attention_fn: the hook ``(layer, q, k_new, v_new, cache) -> (out, cache)``
        (pass the same function object every time, e.g. from
        :func:`jflashloop.models.cache_hooks.paged_attention_hook`).
      commit_fn: None (the hook completes each step's token itself), or
        ``(cache, pending) -> cache``, which commits a pending token (bool
        scalar ``pending``) and runs at the start of every step and in
        :func:`settle`, for a hook that leaves its token pending.
    """

    config: llama.LlamaConfig
    attention_fn: Callable
    commit_fn: CommitFn | None = None

    @classmethod
    def paged(cls, config: llama.LlamaConfig, implementation: str | None = None, kernel_config=None) -> LlamaDecoder:
        """A decoder over a one-loop :class:`~jflashloop.PagedKVCache`: ``write_token`` and
        :func:`jflashloop.decode_attention` per layer, the token committed at the start of the next step."""
        hook = cache_hooks.paged_attention_hook(config.num_layers, implementation, kernel_config, commit=False)
        return cls(config, hook, cache_hooks.commit_pending)

    def __call__(self, params, token_ids: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """``(logits float32 [B, vocab], cache)`` for ``token_ids``, ``positions`` int32 ``[B]``."""
        return llama.decode_step(params, self.config, token_ids, positions, self.attention_fn, cache)


@dataclasses.dataclass(frozen=True)
class OuroDecoder:
    """:func:`jflashloop.models.ouro.decode_step` with a fixed config, hook and loop count.

    Attributes:
      config: the model's :class:`~jflashloop.models.ouro.OuroConfig`.
      attention_fn: the hook ``(loop, layer, q, k_new, v_new, cache) -> (out, cache)``.
      loops: loops run per step (None: ``config.loops``).
      commit_fn: as for :class:`LlamaDecoder`.
    """

    config: ouro.OuroConfig
    attention_fn: Callable
    loops: int | None = None
    commit_fn: CommitFn | None = None

    @classmethod
    def paged(cls, config: ouro.OuroConfig, loops: int | None = None, implementation: str | None = None,
              kernel_config=None) -> OuroDecoder:
        """A decoder over a cross-loop :class:`~jflashloop.PagedKVCache` of ``loops`` loops (default
        ``config.loops``): as :meth:`LlamaDecoder.paged`, loop ``r`` attending over the cache's loop ``r``."""
        count = config.loops if loops is None else loops
        hook = cache_hooks.looped_paged_attention_hook(config.layers, count, implementation, kernel_config,
                                                       commit=False)
        return cls(config, hook, loops, cache_hooks.commit_pending)

    def __call__(self, params, token_ids: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """``(logits float32 [B, vocab], cache)``: the exit logits of the last loop."""
        return ouro.decode_step(params, self.config, token_ids, positions, self.attention_fn, cache, self.loops)


Decoder = LlamaDecoder | OuroDecoder


class DecodeState(NamedTuple):
    """What one decode step reads and writes (a pytree; donated by :func:`generate`)."""

    tokens: jax.Array  # int32 [B]: the newest token of each sequence, the next step's input
    positions: jax.Array  # int32 [B]: its position (tokens cached before it)
    key: jax.Array  # a jax.random key: split once per step for sampling
    cache: Any  # the attention hook's cache (PagedKVCache, DenseLayerKVCache, ...)
    pending: jax.Array  # bool []: the cache holds the last step's token uncommitted (decoders with a commit_fn)

    @classmethod
    def start(cls, tokens, positions, cache, key: jax.Array | None = None) -> DecodeState:
        """A state that feeds ``tokens`` (int ``[B]``) at ``positions`` (int ``[B]``) next.

        ``key`` defaults to ``jax.random.key(0)`` (unused by greedy decoding).
        """
        key = jax.random.key(0) if key is None else key
        return cls(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), key, cache,
                   jnp.zeros((), bool))


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0) -> jax.Array:
    """The next token of every sequence.

    Args:
      logits: float ``[B, vocab]``.
      key: a ``jax.random`` key (unused when ``temperature == 0``).
      temperature: 0 for greedy (argmax, the lowest id among ties), else
        categorical sampling from ``softmax(logits / temperature)`` (static).

    Returns:
      int32 ``[B]``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / jnp.float32(temperature)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def decode_step(
    params, state: DecodeState, *, decoder: Decoder, temperature: float = 0.0
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One decode step: the model over ``state.tokens``, then sampling (pure; jit it or use :func:`generate`).

    A decoder with a ``commit_fn`` first commits the previous step's pending
    token and leaves this step's pending (:func:`settle` commits it).

    Returns:
      ``(state, tokens, logits)``: the next state (its ``tokens`` the sampled
      ones, ``positions + 1``, the key split, the updated cache), the sampled
      int32 ``[B]`` and the float32 ``[B, vocab]`` logits they came from.
    """
    cache = state.cache
    if decoder.commit_fn is not None:
        cache = decoder.commit_fn(cache, state.pending)
    logits, cache = decoder(params, state.tokens, state.positions, cache)
    key, sample_key = jax.random.split(state.key)
    tokens = sample(logits, sample_key, temperature)
    pending = jnp.asarray(decoder.commit_fn is not None)
    return DecodeState(tokens, state.positions + 1, key, cache, pending), tokens, logits


def settle(state: DecodeState, *, decoder: Decoder) -> DecodeState:
    """``state`` with its pending token committed (unchanged for a decoder without ``commit_fn``)."""
    if decoder.commit_fn is None:
        return state
    return state._replace(cache=decoder.commit_fn(state.cache, state.pending), pending=jnp.zeros((), bool))


@functools.partial(
    jax.jit, static_argnames=("decoder", "steps", "temperature", "return_logits"), donate_argnames=("state",)
)
def generate(
    params, state: DecodeState, *, decoder: Decoder, steps: int, temperature: float = 0.0,
    return_logits: bool = False,
) -> tuple[DecodeState, jax.Array] | tuple[DecodeState, jax.Array, jax.Array]:
    """``steps`` decode steps in one compiled call (a ``lax.scan``; ``state`` is donated).

    Step ``i`` feeds each sequence's newest token at its position, runs the
    model through its hook (which stores the token's K/V and attends) and
    samples the next token, which step ``i + 1`` feeds (:func:`decode_step`).
    Nothing leaves the device between steps; one compilation per (decoder,
    steps, temperature, shapes). The returned state is settled (its cache
    holds every step's token, committed).

    Args:
      params: the model's parameter pytree.
      state: :class:`DecodeState` (donated: do not reuse the argument; use the returned state).
      decoder: :class:`LlamaDecoder` or :class:`OuroDecoder` (static).
      steps: decode steps (static, >= 1).
      temperature: 0 for greedy decoding, else categorical sampling (static).
      return_logits: also return every step's logits (static; ``steps * B * vocab`` floats).

    Returns:
      ``(state, tokens)`` with ``tokens`` int32 ``[steps, B]`` (row ``i``:
      the tokens sampled at step ``i``), or ``(state, tokens, logits)`` with
      ``logits`` float32 ``[steps, B, vocab]`` when ``return_logits``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    def body(state, _):
        state, tokens, logits = decode_step(params, state, decoder=decoder, temperature=temperature)
        return state, ((tokens, logits) if return_logits else tokens)

    state, outputs = jax.lax.scan(body, state, None, length=steps)
    state = settle(state, decoder=decoder)
    if return_logits:
        tokens, logits = outputs
        return state, tokens, logits
    return state, outputs
