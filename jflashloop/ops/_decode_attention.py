"""Decode attention over a :class:`~jflashloop.PagedKVCache`: the op, its backends and its reference.

One new query token per sequence attends over one loop of the cache.
:func:`decode_attention` resolves ``implementation`` once
(:func:`jflashloop.ops._dispatch.call`) among three backends:

* ``"xla"``: :func:`decode_attention_reference`, plain JAX: every sequence's
  K/V reconstructed densely, float32 softmax attention (the semantic
  definition the kernels match);
* ``"pallas"``: the Pallas-Triton kernel
  (``jflashloop_pallas_kernels.decode_attention``): every fused format, loop
  chains with sparse streams; interpret mode off a GPU;
* ``"gluon"``: the Gluon kernel (``jflashloop_triton_kernels.decode_attention``,
  through ``jax_triton``; GPU only).

The automatic order on a GPU is Gluon (where :func:`gluon_is_default` and
the Gluon kernel reads the call), then Pallas, then the reference;
elsewhere the reference. A backend that
cannot read the cache raises ``NotImplementedError`` and the next one runs;
an explicit choice raises it to the caller.

The kernels read the cache's arrays in place (:func:`kernel_inputs`) and
its static stream formats (:func:`loop_formats`, the one conversion from
:class:`~jflashloop.CodecSpec` to the kernels' descriptors); with rotated
streams the queries and windows are rotated outside the kernel and the
output rotated back (:func:`rotated_inputs`, :func:`unrotated_output`): the
query and the output by one float32 product each
(:func:`jflashloop.codecs.rotate_by_product`), the four windows by one product together; a loop predicted from the loop before
with no rows is read through that loop's streams with the query, windows and output mapped the same way
(:func:`predicted_source`, :func:`predicted_inputs`, :func:`predicted_output`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jflashloop_pallas_kernels import decode_attention as pallas_decode
from jflashloop_triton_kernels import call as triton_call
from jflashloop_triton_kernels import decode_attention as gluon_decode

from ..cache._config import CacheConfig
from ..cache._inspect import reconstruct, sequence_regions
from ..cache._layout import PagedKVCache, PagedStream
from ..cache._prediction import LoopPrediction
from ..cache._regions import regions, stored_pages, visible_tokens
from ..codecs import CodecSpec, rotate_by_product, rotation_matrix
from . import _dispatch

FUSED_FORMATS = pallas_decode.FUSED_FORMATS
ROW_FORMATS = (*FUSED_FORMATS, "int2")
"""Formats of sparse rows a fused kernel reads: :data:`FUSED_FORMATS` and affine INT2 (the Gluon kernel's
row path; the Pallas kernel raises ``NotImplementedError`` for them)."""
BACKENDS = ("xla", "pallas", "gluon")


def check_arguments(queries, cache: PagedKVCache, layer: int, loop: int) -> None:
    """Raise ``TypeError`` for a non-floating query dtype, ``ValueError`` naming
    the expected shapes and index ranges (every backend runs this check, once)."""
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
    queries: jax.Array, cache: PagedKVCache, layer: int, loop: int, *, include_pending: bool = True,
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
    check_arguments(queries, cache, layer, loop)
    return _reference(queries, cache, layer, loop, include_pending=include_pending, scale=scale)


def _reference(queries, cache: PagedKVCache, layer: int, loop: int, *, include_pending: bool, scale):
    """:func:`decode_attention_reference` after its argument checks."""
    c = cache.config
    sequences, q_heads, head_dim = queries.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // c.num_kv_heads

    def one_sequence(query, slot):
        keys, values, _ = reconstruct(cache, layer, loop, slot, include_pending=include_pending)
        regions = sequence_regions(cache, slot, include_pending=include_pending)
        valid = regions["sink"] | regions["ring"] | regions["pages"]
        seen = jnp.any(valid)
        # query head h = k * group + g reads KV head k: [kv_heads, group, D] against [T, kv_heads, D]
        # (no copy of the keys per query head: at B8 Hq32 Hkv8 T128K that copy alone was 16 GiB)
        query = query.astype(jnp.float32).reshape(c.num_kv_heads, group, head_dim)
        scores = jnp.einsum(
            "kgd,tkd->kgt", query, keys, precision=jax.lax.Precision.HIGHEST
        ).reshape(q_heads, -1) * scale
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        top = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.where(valid[None, :], jnp.exp(scores - jnp.where(seen, top, 0.0)), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        out = jnp.einsum("kgt,tkd->kgd", weights.reshape(c.num_kv_heads, group, -1), values,
                         precision=jax.lax.Precision.HIGHEST).reshape(q_heads, head_dim)
        return jnp.where(seen, out / jnp.where(total > 0, total, 1.0), 0.0)

    return jax.vmap(one_sequence)(queries, jnp.arange(sequences))


# --------------------------------------------------------------------------- what the kernels read


def stream_format(spec: CodecSpec, rows: int) -> pallas_decode.StreamFormat:
    """The kernels' static descriptor of one stream: the one adapter from a :class:`CodecSpec`."""
    return pallas_decode.StreamFormat(spec.format, spec.axis, spec.group_size, rows)


def loop_formats(config: CacheConfig, loop: int) -> tuple[pallas_decode.LoopFormat, ...]:
    """The static stream formats of loops ``config.chain_start(loop)..loop`` (the kernels' ``loops``
    argument: the streams loop ``loop`` reconstructs from)."""
    return tuple(
        pallas_decode.LoopFormat(
            stream_format(config.loops[i].key_spec, config.rows(i)),
            stream_format(config.loops[i].value_spec, config.rows(i)),
            config.loops[i].is_sparse,
        )
        for i in range(config.chain_start(loop), loop + 1)
    )


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What a fused kernel needs to know of loops ``0..loop``, worked out once per call.

    Attributes:
      loops: :func:`loop_formats` of ``source``.
      key_seed, value_seed: the rotation seed of every K (V) stream when they
        are all ``int4_rotated`` with one seed, else None (no stream rotated).
      source, prediction: :func:`predicted_source`: the loop whose chain the
        kernel reads, and the map from it to the loop asked for (None: the
        loop itself).
    """

    loops: tuple[pallas_decode.LoopFormat, ...]
    key_seed: int | None
    value_seed: int | None
    source: int | None = None
    prediction: LoopPrediction | None = None


@functools.cache
def kernel_plan(config: CacheConfig, loop: int) -> KernelPlan:
    """The :class:`KernelPlan` of loops ``0..loop`` (static, so worked out once per config and loop).

    A plan says no more than that some fused kernel may read the chain: each backend checks its own
    layouts (the Pallas kernel's ``unsupported_reason``, the Gluon kernel's).

    Raises:
      NotImplementedError: a stream no fused kernel reads (lattice, INT2 Lloyd-Max,
        INT3, dense affine INT2: :data:`FUSED_FORMATS`, and affine INT2 as
        sparse rows, :data:`ROW_FORMATS`), a chain not in one basis (either no
        stream is rotated, or every K (or V) stream is ``int4_rotated`` with one seed),
        a predicted loop (:attr:`~jflashloop.LoopStorage.prediction`) that stores rows or a dense residual,
        sits on rotated streams or has a map of condition number above :data:`MAX_CONDITION`
        (a predicted loop with no rows is read through its source: :func:`predicted_source`).
    """
    requested = loop
    loop, prediction = predicted_source(config, loop)
    if any(config.loops[i].prediction is not None for i in range(config.chain_start(loop), loop + 1)):
        raise NotImplementedError("the fused kernels do not read a predicted loop that stores rows or a dense "
                                  "residual (LoopStorage.prediction with sparse_rows_per_page other than 0)")
    if prediction is not None and not _well_conditioned(prediction):
        raise NotImplementedError(f"loop {requested}'s prediction is too ill-conditioned to move its windows into "
                                  f"loop {loop}'s basis (condition number above {MAX_CONDITION:g})")
    seeds = []
    for role in ("key_spec", "value_spec"):
        chain = [config.loops[i] for i in range(config.chain_start(loop), loop + 1)]
        specs = [getattr(storage, role) for storage in chain]
        unsupported = [spec.format for storage, spec in zip(chain, specs, strict=True)
                       if spec.format not in (ROW_FORMATS if storage.is_sparse else FUSED_FORMATS)]
        if unsupported:
            raise NotImplementedError(f"the fused kernel does not read {unsupported[0]!r} streams")
        rotated = {s.rotation_seed for s in specs if s.format == "int4_rotated"}
        if rotated and (len(rotated) > 1 or any(s.format != "int4_rotated" for s in specs)):
            raise NotImplementedError(
                "the fused kernel needs every stream of a chain in one basis: all int4_rotated with one "
                "seed, or none rotated"
            )
        seeds.append(rotated.pop() if rotated else None)
    if prediction is not None and any(seed is not None for seed in seeds):
        raise NotImplementedError("the fused kernels do not read a predicted loop over int4_rotated streams")
    return KernelPlan(loop_formats(config, loop), seeds[0], seeds[1], loop, prediction)


MAX_CONDITION = 1e3
"""The largest condition number of a prediction's matrices the fused kernels take (:func:`predicted_inputs` moves
the windows through their inverses)."""


def predicted_source(config: CacheConfig, loop: int) -> tuple[int, LoopPrediction | None]:
    """``(source, prediction)``: the loop a chain of predicted loops with no rows ends on (``loop`` itself when it
    is not one), and the composed map from that loop's reconstruction to loop ``loop``'s (None when none)."""
    prediction = None
    while loop > 0 and config.loops[loop].sparse_rows_per_page == 0 and config.loops[loop].prediction is not None:
        step = config.loops[loop].prediction
        prediction = step if prediction is None else step.then(prediction)
        loop -= 1
    return loop, prediction


@functools.cache
def _well_conditioned(prediction: LoopPrediction) -> bool:
    return all(np.linalg.cond(table[:, :-1].astype(np.float64)).max() <= MAX_CONDITION
               for table in prediction.tables())


def kernel_rotations(cache: PagedKVCache, loop: int, layer: int = 0) -> tuple[int | None, int | None]:
    """``(key_seed, value_seed)`` of :func:`kernel_plan` for ``layer`` (raises its ``NotImplementedError``)."""
    plan = kernel_plan(cache.config.layer(layer), loop)
    return plan.key_seed, plan.value_seed


def _stream_arrays(stream: PagedStream) -> dict[str, jax.Array | None]:
    return {"payload": stream.payload, "scale": stream.scale, "minimum": stream.minimum,
            "global_scale": stream.global_scale}


def kernel_inputs(cache: PagedKVCache, layer: int, loop: int, include_pending: bool) -> dict:
    """The arrays and static formats the fused kernels read for (``layer``, ``loop``).

    ``bounds`` is int32 ``[max_sequences, 2]``: per sequence the visible
    tokens ``n`` and ``pages_end`` of its :func:`~jflashloop.paged_cache.regions`.
    The kernels read positions ``sink_tokens <= t < pages_end`` from pages,
    through block-table columns below ``ceil(pages_end / page_size)``, and
    from the ring the positions ``>= pages_end`` among the latest
    ``window_tokens`` before ``n``. Since ``pages_end`` never passes a
    sequence's first lost page, every block-table entry a kernel reads holds
    one of the sequence's own pages (never -1), and it attends exactly to
    :func:`jflashloop.paged_cache.sequence_regions`.

    ``state`` (``(lengths int32 [max_sequences], active bool [max_sequences])``)
    and ``limits`` (static ``(pending, max_tokens_per_sequence,
    recent_tokens)``) let the Gluon kernel work the same regions out itself
    (then nothing computes ``bounds``): a block-table entry of -1 ends a
    sequence's pages there, since the cache stores no page after a lost one.
    """
    c = cache.config
    pool = cache.layers[layer]
    visible = visible_tokens(cache, include_pending=include_pending)
    pages_end = regions(c, cache.lengths, visible, stored_pages(cache)).pages_end
    source = predicted_source(c.layer(layer), loop)[0]  # a predicted loop reads its source's streams
    streams = tuple(
        {"keys": _stream_arrays(tiles.keys), "values": _stream_arrays(tiles.values),
         "row_positions": tiles.row_positions}
        for tiles in pool.loops[c.layer(layer).chain_start(source): source + 1]
    )
    # The windows go in whole ([loops, sequences, heads, tokens, D]); the
    # kernel reads entry ``window_loop``, so no slice is copied.
    return dict(
        block_tables=cache.block_tables,
        bounds=jnp.stack([visible, pages_end], axis=1).astype(jnp.int32),
        state=(cache.lengths, cache.active),
        limits=(int(include_pending), c.max_tokens_per_sequence, c.recent_tokens),
        streams=streams,
        sink_keys=pool.sink_keys if c.sink_tokens else None,
        sink_values=pool.sink_values if c.sink_tokens else None,
        ring_keys=pool.ring_keys,
        ring_values=pool.ring_values,
        window_loop=loop,
        loops=loop_formats(c.layer(layer), source),
        layer=layer,
    )


def rotated_inputs(queries, cache: PagedKVCache, loop: int, inputs: dict, plan: KernelPlan | None = None):
    """Queries and windows in the streams' basis for a fused kernel.

    Returns ``(queries, windows, window_loop, value_seed)``: with rotated key
    streams the queries are rotated (``q . k = (Rq) . (Rk)``, one float32
    product, :func:`jflashloop.codecs.rotate_by_product`); with rotated key
    or value streams this loop's four windows are rotated in one product
    (:func:`_moved_windows`; the unrotated kind by the identity) and passed
    alone (float32 ``[1, S, H, T, D]``, ``window_loop`` 0); ``value_seed`` is
    what :func:`unrotated_output` needs. ``plan`` defaults to :func:`kernel_plan`.
    """
    plan = kernel_plan(cache.config.layer(inputs["layer"]), loop) if plan is None else plan
    key_seed, value_seed = plan.key_seed, plan.value_seed
    windows = {name: inputs[name] for name in ("sink_keys", "sink_values", "ring_keys", "ring_values")}
    window_loop = inputs["window_loop"]
    if key_seed is not None or value_seed is not None:  # this loop's windows into the streams' basis
        head_dim = queries.shape[-1]
        matrices = np.stack([np.eye(head_dim) if seed is None else rotation_matrix(seed, head_dim)
                             for seed in (key_seed, value_seed)])[:, None]  # [2, 1, D, D]: one for every head
        windows, window_loop = _moved_windows(windows, window_loop, matrices), 0
    if key_seed is not None:
        queries = rotate_by_product(queries.astype(jnp.float32), key_seed)
    return queries, windows, window_loop, value_seed


def predicted_inputs(queries, windows: dict, window_loop: int, plan: KernelPlan):
    """Queries and windows in the source loop's basis for a predicted loop (:func:`predicted_source`).

    A page token of the predicted loop is ``x M + b`` (``x`` the source loop's reconstruction, per KV head), so
    its score is ``(M q) . x`` plus ``q . b``, the same for every token of a query (the softmax drops it): the
    kernel reads the source's pages with the query ``M q``, and this loop's own windows moved to
    ``(k - b) M^-1 = k M^-1 - b M^-1`` (values ``(v - b_v) M_v^-1``) give that query the windows' exact scores;
    the output goes back by :func:`predicted_output`. Returns ``(queries, windows, window_loop)`` (the
    windows float32, alone).

    The maps are a few small products a call (``bench/predicted_maps.py`` times them): the query's and the
    output's at :data:`MAP_PRECISION`; the four windows' in one product (:func:`_moved_windows`), of bfloat16
    values (exact products, float32 sums, at the default precision: on GPUs the TF32 matrix units) against the
    inverse rounded to bfloat16 beside what that rounding left (:func:`_split_bfloat16`; about 2**-16 of each
    term), or of other window dtypes at full float32 precision.
    """
    if plan.prediction is None:
        return queries, windows, window_loop
    sequences, q_heads, head_dim = queries.shape
    heads = plan.prediction.num_kv_heads
    key_table, value_table = plan.prediction.tables()
    grouped = queries.astype(jnp.float32).reshape(sequences, heads, q_heads // heads, head_dim)  # GQA groups
    queries = jnp.einsum("hde,shge->shgd", jnp.asarray(key_table[:, :-1]), grouped,
                         precision=MAP_PRECISION).reshape(sequences, q_heads, head_dim)
    inverses = np.stack([np.linalg.inv(table[:, :-1].astype(np.float64)) for table in (key_table, value_table)])
    shifts = np.einsum("khd,khde->khe", np.stack([key_table[:, -1], value_table[:, -1]]).astype(np.float64), inverses)
    return queries, _moved_windows(windows, window_loop, inverses, shifts), 0


WINDOW_PARTS = ("sink", "ring")


def _moved_windows(windows: dict, window_loop: int, matrices: np.ndarray, shifts: np.ndarray | None = None) -> dict:
    """Window ``window_loop`` of the sink and ring keys and values (each ``[loops, S, H, T, D]``, or None) mapped,
    all four in one product: ``x M - b`` (``matrices`` ``[2, H, D, D]``, keys' then values', or ``[2, 1, D, D]``,
    one for every head; ``shifts`` ``[2, H, D]`` or None, no shift). bfloat16 windows go in one product of
    bfloat16 values against the matrices split in two bfloat16 halves (:func:`_split_bfloat16`: exact products,
    float32 sums, so the GPUs' TF32 matrix units lose nothing), other dtypes at full float32 precision.
    Returns float32 ``[1, S, H, T, D]`` per window (None where absent)."""
    parts = [part for part in WINDOW_PARTS if windows[f"{part}_keys"] is not None]
    moved = {f"{part}_{kind}": None for part in WINDOW_PARTS for kind in ("keys", "values")}
    if not parts:
        return moved
    joined = jnp.stack([jnp.concatenate([windows[f"{part}_{kind}"][window_loop] for part in parts], axis=2)
                        for kind in ("keys", "values")])  # [2, S, H, T, D]: the parts joined along the tokens
    head_dim = joined.shape[-1]
    per_head = matrices.shape[1] != 1
    subscripts = "kshtd,khde->kshte" if per_head else "kshtd,kde->kshte"
    matrices = matrices if per_head else matrices[:, 0]
    if joined.dtype == jnp.bfloat16:  # one product of bfloat16 values (exact at any float32 precision)
        both = jnp.einsum(subscripts, joined.astype(jnp.float32), _split_bfloat16(matrices).astype(jnp.float32),
                          precision=jax.lax.Precision.DEFAULT)
        product = both[..., :head_dim] + both[..., head_dim:]
    else:
        product = jnp.einsum(subscripts, joined.astype(jnp.float32), jnp.asarray(matrices, jnp.float32),
                             precision=jax.lax.Precision.HIGHEST)
    if shifts is not None:
        product = product - jnp.asarray(shifts, jnp.float32)[:, None, :, None]
    start = 0
    for part in parts:
        tokens = windows[f"{part}_keys"].shape[3]
        for index, kind in enumerate(("keys", "values")):
            moved[f"{part}_{kind}"] = product[index:index + 1, :, :, start:start + tokens]
        start += tokens
    return moved


MAP_PRECISION = jax.lax.Precision.HIGHEST
"""Precision of the query's and the output's maps around a predicted loop's kernel: full float32 (at ``HIGH`` an
H100 multiplies float32 operands as TF32, 4e-4 to 6e-4 of the query's map: call 70, ``bench/E2E.md``)."""


def _split_bfloat16(matrix: np.ndarray):
    """bfloat16 ``[..., D, 2E]`` of a float64 ``[..., D, E]`` matrix: its bfloat16 rounding, then what the
    rounding left (rounded too), so that a bfloat16 ``x`` times it summed by halves is ``x M`` to about 2**-16."""
    high = jnp.asarray(matrix, jnp.float32).astype(jnp.bfloat16)
    low = (jnp.asarray(matrix, jnp.float32) - high.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.concatenate([high, low], axis=-1)


def predicted_output(output, inputs: dict, plan: KernelPlan):
    """The kernel's output over the source's basis back to the predicted loop's: ``out M_v + b_v`` (0 for a
    sequence with no visible token, as the reference gives)."""
    if plan.prediction is None:
        return output
    sequences, q_heads, head_dim = output.shape
    heads = plan.prediction.num_kv_heads
    table = jnp.asarray(plan.prediction.tables()[1])
    grouped = output.astype(jnp.float32).reshape(sequences, heads, q_heads // heads, head_dim)
    mapped = jnp.einsum("shgd,hde->shge", grouped, table[:, :-1], precision=MAP_PRECISION)
    seen = inputs["bounds"][:, 0] > 0
    mapped = mapped + jnp.where(seen[:, None, None, None], table[:, -1][None, :, None, :], 0.0)
    return mapped.reshape(sequences, q_heads, head_dim)


def float16_windows(windows: dict) -> dict:
    """The float32 windows (moved by :func:`rotated_inputs` or :func:`predicted_inputs`) as the Gluon kernel reads
    them: clamped to float16's largest finite value, then float16 (its window loads do the same to every window
    dtype, ``_load_window_rows``), so that it reads half the bytes and computes the same bits. Other arrays (and
    None) are returned as they are."""
    return {name: jnp.clip(array, -65504.0, 65504.0).astype(jnp.float16)
            if array is not None and array.dtype == jnp.float32 else array for name, array in windows.items()}


def unrotated_output(output, value_seed):
    """The kernel's output back in the natural basis: ``sum_t p_t R v_t = R (sum_t p_t v_t)``."""
    if value_seed is None:
        return output
    return rotate_by_product(output.astype(jnp.float32), value_seed, inverse=True)


# --------------------------------------------------------------------------- the backends


def gluon_is_default(config: CacheConfig, loop: int) -> bool:
    """Whether the automatic choice on a GPU tries the Gluon kernel first.

    Wherever it reads the cache (elsewhere the Gluon backend raises
    ``NotImplementedError`` and the Pallas kernel runs): it was measured
    faster than the Pallas kernel for every fused format (int4, nvfp4,
    int4_rotated) and for loops 1 and 3 of the FlashLoop chain
    (``bench/RESULTS.md``, device time on an H200).
    """
    return True


def check_gluon_runs(interpret: bool = False) -> None:
    """``NotImplementedError`` unless the Gluon kernels can run here (a CUDA GPU, ``jax_triton``, no interpret mode)."""
    if not _dispatch.on_gpu():
        raise NotImplementedError("the Gluon kernel runs on CUDA GPUs only")
    if interpret:
        raise NotImplementedError("the Gluon kernel has no interpret mode (its CPU emulation is for tests)")
    if not triton_call.available():
        raise NotImplementedError("the Gluon kernel needs jax_triton (pip install jax-triton)")


def _gluon_plan(queries, cache: PagedKVCache, layer: int, loop: int, interpret: bool = False) -> KernelPlan:
    """The :class:`KernelPlan`, or ``NotImplementedError`` saying why the Gluon kernel cannot serve the call."""
    check_gluon_runs(interpret)
    c = cache.config
    if queries.ndim != 3 or queries.shape[1] % c.num_kv_heads:
        raise NotImplementedError("queries must be [max_sequences, q_heads, head_dim]")
    plan = kernel_plan(c.layer(layer), loop)
    reason = gluon_decode.unsupported_reason(plan.loops, c.head_dim, c.page_size, queries.shape[1] // c.num_kv_heads)
    if reason:
        raise NotImplementedError(reason)
    return plan


def gluon_unsupported_reason(queries, cache: PagedKVCache, loop: int, layer: int = 0) -> str | None:
    """Why the Gluon kernel cannot serve this call (of ``layer``), or None (it needs a GPU and ``jax_triton``)."""
    try:
        _gluon_plan(queries, cache, layer, loop)
    except NotImplementedError as error:
        return str(error)
    return None


def _softmax_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _gluon(queries, cache, layer, loop, *, include_pending, scale, kernel_config, interpret):
    plan = _gluon_plan(queries, cache, layer, loop, interpret)
    c = cache.config
    inputs = kernel_inputs(cache, layer, loop, include_pending)
    queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs, plan)
    queries, windows, window_loop = predicted_inputs(queries, windows, window_loop, plan)
    if plan.prediction is not None or plan.key_seed is not None or plan.value_seed is not None:
        windows = float16_windows(windows)  # moved: this loop's windows alone, float32
    options = {}
    if kernel_config is not None:
        options = dict(splits=kernel_config.num_splits, target_programs=kernel_config.target_programs)
        if kernel_config.products == "float32":  # the most precise products: float16 query pairs
            options["precise"] = True
    output = gluon_decode.paged_decode_attention(
        queries, inputs["block_tables"], inputs["bounds"], inputs["streams"], windows["sink_keys"],
        windows["sink_values"], windows["ring_keys"], windows["ring_values"], state=inputs["state"],
        limits=inputs["limits"], loops=plan.loops, page_size=c.page_size, sink_tokens=c.sink_tokens,
        window_loop=window_loop, scale=_softmax_scale(c.head_dim, scale), **options)
    return predicted_output(unrotated_output(output, value_seed), inputs, plan)


def _pallas(queries, cache, layer, loop, *, include_pending, scale, kernel_config, interpret, poison):
    plan = kernel_plan(cache.config.layer(layer), loop)
    c = cache.config
    inputs = kernel_inputs(cache, layer, loop, include_pending)
    queries, windows, window_loop, value_seed = rotated_inputs(queries, cache, loop, inputs, plan)
    queries, windows, window_loop = predicted_inputs(queries, windows, window_loop, plan)
    output = pallas_decode.paged_decode_attention(
        queries,
        inputs["block_tables"],
        inputs["bounds"],
        inputs["streams"],
        windows["sink_keys"],
        windows["sink_values"],
        windows["ring_keys"],
        windows["ring_values"],
        loops=plan.loops,
        page_size=c.page_size,
        sink_tokens=c.sink_tokens,
        window_loop=window_loop,
        scale=_softmax_scale(c.head_dim, scale),
        config=kernel_config or pallas_decode.KernelConfig(),
        interpret=interpret,
        poison=poison,
    )
    return predicted_output(unrotated_output(output, value_seed), inputs, plan)


def decode_attention(
    queries: jax.Array,
    cache: PagedKVCache,
    layer: int,
    loop: int,
    *,
    include_pending: bool = True,
    scale: float | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    kernel_config=None,
    poison_for_tests: bool = False,
) -> jax.Array:
    """Decode attention over a :class:`~jflashloop.PagedKVCache` (fused on GPU).

    Same contract as :func:`decode_attention_reference`.

    Args:
      queries: ``[max_sequences, q_heads, head_dim]``.
      cache, layer, loop, include_pending, scale: as for the reference.
      implementation: ``None`` (on a GPU the Gluon kernel wherever it reads
        the cache and ``jax_triton`` is installed, else the Pallas kernel; the
        reference path elsewhere and wherever no kernel reads the cache; see
        :func:`gluon_is_default`), ``"gluon"`` (the Gluon kernel: int4, nvfp4
        or int4_rotated streams, loop chains of 1-4 with sparse loops, whose
        rows may also be affine INT2; GPU only), ``"pallas"`` (the Pallas
        kernel, no INT2 rows; interpret mode off GPU, slow, for tests), or
        ``"xla"`` (the reference path).
      interpret: run the Pallas kernel in interpret mode; None: off a GPU only
        (True runs the kernel's logic in interpret mode on a GPU host too).
      kernel_config: ``jflashloop_pallas_kernels.decode_attention.KernelConfig``
        (block sizes, splits, warps); None uses the measured defaults. The
        Gluon kernel takes its ``num_splits`` and ``target_programs``, and
        reads ``products="float32"`` as a request for its most precise
        products (the query and scaled query as float16 pairs, which are
        also its default).
      poison_for_tests: fill the Pallas kernel's partial outputs with NaN
        first, so an element it fails to write shows up as NaN.
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
      ValueError: queries of the wrong shape, layer or loop out of range, an
        unknown ``implementation``.
      NotImplementedError: an explicit ``implementation`` that cannot read
        the cache (the automatic choice falls back to the next backend instead).
    """
    if implementation is not None and implementation not in BACKENDS:
        _dispatch.resolve(implementation, choices=BACKENDS)  # raises the ValueError naming the choices
    check_arguments(queries, cache, layer, loop)
    common = dict(include_pending=include_pending, scale=scale)
    kernels = dict(common, kernel_config=kernel_config)
    backends = {
        "xla": lambda chosen: _reference(queries, cache, layer, loop, **common),
        "pallas": lambda chosen: _pallas(queries, cache, layer, loop, **kernels, interpret=chosen.interpret,
                                         poison=poison_for_tests),
        "gluon": lambda chosen: _gluon(queries, cache, layer, loop, **kernels, interpret=chosen.interpret),
    }
    automatic = ("xla",)
    if _dispatch.on_gpu():
        automatic = ("gluon", "pallas", "xla") if gluon_is_default(cache.config, loop) else ("pallas", "xla")
    return _dispatch.call(implementation, backends, automatic=automatic, interpret=interpret)
