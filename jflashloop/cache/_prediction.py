"""A looped cache's loop predicted from the loop before it: :class:`LoopPrediction`.

Later loops of a looped model are close to a linear function of the loop before them (per KV head), much closer
than to the loop itself: on the shipped looped checkpoint a fitted map from loop 2's reconstruction predicts loops
3 and 4 better than 24 stored residual rows a page do (``bench/LOOPS.md``, "Loops predicted from the loop before").
A :class:`LoopStorage` with a ``prediction`` stores its residual against ``prediction.apply(previous)`` instead of
``previous`` (dense, sparse rows, or no rows at all), and reconstructs as ``prediction.apply(previous) +
residual``. The tables are static (part of the config, like a fitted codec's): no bytes per token.
:func:`jflashloop.fitting.fitted_prediction` fits one by least squares on calibration tensors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LoopPrediction:
    """A per-KV-head affine map of a loop's K and V: ``x @ matrix[h] + bias[h]`` (static under jit).

    Build it with :meth:`from_arrays` (or :func:`jflashloop.fitting.fitted_prediction`); the tables are kept as
    float32 little-endian bytes so a config holding them hashes and compares quickly.

    Attributes:
      num_kv_heads, head_dim: the shape it maps (``H``, ``D``).
      key_table, value_table: float32 ``[H, D + 1, D]`` as bytes: rows ``0..D-1`` the matrix, row ``D`` the bias.
    """

    num_kv_heads: int
    head_dim: int
    key_table: bytes = dataclasses.field(repr=False)
    value_table: bytes = dataclasses.field(repr=False)

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoopPrediction.{name} must be a positive int, got {value!r}")
        size = 4 * self.num_kv_heads * (self.head_dim + 1) * self.head_dim
        for name in ("key_table", "value_table"):
            table = getattr(self, name)
            if not isinstance(table, bytes) or len(table) != size:
                raise ValueError(f"LoopPrediction.{name} must be {size} bytes (float32 [{self.num_kv_heads}, "
                                 f"{self.head_dim + 1}, {self.head_dim}]), got "
                                 f"{len(table) if isinstance(table, bytes) else type(table).__name__}")
            if not np.all(np.isfinite(np.frombuffer(table, "<f4"))):
                raise ValueError(f"LoopPrediction.{name} must hold finite numbers")

    @classmethod
    def from_arrays(cls, key_matrix, key_bias, value_matrix, value_bias) -> LoopPrediction:
        """From float ``[H, D, D]`` matrices and ``[H, D]`` biases (rounded to float32).

        Raises:
          ValueError: shapes that disagree, or a non-finite entry.
        """
        key_matrix, value_matrix = np.asarray(key_matrix), np.asarray(value_matrix)
        if key_matrix.ndim != 3 or key_matrix.shape[1] != key_matrix.shape[2]:
            raise ValueError(f"key_matrix must be [kv_heads, head_dim, head_dim], got shape {key_matrix.shape}")
        heads, head_dim, _ = key_matrix.shape
        tables = []
        for name, matrix, bias in (("key", key_matrix, key_bias), ("value", value_matrix, value_bias)):
            bias = np.asarray(bias)
            if matrix.shape != (heads, head_dim, head_dim) or bias.shape != (heads, head_dim):
                raise ValueError(f"{name}_matrix and {name}_bias must be [{heads}, {head_dim}, {head_dim}] and "
                                 f"[{heads}, {head_dim}], got {matrix.shape} and {bias.shape}")
            tables.append(np.concatenate([matrix, bias[:, None, :]], axis=1))
        return cls._from_tables(*tables)

    @classmethod
    def _from_tables(cls, key_table, value_table) -> LoopPrediction:
        """From float ``[H, D + 1, D]`` tables (rounded to float32; :meth:`tables`' layout)."""
        heads, _, head_dim = np.shape(key_table)
        return cls(heads, head_dim, *(np.asarray(t).astype("<f4").tobytes() for t in (key_table, value_table)))

    @classmethod
    def identity(cls, num_kv_heads: int, head_dim: int) -> LoopPrediction:
        """The map that predicts a loop as the loop before it (a plain residual)."""
        eye = np.broadcast_to(np.eye(head_dim, dtype=np.float32), (num_kv_heads, head_dim, head_dim))
        zero = np.zeros((num_kv_heads, head_dim), np.float32)
        return cls.from_arrays(eye, zero, eye, zero)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``[H, D + 1, D]`` key and value tables (rows ``0..D-1`` the matrix, row ``D`` the bias)."""
        shape = (self.num_kv_heads, self.head_dim + 1, self.head_dim)
        return tuple(np.frombuffer(t, "<f4").reshape(shape) for t in (self.key_table, self.value_table))

    @property
    def same_for_every_head(self) -> bool:
        """Whether every KV head has the same tables."""
        return all((table == table[:1]).all() for table in self.tables())

    def for_heads(self, start: int, count: int) -> LoopPrediction:
        """The prediction of heads ``start .. start + count - 1``."""
        if not 0 <= start < start + count <= self.num_kv_heads:
            raise ValueError(f"heads {start}..{start + count - 1} are not in [0, {self.num_kv_heads})")
        return LoopPrediction._from_tables(*(table[start:start + count] for table in self.tables()))

    def then(self, following: LoopPrediction) -> LoopPrediction:
        """The map of ``following`` applied after this one: ``(x M1 + b1) M2 + b2 = x (M1 M2) + (b1 M2 + b2)``
        (float64 products, rounded to float32)."""
        tables = []
        for first, second in zip(self.tables(), following.tables(), strict=True):
            first, second = first.astype(np.float64), second.astype(np.float64)
            composed = first @ second[:, :-1]  # rows 0..D-1: M1 M2; row D: b1 M2
            composed[:, -1] += second[:, -1]
            tables.append(composed)
        return LoopPrediction._from_tables(*tables)

    def apply(self, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        """float32 ``(keys @ Mk[h] + bk[h], values @ Mv[h] + bv[h])`` of float ``[..., H, D]`` K and V."""
        out = []
        for x, table in zip((keys, values), self.tables(), strict=True):
            table = jnp.asarray(table)
            mapped = jnp.einsum("...hd,hde->...he", jnp.asarray(x, jnp.float32), table[:, :-1],
                                precision=jax.lax.Precision.HIGHEST)
            out.append(mapped + table[:, -1])
        return out[0], out[1]

    def to_json(self) -> dict:
        """JSON-ready fields (tables as nested lists of floats, exact: float32 values print exactly as floats)."""
        keys, values = self.tables()
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "key_table": keys.astype(float).tolist(), "value_table": values.astype(float).tolist()}

    @classmethod
    def from_json(cls, data) -> LoopPrediction:
        """Inverse of :meth:`to_json` (raises ``ValueError`` / ``KeyError`` / ``TypeError`` on bad fields)."""
        keys, values = (np.asarray(data[name], np.float64) for name in ("key_table", "value_table"))
        heads, head_dim = data["num_kv_heads"], data["head_dim"]
        shape = (heads, head_dim + 1, head_dim)
        if keys.shape != shape or values.shape != shape:
            raise ValueError(f"LoopPrediction tables must be {list(shape)}, got {list(keys.shape)} and "
                             f"{list(values.shape)}")
        return cls._from_tables(keys, values)
