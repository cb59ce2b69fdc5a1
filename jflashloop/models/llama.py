"""A small, pure-functional Llama forward pass (SmolLM2 style) in JAX.

Two entry points share one per-layer implementation:

* :func:`prefill` runs a whole sequence at once with causal attention and
  returns the logits plus every layer's post-RoPE keys, values and queries
  (what a KV cache would store, and the queries that read it).
* :func:`decode_step` runs one token per sequence and delegates attention to
  a caller-supplied hook, so any KV cache (dense, quantized, ...) can be
  plugged in. :class:`DenseKVCache` with :func:`dense_attention_fn` is the
  reference hook.

All arithmetic is float32 whatever the weight dtype. Layers are unrolled in
Python, so hooks receive ``layer_index`` as a plain Python ``int``.

Params layout: see :func:`jflashloop.models.gguf_loader.load_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
ChunkAttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], jax.Array]

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyperparameters (hashable, so it can be a static argument under ``jit``).

    The defaults are SmolLM2-135M's.
    """

    num_layers: int = 30
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_query_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 8192

    def __post_init__(self) -> None:
        if self.num_query_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_query_heads ({self.num_query_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def queries_per_key_value_head(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.num_query_heads // self.num_key_value_heads

    @classmethod
    def from_gguf(cls, reader: Any) -> LlamaConfig:
        """Read the configuration from the ``llama.*`` metadata of a ``gguf.GGUFReader``.

        Raises:
            ValueError: the file is not a llama-architecture model, or its
                RoPE dimension differs from ``hidden_size / head_count``.
        """

        def scalar(key: str) -> Any:
            field = reader.fields[key]
            return field.parts[field.data[0]][0].item()

        architecture_field = reader.fields["general.architecture"]
        architecture = bytes(architecture_field.parts[architecture_field.data[0]]).decode("utf-8")
        if architecture != "llama":
            raise ValueError(f"expected a llama-architecture GGUF file, got {architecture!r}")
        hidden_size = int(scalar("llama.embedding_length"))
        num_query_heads = int(scalar("llama.attention.head_count"))
        head_dim = hidden_size // num_query_heads
        if "llama.rope.dimension_count" in reader.fields:
            rope_dimensions = int(scalar("llama.rope.dimension_count"))
            if rope_dimensions != head_dim:
                raise ValueError(
                    f"partial RoPE is not supported: rope.dimension_count={rope_dimensions}, "
                    f"head_dim={head_dim}"
                )
        if "llama.vocab_size" in reader.fields:
            vocab_size = int(scalar("llama.vocab_size"))
        else:
            vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
        return cls(
            num_layers=int(scalar("llama.block_count")),
            hidden_size=hidden_size,
            intermediate_size=int(scalar("llama.feed_forward_length")),
            num_query_heads=num_query_heads,
            num_key_value_heads=int(scalar("llama.attention.head_count_kv")),
            head_dim=head_dim,
            vocab_size=vocab_size,
            rope_theta=float(scalar("llama.rope.freq_base")),
            rms_norm_eps=float(scalar("llama.attention.layer_norm_rms_epsilon")),
            context_length=int(scalar("llama.context_length")),
        )


def init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters of ``config``'s shapes, in the layout of
    :func:`jflashloop.models.gguf_loader.load_params` (for speed measurements
    and tests: a decode step's cost depends on the shapes only).

    Projections are ``normal(0, 1 / sqrt(fan_in))`` (``[in, out]``), the
    (tied) token embedding ``normal(0, 1 / sqrt(hidden))``, every RMSNorm
    gain one.

    Args:
        config: the model configuration.
        key: a ``jax.random`` key.
        dtype: dtype of every array.

    Returns:
        the params pytree.
    """
    hidden, mlp = config.hidden_size, config.intermediate_size
    query_width = config.num_query_heads * config.head_dim
    key_value_width = config.num_key_value_heads * config.head_dim
    embedding_key, *layer_keys = jax.random.split(key, 1 + config.num_layers)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    def one_layer(layer_key):
        keys = jax.random.split(layer_key, 7)
        return {
            "attention_norm": jnp.ones((hidden,), dtype),
            "query": normal(keys[0], (hidden, query_width), hidden),
            "key": normal(keys[1], (hidden, key_value_width), hidden),
            "value": normal(keys[2], (hidden, key_value_width), hidden),
            "attention_output": normal(keys[3], (query_width, hidden), query_width),
            "mlp_norm": jnp.ones((hidden,), dtype),
            "gate": normal(keys[4], (hidden, mlp), hidden),
            "up": normal(keys[5], (hidden, mlp), hidden),
            "down": normal(keys[6], (mlp, hidden), mlp),
        }

    return {
        "token_embedding": normal(embedding_key, (config.vocab_size, hidden), hidden),
        "output_norm": jnp.ones((hidden,), dtype),
        "layers": [one_layer(layer_key) for layer_key in layer_keys],
    }


# --------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight`` with a float32 result (``weight`` is ``[in, out]``).

    float32 weights multiply at the highest precision; narrower weights
    (bfloat16, float16) take ``x`` rounded to their dtype and accumulate in
    float32, as a serving stack runs them.
    """
    if weight.dtype == jnp.float32:
        return jnp.matmul(x, weight, precision=_HIGHEST)
    return jnp.matmul(x.astype(weight.dtype), weight, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Root-mean-square normalization over the last axis.

    Args:
        x: float32 ``[..., D]``.
        weight: ``[D]`` per-channel gain.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        float32 ``[..., D]``.
    """
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + eps) * weight.astype(jnp.float32)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cosines and sines of the rotary angles for the rotate-half convention.

    Channel ``c`` and ``c + head_dim/2`` rotate together with frequency
    ``theta ** (-2c / head_dim)``.

    Args:
        positions: int ``[N]`` token positions.
        head_dim: channels per head (even).
        theta: RoPE base.

    Returns:
        ``(cos, sin)``, each float32 ``[N, head_dim]``.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inverse_frequencies = jnp.asarray(1.0 / theta**exponents, dtype=jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inverse_frequencies[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` (float32 ``[N, heads, head_dim]``) by per-token angles (``[N, head_dim]``).

    Returns:
        float32 ``[N, heads, head_dim]``: ``x * cos + rotate_half(x) * sin``,
        where ``rotate_half([a, b]) = [-b, a]`` on the two channel halves.
    """
    first_half, second_half = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second_half, first_half], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def grouped_query_attention(
    queries: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array
) -> jax.Array:
    """Softmax attention with grouped key/value heads, computed in float32.

    Query head ``h`` reads key/value head ``h // (Hq / Hkv)``. Scores are scaled
    by ``1 / sqrt(head_dim)``.

    Args:
        queries: ``[B, Q, Hq, d]`` (any float dtype).
        keys: ``[B, K, Hkv, d]``.
        values: ``[B, K, Hkv, d]``.
        mask: bool ``[B, Q, K]``; True where query ``q`` may attend to key
            ``k``. Every query row must allow at least one key.

    Returns:
        float32 ``[B, Q, Hq, d]``.
    """
    batch, query_count, query_heads, head_dim = queries.shape
    key_value_heads = keys.shape[2]
    group = query_heads // key_value_heads
    grouped = queries.astype(jnp.float32).reshape(
        batch, query_count, key_value_heads, group, head_dim
    )
    scores = jnp.einsum(
        "bqhgd,bkhd->bhgqk", grouped, keys.astype(jnp.float32), precision=_HIGHEST
    ) / math.sqrt(head_dim)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    output = jnp.einsum(
        "bhgqk,bkhd->bqhgd", weights, values.astype(jnp.float32), precision=_HIGHEST
    )
    return output.reshape(batch, query_count, query_heads, head_dim)


def _attention_inputs(
    layer: Params, config: LlamaConfig, hidden: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Project ``hidden`` (float32 ``[N, D]``) to post-RoPE queries, keys and values.

    Returns:
        ``(q [N, Hq, d], k [N, Hkv, d], v [N, Hkv, d])``, float32.
    """
    tokens = hidden.shape[0]
    normed = rms_norm(hidden, layer["attention_norm"], config.rms_norm_eps)
    queries = _linear(normed, layer["query"]).reshape(
        tokens, config.num_query_heads, config.head_dim
    )
    keys = _linear(normed, layer["key"]).reshape(
        tokens, config.num_key_value_heads, config.head_dim
    )
    values = _linear(normed, layer["value"]).reshape(
        tokens, config.num_key_value_heads, config.head_dim
    )
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    return apply_rope(queries, cos, sin), apply_rope(keys, cos, sin), values


def _finish_layer(
    layer: Params, config: LlamaConfig, hidden: jax.Array, attention_output: jax.Array
) -> jax.Array:
    """Output projection, residual, then the SwiGLU MLP block with its residual.

    Args:
        hidden: float32 ``[N, D]``, the layer input (residual stream).
        attention_output: ``[N, Hq, d]``.

    Returns:
        float32 ``[N, D]``, the layer output.
    """
    tokens = hidden.shape[0]
    attention_output = attention_output.astype(jnp.float32).reshape(tokens, -1)
    hidden = hidden + _linear(attention_output, layer["attention_output"])
    normed = rms_norm(hidden, layer["mlp_norm"], config.rms_norm_eps)
    activated = jax.nn.silu(_linear(normed, layer["gate"])) * _linear(normed, layer["up"])
    return hidden + _linear(activated, layer["down"])


def _embed(params: Params, token_ids: jax.Array) -> jax.Array:
    """Look up token embeddings: int ``[N]`` -> float32 ``[N, D]``."""
    return jnp.take(params["token_embedding"], token_ids, axis=0).astype(jnp.float32)


def _output_logits(params: Params, config: LlamaConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and the tied output projection: float32 ``[N, D]`` -> float32 ``[N, V]``."""
    normed = rms_norm(hidden, params["output_norm"], config.rms_norm_eps)
    return _linear(normed, params["token_embedding"].T)


# --------------------------------------------------------------------------
# Prefill and teacher-forced likelihood
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def prefill(
    params: Params, config: LlamaConfig, token_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Run one sequence through the model with causal attention.

    Positions are ``0 .. T-1``. Attention is causal, so appending tokens never
    changes the outputs at earlier positions: callers may pad to a fixed
    length to reuse one compilation (it is jitted per distinct ``T``).

    Args:
        params: the params pytree.
        config: the model configuration (static).
        token_ids: int32 ``[T]``.

    Returns:
        ``(logits, keys, values, queries)``:

        * ``logits``: float32 ``[T, vocab]``; row ``t`` predicts token ``t + 1``.
        * ``keys``: float32 ``[layers, T, kv_heads, head_dim]``, after RoPE
          (exactly what a KV cache stores).
        * ``values``: float32 ``[layers, T, kv_heads, head_dim]``.
        * ``queries``: float32 ``[layers, T, q_heads, head_dim]``, after RoPE.
    """
    token_ids = jnp.asarray(token_ids, dtype=jnp.int32)
    tokens = token_ids.shape[0]
    positions = jnp.arange(tokens, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((tokens, tokens), dtype=bool))[None]
    hidden = _embed(params, token_ids)
    all_keys, all_values, all_queries = [], [], []
    for layer in params["layers"]:
        queries, keys, values = _attention_inputs(layer, config, hidden, positions)
        batched_output = grouped_query_attention(queries[None], keys[None], values[None], causal)
        attention_output = batched_output[0]
        hidden = _finish_layer(layer, config, hidden, attention_output)
        all_keys.append(keys)
        all_values.append(values)
        all_queries.append(queries)
    logits = _output_logits(params, config, hidden)
    return logits, jnp.stack(all_keys), jnp.stack(all_values), jnp.stack(all_queries)


def token_negative_log_likelihoods(logits: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood (nats) of ``token_ids[1:]`` under ``logits[:-1]``.

    Args:
        logits: float ``[T, vocab]`` from :func:`prefill`.
        token_ids: int ``[T]``.

    Returns:
        float32 ``[T - 1]``.
    """
    log_probabilities = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    targets = jnp.asarray(token_ids)[1:]
    return -jnp.take_along_axis(log_probabilities, targets[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("config",))
def mean_nll(params: Params, config: LlamaConfig, token_ids: jax.Array) -> jax.Array:
    """Teacher-forced mean negative log-likelihood in nats per predicted token.

    The first token is only conditioned on (no BOS is prepended), so the mean
    is over ``T - 1`` predictions.

    Args:
        params: the params pytree.
        config: the model configuration (static).
        token_ids: int32 ``[T]``, ``T >= 2``.

    Returns:
        float32 scalar.
    """
    logits, _, _, _ = prefill(params, config, token_ids)
    return jnp.mean(token_negative_log_likelihoods(logits, token_ids))


# --------------------------------------------------------------------------
# Decode with a pluggable attention hook
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"))
def decode_step(
    params: Params,
    config: LlamaConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    attention_fn: AttentionFn,
    state: Any,
) -> tuple[jax.Array, Any]:
    """Run one new token per sequence, with attention delegated to ``attention_fn``.

    For every layer ``i`` (in order ``0 .. layers-1``) the model calls::

        out, state = attention_fn(i, q, k_new, v_new, state)

    with ``i`` a Python ``int``, ``q`` float32 ``[B, q_heads, head_dim]`` and
    ``k_new``/``v_new`` float32 ``[B, kv_heads, head_dim]`` (``q`` and
    ``k_new`` after RoPE at ``positions``). The hook must store
    ``k_new``/``v_new`` in its cache and return the attention output ``out``
    ``[B, q_heads, head_dim]`` over every cached position including the new
    one; the model then applies the output projection. ``state`` is opaque to
    the model (any pytree).

    Jitted with ``config`` and ``attention_fn`` static: pass the same function
    object every step (not a fresh ``functools.partial``) so that one
    compilation is reused.

    Args:
        params: the params pytree.
        config: the model configuration (static).
        token_ids: int32 ``[B]``, the newest token of each sequence.
        positions: int32 ``[B]``, its position (the number of earlier tokens).
        attention_fn: the attention hook (static).
        state: the hook's cache state.

    Returns:
        ``(logits, state)``: float32 ``[B, vocab]`` predicting the next token,
        and the hook's updated state.
    """
    token_ids = jnp.asarray(token_ids, dtype=jnp.int32)
    positions = jnp.asarray(positions, dtype=jnp.int32)
    hidden = _embed(params, token_ids)
    for layer_index, layer in enumerate(params["layers"]):
        queries, keys, values = _attention_inputs(layer, config, hidden, positions)
        attention_output, state = attention_fn(layer_index, queries, keys, values, state)
        hidden = _finish_layer(layer, config, hidden, attention_output)
    return _output_logits(params, config, hidden), state


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"))
def chunk_step(
    params: Params,
    config: LlamaConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    attention_fn: ChunkAttentionFn,
    state: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run a chunk of new tokens per sequence, with attention delegated to ``attention_fn``.

    For every layer ``i`` the model calls ``out = attention_fn(i, q, k, v,
    state)`` with ``q`` float32 ``[B, C, q_heads, head_dim]`` and ``k``/``v``
    float32 ``[B, C, kv_heads, head_dim]`` (after RoPE at ``positions``): the
    hook attends causally over its cache and the chunk (for example
    :func:`jflashloop.chunk_attention`) and returns ``out`` ``[B, C, q_heads,
    head_dim]``; it does not store the chunk. The caller stores the tokens it
    keeps afterwards from the returned K/V (``paged_cache.append_tokens``):
    all of a prefill chunk, the accepted ones of a speculative draft.

    Args:
        token_ids: int32 ``[B, C]``.
        positions: int32 ``[B, C]`` (the cached tokens before each, plus its index in the chunk).
        attention_fn: the chunk hook (static: pass the same function object every step).
        state: the hook's read-only state (any pytree).
    Returns:
        ``(logits, keys, values)``: float32 ``[B, C, vocab]`` (row ``i``
        predicts the token after token ``i``) and the chunk's K/V, float32
        ``[layers, B, C, kv_heads, head_dim]``.
    """
    token_ids = jnp.asarray(token_ids, dtype=jnp.int32)
    batch, chunk = token_ids.shape
    flat_positions = jnp.asarray(positions, dtype=jnp.int32).reshape(-1)
    hidden = _embed(params, token_ids.reshape(-1))
    all_keys, all_values = [], []
    for layer_index, layer in enumerate(params["layers"]):
        queries, keys, values = _attention_inputs(layer, config, hidden, flat_positions)
        shaped = [x.reshape(batch, chunk, *x.shape[1:]) for x in (queries, keys, values)]
        attention_output = attention_fn(layer_index, *shaped, state)
        hidden = _finish_layer(layer, config, hidden, attention_output.reshape(batch * chunk, *queries.shape[1:]))
        all_keys.append(shaped[1])
        all_values.append(shaped[2])
    logits = _output_logits(params, config, hidden).reshape(batch, chunk, -1)
    return logits, jnp.stack(all_keys), jnp.stack(all_values)


@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """A plain (unquantized) KV cache for :func:`dense_attention_fn`; a pytree.

    Array leaves:

    * ``keys``: ``[layers, B, max_tokens, kv_heads, head_dim]`` in the cache
      dtype (bfloat16 by default), post-RoPE.
    * ``values``: same shape and dtype.
    * ``lengths``: int32 ``[B]``, tokens held per sequence. Slots at or past
      ``lengths[b]`` are ignored.
    """

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array

    @property
    def max_tokens(self) -> int:
        """Capacity in tokens per sequence."""
        return self.keys.shape[2]

    @classmethod
    def create(
        cls, config: LlamaConfig, batch: int, max_tokens: int, dtype: Any = jnp.bfloat16
    ) -> DenseKVCache:
        """An empty cache: zeros of shape ``[layers, batch, max_tokens, kv_heads, head_dim]``."""
        shape = (config.num_layers, batch, max_tokens, config.num_key_value_heads, config.head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @classmethod
    def from_prefill(
        cls, keys: jax.Array, values: jax.Array, max_tokens: int, dtype: Any = jnp.bfloat16
    ) -> DenseKVCache:
        """A cache holding the keys and values returned by :func:`prefill`.

        Args:
            keys: ``[layers, T, kv_heads, head_dim]`` (one sequence, giving
                ``B = 1``) or ``[layers, B, T, kv_heads, head_dim]`` (``B``
                sequences of equal length ``T``).
            values: same shape as ``keys``.
            max_tokens: capacity per sequence, ``>= T``.
            dtype: storage dtype (keys and values are rounded to it).

        Returns:
            a cache with ``lengths == T`` for every sequence.
        """
        if keys.shape != values.shape:
            raise ValueError(f"keys {keys.shape} and values {values.shape} differ in shape")
        if keys.ndim == 4:
            keys, values = keys[:, None], values[:, None]
        if keys.ndim != 5:
            raise ValueError(f"keys must have rank 4 or 5, got shape {keys.shape}")
        _, batch, tokens, _, _ = keys.shape
        if tokens > max_tokens:
            raise ValueError(f"{tokens} prefill tokens exceed max_tokens={max_tokens}")
        padding = ((0, 0), (0, 0), (0, max_tokens - tokens), (0, 0), (0, 0))
        return cls(
            keys=jnp.pad(keys.astype(dtype), padding),
            values=jnp.pad(values.astype(dtype), padding),
            lengths=jnp.full((batch,), tokens, jnp.int32),
        )


jax.tree_util.register_dataclass(
    DenseKVCache, data_fields=["keys", "values", "lengths"], meta_fields=[]
)


def dense_attention_fn(
    layer_index: int,
    queries: jax.Array,
    new_keys: jax.Array,
    new_values: jax.Array,
    state: DenseKVCache,
) -> tuple[jax.Array, DenseKVCache]:
    """Reference attention hook for :func:`decode_step` over a :class:`DenseKVCache`.

    Writes the new key/value of each sequence ``b`` at slot ``state.lengths[b]``
    (which must equal the ``positions[b]`` given to :func:`decode_step`, and be
    ``< max_tokens``), then attends over slots ``0 .. lengths[b]`` inclusive in
    float32, reading keys and values back in the cache dtype. After the last
    layer has written, ``lengths`` grows by one, so one decode step adds
    exactly one token.

    Args:
        layer_index: Python ``int`` in ``[0, layers)``.
        queries: float32 ``[B, q_heads, head_dim]``.
        new_keys: float32 ``[B, kv_heads, head_dim]``.
        new_values: float32 ``[B, kv_heads, head_dim]``.
        state: the cache.

    Returns:
        ``(output, state)``: float32 ``[B, q_heads, head_dim]`` and the updated cache.
    """
    batch = queries.shape[0]
    batch_index = jnp.arange(batch)
    keys = state.keys.at[layer_index, batch_index, state.lengths].set(
        new_keys.astype(state.keys.dtype)
    )
    values = state.values.at[layer_index, batch_index, state.lengths].set(
        new_values.astype(state.values.dtype)
    )
    slots = jnp.arange(state.max_tokens)
    mask = (slots[None, :] <= state.lengths[:, None])[:, None, :]  # [B, 1, max_tokens]
    output = grouped_query_attention(
        queries[:, None], keys[layer_index], values[layer_index], mask
    )[:, 0]
    is_last_layer = layer_index == state.keys.shape[0] - 1
    lengths = state.lengths + 1 if is_last_layer else state.lengths
    return output, DenseKVCache(keys=keys, values=values, lengths=lengths)


def generate_greedy(
    params: Params,
    config: LlamaConfig,
    prompt_ids: jax.Array,
    steps: int,
    attention_fn: AttentionFn,
    state: Any,
    *,
    prefilled_tokens: int = 0,
) -> tuple[np.ndarray, Any]:
    """Greedy generation for one sequence through the jitted :func:`decode_step`.

    ``state`` already holds the first ``prefilled_tokens`` prompt tokens (for
    example a :meth:`DenseKVCache.from_prefill` of ``prompt_ids[:-1]``, or an
    empty cache with ``prefilled_tokens=0``); the remaining prompt tokens are
    fed one at a time through the hook, then ``steps`` tokens are chosen by
    argmax. Every call to the decode step reuses one compilation.

    Args:
        params: the params pytree.
        config: the model configuration.
        prompt_ids: int ``[T]``.
        steps: number of tokens to generate, ``>= 1``.
        attention_fn: the attention hook (see :func:`decode_step`).
        state: the hook's state with batch size 1.
        prefilled_tokens: prompt tokens already in ``state``, ``< T`` (the last
            prompt token must go through the decode step to produce logits).

    Returns:
        ``(generated, state)``: int32 numpy ``[steps]`` and the final state
        (which holds ``T + steps - 1`` tokens).
    """
    prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
    prompt_length = prompt_ids.shape[0]
    if not 0 <= prefilled_tokens < prompt_length:
        raise ValueError(
            f"prefilled_tokens must be in [0, {prompt_length}), got {prefilled_tokens}"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    def step(token: jax.Array, position: int, state: Any) -> tuple[jax.Array, Any]:
        positions = jnp.full((1,), position, jnp.int32)
        return decode_step(params, config, token, positions, attention_fn, state)

    for position in range(prefilled_tokens, prompt_length):
        logits, state = step(jnp.asarray(prompt_ids[position : position + 1]), position, state)
    generated = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    for index in range(1, steps):
        logits, state = step(generated[-1], prompt_length + index - 1, state)
        generated.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return np.asarray(jnp.concatenate(generated)), state
