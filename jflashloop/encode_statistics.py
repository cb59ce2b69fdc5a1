"""`EncodeStatistics`: what an encode had to bend (non-finite and saturated elements)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
