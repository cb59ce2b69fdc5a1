"""Residual chains for looped models.

Loop 1 of a looped model is stored as a quantized base; every later loop
stores only its residual against the *reconstructed* predecessor, either for
every token (dense) or for selected token positions (compact sparse: only
those rows are stored, in position order; absent positions inherit the
predecessor unchanged).

Reconstruction is float32: ``loop_r = ((base + d_2) + d_3) + ... + d_r`` in
that order, which is also what the fused kernels compute.

Chains are closed-loop by default: each residual is encoded against the
decoded predecessor, so one loop's quantization error is corrected by the
next loop's residual instead of compounding.

Positions of a sparse loop need not be a subset of the previous sparse loop's
positions: any sorted set works, because each residual is taken against the
full reconstruction of its predecessor (the general case; FlashLoop's
subset rule is one instance of it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .codecs import CodecSpec, Packed, decode, encode
from .validation import check_float_array, is_concrete


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

    ``target - predecessor`` (in the promoted compute dtype, at least float32),
    all rows when ``positions`` is None, else the rows at ``positions``; a row
    that does not apply (:func:`applied_rows`) is 0, so it cannot change how
    the others are encoded.
    """
    compute_dtype = jnp.promote_types(jnp.promote_types(target.dtype, predecessor.dtype), jnp.float32)
    difference = target.astype(compute_dtype) - predecessor.astype(compute_dtype)
    if positions is None:
        return difference, None
    positions = jnp.asarray(positions, jnp.int32)
    applies = applied_rows(positions, difference.shape[0])
    rows = difference[jnp.clip(positions, 0, difference.shape[0] - 1)]
    return jnp.where(applies[:, None, None], rows, jnp.zeros((), rows.dtype)), positions


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
    applies = applied_rows(residual.positions, residual.tokens)
    return base.at[jnp.where(applies, residual.positions, residual.tokens)].add(delta, mode="drop")


@dataclasses.dataclass(frozen=True)
class Chain:
    """A looped tensor: a quantized base (loop 1) and one residual per later loop."""

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
      loops: ``num_loops`` arrays ``[tokens, kv_heads, channels]``: loop 1 first.
      base_spec: codec of loop 1.
      residual_specs: ``num_loops - 1`` codecs, one per later loop.
      positions: ``num_loops - 1`` entries: None (dense) or sorted int32 positions.
      closed_loop: encode each residual against the reconstructed predecessor
        (True, the default); False uses the exact previous loop instead, which
        lets errors compound (kept for comparison).
    Returns:
      :class:`Chain`.
    """
    if not loops:
        raise ValueError("loops must hold at least one array (loop 1)")
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
    base = encode(loops[0], base_spec, implementation=implementation)
    reconstructed = decode(base, jnp.float32)
    residuals = []
    for loop_index in range(1, len(loops)):
        predecessor = reconstructed if closed_loop else loops[loop_index - 1]
        residual = encode_residual(
            loops[loop_index], predecessor, residual_specs[loop_index - 1],
            positions[loop_index - 1], implementation=implementation,
        )
        residuals.append(residual)
        # The decoder only ever has reconstructions to add onto, in both modes.
        reconstructed = decode_residual(residual, reconstructed)
    return Chain(base=base, residuals=tuple(residuals))


def decode_chain(chain: Chain, loop: int | None = None) -> jax.Array:
    """float32 reconstruction of loop ``loop`` (1-based; default the last loop)."""
    loop = len(chain.residuals) + 1 if loop is None else loop
    if isinstance(loop, bool) or not isinstance(loop, int | np.integer):
        raise TypeError(f"loop must be a Python int (1-based), got {type(loop).__name__}")
    if not 1 <= loop <= len(chain.residuals) + 1:
        raise ValueError(f"loop must be in [1, {len(chain.residuals) + 1}], got {loop}")
    reconstructed = decode(chain.base, jnp.float32)
    for residual in chain.residuals[: loop - 1]:
        reconstructed = decode_residual(residual, reconstructed)
    return reconstructed
