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

from .codec_spec import CodecSpec
from .codecs import decode, encode
from .packed import Packed


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
    if positions is None or isinstance(positions, jax.core.Tracer):
        return
    values = np.asarray(positions)
    if values.ndim != 1:
        raise ValueError(f"positions must be a 1-D int vector, got shape {values.shape}")
    if not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"positions must be integers, got {values.dtype}")
    if values.size and (values.min() < 0 or values.max() >= tokens):
        raise ValueError(f"positions must lie in [0, {tokens}), got min {values.min()} max {values.max()}")
    if values.size > 1 and not (np.diff(values) > 0).all():
        raise ValueError("positions must be sorted and unique (strictly increasing)")


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
      positions: None (dense) or sorted unique int32 ``[rows]`` token positions.
      implementation: as for :func:`jflashloop.encode`.
    Returns:
      :class:`Residual`. The difference is formed in float32 (the promoted
      compute dtype of the two operands when wider).
    """
    if target.shape != predecessor.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal predecessor shape {tuple(predecessor.shape)}"
        )
    tokens = target.shape[0]
    _check_positions(positions, tokens)
    compute_dtype = jnp.promote_types(jnp.promote_types(target.dtype, predecessor.dtype), jnp.float32)
    difference = target.astype(compute_dtype) - predecessor.astype(compute_dtype)
    if positions is not None:
        positions = jnp.asarray(positions, jnp.int32)
        difference = difference[positions]
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
      residual equal ``predecessor`` unchanged.
    """
    if predecessor.shape[0] != residual.tokens:
        raise ValueError(
            f"predecessor has {predecessor.shape[0]} tokens, the residual was made for {residual.tokens}"
        )
    base = jnp.asarray(predecessor, jnp.float32)
    delta = decode(residual.packed, jnp.float32)
    if residual.positions is None:
        return base + delta
    return base.at[residual.positions].add(delta)


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
    if not (len(residual_specs) == len(positions) == len(loops) - 1):
        raise ValueError(
            f"need {len(loops) - 1} residual specs and positions for {len(loops)} loops, "
            f"got {len(residual_specs)} and {len(positions)}"
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
    if not 1 <= loop <= len(chain.residuals) + 1:
        raise ValueError(f"loop must be in [1, {len(chain.residuals) + 1}], got {loop}")
    reconstructed = decode(chain.base, jnp.float32)
    for residual in chain.residuals[: loop - 1]:
        reconstructed = decode_residual(residual, reconstructed)
    return reconstructed
