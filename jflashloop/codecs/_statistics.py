"""`EncodeStatistics` and the one saturation rule of each format.

What an encode had to bend is counted by the rules here, and by nothing
else: the codecs count from the float32 values they compute, the paged
cache (``jflashloop.cache``) from the metadata it stores, both through
:func:`int4_saturated_groups` and :func:`nvfp4_saturated`; ``int4_rotated``
counts from its input rule (:func:`jflashloop.codecs._rotated.int4_rotated_input`),
in the codec and in the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ._floats import FLOAT16_MAX

FLOAT16_OVERFLOW = 65520.0
"""Smallest float32 magnitude that float16 rounding (RNE) turns into inf."""


@dataclasses.dataclass(frozen=True)
class EncodeStatistics:
    """Counts of the elements an encode could not store faithfully (a pytree).

    Both counts are int32 ``[]`` arrays (with extra leading axes under
    ``vmap``), computed inside the same ``jit`` as the encode, so reading them
    needs no extra pass over the data. ``docs/reliability.md`` defines them;
    in short:

    Attributes:
      nonfinite: elements that were NaN or +-inf. They take no part in any
        group statistic and are stored as the saturated code of their sign
        (+-inf) or as the code of 0.0 (NaN).
      saturated: finite elements stored beyond their format's range: INT4:
        members of groups whose float32 min or scale is at least 65520 in
        magnitude (float16 rounding would give inf; jflashloop stores +-65504);
        NVFP4: elements with ``|x| / (local * global) >= 7`` (beyond the
        largest E2M1 magnitude 6 by more than E2M1's own rounding: only when
        the block scale is clamped at 448, i.e. the global scale is too small),
        and every finite element when the global scale is not finite (a traced
        one; a concrete one is refused); ``int4_rotated``: finite elements
        beyond +-2**64, stored as +-2**64 (its NaN and +-inf are read as 0).
    """

    nonfinite: jax.Array
    saturated: jax.Array

    def __add__(self, other: EncodeStatistics) -> EncodeStatistics:
        return EncodeStatistics(self.nonfinite + other.nonfinite, self.saturated + other.saturated)


jax.tree_util.register_dataclass(
    EncodeStatistics, data_fields=["nonfinite", "saturated"], meta_fields=[]
)


def count(mask: jax.Array) -> jax.Array:
    """int32 ``[]``: number of True elements of a bool array."""
    return jnp.sum(mask, dtype=jnp.int32)


def int4_saturated_groups(minimum: jax.Array, scale: jax.Array) -> jax.Array:
    """bool, per INT4 group: its float16 min or scale saturates.

    The rule is that float16 metadata beyond +-65504 is stored as +-65504.
    Given the float32 group parameters (an encode), that is a magnitude of at
    least :data:`FLOAT16_OVERFLOW` (65520: float16 rounding would give inf),
    or a non-finite one. Given the stored float16 metadata (a packed page,
    whose float32 parameters are gone), it is a value at +-65504 (where
    saturation puts it) or a non-finite one; this can over-count a group
    whose min or scale is legitimately within rounding of 65504.
    """
    limit = FLOAT16_OVERFLOW if minimum.dtype == jnp.float32 else FLOAT16_MAX
    minimum, scale = minimum.astype(jnp.float32), scale.astype(jnp.float32)
    return ~(jnp.abs(minimum) < limit) | ~(jnp.abs(scale) < limit)


def nvfp4_saturated(global_scale: jax.Array) -> jax.Array:
    """bool: an NVFP4 tensor scale that is not finite, so every finite element saturates.

    Only a traced global scale can get past the argument check; the cache's
    tile scales come from each tile's own amax and are finite.
    """
    return ~jnp.isfinite(global_scale)
