"""Decode attention over a paged INT4 cache with the Gluon page kernel (GPU).

The page kernel (:mod:`jflashloop_triton_kernels.gluon_decode`) writes one
online-softmax partial per split; the Pallas window kernel adds the sink and
recent windows; a log-sum-exp merge combines them. Same arguments and result
as :func:`jflashloop_pallas_kernels.decode_attention.paged_decode_attention`
for the streams :func:`unsupported_reason` accepts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jflashloop_pallas_kernels import decode_attention as pallas_decode
from jflashloop_pallas_kernels import launch as pallas_launch

from . import launch

ROWS = 8
LOG2_E = math.log2(math.e)
# The page kernel merges the splits itself (one launch for the whole call) when a (sequence, KV head)
# has at most this many partials; more are merged apart (preferred_merge: the last program's merge is then too long).
KERNEL_MERGE_SLOTS = 16
# Beyond this many partials a (sequence, KV head), the Gluon merge kernel merges them (one pass, one launch):
# 3.5 against XLA's 5.7 us at 33 partials, 2.2 against 3.4 at 65; at 17, XLA's single fusion took 1.1 against 2.6
# (bench/KERNEL_NOTES.md, "The merge kernel in one pass").
GLUON_MERGE_SLOTS = 32


def unsupported_reason(loops, head_dim: int, page_size: int, group: int, kernel: str = "pipelined",
                       rows: int = ROWS) -> str | None:
    """Why the Gluon kernel cannot read these streams, or None if it can.

    ``group``: query rows per KV head; ``rows``: the most the caller accepts
    (the pipelined kernel reads up to 32 in blocks of 8, re-reading the
    pages per block: ``chunk_attention``; decode keeps 8).
    """
    dense = [loop for loop in loops if not loop.sparse]
    sparse = loops[len(dense):]
    most = 2 if kernel == "pipelined" else 1
    if not 1 <= len(dense) <= most or any(loop.sparse for loop in loops[:len(dense)]):
        return f"the {kernel} Gluon kernel reads chains of up to {most} dense loop(s)"
    if any(loop != loops[0] for loop in dense):
        return "the Gluon kernel reads chains whose loops share one format"
    keys, values = loops[0].keys, loops[0].values
    if sparse:
        if kernel != "pipelined" or len(sparse) > 2:
            return "the pipelined Gluon kernel reads up to two sparse loops after one or two dense loops"
        # INT4 rows grouped like the dense values (not after int4_rotated streams: another basis), or rows
        # of the dense streams' own format and grouping
        row_specs = {(values.format, "token", values.group_size)}
        if values.format != "int4_rotated":
            row_specs |= {("int4", "token", values.group_size), ("int2", "token", values.group_size)}
        specs = {(stream.format, stream.axis, stream.group_size) for loop in sparse
                 for stream in (loop.keys, loop.values)}
        if len(specs) > 1 or not specs <= row_specs:
            return ("the Gluon kernel reads sparse loops of one format: INT4 or affine INT2 rows grouped like the "
                    "dense values (after INT4 or NVFP4 streams), or rows of the dense streams' format and grouping")
        if any(loop.keys.rows > page_size for loop in sparse):
            return "sparse rows exceed the page"
    formats = (keys.format, keys.axis, values.format, values.axis)
    if formats == ("nvfp4", "token", "nvfp4", "token") and kernel == "pipelined":
        pass  # NVFP4 keys and values, 16-channel blocks
    elif formats == ("int4_rotated", "token", "int4_rotated", "token") and kernel == "pipelined":
        pass  # per-token scales with the zero point in their low mantissa bits (the caller rotates)
    elif formats != ("int4", "channel", "int4", "token"):
        return ("the Gluon kernel reads INT4 keys grouped per channel with INT4 values grouped per token"
                + (", or NVFP4 or int4_rotated keys and values" if kernel == "pipelined" else ""))
    elif keys.group_size != page_size:
        return "the Gluon kernel needs one key group per page"
    if head_dim not in (64, 128, 256):
        return f"the Gluon kernel reads head_dim 64, 128 or 256, got {head_dim}"
    smallest = 16 if kernel == "pipelined" else head_dim // 8
    if values.format == "int4" and (values.group_size < smallest or values.group_size & (values.group_size - 1)):
        return f"the {kernel} Gluon kernel needs value groups of a power of two >= {smallest}, got {values.group_size}"
    if not 16 <= page_size <= 128:
        return f"the Gluon kernel reads pages of 16 to 128 tokens, got {page_size}"
    most = min(rows, 4 * ROWS) if kernel == "pipelined" else ROWS
    if group > most:
        return f"the Gluon kernel reads GQA groups of at most {most} query heads, got {group}"
    return None


MERGE_VALUES_PER_THREAD = 64  # partials a thread of the merge kernel holds per block of slots


def merge_launch(head_dim: int, slots: int, group: int = ROWS) -> dict[str, int]:
    """The merge kernel's blocks: ``SB`` slots per load, ``DB`` channels per program, ``WARPS``.

    ``SB`` covers every slot in one block where a thread then holds at most
    :data:`MERGE_VALUES_PER_THREAD` partials (``SB x rows x DB / threads``, the rows the group padded to a
    power of two), so the kernel's loads all leave in one round trip to memory."""
    channels, warps = min(32, head_dim), 4
    rows = 1 << (group - 1).bit_length()
    most = max(1, MERGE_VALUES_PER_THREAD * 32 * warps // (rows * channels))
    return dict(SB=min(1 << (most.bit_length() - 1), 1 << max(slots - 1, 1).bit_length()), DB=channels,
                WARPS=warps)


def preferred_merge(slots: int, *, in_kernel: bool, row_blocks: int = 1) -> str:
    """The merge of ``slots`` partials a (sequence, KV head) when the caller names none: ``"kernel"`` where
    the page kernel can merge (``in_kernel``: pipelined, windows fused, not partials only; one block of 8
    rows) and there are at most :data:`KERNEL_MERGE_SLOTS`; the Gluon merge kernel beyond
    :data:`GLUON_MERGE_SLOTS` (one block of rows); else ``"xla"``.

    Raises:
      ValueError: ``slots`` or ``row_blocks`` below 1.
    """
    if slots < 1 or row_blocks < 1:
        raise ValueError(f"preferred_merge needs positive sizes, got slots={slots}, row_blocks={row_blocks}")
    if row_blocks == 1 and in_kernel and slots <= KERNEL_MERGE_SLOTS:
        return "kernel"
    if row_blocks == 1 and slots > GLUON_MERGE_SLOTS:
        return "gluon"
    return "xla"


def merge_partials(output, total, running_max, group: int, *, emulate: bool = False):
    """float32 ``[S, H * group, D]``: the split partials of the page kernel merged by the Gluon merge kernel.

    ``output`` float32 ``[S, H, slots, 8, D]``, ``total`` and ``running_max``
    ``[S, H, slots, 8]`` (rows below ``group`` are read); the same result as
    ``jflashloop_pallas_kernels.decode_attention.merge_splits`` (XLA) of those rows.
    """
    from . import call, gluon_decode

    sequences, kv_heads, slots, _, head_dim = output.shape
    launch = merge_launch(head_dim, slots, group)
    out_shape = [jax.ShapeDtypeStruct((sequences, kv_heads * group, head_dim), jnp.float32)]
    grid = (sequences * kv_heads, head_dim // launch["DB"], 1)
    constants = dict(D=head_dim, GROUP=group, SLOTS=slots, **launch)
    arrays = [output, total, running_max]
    if emulate:
        return _emulated_call(gluon_decode.merge_kernel, grid, arrays, [], out_shape, constants)[0]
    return call.triton_call(*arrays, kernel=gluon_decode.merge_kernel, out_shape=out_shape, grid=grid,
                            num_warps=launch["WARPS"], name="jflashloop_merge_splits", **constants)[0]


FORMAT_NAMES = ("int4", "nvfp4", "int4_rotated", "int2")
"""The formats of the Gluon kernel's format constants (:func:`_stream_format`), by constant."""


def _stream_format(stream, head_dim: int) -> int:
    """The Gluon kernel's format constant of a stream's arrays: 0 INT4 (a minimum, 8 codes a word), 1
    NVFP4 (a tile scale), 2 int4_rotated, 3 affine INT2 (a minimum, 16 codes a word: sparse rows)."""
    if stream["minimum"] is not None:
        return 3 if stream["payload"].shape[-1] * 16 == head_dim else 0
    return 1 if stream["global_scale"] is not None else 2


def _int2_row_halfwords(payload):
    """Affine INT2 row words uint32 ``[..., D/16]`` -> uint16 ``[..., D/8]`` (little-endian, the same
    memory): halfword ``w`` holds the 2-bit codes of channels ``8 w .. 8 w + 7``, INT4 word ``w``'s."""
    return jax.lax.bitcast_convert_type(payload, jnp.uint16).reshape(*payload.shape[:-1], -1)


def page_partials(query, block_tables, bounds, keys: dict[str, Any], values: dict[str, Any], *,
                  residual: tuple[dict[str, Any], dict[str, Any]] | None = None,
                  sparse: tuple[dict[str, Any], ...] = (), sparse_rows: tuple[int, ...] = (),
                  page_size: int, sink_tokens: int, value_group: int, splits: int, kernel: str = "pipelined",
                  num_warps: int = 1, num_stages: int = 1, stages: int | None = None, windows=None,
                  chunk: int | None = None, window_program: bool = True, maxnreg: int | None = None,
                  emulate: bool = False, merge_group: int | None = None, precise: bool = True,
                  query_scale: float | None = None, state=None, limits: tuple[int, int, int] = (1, 1 << 30, 0),
                  row_blocks: int = 1, lazy: bool = False, overlap: bool = False,
                  merge_registers: int = launch.MERGE_REGISTERS, stagger: bool = False,
                  scaled: bool | None = None, persistent: int = 0):
    """Run the Gluon page kernel.

    Args:
      query: float32 ``[S, H, 8, D]`` (natural channel order), pre-scaled by
        softmax scale * log2(e); with ``query_scale`` (pipelined kernel) the
        caller's queries ``[S, H, group, D]`` (any float dtype), which the
        kernel scales by ``query_scale`` and pads itself.
      block_tables, bounds: as for ``paged_decode_attention`` (the pipelined
        kernel reads ``state`` instead of ``bounds``).
      state, limits: the pipelined kernel's sequence state ``(lengths int32
        [S], active bool [S])`` and ``(pending, capacity, recent_tokens)``:
        it works out each sequence's regions itself (no computation before it).
      keys, values: one loop's stream arrays (``payload`` uint32 ``[H, pool,
        page, D/8]``, ``scale`` / ``minimum`` float16).
      residual: loop 2's (keys, values) of a dense chain (pipelined kernel only).
      sparse, sparse_rows: loops 3-4 of a FlashLoop chain (their stream dicts,
        with ``row_positions``) and their stored rows per tile.
      merge_group: merge the splits inside the kernel and also return the
        output float32 ``[S, H * merge_group, D]`` (pipelined kernel only).
      row_blocks: blocks of 8 query rows per KV head (pipelined kernel; the
        query ``[S, H, group, D]`` with ``group <= 8 row_blocks``).
      lazy: rescale the running softmax state only when a row's maximum grows
        by more than ``gluon_decode.RESCALE_LOG2`` (pipelined kernel).
      overlap: make each page's scores before the previous page's softmax
        (pipelined kernel; one dense stream, whole-page chunks, three stages
        or more to keep a page in flight).
      merge_registers: registers a thread gives the in-kernel merge's partials
        per round trip (``launch.MERGE_REGISTERS``; 128 halves the round trips
        at head_dim 128).
      stagger: with one stage (pipelined kernel), copy a page's keys and its
        values as two groups, each behind the other half of a page's work.
      scaled: INT4 or int4_rotated values as subnormal codes, NVFP4's as E2M1
        values, their scales (and minimums or zero points) on the probabilities
        (pipelined kernel); None:
        :func:`jflashloop_triton_kernels.launch.preferred_scaled_values`.
      persistent: > 0: a grid of at most that many persistent programs, each
        taking the (sequence, row program, slot) items in turn, the next
        item's first page copied during this one's last (pipelined kernel,
        two stages, not ``overlap`` or ``stagger``); 0: one program per item.
    Returns:
      ``(out [S, H * row_blocks, splits, 8, D], sum [S, H * row_blocks,
      splits, 8], max [...])`` float32, natural channel order (program ``h *
      row_blocks + b`` holds rows ``8 b ..`` of KV head ``h``).
    """
    from . import call, gluon_decode, triton_decode

    kernel = {"pipelined": gluon_decode.int4_pages_kernel_v2, "simple": gluon_decode.int4_pages_kernel,
              "triton": triton_decode.int4_pages_kernel}[kernel]

    sequences, kv_heads, group, head_dim = query.shape
    if query_scale is None and (group != ROWS or query.dtype != jnp.float32):
        raise ValueError(f"a query of {group} rows needs query_scale (the pipelined kernel pads it)")
    pool = keys["payload"].shape[1]
    max_pages = block_tables.shape[1]
    pages_per_split = -(-max_pages // splits)
    # With fused windows, a program of its own (split index ``splits``, no pages) attends over them.
    slots = splits + 1 if windows is not None and window_program else splits
    if row_blocks != 1 and (stages is None or merge_group is not None or group > ROWS * row_blocks):
        raise ValueError("row blocks need the pipelined kernel, no in-kernel merge and group <= 8 row_blocks")
    programs = kv_heads * row_blocks
    out_shape = [
        jax.ShapeDtypeStruct((sequences, programs, slots, ROWS, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((sequences, programs, slots, ROWS), jnp.float32),
        jax.ShapeDtypeStruct((sequences, programs, slots, ROWS), jnp.float32),
    ]
    stream_format = _stream_format(keys, head_dim)

    def stream_arrays(stream):
        if _stream_format(stream, head_dim) == 3:  # affine INT2 rows: a halfword per INT4 word
            return [_int2_row_halfwords(stream["payload"]), stream["scale"], stream["minimum"]]
        if stream["global_scale"] is not None:  # NVFP4: E4M3 scales as bytes, the tile scales for the minimums
            return [stream["payload"], jax.lax.bitcast_convert_type(stream["scale"], jnp.uint8), stream["global_scale"]]
        if stream["minimum"] is None:  # int4_rotated: the per-token scales (twice; the second slot is unread)
            return [stream["payload"], stream["scale"], stream["scale"]]
        return [stream["payload"], stream["scale"], stream["minimum"]]

    if merge_registers < 1:
        raise ValueError(f"merge_registers must be positive, got {merge_registers}")
    if overlap and (stages is None or stages < 2 or residual is not None or sparse or (chunk or page_size) != page_size):
        raise ValueError("overlap needs the pipelined kernel with 2 or more stages, one dense stream and "
                         "whole-page chunks")
    if stagger and stages != 1:
        raise ValueError(f"stagger needs the pipelined kernel with one stage, got stages={stages}")
    if persistent < 0:
        raise ValueError(f"persistent must be 0 or a number of programs, got {persistent}")
    if persistent and (stages != 2 or overlap or stagger):
        raise ValueError("persistent programs run the pipelined kernel's plain loop of two stages")
    items = sequences * programs * slots
    persistent = min(persistent, items)
    rows_format = _stream_format(sparse[0]["keys"], head_dim) if sparse else 0
    where = dict(format=FORMAT_NAMES[stream_format], head_dim=head_dim,
                 value_group=value_group, group=group, row_blocks=row_blocks, lazy=lazy, sparse_loops=len(sparse),
                 row_format=FORMAT_NAMES[rows_format])
    if scaled is None:
        scaled = stages is not None and launch.preferred_scaled_values(streams=1 if residual is None else 2, **where)
    elif scaled and not (stages is not None and launch.scaled_values(**where)):
        raise ValueError("scaled values need the pipelined kernel, one row block and no lazy rescaling, and "
                         "INT4 streams with at most 8 / (head_dim / value_group) query rows, NVFP4 streams with "
                         "at most 8 / (head_dim / 16) and no sparse loops or NVFP4 rows, or int4_rotated "
                         "streams without sparse loops")
    if stages is not None:  # the pipelined kernel: the sequence state, not the bounds
        if state is None:
            raise ValueError("the pipelined kernel reads the sequence state (lengths, active)")
        heads = [state[0].astype(jnp.int32), state[1].astype(jnp.bool_)]
    else:
        heads = [bounds.astype(jnp.int32)]
    arrays = [query, block_tables.astype(jnp.int32), *heads, *stream_arrays(keys), *stream_arrays(values)]
    scalars = [kv_heads, pool, max_pages, pages_per_split, slots]
    extra = {} if stages is None else {"STAGES": stages, "CHUNK": chunk or page_size,
                                       "STREAMS": 1 if residual is None else 2, "FORMAT": stream_format}
    if stages is not None:  # loop 2's stream arrays (loop 1's again, unread, for one loop)
        keys2, values2 = residual if residual is not None else (keys, values)
        arrays += [*stream_arrays(keys2), *stream_arrays(values2)]
        for index in range(2):  # sparse loops 3 and 4 (loop 1's arrays, unread, where absent)
            if index < len(sparse):
                s = sparse[index]
                arrays += [*stream_arrays(s["keys"]), *stream_arrays(s["values"]), s["row_positions"]]
            else:
                arrays += [*stream_arrays(keys), *stream_arrays(values), block_tables]
        extra.update(SPARSE=len(sparse), R3=sparse_rows[0] if sparse else 16,
                     R4=sparse_rows[1] if len(sparse) > 1 else 16,
                     ROWS_FORMAT=rows_format)
        out_shape += [
            jax.ShapeDtypeStruct((sequences, kv_heads * (merge_group or 1), head_dim) if merge_group else (1,),
                                 jnp.float32),
            jax.ShapeDtypeStruct((sequences, kv_heads) if merge_group else (1,), jnp.int32),
        ]
        if merge_group is not None and merge_group != group:
            raise ValueError(f"merge_group {merge_group} differs from the query's {group} rows")
        extra.update(MERGE=merge_group is not None, GROUP=group, PRECISE=precise,
                     QSCALE=1.0 if query_scale is None else float(query_scale),
                     PENDING=int(limits[0]), CAPACITY=int(limits[1]), RECENT=int(limits[2]), RB=row_blocks,
                     LAZY=lazy, OVERLAP=overlap, MERGE_REGS=merge_registers, STAGGER=stagger,
                     SCALED=scaled, PERSIST=persistent)
    elif query_scale is not None:
        raise ValueError("only the pipelined kernel scales and pads the query itself")
    elif stream_format:
        raise ValueError("only the pipelined kernel reads NVFP4 and int4_rotated streams")
    elif residual is not None:
        raise ValueError("only the pipelined kernel reads a residual chain")
    if windows is not None:  # (sink_keys | None, sink_values | None, ring_keys, ring_values, window_loop)
        sink_k, sink_v, ring_k, ring_v, window_loop = windows
        arrays += [ring_k if sink_k is None else sink_k, ring_v if sink_v is None else sink_v, ring_k, ring_v]
        scalars += [sequences, window_loop, slots - 1]
        extra.update(RING=ring_k.shape[3], WINDOWS=True)
    elif stages is not None:  # the pipelined kernel without windows: any arrays for the unused pointers
        arrays += [query] * 4
        scalars += [sequences, 0, 0]
        extra.update(RING=16, WINDOWS=False)
    constants = dict(D=head_dim, PAGE=page_size, GV=value_group, SINK=sink_tokens, **extra)
    zeroed = (len(out_shape) - 1,) if merge_group else ()  # the merge counters start at zero (hashable: a jaxpr parameter)
    if emulate:  # the kernel's own body on the CPU (numpy), for tests
        grid = (persistent, 1, 1) if persistent else (sequences, programs, slots)
        return _emulated_call(kernel, grid, arrays, scalars, out_shape, constants)
    return call.triton_call(
        *arrays, *scalars, zeroed_outputs=zeroed,
        kernel=kernel, out_shape=out_shape, grid=(persistent, 1, 1) if persistent else (sequences, programs, slots),
        num_warps=num_warps, num_stages=num_stages, name=f"jflashloop_int4_pages_{splits=}",
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
        **constants,
    )


def _emulated_call(kernel, grid, arrays, scalars, out_shape, constants):
    from . import emulate, gluon_decode

    name = next(n for n, f in vars(gluon_decode).items() if f is kernel)

    def host(*host_arrays):
        outputs = [np.zeros(s.shape, s.dtype) for s in out_shape]
        return tuple(emulate.run(name, grid, [np.asarray(a) for a in host_arrays], scalars, outputs, constants))

    return jax.pure_callback(host, tuple(out_shape), *arrays)


@functools.partial(jax.jit, static_argnames=("loops", "page_size", "sink_tokens", "window_loop", "scale",
                                             "splits", "pages_only", "kernel", "stages",
                                             "fused_windows", "chunk", "target_programs", "min_pages_per_split",
                                             "partials_only", "maxnreg", "emulate", "merge", "precise",
                                             "limits", "lazy", "overlap", "merge_registers", "stagger",
                                             "scaled_values", "persistent_programs"))
def paged_decode_attention(queries, block_tables, bounds, streams, sink_keys, sink_values, ring_keys,
                           ring_values, *, state=None, limits: tuple[int, int, int] | None = None,
                           loops, page_size: int, sink_tokens: int, window_loop: int,
                           scale: float, splits: int | None = None, pages_only: bool = False,
                           kernel: str = "pipelined", stages: int | None = None, fused_windows: bool = True,
                           chunk: int | None = None, target_programs: int | None = None,
                           min_pages_per_split: int = launch.MIN_PAGES_PER_SPLIT,
                           partials_only: bool = False, maxnreg: int | None = None, emulate: bool = False,
                           merge: str | None = None, precise: bool | None = None, lazy: bool | None = None,
                           overlap: bool | None = None, merge_registers: int | None = None,
                           stagger: bool | None = None, scaled_values: bool | None = None,
                           persistent_programs: int | None = None):
    """float32 ``[S, q_heads, D]``: decode attention over one dense INT4 loop, or
    loop 2 of a dense INT4 chain (pipelined kernel).

    Arguments as for
    :func:`jflashloop_pallas_kernels.decode_attention.paged_decode_attention`;
    the rest choose the kernel (the defaults are the measured best,
    ``bench/KERNEL_NOTES.md``):

    * ``kernel``: ``"pipelined"`` (cp.async pipeline of ``stages`` pages; None:
      2, or fewer where the GPU's shared memory per block needs it,
      :func:`jflashloop_triton_kernels.launch.pipelined_stages`; windows inside
      when ``fused_windows``), ``"simple"`` (one page at a time,
      loads straight to registers; windows by the Pallas window kernel) or
      ``"triton"`` (the simple kernel's algorithm in plain Triton).
    * ``splits``: split-KV programs per (sequence, KV head); None gives about
      ``target_programs`` programs in all (None: the measured best,
      :func:`jflashloop_triton_kernels.launch.preferred_target_programs`), but no fewer than
      ``min_pages_per_split`` pages per program (twice that where a wave
      stays full: :func:`jflashloop_triton_kernels.launch.split_count`); with
      ``target_programs`` None too, fitted to whole waves of the kernel's programs
      (:func:`jflashloop_triton_kernels.launch.wave_fitted_splits`, at
      :func:`jflashloop_triton_kernels.launch.resident_programs` an SM).
    * ``chunk``: tokens per step inside a page (default: the page);
      ``maxnreg``: a register cap per thread (ptxas; None: the pipelined
      kernel's :func:`jflashloop_triton_kernels.launch.preferred_maxnreg`).
    * ``pages_only`` skips the windows and ``partials_only`` returns the
      kernel's partials unmerged (benchmarks).
    * ``emulate`` runs the Gluon kernel's own body on the CPU with numpy
      (:mod:`jflashloop_triton_kernels.emulate`; tests, small shapes).
    * ``precise`` (pipelined kernel): the query and each page's scaled query
      as float16 pairs, the low halves in the m16 products' padding rows 8-15
      (no extra product; about 10x less error on keys with outlier channels
      and large per-channel offsets: at most 2.6e-4 against up to 2.8e-3 with
      one float16), else one float16 each. None: the pairs.
    * ``lazy`` (pipelined kernel): rescale the running softmax state only
      when a row's maximum grows by more than ``RESCALE_LOG2`` (fewer
      multiplies per page). None: off.
    * ``overlap`` (pipelined kernel, one dense stream, whole-page chunks):
      make each page's scores before the previous page's softmax, so that
      their products overlap it. None: on where
      :func:`jflashloop_triton_kernels.launch.preferred_overlap` says so
      (INT4 at head_dim 256, 64-token pages), with :data:`launch.OVERLAP_STAGES` stages
      when ``stages`` is None.
    * ``merge_registers`` (in-kernel merge): registers a thread gives the
      partials per round trip; None: ``launch.MERGE_REGISTERS``.
    * ``stagger`` (pipelined kernel, one stage): copy a page's keys and its
      values as two groups, the next page's keys behind this page's softmax
      and values, its values behind the next page's scores. None:
      :data:`jflashloop_triton_kernels.launch.STAGGER` (on) where one stage is used
      (the chains' default; faster on an H200: ``bench/RESULTS.md``).
    * ``scaled_values`` (pipelined kernel): the value codes enter the
      products as float16 subnormals (NVFP4: E2M1 values), their scales (and
      minimums or zero points) join the probabilities. None:
      :func:`jflashloop_triton_kernels.launch.preferred_scaled_values` (INT4
      wherever it can; NVFP4 where two dense streams are read; int4_rotated
      not yet).
    * ``persistent_programs`` (pipelined kernel, two stages, not ``overlap``
      or ``stagger``): at most that many programs, each taking the split-KV
      items in turn, the next item's first page copied during this one's
      last; 0: one program per item. None:
      :func:`jflashloop_triton_kernels.launch.preferred_persistent_programs`
      (one INT4 stream at head_dim 128 over at least two waves of items).
    * ``state``, ``limits``: the pipelined kernel's ``(lengths, active)``
      arrays and static ``(pending, capacity, recent_tokens)``
      (``jflashloop.ops._decode_attention.kernel_inputs``): it works out the
      regions itself, so nothing runs before it; ``bounds`` is read by the
      other kernels (and the pipelined kernel does not need it computed).
    * ``merge``: ``"xla"`` (an XLA computation), ``"gluon"`` (the Gluon
      merge kernel: one more custom call) or ``"kernel"`` (the last program
      of each (sequence, KV head) merges inside the page kernel: one launch
      for the whole call; pipelined kernel with fused windows); None:
      :func:`preferred_merge` (``bench/KERNEL_NOTES.md``).
    """
    sequences, q_heads, head_dim = queries.shape
    kv_heads = ring_keys.shape[2]
    group = q_heads // kv_heads
    pipelined = kernel == "pipelined"
    row_blocks = -(-group // ROWS) if pipelined else 1  # more than 8 rows: blocks of 8, pages read per block
    reason = unsupported_reason(loops, head_dim, page_size, group, kernel, rows=ROWS * row_blocks)
    if reason:
        raise NotImplementedError(reason)
    if row_blocks > 1 and merge == "kernel":
        raise NotImplementedError("the in-kernel merge reads groups of at most 8 query rows")
    max_pages = block_tables.shape[1]
    dense = sum(not loop.sparse for loop in loops)  # the chain's dense streams, then its sparse ones
    sparse_rows = tuple(loops[i].keys.rows for i in range(dense, len(loops)))
    fitted = splits is None and target_programs is None  # the library's own plan, fitted to the kernel's waves below
    pairs = sequences * kv_heads * row_blocks
    if splits is None:
        if target_programs is None:
            target_programs = launch.preferred_target_programs(format=loops[0].keys.format, streams=len(loops))
        splits = launch.split_count(pairs, max_pages, target_programs=target_programs,
                                    min_pages_per_split=min_pages_per_split)
    query = None
    if not pipelined or not (fused_windows and not pages_only):  # the simple kernels and the window partials
        query = queries.astype(jnp.float32) * (scale * LOG2_E)
        query = query.reshape(sequences, kv_heads, group, head_dim)
        query = jnp.pad(query, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    stream = streams[0]
    fused_windows = fused_windows and pipelined and not pages_only
    windows = None
    if fused_windows:
        windows = (sink_keys if sink_tokens else None, sink_values if sink_tokens else None, ring_keys, ring_values,
                   window_loop)
    residual = (streams[1]["keys"], streams[1]["values"]) if dense == 2 else None
    sparse = tuple(streams[i] for i in range(dense, len(loops)))
    streams_read = dense
    default_overlap = overlap is None
    if default_overlap:
        overlap = (pipelined and (stages is None or stages >= 2) and (chunk or page_size) == page_size
                   and launch.preferred_overlap(format=loops[0].keys.format, head_dim=head_dim,
                                                page_size=page_size, streams=streams_read,
                                                sparse_rows=sparse_rows))
    capability = None if emulate else pallas_launch.local_capability()
    sm_count = None if emulate else pallas_launch.local_sm_count()
    # the pipelined kernel's sizes that set its shared memory (launch.pipelined_shared_bytes)
    kernel_sizes = dict(format=loops[0].keys.format, head_dim=head_dim, page_size=page_size,
                        value_group=loops[0].values.group_size, streams=streams_read, sparse_rows=sparse_rows,
                        row_format=loops[dense].keys.format if sparse else "int4")
    if stages is None:
        stages = launch.preferred_stages(streams=streams_read, sparse_rows=sparse_rows, overlap=overlap) \
            if capability is None else launch.pipelined_stages(capability=capability, overlap=overlap,
                                                               **kernel_sizes)
    if default_overlap and stages < 2:  # too little shared memory for a page in flight
        overlap = False
    # the waves of the kernel that runs: its programs an SM by registers and shared memory
    resident = launch.resident_programs(stages=stages, overlap=overlap, capability=capability, **kernel_sizes) \
        if pipelined else launch.PERSISTENT_BLOCKS_PER_SM
    if fitted:
        splits = launch.wave_fitted_splits(pairs, max_pages, splits, sm_count=sm_count,
                                           min_pages_per_split=min_pages_per_split, resident=resident)
    if merge is None:  # measured: bench/KERNEL_NOTES.md ("Splits, merges and the custom-call target at 48 calls")
        slots = splits + 1 if fused_windows else splits
        merge = preferred_merge(slots, in_kernel=pipelined and fused_windows and not partials_only,
                                row_blocks=row_blocks)
    if merge not in ("gluon", "xla", "kernel"):
        raise ValueError(f"merge must be 'gluon', 'xla' or 'kernel', got {merge!r}")
    in_kernel = merge == "kernel" and pipelined and fused_windows and not partials_only
    if maxnreg is None and pipelined:
        maxnreg = launch.preferred_maxnreg(loops[0].keys.format)
    if persistent_programs is None:
        persistent_programs = launch.preferred_persistent_programs(
            format=loops[0].keys.format, head_dim=head_dim, streams=streams_read, sparse_rows=sparse_rows,
            stages=stages if pipelined else None, overlap=overlap,
            items=sequences * kv_heads * row_blocks * (splits + 1 if fused_windows else splits),
            sm_count=sm_count, resident=resident)
    if precise is None:
        precise = True
    if lazy is None:
        lazy = False
    # The pipelined kernel scales and pads the caller's queries itself (no XLA pass before it).
    kernel_query = queries.reshape(sequences, kv_heads, group, head_dim) if pipelined else query
    outputs = page_partials(
        kernel_query, block_tables, bounds, stream["keys"], stream["values"], residual=residual, sparse=sparse,
        sparse_rows=sparse_rows, merge_group=group if in_kernel else None, precise=precise, page_size=page_size,
        sink_tokens=sink_tokens, value_group=loops[0].values.group_size, splits=splits, kernel=kernel,
        stages=stages if pipelined else None, windows=windows, chunk=chunk, maxnreg=maxnreg, emulate=emulate,
        query_scale=scale * LOG2_E if pipelined else None, state=state, row_blocks=row_blocks, lazy=lazy,
        overlap=overlap, merge_registers=launch.MERGE_REGISTERS if merge_registers is None else merge_registers,
        stagger=(launch.STAGGER and pipelined and stages == 1) if stagger is None else stagger,
        scaled=scaled_values, persistent=persistent_programs or 0,
        **({} if limits is None else {"limits": limits}),
        **({"num_warps": 4, "num_stages": 2} if kernel == "triton" else {}))
    output, total, running_max = outputs[:3]
    if in_kernel:
        return outputs[3]
    if row_blocks > 1:  # [S, H * RB, slots, 8, ...] -> [S, H, slots, RB * 8, ...]
        def rows_together(x):
            x = x.reshape(sequences, kv_heads, row_blocks, *x.shape[2:])
            x = jnp.moveaxis(x, 2, 3)
            return x.reshape(*x.shape[:3], row_blocks * ROWS, *x.shape[5:])

        output, total, running_max = (rows_together(x) for x in (output, total, running_max))
    if partials_only:
        return output, total, running_max
    if not (pages_only or fused_windows):
        order = pallas_decode.pair_order(head_dim)
        w_out, w_sum, w_max = pallas_decode.window_partials(
            query[..., jnp.asarray(order)], bounds, sink_keys, sink_values, ring_keys, ring_values,
            sink_tokens=sink_tokens, window_loop=window_loop, interpret=emulate)
        w_out = w_out[..., jnp.asarray(np.argsort(order))]
        output = jnp.concatenate([output, w_out], axis=2)
        total = jnp.concatenate([total, w_sum], axis=2)
        running_max = jnp.concatenate([running_max, w_max], axis=2)
    if merge == "gluon" and row_blocks == 1:
        return merge_partials(output, total, running_max, group, emulate=emulate).reshape(
            sequences, q_heads, head_dim)
    # The group's rows only (the slice fuses into the merge's reductions).
    merged = pallas_decode.merge_splits(output[:, :, :, :group], total[..., :group], running_max[..., :group])
    return merged.reshape(sequences, q_heads, head_dim)  # [S, H, group, D] -> [S, q_heads, D]
