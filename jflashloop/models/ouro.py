"""An Ouro-style looped decoder-only transformer in pure JAX.

A looped model applies its whole stack of ``layers`` transformer blocks
``loops`` times with the same (shared) weights. Every (loop, layer) pair
computes its own keys and values, so one token owns ``loops * layers`` KV
entries; this is the cache shape the 4-bit codecs of :mod:`jflashloop` target.

Architecture (one block, "sandwich" RMSNorm)::

    x = x + post_attention_norm(attention(pre_attention_norm(x)))
    x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))

with rotate-half RoPE on queries and keys, grouped-query attention when
``kv_heads < heads``, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``) and no
biases. At the end of every loop the *un-normalized* residual stream is
carried into the next loop, and ``final_norm`` followed by the LM head turns it
into that loop's exit logits. Token embeddings and the LM head are untied (two
separate matrices). Ouro's learned early-exit gate is not modelled: every exit
is available and the caller picks the loop count.

Parameters are a nested dict of float32 arrays (see :func:`init_params`)::

    embedding                     [vocab, hidden]
    layers/<i>/attention/wq       [hidden, heads * head_dim]
    layers/<i>/attention/wk       [hidden, kv_heads * head_dim]
    layers/<i>/attention/wv       [hidden, kv_heads * head_dim]
    layers/<i>/attention/wo       [heads * head_dim, hidden]
    layers/<i>/mlp/w_gate         [hidden, mlp_hidden]
    layers/<i>/mlp/w_up           [hidden, mlp_hidden]
    layers/<i>/mlp/w_down         [mlp_hidden, hidden]
    layers/<i>/pre_attention_norm, post_attention_norm,
    layers/<i>/pre_mlp_norm, post_mlp_norm   [hidden]
    final_norm                    [hidden]
    lm_head                       [hidden, vocab]

Everything computes in the dtype of the parameters, except RMSNorm, RoPE,
attention scores/softmax and the logits, which always use float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
AttentionFn = Callable[..., tuple[jax.Array, Any]]


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OuroConfig:
    """Shapes and constants of a looped decoder (hashable, so static under jit).

    Attributes:
      vocab_size: number of token ids.
      hidden: width of the residual stream.
      layers: transformer blocks per loop (their weights are shared by all loops).
      heads: query heads.
      kv_heads: key/value heads (``heads % kv_heads == 0``; fewer means GQA).
      head_dim: channels per head.
      mlp_hidden: inner width of the SwiGLU MLP.
      loops: how many times the block stack is applied by default.
      rope_theta: RoPE base frequency.
      norm_eps: epsilon inside every RMSNorm.
      max_position: longest supported sequence (positions are ``< max_position``).
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    loops: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    max_position: int = 4096

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head_dim, got {self.head_dim}")
        for name in ("vocab_size", "hidden", "layers", "heads", "head_dim", "mlp_hidden", "loops"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def query_groups(self) -> int:
        """Query heads sharing one key/value head (``heads // kv_heads``)."""
        return self.heads // self.kv_heads

    @classmethod
    def ouro_1_4b(cls) -> OuroConfig:
        """Ouro-1.4B shapes: 24 layers x 4 loops, hidden 2048, 16 heads, no GQA.

        ``vocab_size=49152``, ``mlp_hidden=5632``, ``rope_theta=1e6``,
        ``norm_eps=1e-6`` and ``max_position=65536`` are assumed values for the
        published checkpoint, not read from it.
        """
        return cls(vocab_size=49152, hidden=2048, layers=24, heads=16, kv_heads=16,
                   head_dim=128, mlp_hidden=5632, loops=4, rope_theta=1_000_000.0,
                   norm_eps=1e-6, max_position=65536)

    @classmethod
    def ouro_2_6b(cls) -> OuroConfig:
        """Ouro-2.6B shapes: as :meth:`ouro_1_4b` but with 48 layers (same assumptions)."""
        return dataclasses.replace(cls.ouro_1_4b(), layers=48)

    @classmethod
    def tiny(cls) -> OuroConfig:
        """A byte-level model (vocab 256) small enough to train in minutes.

        4 layers x 4 loops, hidden 256, 4 heads of 64 channels (no GQA), SwiGLU
        width 704; about 3.3 million parameters.
        """
        return cls(vocab_size=256, hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64,
                   mlp_hidden=704, loops=4, rope_theta=10_000.0, norm_eps=1e-6,
                   max_position=4096)


def _resolve_loops(config: OuroConfig, loops: int | None) -> int:
    """The loop count to run: ``config.loops`` when ``loops`` is None."""
    loops = config.loops if loops is None else int(loops)
    if loops < 1:
        raise ValueError(f"loops must be at least 1, got {loops}")
    return loops


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


def _normal(key: jax.Array, shape: tuple[int, ...], standard_deviation: float) -> jax.Array:
    return standard_deviation * jax.random.normal(key, shape, jnp.float32)


def init_params(config: OuroConfig, key: jax.Array) -> Params:
    """Random float32 parameters (layout in the module docstring).

    Projections are ``normal(0, 1 / sqrt(fan_in))``, so every matmul roughly
    preserves the RMS of its input; the embedding is ``normal(0, 1)`` (the same
    RMS as a post-normed block output); RMSNorm weights start at one.

    Args:
      config: model shapes.
      key: a ``jax.random`` key.

    Returns:
      The parameter pytree; every leaf is float32.
    """
    hidden, mlp_hidden = config.hidden, config.mlp_hidden
    query_width = config.heads * config.head_dim
    key_width = config.kv_heads * config.head_dim
    embedding_key, head_key, *layer_keys = jax.random.split(key, 2 + config.layers)

    def one_layer(layer_key: jax.Array) -> Params:
        keys = jax.random.split(layer_key, 7)
        return {
            "attention": {
                "wq": _normal(keys[0], (hidden, query_width), hidden**-0.5),
                "wk": _normal(keys[1], (hidden, key_width), hidden**-0.5),
                "wv": _normal(keys[2], (hidden, key_width), hidden**-0.5),
                "wo": _normal(keys[3], (query_width, hidden), query_width**-0.5),
            },
            "mlp": {
                "w_gate": _normal(keys[4], (hidden, mlp_hidden), hidden**-0.5),
                "w_up": _normal(keys[5], (hidden, mlp_hidden), hidden**-0.5),
                "w_down": _normal(keys[6], (mlp_hidden, hidden), mlp_hidden**-0.5),
            },
            "pre_attention_norm": jnp.ones((hidden,), jnp.float32),
            "post_attention_norm": jnp.ones((hidden,), jnp.float32),
            "pre_mlp_norm": jnp.ones((hidden,), jnp.float32),
            "post_mlp_norm": jnp.ones((hidden,), jnp.float32),
        }

    return {
        "embedding": _normal(embedding_key, (config.vocab_size, hidden), 1.0),
        "layers": [one_layer(layer_key) for layer_key in layer_keys],
        "final_norm": jnp.ones((hidden,), jnp.float32),
        "lm_head": _normal(head_key, (hidden, config.vocab_size), hidden**-0.5),
    }


def param_count(params: Params) -> int:
    """Total number of scalars in a parameter pytree."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


# --------------------------------------------------------------------------
# Building blocks (shared by forward and decode_step)
# --------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis, in float32.

    Args:
      x: ``[..., hidden]`` any float dtype.
      weight: ``[hidden]``.
      eps: added to the mean square.

    Returns:
      ``[..., hidden]`` in the dtype of ``x``.
    """
    x32 = x.astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inverse_rms * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary position embedding, computed in float32.

    Channel ``c < head_dim / 2`` pairs with channel ``c + head_dim / 2`` and the
    pair rotates by ``position * theta ** (-2c / head_dim)``.

    Args:
      x: ``[..., heads, head_dim]``.
      positions: integer array whose shape is ``x.shape[:-2]`` (or broadcasts to it).

    Returns:
      ``[..., heads, head_dim]`` in the dtype of ``x``.
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    inverse_frequency = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles = positions.astype(jnp.float32)[..., None, None] * inverse_frequency  # [..., 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def _project_qkv(
    layer: Params, config: OuroConfig, normed: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[..., heads, head_dim]`` and keys, values ``[..., kv_heads, head_dim]``.

    Queries and keys are rotated by RoPE at ``positions`` (shape ``normed.shape[:-1]``).
    """
    attention = layer["attention"]
    leading = normed.shape[:-1]
    q = (normed @ attention["wq"]).reshape(*leading, config.heads, config.head_dim)
    k = (normed @ attention["wk"]).reshape(*leading, config.kv_heads, config.head_dim)
    v = (normed @ attention["wv"]).reshape(*leading, config.kv_heads, config.head_dim)
    return (apply_rope(q, positions, config.rope_theta),
            apply_rope(k, positions, config.rope_theta), v)


def _mlp(layer: Params, x: jax.Array) -> jax.Array:
    """SwiGLU: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``; ``[..., hidden]`` in and out."""
    mlp = layer["mlp"]
    return (jax.nn.silu(x @ mlp["w_gate"]) * (x @ mlp["w_up"])) @ mlp["w_down"]


def _finish_block(
    layer: Params, config: OuroConfig, x: jax.Array, attention_output: jax.Array
) -> jax.Array:
    """Output projection, both residual additions and the MLP of one block.

    Args:
      x: ``[..., hidden]`` residual stream entering the block.
      attention_output: ``[..., heads, head_dim]`` (any float dtype).

    Returns:
      ``[..., hidden]`` residual stream leaving the block, dtype of ``x``.
    """
    flat = attention_output.reshape(*x.shape[:-1], config.heads * config.head_dim)
    attended = flat.astype(x.dtype) @ layer["attention"]["wo"]
    x = x + rms_norm(attended, layer["post_attention_norm"], config.norm_eps)
    mlp_output = _mlp(layer, rms_norm(x, layer["pre_mlp_norm"], config.norm_eps))
    return x + rms_norm(mlp_output, layer["post_mlp_norm"], config.norm_eps)


def _logits(params: Params, config: OuroConfig, hidden: jax.Array) -> jax.Array:
    """Exit logits ``[..., vocab]`` float32 from an un-normalized residual stream."""
    normed = rms_norm(hidden, params["final_norm"], config.norm_eps)
    return (normed @ params["lm_head"]).astype(jnp.float32)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query softmax attention over a whole sequence, in float32.

    Args:
      q: ``[B, T, heads, head_dim]``.
      k, v: ``[B, T, kv_heads, head_dim]``.

    Returns:
      ``[B, T, heads, head_dim]`` float32.
    """
    batch, tokens, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.astype(jnp.float32).reshape(batch, tokens, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k.astype(jnp.float32))
    scores = scores * (1.0 / math.sqrt(head_dim))
    causal = jnp.tril(jnp.ones((tokens, tokens), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v.astype(jnp.float32))
    return out.reshape(batch, tokens, heads, head_dim)


# --------------------------------------------------------------------------
# Full-sequence forward pass
# --------------------------------------------------------------------------


def forward(
    params: Params, config: OuroConfig, token_ids: jax.Array, loops: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Run the looped model over whole sequences (positions ``0 .. T-1``).

    Args:
      params: parameter pytree from :func:`init_params` (float32, or cast to
        bfloat16 for mixed precision).
      config: model shapes (static).
      token_ids: int ``[B, T]``.
      loops: static number of loops to run (default ``config.loops``); the exit
        of loop ``r`` does not depend on later loops, so ``forward(loops=r)``
        equals the first ``r`` exits of a longer run.

    Returns:
      * ``logits_per_loop``: float32 ``[loops, B, T, vocab]``; exit logits of
        every loop (final norm + LM head of that loop's residual stream).
      * ``keys``: ``[loops, layers, B, T, kv_heads, head_dim]`` post-RoPE keys,
        parameter dtype.
      * ``values``: same shape and dtype as ``keys``.
      * ``hidden_per_loop``: ``[loops, B, T, hidden]`` un-normalized residual
        stream at the end of every loop (what the next loop receives).
    """
    loops = _resolve_loops(config, loops)
    tokens = token_ids.shape[1]
    if tokens > config.max_position:
        raise ValueError(f"{tokens} tokens exceed max_position={config.max_position}")
    positions = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    x = jnp.take(params["embedding"], token_ids, axis=0)
    all_logits, all_keys, all_values, all_hidden = [], [], [], []
    for _ in range(loops):
        loop_keys, loop_values = [], []
        for layer in params["layers"]:
            normed = rms_norm(x, layer["pre_attention_norm"], config.norm_eps)
            q, k, v = _project_qkv(layer, config, normed, positions)
            x = _finish_block(layer, config, x, _causal_attention(q, k, v))
            loop_keys.append(k)
            loop_values.append(v)
        all_keys.append(jnp.stack(loop_keys))
        all_values.append(jnp.stack(loop_values))
        all_hidden.append(x)
        all_logits.append(_logits(params, config, x))
    return (jnp.stack(all_logits), jnp.stack(all_keys), jnp.stack(all_values),
            jnp.stack(all_hidden))


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats.

    Args:
      logits: float ``[..., vocab]``.
      targets: int ``[...]`` (the leading shape of ``logits``).

    Returns:
      float32 scalar.
    """
    log_probabilities = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probabilities, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def loss_per_loop(
    params: Params, config: OuroConfig, batch: jax.Array, loops: int | None = None
) -> jax.Array:
    """Next-token cross-entropy of every exit.

    Args:
      batch: int ``[B, T + 1]``; tokens ``[:, :-1]`` predict ``[:, 1:]``.
      loops: static loop count (default ``config.loops``).

    Returns:
      float32 ``[loops]``; entry ``r`` is the mean loss (nats/token) when
      exiting after loop ``r + 1``.
    """
    logits_per_loop = forward(params, config, batch[:, :-1], loops)[0]
    targets = batch[:, 1:]
    return jax.vmap(cross_entropy, in_axes=(0, None))(logits_per_loop, targets)


def loss_fn(
    params: Params, config: OuroConfig, batch: jax.Array, loops: int | None = None
) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) at the last loop's exit.

    Args:
      batch: int ``[B, T + 1]``.
      loops: static loop count (default ``config.loops``).

    Returns:
      float32 scalar.
    """
    return loss_per_loop(params, config, batch, loops)[-1]


def multi_exit_loss(
    params: Params,
    config: OuroConfig,
    batch: jax.Array,
    loops: int | None = None,
    loop_weights: tuple[float, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Training objective: a weighted mean of the cross-entropies of all exits.

    Training every exit (as Ouro does) keeps each intermediate loop a usable
    model, so held-out loss can be measured per loop count. Ouro's learned
    exit distribution is replaced by fixed weights, uniform by default.

    Args:
      batch: int ``[B, T + 1]``.
      loops: static loop count (default ``config.loops``).
      loop_weights: one non-negative weight per loop (normalized to sum to one);
        None means uniform.

    Returns:
      ``(loss, per_loop)``: float32 scalar and float32 ``[loops]``.
    """
    per_loop = loss_per_loop(params, config, batch, loops)
    if loop_weights is None:
        weights = jnp.full(per_loop.shape, 1.0 / per_loop.shape[0], jnp.float32)
    else:
        if len(loop_weights) != per_loop.shape[0]:
            raise ValueError(f"{len(loop_weights)} loop weights for {per_loop.shape[0]} loops")
        weights = jnp.asarray(loop_weights, jnp.float32)
        weights = weights / jnp.sum(weights)
    return jnp.sum(weights * per_loop), per_loop


# --------------------------------------------------------------------------
# One-token decode with a pluggable attention hook
# --------------------------------------------------------------------------


def decode_step(
    params: Params,
    config: OuroConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    attention_fn: AttentionFn,
    state: Any,
    loops: int | None = None,
) -> tuple[jax.Array, Any]:
    """Advance every sequence of the batch by one token through all loops.

    For every (loop, layer), in order, the model calls::

        out, state = attention_fn(loop_index, layer_index, q, k_new, v_new, state)

    with Python-int indices, ``q`` ``[B, heads, head_dim]`` and ``k_new``,
    ``v_new`` ``[B, kv_heads, head_dim]`` (post-RoPE keys). The hook stores the
    new key/value in its cache for that (loop, layer), attends over every
    cached position including the new one, and returns ``out``
    ``[B, heads, head_dim]`` (any float dtype). ``state`` is any pytree the hook
    owns (e.g. :class:`DenseLoopKVCache`).

    Args:
      params: parameter pytree.
      config: model shapes (static).
      token_ids: int32 ``[B]``, the token at ``positions``.
      positions: int32 ``[B]``, RoPE position of each new token.
      attention_fn: the hook (static under jit).
      state: the hook's state.
      loops: static loop count (default ``config.loops``).

    Returns:
      ``(logits, state)``: float32 ``[B, vocab]`` exit logits of the last loop
      and the hook's updated state.
    """
    loops = _resolve_loops(config, loops)
    x = jnp.take(params["embedding"], token_ids, axis=0)
    for loop_index in range(loops):
        for layer_index, layer in enumerate(params["layers"]):
            normed = rms_norm(x, layer["pre_attention_norm"], config.norm_eps)
            q, k_new, v_new = _project_qkv(layer, config, normed, positions)
            out, state = attention_fn(loop_index, layer_index, q, k_new, v_new, state)
            x = _finish_block(layer, config, x, out)
    return _logits(params, config, x), state


@dataclasses.dataclass(frozen=True)
class DenseLoopKVCache:
    """Uncompressed KV cache of a looped model: the reference attention hook's state.

    Array leaves:

    * ``keys``: ``[loops, layers, B, max_tokens, kv_heads, head_dim]`` (bfloat16
      by default), post-RoPE.
    * ``values``: same shape and dtype.
    * ``lengths``: int32 ``[B]``, cached tokens per sequence. Slots at or past
      ``lengths[b]`` are ignored.

    Used with :func:`dense_attention_fn`: each decode step writes the new token
    at slot ``lengths[b]`` of every (loop, layer) and increments ``lengths``
    after the last (loop, layer) of the cache, so the cache's ``loops`` must
    equal the ``loops`` the model runs. The caller keeps ``lengths < max_tokens``.
    """

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array

    @property
    def loops(self) -> int:
        """Number of loops the cache holds."""
        return self.keys.shape[0]

    @property
    def layers(self) -> int:
        """Number of layers per loop the cache holds."""
        return self.keys.shape[1]

    @property
    def max_tokens(self) -> int:
        """Slots per sequence."""
        return self.keys.shape[3]

    @classmethod
    def create(
        cls,
        config: OuroConfig,
        batch: int,
        max_tokens: int,
        loops: int | None = None,
        dtype: Any = jnp.bfloat16,
    ) -> DenseLoopKVCache:
        """An empty cache (all lengths zero) for ``batch`` sequences of up to ``max_tokens``."""
        loops = _resolve_loops(config, loops)
        shape = (loops, config.layers, batch, max_tokens, config.kv_heads, config.head_dim)
        return cls(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def from_prefill(
        cls,
        keys: jax.Array,
        values: jax.Array,
        lengths: jax.Array,
        max_tokens: int,
        dtype: Any = jnp.bfloat16,
    ) -> DenseLoopKVCache:
        """A cache holding the keys/values returned by :func:`forward`.

        Args:
          keys, values: ``[loops, layers, B, T, kv_heads, head_dim]``, ``T <= max_tokens``.
          lengths: int ``[B]``, valid prefix length of each sequence (``<= T``).
          max_tokens: slots per sequence in the returned cache.
          dtype: storage dtype.
        """
        tokens = keys.shape[3]
        if tokens > max_tokens:
            raise ValueError(f"prefill has {tokens} tokens but max_tokens={max_tokens}")
        padding = [(0, 0)] * keys.ndim
        padding[3] = (0, max_tokens - tokens)
        return cls(keys=jnp.pad(keys.astype(dtype), padding),
                   values=jnp.pad(values.astype(dtype), padding),
                   lengths=jnp.asarray(lengths, jnp.int32))


jax.tree_util.register_dataclass(
    DenseLoopKVCache, data_fields=["keys", "values", "lengths"], meta_fields=[]
)


def dense_attention_fn(
    loop_index: int,
    layer_index: int,
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache: DenseLoopKVCache,
) -> tuple[jax.Array, DenseLoopKVCache]:
    """Reference :func:`decode_step` hook over a :class:`DenseLoopKVCache`.

    Writes ``k_new``/``v_new`` at slot ``lengths[b]`` of (loop, layer), then
    runs grouped-query softmax attention in float32 (scale
    ``1 / sqrt(head_dim)``) over slots ``0 .. lengths[b]``.

    Args:
      loop_index, layer_index: Python ints.
      q: ``[B, heads, head_dim]``.
      k_new, v_new: ``[B, kv_heads, head_dim]``.
      cache: the cache state.

    Returns:
      ``(out, cache)``: float32 ``[B, heads, head_dim]`` and the updated cache.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    rows = jnp.arange(batch)
    slot = cache.lengths
    keys = cache.keys.at[loop_index, layer_index, rows, slot].set(k_new.astype(cache.keys.dtype))
    values = cache.values.at[loop_index, layer_index, rows, slot].set(
        v_new.astype(cache.values.dtype))
    layer_keys = keys[loop_index, layer_index].astype(jnp.float32)  # [B, S, kv_heads, head_dim]
    layer_values = values[loop_index, layer_index].astype(jnp.float32)
    grouped = q.astype(jnp.float32).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bkgd,bskd->bkgs", grouped, layer_keys) * (1.0 / math.sqrt(head_dim))
    visible = jnp.arange(cache.max_tokens)[None, :] <= slot[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", weights, layer_values).reshape(batch, heads, head_dim)
    is_last = loop_index == cache.loops - 1 and layer_index == cache.layers - 1
    lengths = cache.lengths + 1 if is_last else cache.lengths
    return out, DenseLoopKVCache(keys=keys, values=values, lengths=lengths)
