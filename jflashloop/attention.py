"""Decode attention over a :class:`~jflashloop.PagedKVCache` (reference path)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import paged_cache
from .paged_cache import PagedKVCache


def _check_arguments(queries, cache: PagedKVCache, layer: int, loop: int) -> None:
    """Raise ``TypeError`` for a non-floating query dtype, ``ValueError`` naming
    the expected shapes and index ranges (both paths run this check)."""
    c = cache.config
    if not jnp.issubdtype(queries.dtype, jnp.floating):
        raise TypeError(f"queries must have a floating dtype (float32, bfloat16, float16), got {queries.dtype}")
    if queries.ndim != 3:
        raise ValueError(f"queries must have rank 3 [max_sequences, q_heads, head_dim], got {tuple(queries.shape)}")
    sequences, q_heads, head_dim = queries.shape
    if sequences != c.max_sequences or head_dim != c.head_dim or q_heads % c.num_kv_heads:
        raise ValueError(
            f"queries must be [max_sequences={c.max_sequences}, q_heads (a multiple of "
            f"{c.num_kv_heads}), head_dim={c.head_dim}], got {tuple(queries.shape)}"
        )
    if not (0 <= layer < c.num_layers and 0 <= loop < c.num_loops):
        raise ValueError(f"layer must be in [0, {c.num_layers}) and loop in [0, {c.num_loops}), got {layer}, {loop}")


def decode_attention_reference(
    queries: jax.Array,
    cache: PagedKVCache,
    layer: int,
    loop: int,
    *,
    include_pending: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """One new query token per sequence attending over its loop-``loop`` K/V.

    Plain JAX: reconstructs every sequence's K/V densely (the semantic
    definition that the fused kernels match) and runs float32 softmax
    attention at ``HIGHEST`` matmul precision.

    Args:
      queries: ``[max_sequences, q_heads, head_dim]``, a floating dtype (read
        as float32); ``q_heads`` is a multiple of ``kv_heads`` and query head
        ``h`` reads KV head ``h // (q_heads // kv_heads)`` (GQA).
      cache: the cache.
      layer, loop: 0-based Python ints.
      include_pending: attend to the token written by ``write_token`` but not
        yet committed (the usual decode step), i.e. ``lengths + 1`` positions
        (see :func:`jflashloop.paged_cache.visible_tokens`: an inactive slot
        sees nothing, a full sequence does not see its dropped token).
      scale: softmax scale, default ``1 / sqrt(head_dim)``.
    Returns:
      float32 ``[max_sequences, q_heads, head_dim]``; zeros for a sequence with
      no visible token (an inactive slot, whatever ``include_pending`` says).
    """
    c = cache.config
    _check_arguments(queries, cache, layer, loop)
    sequences, q_heads, head_dim = queries.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // c.num_kv_heads

    def one_sequence(query, slot):
        keys, values, _ = paged_cache.reconstruct(cache, layer, loop, slot, include_pending=include_pending)
        regions = paged_cache.sequence_regions(cache, slot, include_pending=include_pending)
        valid = regions["sink"] | regions["ring"] | regions["pages"]
        seen = jnp.any(valid)
        keys = jnp.repeat(keys, group, axis=1)  # [T, q_heads, D]
        values = jnp.repeat(values, group, axis=1)
        scores = jnp.einsum(
            "hd,thd->ht", query.astype(jnp.float32), keys, precision=jax.lax.Precision.HIGHEST
        ) * scale
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        top = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.where(valid[None, :], jnp.exp(scores - jnp.where(seen, top, 0.0)), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        out = jnp.einsum("ht,thd->hd", weights, values, precision=jax.lax.Precision.HIGHEST)
        return jnp.where(seen, out / jnp.where(total > 0, total, 1.0), 0.0)

    return jax.vmap(one_sequence)(queries, jnp.arange(sequences))


FUSED_FORMATS = ("int4", "nvfp4", "int4_rotated")


def kernel_rotations(cache: PagedKVCache, loop: int) -> tuple[int | None, int | None]:
    """Rotation seeds of the K and V streams of loops ``0..loop`` for the fused kernel.

    The kernel sums streams in one basis: either no stream is rotated, or
    every K (or V) stream is ``int4_rotated`` with one seed. Raises
    ``NotImplementedError`` for any other mix (the reference path handles it).
    """
    seeds = []
    for role in ("key_spec", "value_spec"):
        specs = [getattr(cache.config.loops[i], role) for i in range(loop + 1)]
        unsupported = [s.format for s in specs if s.format not in FUSED_FORMATS]
        if unsupported:
            raise NotImplementedError(f"the fused kernel does not read {unsupported[0]!r} streams")
        rotated = {s.rotation_seed for s in specs if s.format == "int4_rotated"}
        if rotated and (len(rotated) > 1 or any(s.format != "int4_rotated" for s in specs)):
            raise NotImplementedError(
                "the fused kernel needs every stream of a chain in one basis: all int4_rotated with one "
                "seed, or none rotated"
            )
        seeds.append(rotated.pop() if rotated else None)
    from jflashloop_pallas_kernels.decode_attention import (
        LoopFormat,
        StreamFormat,
        unsupported_reason,
    )

    c = cache.config
    formats = tuple(
        LoopFormat(
            StreamFormat(c.loops[i].key_spec.format, c.loops[i].key_spec.axis, c.loops[i].key_spec.group_size, c.rows(i)),
            StreamFormat(c.loops[i].value_spec.format, c.loops[i].value_spec.axis, c.loops[i].value_spec.group_size, c.rows(i)),
            c.loops[i].is_sparse,
        )
        for i in range(loop + 1)
    )
    reason = unsupported_reason(formats, c.head_dim, c.page_size)
    if reason:
        raise NotImplementedError(reason)
    return seeds[0], seeds[1]


def kernel_inputs(cache: PagedKVCache, layer: int, loop: int, include_pending: bool):
    """The arrays and static formats the fused kernel reads for (``layer``, ``loop``).

    ``bounds`` is int32 ``[max_sequences, 2]``: the visible tokens ``n``
    (:func:`jflashloop.paged_cache.visible_tokens`: 0 for an inactive slot)
    and ``end = max(window_start, 0)`` (:func:`jflashloop.paged_cache.window_start`
    with the sequence's stored pages). The kernel reads positions
    ``sink_tokens <= t < end`` from pages, through block-table columns below
    ``ceil(end / page_size)``, and from the ring the positions ``>= end``
    among the latest ``window_tokens`` before ``n``. Since ``end`` never
    passes a sequence's first lost page, every block-table entry the kernel
    reads holds one of the sequence's own pages (never -1), and it attends
    exactly to :func:`jflashloop.paged_cache.sequence_regions`.
    """
    from jflashloop_pallas_kernels.decode_attention import LoopFormat, StreamFormat

    c = cache.config
    pool = cache.layers[layer]
    visible = paged_cache.visible_tokens(cache, include_pending=include_pending)
    end = paged_cache.window_start(c, cache.lengths, visible, paged_cache.stored_pages(cache))
    bounds = jnp.stack([visible, jnp.maximum(end, 0)], axis=1).astype(jnp.int32)
    streams, formats = [], []
    for index in range(loop + 1):
        storage = c.loops[index]
        tiles = pool.loops[index]

        def stream_arrays(stream):
            return {
                "payload": stream.payload,
                "scale": stream.scale,
                "minimum": stream.minimum,
                "global_scale": stream.global_scale,
            }

        def stream_format(spec, rows):
            return StreamFormat(spec.format, spec.axis, spec.group_size, rows)

        rows = c.rows(index)
        streams.append(
            {
                "keys": stream_arrays(tiles.keys),
                "values": stream_arrays(tiles.values),
                "row_positions": tiles.row_positions,
            }
        )
        formats.append(
            LoopFormat(stream_format(storage.key_spec, rows), stream_format(storage.value_spec, rows),
                       storage.is_sparse)
        )
    # The windows go in whole ([loops, sequences, heads, tokens, D]); the
    # kernel reads entry ``window_loop``, so no slice is copied.
    return dict(
        block_tables=cache.block_tables,
        bounds=bounds,
        streams=tuple(streams),
        sink_keys=pool.sink_keys if c.sink_tokens else None,
        sink_values=pool.sink_values if c.sink_tokens else None,
        ring_keys=pool.ring_keys,
        ring_values=pool.ring_values,
        window_loop=loop,
        loops=tuple(formats),
    )


def rotated_inputs(queries, cache: PagedKVCache, loop: int, inputs: dict):
    """Queries and windows in the streams' basis for a fused kernel.

    Returns ``(queries, windows, window_loop, value_seed)``: with rotated key
    streams the queries are rotated (``q . k = (Rq) . (Rk)``) and so are this
    loop's windows (then passed alone, ``window_loop`` 0); ``value_seed`` is
    what :func:`unrotated_output` needs.
    """
    key_seed, value_seed = kernel_rotations(cache, loop)
    windows = {name: inputs[name] for name in ("sink_keys", "sink_values", "ring_keys", "ring_values")}
    window_loop = inputs["window_loop"]
    if key_seed is not None or value_seed is not None:  # rotate this loop's windows into the streams' basis
        from .codecs import rotate

        window_loop = 0
        for name, seed in (("sink_keys", key_seed), ("ring_keys", key_seed),
                           ("sink_values", value_seed), ("ring_values", value_seed)):
            array = windows[name]
            if array is not None:
                array = array[loop:loop + 1]
                windows[name] = rotate(array.astype(jnp.float32), seed) if seed is not None else array
    if key_seed is not None:
        queries = rotate(queries.astype(jnp.float32), key_seed)
    return queries, windows, window_loop, value_seed


def unrotated_output(output, value_seed):
    """The kernel's output back in the natural basis: ``sum_t p_t R v_t = R (sum_t p_t v_t)``."""
    if value_seed is None:
        return output
    from .codecs import unrotate

    return unrotate(output, value_seed)


def gluon_unsupported_reason(queries, cache: PagedKVCache, loop: int) -> str | None:
    """Why the Gluon kernel cannot serve this call, or None (it needs a GPU and ``jax_triton``)."""
    if jax.default_backend() != "gpu":
        return "the Gluon kernel runs on CUDA GPUs only"
    try:
        from jflashloop_triton_kernels import call
        from jflashloop_triton_kernels.decode_attention import unsupported_reason
    except ImportError as error:  # pragma: no cover - depends on the installation
        return f"the Gluon kernel needs triton: {error}"
    if not call.available():
        return "the Gluon kernel needs jax_triton (pip install jax-triton)"
    c = cache.config
    if queries.ndim != 3 or queries.shape[1] % c.num_kv_heads:
        return "queries must be [max_sequences, q_heads, head_dim]"
    try:
        kernel_rotations(cache, loop)
    except NotImplementedError as error:
        return str(error)
    loops = kernel_inputs_formats(cache, loop)
    return unsupported_reason(loops, c.head_dim, c.page_size, queries.shape[1] // c.num_kv_heads)


def gluon_is_default(queries, cache: PagedKVCache, loop: int) -> bool:
    """Whether the automatic choice on a GPU is the Gluon kernel.

    Where it reads the cache and was measured faster than the Pallas kernel:
    one INT4 loop (``bench/RESULTS.md``). It also reads NVFP4 streams and
    two-loop dense chains (tested on the GPU, not yet timed): there it runs
    only when asked for (``implementation="gluon"``).
    """
    if gluon_unsupported_reason(queries, cache, loop) is not None:
        return False
    first = cache.config.loops[0]
    return loop == 0 and first.key_spec.format == "int4" and first.value_spec.format == "int4"


def kernel_inputs_formats(cache: PagedKVCache, loop: int):
    """The static stream formats of loops ``0..loop`` (kernel descriptors)."""
    from jflashloop_pallas_kernels.decode_attention import LoopFormat, StreamFormat

    c = cache.config
    return tuple(
        LoopFormat(
            StreamFormat(c.loops[i].key_spec.format, c.loops[i].key_spec.axis, c.loops[i].key_spec.group_size, c.rows(i)),
            StreamFormat(c.loops[i].value_spec.format, c.loops[i].value_spec.axis, c.loops[i].value_spec.group_size, c.rows(i)),
            c.loops[i].is_sparse,
        )
        for i in range(loop + 1)
    )


def _gluon_decode_attention(queries, cache, layer, loop, *, include_pending, scale, kernel_config):
    from jflashloop_triton_kernels.decode_attention import paged_decode_attention

    c = cache.config
    _check_arguments(queries, cache, layer, loop)
    scale = 1.0 / math.sqrt(c.head_dim) if scale is None else float(scale)
    inputs = kernel_inputs(cache, layer, loop, include_pending)
    queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs)
    options = {}
    if kernel_config is not None:
        options = dict(splits=kernel_config.num_splits, target_programs=kernel_config.target_programs)
    output = paged_decode_attention(
        queries, inputs["block_tables"], inputs["bounds"], inputs["streams"], windows["sink_keys"],
        windows["sink_values"], windows["ring_keys"], windows["ring_values"], loops=inputs["loops"],
        page_size=c.page_size, sink_tokens=c.sink_tokens, window_loop=window_loop, scale=scale, **options)
    return unrotated_output(output, value_seed)


def decode_attention(
    queries: jax.Array,
    cache: PagedKVCache,
    layer: int,
    loop: int,
    *,
    include_pending: bool = True,
    scale: float | None = None,
    implementation: str | None = None,
    kernel_config=None,
    poison_for_tests: bool = False,
) -> jax.Array:
    """Decode attention over a :class:`~jflashloop.PagedKVCache` (fused on GPU).

    Same contract as :func:`decode_attention_reference`.

    Args:
      queries: ``[max_sequences, q_heads, head_dim]``.
      cache, layer, loop, include_pending, scale: as for the reference.
      implementation: ``None`` (on a GPU the Gluon kernel for one INT4 loop
        when ``jax_triton`` is installed, else the Pallas kernel; the reference
        path elsewhere; see :func:`gluon_is_default`), ``"gluon"`` (the Gluon
        kernel: INT4 or NVFP4, one loop or a two-loop dense chain; GPU only),
        ``"pallas"`` (the Pallas kernel; interpret mode off GPU, slow, for
        tests), or ``"xla"`` (the reference path).
      kernel_config: ``jflashloop_pallas_kernels.decode_attention.KernelConfig``
        (block sizes, splits, warps); None uses the measured defaults. The
        Gluon kernel takes its ``num_splits`` and ``target_programs`` only.
      poison_for_tests: fill the kernel's partial outputs with NaN first, so an
        element it fails to write shows up as NaN.
    Returns:
      float32 ``[max_sequences, q_heads, head_dim]``. The fused kernels match
      the reference within a relative error (Frobenius norm) per sequence of
      typically 2e-4: codes enter their matrix products exactly, decoded
      values and probabilities are rounded to float16, and they accumulate in
      float32. The Gluon kernel holds the query and the scaled query as
      float16 pairs (2e-4 also on keys with outlier channels and large
      per-channel offsets); the Pallas kernel rounds them to float16, which
      stays within 2e-3 on typical caches but reached 2.1e-3 to 2.4e-3 at
      head_dim 64 on such outlier keys with sharp attention
      (``KernelConfig(products="float32")`` keeps float32 operands). Decoded
      K/V must lie within +-65504.
    Raises:
      TypeError: queries of a non-floating dtype (int, bool, complex).
      ValueError: queries of the wrong shape, layer or loop out of range.
      NotImplementedError: ``implementation="pallas"`` for streams the fused
        kernel does not read (the automatic choice falls back to the
        reference path instead).
    """
    if implementation not in ("xla", "pallas", "gluon", None):
        raise ValueError(f"implementation must be None, 'xla', 'pallas' or 'gluon', got {implementation!r}")
    _check_arguments(queries, cache, layer, loop)
    automatic = implementation is None
    if automatic:
        implementation = "xla"
        if jax.default_backend() == "gpu":
            implementation = "gluon" if gluon_is_default(queries, cache, loop) else "pallas"
    if implementation == "gluon":
        reason = gluon_unsupported_reason(queries, cache, loop)
        if reason:
            raise NotImplementedError(reason)
        return _gluon_decode_attention(queries, cache, layer, loop, include_pending=include_pending, scale=scale,
                                       kernel_config=kernel_config)
    if implementation == "pallas":
        try:
            kernel_rotations(cache, loop)
        except NotImplementedError:
            if not automatic:
                raise
            implementation = "xla"  # formats without a fused kernel use the reference path
    if implementation == "xla":
        return decode_attention_reference(
            queries, cache, layer, loop, include_pending=include_pending, scale=scale
        )
    from jflashloop_pallas_kernels.decode_attention import KernelConfig, paged_decode_attention

    c = cache.config
    head_dim = queries.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    inputs = kernel_inputs(cache, layer, loop, include_pending)
    queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs)
    output = paged_decode_attention(
        queries,
        inputs["block_tables"],
        inputs["bounds"],
        inputs["streams"],
        windows["sink_keys"],
        windows["sink_values"],
        windows["ring_keys"],
        windows["ring_values"],
        loops=inputs["loops"],
        page_size=c.page_size,
        sink_tokens=c.sink_tokens,
        window_loop=window_loop,
        scale=scale,
        config=kernel_config or KernelConfig(),
        interpret=jax.default_backend() != "gpu",
        poison=poison_for_tests,
    )
    return unrotated_output(output, value_seed)
