"""Residual chains for looped models: the one algebra, and the dense chains API.

The first loop (loop 0) of a looped model is stored as a quantized base; every later loop
stores only its residual against the *reconstructed* predecessor, either for
every token (dense) or for selected token positions (compact sparse: only
those rows are stored, in position order; absent positions inherit the
predecessor unchanged).

Reconstruction is float32: ``loop_r = ((base + d_1) + d_2) + ... + d_r`` in
that order, which is also what the fused kernels compute.

Chains are closed-loop by default: each residual is encoded against the
decoded predecessor, so one loop's quantization error is corrected by the
next loop's residual instead of compounding.

Positions of a sparse loop need not be a subset of the previous sparse loop's
positions: any sorted set works, because each residual is taken against the
full reconstruction of its predecessor (the general case; FlashLoop's
subset rule is one instance of it).

Loops are numbered from 0, as everywhere in jflashloop: loop 0 is the base,
loop ``r`` the ``r``-th residual.

The algebra (:func:`difference`, :func:`take_rows`, :func:`add_rows`,
:func:`encode_loops`, :func:`decode_loops`) is shared by the dense chains
below (one tensor, positions over its tokens) and by the paged cache's page
tiles (``jflashloop.cache._pages``: one chain per page, positions per KV head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import _deprecation
from ._validation import check_float_array, is_concrete
from .codecs import CodecSpec, Packed, decode, encode

Step = TypeVar("Step")
Value = TypeVar("Value")


# --------------------------------------------------------------------------- the algebra


def difference(target: jax.Array, predecessor: jax.Array) -> jax.Array:
    """``target - predecessor`` in their promoted compute dtype (at least float32)."""
    compute_dtype = jnp.promote_types(jnp.promote_types(target.dtype, predecessor.dtype), jnp.float32)
    return target.astype(compute_dtype) - predecessor.astype(compute_dtype)


def _per_head(positions: jax.Array, heads: int) -> jax.Array:
    """int32 ``[heads, rows]``: ``positions`` ``[rows]`` (shared by every head) or ``[heads, rows]``."""
    positions = jnp.asarray(positions, jnp.int32)
    return jnp.broadcast_to(positions, (heads, positions.shape[-1]))


def take_rows(x: jax.Array, positions: jax.Array) -> jax.Array:
    """The rows of ``x`` ``[tokens, heads, D]`` at ``positions``, as ``[rows, heads, D]``.

    ``positions``: int ``[rows]`` (the same rows for every head) or
    ``[heads, rows]``. A position outside ``[0, tokens)`` gives a row of
    zeros (never a wrapped or clipped row).
    """
    tokens, heads, _ = x.shape
    positions = _per_head(positions, heads)
    clipped = jnp.clip(positions, 0, tokens - 1)
    rows = jnp.take_along_axis(x.transpose(1, 0, 2), clipped[..., None], axis=1)  # [heads, rows, D]
    inside = (positions >= 0) & (positions < tokens)
    return jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype)).transpose(1, 0, 2)


def add_rows(x: jax.Array, positions: jax.Array, rows: jax.Array) -> jax.Array:
    """``x`` ``[tokens, heads, D]`` with ``rows`` ``[rows, heads, D]`` added at ``positions``.

    ``positions`` as for :func:`take_rows`; rows at positions outside ``[0,
    tokens)`` are dropped. Each position must appear at most once per head
    (one addition per element, so the order of the rows does not matter).
    """
    tokens, heads, _ = x.shape
    positions = _per_head(positions, heads)
    positions = jnp.where((positions >= 0) & (positions < tokens), positions, tokens)
    head_index = jnp.arange(heads)[:, None]
    return x.at[positions, head_index].add(rows.transpose(1, 0, 2), mode="drop")


def encode_loops(
    targets: Sequence[Value],
    encode_step: Callable[[int, Value, Value | None], Step],
    reconstruct_step: Callable[[Step, Value | None], Value],
    *,
    closed_loop: bool = True,
    starts: Sequence[bool] | None = None,
) -> list[Step]:
    """Encode a chain: loop 0 on its own, every later loop against its predecessor.

    Args:
      targets: each loop's exact values (any pytree the steps understand).
      encode_step: ``(loop, target, predecessor) -> step``; ``predecessor`` is
        None for loop 0, else the reconstruction of loop ``loop - 1``
        (closed loop) or its exact ``targets[loop - 1]`` (open loop).
      reconstruct_step: ``(step, previous) -> reconstruction``: the base's
        decoded values for ``previous=None``, else ``previous`` plus the
        step's decoded residual.
      closed_loop: see ``encode_step``. The reconstruction is built from
        the steps in both modes (it is all a decoder has).
      starts: None (only loop 0 starts the chain), or one bool per loop:
        the loops encoded on their own (``predecessor`` None) like loop 0,
        which must be True; later loops are against them.
    Returns:
      One step per loop.
    """
    starts = _starts(starts, len(targets))
    steps, reconstructed = [], None
    for loop, target in enumerate(targets):
        if starts[loop]:
            predecessor = reconstructed = None
        else:
            predecessor = reconstructed if closed_loop else targets[loop - 1]
        steps.append(encode_step(loop, target, predecessor))
        if loop + 1 < len(targets):
            reconstructed = reconstruct_step(steps[-1], reconstructed)
    return steps


def decode_loops(steps: Sequence[Step], reconstruct_step: Callable[[Step, Value | None], Value], loop: int,
                 starts: Sequence[bool] | None = None) -> Value:
    """The reconstruction of loop ``loop`` (0-based) from the steps of :func:`encode_loops` (``starts`` as
    there): the steps from the last chain start up to ``loop``, in order."""
    starts = _starts(starts, len(steps))
    first = max(i for i in range(loop + 1) if starts[i])
    reconstructed = None
    for step in steps[first: loop + 1]:
        reconstructed = reconstruct_step(step, reconstructed)
    return reconstructed


def _starts(starts: Sequence[bool] | None, loops: int) -> tuple[bool, ...]:
    """``starts`` as a tuple of ``loops`` bools (None: loop 0 only); loop 0 must start the chain."""
    if starts is None:
        return (True,) + (False,) * (loops - 1)
    starts = tuple(bool(start) for start in starts)
    if len(starts) != loops or (loops and not starts[0]):
        raise ValueError(f"starts must give {loops} bools, the first True (loop 0 starts the chain), got {starts}")
    return starts


# --------------------------------------------------------------------------- dense chains


@dataclasses.dataclass(frozen=True)
class Residual:
    """An encoded residual of one loop against its predecessor.

    Attributes:
      packed: the encoded residual rows, :class:`Packed` of logical shape
        ``[rows, kv_heads, channels]`` (``rows == tokens`` when dense).
      positions: int32 ``[rows]`` sorted token positions of a compact sparse
        residual (row ``i`` updates token ``positions[i]``); None when dense.
      tokens: static number of tokens of the full tensor.
    """

    packed: Packed
    positions: jax.Array | None
    tokens: int = dataclasses.field(metadata={"static": True})

    @property
    def nbytes(self) -> int:
        """Exact bytes: the packed rows plus the int32 position list when sparse."""
        position_bytes = 0 if self.positions is None else self.positions.size * 4
        return self.packed.nbytes + position_bytes


jax.tree_util.register_dataclass(
    Residual, data_fields=["packed", "positions"], meta_fields=["tokens"]
)


def _check_positions(positions, tokens: int) -> None:
    """Rank and dtype always; range, order and uniqueness when concrete."""
    if positions is None:
        return
    if np.ndim(positions) != 1:
        raise ValueError(f"positions must be a 1-D int vector, got shape {tuple(np.shape(positions))}")
    dtype = positions.dtype if hasattr(positions, "dtype") else np.asarray(positions).dtype
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"positions must be integers, got {np.dtype(dtype)}")
    if np.shape(positions)[0] == 0:
        raise ValueError("positions must hold at least one position (a loop without updates needs no residual)")
    if np.shape(positions)[0] > tokens:
        raise ValueError(
            f"positions has {np.shape(positions)[0]} entries; at most tokens={tokens} unique positions exist"
        )
    if not is_concrete(positions):
        return
    values = np.asarray(positions)
    if values.size and (values.min() < 0 or values.max() >= tokens):
        raise ValueError(f"positions must lie in [0, {tokens}), got min {values.min()} max {values.max()}")
    if values.size > 1 and not (np.diff(values) > 0).all():
        raise ValueError("positions must be sorted and unique (strictly increasing)")


def applied_rows(positions: jax.Array, tokens: int) -> jax.Array:
    """bool ``[rows]``: the rows of a sparse residual that update their position.

    A row applies when its position lies in ``[0, tokens)`` and no earlier row
    holds the same position. For checked (sorted, unique, in range) positions
    every row applies; traced positions are not checked, and this is the rule
    for them: an out-of-range position is ignored (never wrapped or
    clipped), a repeated one is applied once, by its first row, and the order
    does not matter (each row updates its own position).

    Args:
      positions: int ``[rows]``.
      tokens: static number of tokens.
    """
    rows = positions.shape[0]
    inside = (positions >= 0) & (positions < tokens)
    target = jnp.where(inside, positions, tokens)
    order = jnp.arange(rows, dtype=jnp.int32)
    first = jnp.full((tokens + 1,), rows, jnp.int32).at[target].min(order)
    return inside & (first[target] == order)


def residual_rows(
    target: jax.Array, predecessor: jax.Array, positions: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """The float32 rows :func:`encode_residual` encodes, and int32 positions (or None).

    ``target - predecessor`` (:func:`difference`: the promoted compute
    dtype, at least float32), all rows when ``positions`` is None, else the
    rows at ``positions``; a row that does not apply (:func:`applied_rows`) is
    0, so it cannot change how the others are encoded.
    """
    rows = difference(target, predecessor)
    if positions is None:
        return rows, None
    positions = jnp.asarray(positions, jnp.int32)
    return take_rows(rows, _applied_positions(positions, rows.shape[0])), positions


def _applied_positions(positions: jax.Array, tokens: int) -> jax.Array:
    """``positions`` with every row that does not apply moved out of range (``tokens``)."""
    return jnp.where(applied_rows(positions, tokens), positions, tokens)


def encode_residual(
    target: jax.Array,
    predecessor: jax.Array,
    spec: CodecSpec,
    positions: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> Residual:
    """Encode ``target - predecessor`` (dense, or the rows at ``positions``).

    Args:
      target: ``[tokens, kv_heads, channels]`` float32/bfloat16/float16: this
        loop's exact K or V.
      predecessor: same shape: the *reconstructed* previous loop (closed loop).
      spec: the residual's codec (any :class:`CodecSpec`; e.g. NVFP4 residuals
        on an INT4 base).
      positions: None (dense) or sorted unique int32 ``[rows]`` token
        positions, at least one (checked when concrete; traced positions
        follow the rule of :func:`applied_rows`).
      implementation: as for :func:`jflashloop.encode`.
    Returns:
      :class:`Residual`. The difference is formed in float32 (the promoted
      compute dtype of the two operands when wider).
    """
    check_float_array("target", target)
    check_float_array("predecessor", predecessor)
    if target.shape != predecessor.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal predecessor shape {tuple(predecessor.shape)}"
        )
    if target.ndim != 3:
        raise ValueError(
            f"target must have rank 3 [tokens, kv_heads, channels], got shape {tuple(target.shape)}"
        )
    tokens = target.shape[0]
    _check_positions(positions, tokens)
    difference, positions = residual_rows(target, predecessor, positions)
    return Residual(
        packed=encode(difference, spec, implementation=implementation),
        positions=positions,
        tokens=tokens,
    )


def decode_residual(residual: Residual, predecessor: jax.Array) -> jax.Array:
    """Reconstruct a loop: ``predecessor + decoded residual`` in float32.

    Args:
      residual: from :func:`encode_residual`.
      predecessor: ``[tokens, kv_heads, channels]``, the reconstructed previous loop.
    Returns:
      float32 ``[tokens, kv_heads, channels]``; positions absent from a sparse
      residual equal ``predecessor`` unchanged. Only the rows of
      :func:`applied_rows` are added (all of them for checked positions).
    """
    if not isinstance(residual, Residual):
        raise TypeError(f"residual must be a Residual, got {type(residual).__name__}")
    check_float_array("predecessor", predecessor)
    _, heads, channels = residual.packed.shape
    expected = (residual.tokens, heads, channels)
    if tuple(predecessor.shape) != expected:
        raise ValueError(
            f"predecessor must have shape [tokens={expected[0]}, kv_heads={heads}, channels={channels}] "
            f"(the shape the residual was made for), got {tuple(predecessor.shape)}"
        )
    rows = residual.packed.shape[0]
    if residual.positions is None and rows != residual.tokens:
        raise ValueError(f"a dense residual must have tokens={residual.tokens} rows, got {rows}")
    if residual.positions is not None and tuple(residual.positions.shape) != (rows,):
        raise ValueError(
            f"residual.positions must have shape ({rows},) (one per stored row), got {tuple(residual.positions.shape)}"
        )
    base = jnp.asarray(predecessor, jnp.float32)
    delta = decode(residual.packed, jnp.float32)
    if residual.positions is None:
        return base + delta
    return add_rows(base, _applied_positions(residual.positions, residual.tokens), delta)


@dataclasses.dataclass(frozen=True)
class Chain:
    """A looped tensor: a quantized base (loop 0) and one residual per later loop."""

    base: Packed
    residuals: tuple[Residual, ...]

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + sum(r.nbytes for r in self.residuals)


jax.tree_util.register_dataclass(Chain, data_fields=["base", "residuals"], meta_fields=[])


def encode_chain(
    loops: Sequence[jax.Array],
    base_spec: CodecSpec,
    residual_specs: Sequence[CodecSpec],
    positions: Sequence[jax.Array | None],
    *,
    closed_loop: bool = True,
    implementation: str | None = None,
) -> Chain:
    """Encode every loop's K (or V) of one layer as a base plus residuals.

    Args:
      loops: ``num_loops`` arrays ``[tokens, kv_heads, channels]``: loop 0 first.
      base_spec: codec of loop 0 (the base).
      residual_specs: ``num_loops - 1`` codecs, one per later loop.
      positions: ``num_loops - 1`` entries: None (dense) or sorted int32 positions.
      closed_loop: encode each residual against the reconstructed predecessor
        (True, the default); False uses the exact previous loop instead, which
        lets errors compound (kept for comparison).
    Returns:
      :class:`Chain`.
    """
    if not loops:
        raise ValueError("loops must hold at least one array (loop 0, the base)")
    if not (len(residual_specs) == len(positions) == len(loops) - 1):
        raise ValueError(
            f"need {len(loops) - 1} residual specs and positions for {len(loops)} loops, "
            f"got {len(residual_specs)} and {len(positions)}"
        )
    for index, loop in enumerate(loops):
        check_float_array(f"loops[{index}]", loop)
        if loop.shape != loops[0].shape:
            raise ValueError(
                f"loops[{index}] has shape {tuple(loop.shape)}; every loop must have the shape of "
                f"loops[0], {tuple(loops[0].shape)}"
            )
    def encode_step(loop, target, predecessor):
        if loop == 0:
            return encode(target, base_spec, implementation=implementation)
        return encode_residual(target, predecessor, residual_specs[loop - 1], positions[loop - 1],
                               implementation=implementation)

    steps = encode_loops(loops, encode_step, _reconstruct_step, closed_loop=closed_loop)
    return Chain(base=steps[0], residuals=tuple(steps[1:]))


def _reconstruct_step(step: Packed | Residual, previous: jax.Array | None) -> jax.Array:
    """float32 reconstruction after one step of a :class:`Chain` (the base, or a residual on ``previous``)."""
    return decode(step, jnp.float32) if previous is None else decode_residual(step, previous)


def decode_loop(chain: Chain, loop: int) -> jax.Array:
    """float32 ``[tokens, kv_heads, channels]`` reconstruction of loop ``loop`` of ``chain``.

    Args:
      chain: from :func:`encode_chain`.
      loop: 0-based, in ``[0, num_loops)``: 0 is the base (``decode(chain.base)``),
        ``r`` adds the first ``r`` residuals in order, ``((base + d_1) + ...) + d_r``.
    """
    loops = len(chain.residuals) + 1
    if isinstance(loop, bool) or not isinstance(loop, int | np.integer):
        raise TypeError(f"loop must be a Python int (0-based), got {type(loop).__name__}")
    if not 0 <= loop < loops:
        raise ValueError(f"loop must be in [0, {loops}), got {loop}")
    return decode_loops((chain.base, *chain.residuals), _reconstruct_step, int(loop))


def decode_chain(chain: Chain, loop: int | None = None) -> jax.Array:
    """float32 reconstruction of the last loop of ``chain`` (:func:`decode_loop` reads any loop).

    ``loop`` is deprecated: it counts loops from 1 (``decode_chain(chain, 4)``
    is the fourth loop) while every other loop argument of jflashloop counts
    from 0; ``decode_loop(chain, loop - 1)`` gives the same array. Passing it
    warns and keeps its old meaning for one release.
    """
    if loop is None:
        return decode_loop(chain, len(chain.residuals))
    _deprecation.warn(
        "jflashloop.decode_chain(chain, loop) counts loops from 1 and is deprecated; "
        "use jflashloop.decode_loop(chain, loop - 1) (0-based, like every other loop argument)"
    )
    if isinstance(loop, bool) or not isinstance(loop, int | np.integer):
        raise TypeError(f"loop must be a Python int (1-based), got {type(loop).__name__}")
    if not 1 <= loop <= len(chain.residuals) + 1:
        raise ValueError(f"loop must be in [1, {len(chain.residuals) + 1}], got {loop}")
    return decode_loop(chain, int(loop) - 1)
