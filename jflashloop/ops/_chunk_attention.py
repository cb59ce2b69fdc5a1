"""Attention of a chunk of new query tokens per sequence over the packed cache and the chunk itself.

Chunked prefill and speculative verification attend with several query
tokens per sequence: query ``i`` of sequence ``s`` sits at position
``lengths[s] + i`` and attends causally, to the cached positions (packed
pages, sink and recent windows, loop ``loop``'s chain) and to the chunk's
own tokens ``0 .. i``, which are not in the cache yet (append them with
:func:`jflashloop.paged_cache.append_tokens` afterwards).
:func:`chunk_attention` resolves ``implementation`` once
(:func:`jflashloop.ops._dispatch.call`); :func:`chunk_attention_reference`
is the plain-JAX definition.

The cached positions are read as :func:`~jflashloop.decode_attention` reads
them after ``write_token`` of the chunk's first token (the regions of
``lengths + 1`` visible tokens, without that token), so that a chunk of one
token gives exactly ``decode_attention`` after ``write_token`` of it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jflashloop_pallas_kernels import decode_attention as pallas_decode
from jflashloop_triton_kernels import decode_attention as gluon_decode

from ..cache._chunks import check_counts, chunk_window_values
from ..cache._inspect import reconstruct, sequence_regions
from ..cache._layout import PagedKVCache
from ..cache._state import write_token
from ..codecs import rotate_by_product
from . import _dispatch
from ._decode_attention import (
    check_gluon_runs,
    kernel_inputs,
    kernel_plan,
    rotated_inputs,
    unrotated_output,
)

BACKENDS = ("xla", "gluon", "dense")
GLUON_ROWS = 4 * gluon_decode.ROWS  # query rows (chunk x GQA group) per KV head that the Gluon path serves
LOG2_E = math.log2(math.e)


def check_chunk_arguments(queries, cache: PagedKVCache, layer: int, loop: int, keys, values, counts):
    """Raise ``TypeError``/``ValueError`` naming the expected shapes; returns int32 ``counts``."""
    c = cache.config
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array (float32, bfloat16, float16), got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [max_sequences, chunk, heads, head_dim], got {tuple(x.shape)}")
    sequences, chunk, q_heads, head_dim = queries.shape
    if sequences != c.max_sequences or head_dim != c.head_dim or q_heads % c.num_kv_heads or chunk < 1:
        raise ValueError(
            f"queries must be [max_sequences={c.max_sequences}, chunk >= 1, q_heads (a multiple of "
            f"{c.num_kv_heads}), head_dim={c.head_dim}], got {tuple(queries.shape)}"
        )
    expected = (c.max_sequences, chunk, c.num_kv_heads, c.head_dim)
    for name, x in (("keys", keys), ("values", values)):
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} must be [max_sequences, chunk, kv_heads, head_dim] = {expected}, "
                             f"got {tuple(x.shape)}")
    if not (0 <= layer < c.num_layers and 0 <= loop < c.num_loops):
        raise ValueError(f"layer must be in [0, {c.num_layers}) and loop in [0, {c.num_loops}), got {layer}, {loop}")
    return check_counts(counts, c.max_sequences, chunk)


def chunk_attention_reference(queries, cache: PagedKVCache, layer: int, loop: int, keys, values, counts, *,
                              scale: float | None = None) -> jax.Array:
    """Plain-JAX chunk attention (the semantic definition; float32 softmax at ``HIGHEST`` precision).

    Args:
      queries: ``[max_sequences, chunk, q_heads, head_dim]``, a floating dtype
        (read as float32); query head ``h`` reads KV head ``h // (q_heads //
        kv_heads)`` (GQA).
      cache: the cache (the chunk's tokens are not in it).
      layer, loop: 0-based Python ints.
      keys, values: ``[max_sequences, chunk, kv_heads, head_dim]``, a
        floating dtype: the chunk's own K/V of this layer and loop, read
        rounded to the window dtype (as the ring would hold them; NaN/+-inf
        as 0).
      counts: int ``[max_sequences]`` in ``[0, chunk]`` (may be traced; under
        ``jit`` values outside are clamped): the chunk's tokens per sequence.
      scale: softmax scale, default ``1 / sqrt(head_dim)``.
    Returns:
      float32 ``[max_sequences, chunk, q_heads, head_dim]``: query ``i <
      counts[s]`` of an active sequence ``s`` (position ``lengths[s] + i``)
      attends to the cached positions ``< lengths[s]`` the cache holds and to
      the chunk's tokens ``j <= i`` at positions below
      ``max_tokens_per_sequence`` (those beyond would be dropped by
      ``append_tokens``); rows ``i >= counts[s]`` and inactive sequences are
      zeros.
    """
    counts = check_chunk_arguments(queries, cache, layer, loop, keys, values, counts)
    return _reference(queries, cache, layer, loop, keys, values, counts, scale=scale)


def _keys_and_mask(cache, layer, loop, keys, values, counts, chunk):
    """Per sequence: every position a chunk query may read, and which it reads.

    Returns ``(all_k, all_v, valid)``: float32 ``[S, T + C, kv_heads, D]``
    (the cached positions ``T = max_tokens_per_sequence + 1`` as
    ``reconstruct`` gives them, then the chunk's tokens rounded to the window
    dtype) and bool ``[S, C, T + C]`` (query row ``i`` of sequence ``s``:
    the cached positions ``< lengths[s]`` the cache holds, the chunk's
    tokens ``j <= i`` below capacity; nothing for rows ``i >= counts[s]``
    or an inactive sequence).
    """
    c = cache.config
    counts = jnp.clip(counts, 0, chunk)
    chunk_k = chunk_window_values(cache, keys)[0].astype(jnp.float32)
    chunk_v = chunk_window_values(cache, values)[0].astype(jnp.float32)

    def one_sequence(own_k, own_v, count, slot):
        cached_k, cached_v, _ = reconstruct(cache, layer, loop, slot, include_pending=True)
        regions = sequence_regions(cache, slot, include_pending=True)
        length = cache.lengths[slot]
        t = jnp.arange(cached_k.shape[0])
        cached = (regions["sink"] | regions["ring"] | regions["pages"]) & (t < length)  # [T]
        i = jnp.arange(chunk)
        live = cache.active[slot] & (i < count)  # [C] query rows
        own = (i[None, :] <= i[:, None]) & (length + i[None, :] < c.max_tokens_per_sequence)  # [C, C]
        valid = jnp.concatenate([jnp.broadcast_to(cached, (chunk, t.shape[0])), own], axis=1) & live[:, None]
        return (jnp.concatenate([cached_k, own_k], axis=0), jnp.concatenate([cached_v, own_v], axis=0), valid)

    return jax.vmap(one_sequence)(chunk_k, chunk_v, counts, jnp.arange(c.max_sequences))


def _reference(queries, cache, layer, loop, keys, values, counts, *, scale):
    c = cache.config
    _, chunk, q_heads, head_dim = queries.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // c.num_kv_heads
    all_k, all_v, valid = _keys_and_mask(cache, layer, loop, keys, values, counts, chunk)

    def one_sequence(query, keys, values, valid):
        all_k = jnp.repeat(keys, group, axis=1)  # [T + C, q_heads, D]
        all_v = jnp.repeat(values, group, axis=1)
        scores = jnp.einsum("chd,thd->hct", query.astype(jnp.float32), all_k,
                            precision=jax.lax.Precision.HIGHEST) * scale
        scores = jnp.where(valid[None], scores, -jnp.inf)
        seen = jnp.any(valid, axis=1)  # [C]
        top = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.where(valid[None], jnp.exp(scores - jnp.where(seen[None, :, None], top, 0.0)), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        out = jnp.einsum("hct,thd->chd", weights, all_v, precision=jax.lax.Precision.HIGHEST)
        out = out / jnp.where(total > 0, total, 1.0).transpose(1, 0, 2)
        return jnp.where(seen[:, None, None], out, 0.0)

    return jax.vmap(one_sequence)(queries, all_k, all_v, valid)


DENSE_KEY_MULTIPLE = 128  # key positions padded (masked) to a multiple of this: cuDNN's flash kernels need it


def flash_attention(*arguments, **options):
    """``jax.nn.dot_product_attention``: cuDNN's flash attention on a GPU where it takes the call (shapes,
    dtypes), else jax's own choice."""
    if _dispatch.on_gpu():
        try:
            return jax.nn.dot_product_attention(*arguments, implementation="cudnn", **options)
        except (NotImplementedError, ValueError, RuntimeError):
            pass
    return jax.nn.dot_product_attention(*arguments, **options)


def _dense(queries, cache, layer, loop, keys, values, counts, *, scale):
    """The cached positions decoded to bfloat16, then ``jax.nn.dot_product_attention`` (cuDNN's flash
    attention on a GPU; the key axis padded with masked positions to a multiple of
    :data:`DENSE_KEY_MULTIPLE`, which cuDNN needs: otherwise jax falls back to XLA's attention, which
    materializes every score)."""
    head_dim = queries.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    all_k, all_v, valid = _keys_and_mask(cache, layer, loop, keys, values, counts, queries.shape[1])
    extra = -all_k.shape[1] % DENSE_KEY_MULTIPLE
    all_k, all_v = (jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, extra), (0, 0), (0, 0))) for x in (all_k, all_v))
    mask = jnp.pad(valid, ((0, 0), (0, 0), (0, extra)))[:, None]  # [S, 1, C, T + C + extra]
    out = flash_attention(queries.astype(jnp.bfloat16), all_k, all_v, mask=mask, scale=scale)
    return jnp.where(jnp.any(valid, axis=-1)[:, :, None, None], out.astype(jnp.float32), 0.0)


def _gluon(queries, cache: PagedKVCache, layer: int, loop: int, keys, values, counts, *, scale, interpret=False,
           emulate: bool = False):
    """The Gluon decode kernel over the cache, the chunk's own tokens in XLA, one merge.

    The chunk's ``C x group`` query rows of each KV head go through the
    page kernel in blocks of 8 (it re-reads the pages per block), with the
    chunk's token 0 written into the ring first so that the kernel attends to
    it as the pending token (every query sees it); tokens ``1 .. i`` of the
    chunk (causal) are one more partial, computed in XLA. ``emulate`` runs
    the kernel's body on the CPU (tests).
    """
    c = cache.config
    sequences, chunk, q_heads, head_dim = queries.shape
    heads = c.num_kv_heads
    group = q_heads // heads
    rows = chunk * group
    if not emulate:
        check_gluon_runs(interpret)
    plan = kernel_plan(c.layer(layer), loop)
    if plan.prediction is not None:
        raise NotImplementedError("the chunk kernel does not read predicted loops (LoopStorage.prediction)")
    reason = gluon_decode.unsupported_reason(plan.loops, head_dim, c.page_size, rows, rows=GLUON_ROWS)
    if reason:
        raise NotImplementedError(f"{reason} (chunk x GQA group query rows per KV head)")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    written = write_token(cache, layer, loop, keys[:, 0], values[:, 0])  # token 0: the kernel's pending token
    inputs = kernel_inputs(written, layer, loop, include_pending=True)
    # Query rows per KV head, ordered (chunk position, GQA head): [S, H * rows, D].
    flat = queries.reshape(sequences, chunk, heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    flat = flat.reshape(sequences, heads * rows, head_dim)
    flat, windows, window_loop, value_seed = rotated_inputs(flat, written, loop, inputs, plan)
    out, total, top = gluon_decode.paged_decode_attention(
        flat, inputs["block_tables"], inputs["bounds"], inputs["streams"], windows["sink_keys"],
        windows["sink_values"], windows["ring_keys"], windows["ring_values"], state=inputs["state"],
        limits=inputs["limits"], loops=plan.loops, page_size=c.page_size, sink_tokens=c.sink_tokens,
        window_loop=window_loop, scale=scale, partials_only=True, emulate=emulate)
    out, total, top = out[:, :, :, :rows], total[..., :rows], top[..., :rows]  # [S, H, slots, rows, (D)]

    # The chunk's tokens 1 .. i for query row (i, g), in the kernel's basis and base-2 logits.
    own_k = chunk_window_values(cache, keys)[0].astype(jnp.float32)  # [S, C, H, D]
    own_v = chunk_window_values(cache, values)[0].astype(jnp.float32)
    if plan.key_seed is not None:
        own_k = rotate_by_product(own_k, plan.key_seed)
    if value_seed is not None:
        own_v = rotate_by_product(own_v, value_seed)
    q = flat.astype(jnp.float32).reshape(sequences, heads, rows, head_dim) * (scale * LOG2_E)
    logits = jnp.einsum("shrd,schd->shrc", q, own_k, precision=jax.lax.Precision.HIGHEST)
    position = jnp.arange(rows) // group  # chunk index of each query row
    j = jnp.arange(chunk)
    kept = (cache.lengths[:, None] + j[None, :]) < c.max_tokens_per_sequence  # [S, C]
    valid = ((j[None, :] >= 1) & (j[None, :] <= position[:, None]))[None, None] & kept[:, None, None, :]
    logits = jnp.where(valid, logits, pallas_decode.MASK_VALUE)
    own_top = jnp.max(logits, axis=-1)  # [S, H, rows]
    weights = jnp.where(valid, jnp.exp2(logits - own_top[..., None]), 0.0)
    own_out = jnp.einsum("shrc,schd->shrd", weights, own_v, precision=jax.lax.Precision.HIGHEST)
    merged = pallas_decode.merge_splits(
        jnp.concatenate([out, own_out[:, :, None]], axis=2),
        jnp.concatenate([total, jnp.sum(weights, axis=-1)[:, :, None]], axis=2),
        jnp.concatenate([top, own_top[:, :, None]], axis=2))  # [S, H, rows, D]
    merged = unrotated_output(merged, value_seed)
    live = cache.active[:, None] & (jnp.arange(chunk)[None, :] < jnp.clip(counts, 0, chunk)[:, None])  # [S, C]
    merged = merged.reshape(sequences, heads, chunk, group, head_dim).transpose(0, 2, 1, 3, 4)
    merged = merged.reshape(sequences, chunk, q_heads, head_dim)
    return jnp.where(live[:, :, None, None], merged, 0.0)


def chunk_attention(queries, cache: PagedKVCache, layer: int, loop: int, keys, values, counts, *,
                    implementation: str | None = None, scale: float | None = None) -> jax.Array:
    """Attention of a chunk of query tokens per sequence over the cache and the chunk (causal).

    Same arguments and result as :func:`chunk_attention_reference`; with
    ``chunk = 1`` it equals :func:`~jflashloop.decode_attention` (with
    ``include_pending=True``) after ``write_token`` of the same token.

    Args:
      implementation: ``None`` (automatic: on a GPU ``"gluon"`` where it
        can serve the call, else ``"dense"`` for chunks of more than 32
        query rows per KV head and ``"xla"`` for smaller ones; ``"xla"``
        elsewhere), ``"xla"``
        (the reference path), ``"gluon"`` (GPU with ``jax_triton``: the
        Gluon decode kernel reads the packed pages for up to 32 query rows
        (chunk x GQA group) per KV head, in blocks of 8, and the chunk's own
        tokens are attended in XLA; 16x faster than the XLA path and 3-5x
        faster than cuDNN BF16 at chunk 4 and 8, B8 Hq32 Hkv8, 32K cached
        tokens, ``bench/RESULTS.md``) or ``"dense"`` (large chunks, where
        attention is compute-bound: the cached positions decoded to bfloat16
        and ``jax.nn.dot_product_attention`` with the mask, cuDNN's flash
        attention on a GPU; bfloat16 queries and K/V, about 1e-2 relative
        error; chunk 512 over 32K cached tokens at 0.94x the speed of cuDNN
        on a BF16 cache with the same mask, the decoding about 6% of it).
    Raises:
      TypeError, ValueError: arrays of the wrong dtype or shape, layer or
        loop out of range, concrete ``counts`` outside ``[0, chunk]``, an
        unknown ``implementation``.
    """
    if implementation is not None and implementation not in BACKENDS:
        _dispatch.resolve(implementation, choices=BACKENDS)  # raises the ValueError naming the choices
    counts = check_chunk_arguments(queries, cache, layer, loop, keys, values, counts)
    backends = {
        "xla": lambda chosen: _reference(queries, cache, layer, loop, keys, values, counts, scale=scale),
        "gluon": lambda chosen: _gluon(queries, cache, layer, loop, keys, values, counts, scale=scale,
                                       interpret=chosen.interpret),
        "dense": lambda chosen: _dense(queries, cache, layer, loop, keys, values, counts, scale=scale),
    }
    return _dispatch.call(implementation, backends, automatic=_automatic(queries, cache))


def _automatic(queries, cache: PagedKVCache) -> tuple[str, ...]:
    """The automatic choice, in order: on a GPU the Gluon kernel, then, for chunks of more query rows
    per KV head than it serves (compute-bound: chunked prefill), the bfloat16 dense path, else the
    float32 reference path (its accuracy: a small chunk that the kernel cannot serve)."""
    if not _dispatch.on_gpu():
        return ("xla",)
    _, chunk, q_heads, _ = queries.shape
    rows = chunk * (q_heads // cache.config.num_kv_heads)
    return ("gluon", "dense" if rows > GLUON_ROWS else "xla")
