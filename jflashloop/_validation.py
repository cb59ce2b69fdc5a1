"""Argument checks shared by the public API (the exceptions are in :mod:`._errors`).

Checks on static facts (ranks, shapes, dtypes, Python ints) always run; checks
on values run only when the value is concrete (not a tracer), so they add no
work inside ``jit``. Every message names the argument and what was expected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import NonFiniteInputError

SUPPORTED_FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_concrete(x) -> bool:
    """True unless ``x`` is a JAX tracer (inside ``jit``, ``vmap``, ...)."""
    return not isinstance(x, jax.core.Tracer)


def require_concrete(function: str, **arguments) -> None:
    """Raise ``TypeError`` if any leaf of any argument (a pytree) is a tracer.

    Checked entry points read values on the host, so they run outside ``jit``.
    """
    for name, value in arguments.items():
        if any(not is_concrete(leaf) for leaf in jax.tree_util.tree_leaves(value)):
            raise TypeError(
                f"{function}: checked mode needs concrete arrays, but {name} is traced (inside jit, vmap, ...); "
                "call it outside jit (inside jit use the unchecked function, which counts what it cannot raise)"
            )


def check_float_array(name: str, x, dtypes=SUPPORTED_FLOAT_DTYPES) -> None:
    """``x`` must be an array of one of ``dtypes``."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if np.dtype(dtype) not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {np.dtype(dtype)}")


def check_integer_scalar(name: str, value) -> None:
    """``value`` must be a Python int or an integer array of rank 0."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an int, got a bool")
    if isinstance(value, int | np.integer):
        return
    dtype = getattr(value, "dtype", None)
    if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"{name} must be an int or an integer scalar array, got {type(value).__name__}"
                        + (f" of dtype {np.dtype(dtype)}" if dtype is not None else ""))
    if np.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar (rank 0), got shape {tuple(np.shape(value))}")


def concrete_int(value) -> int | None:
    """The Python int of an integer scalar, or None when it is traced."""
    if not is_concrete(value):
        return None
    return int(np.asarray(value))


def check_index(name: str, value, size: int) -> None:
    """An integer scalar in ``[0, size)`` (checked when concrete)."""
    check_integer_scalar(name, value)
    index = concrete_int(value)
    if index is not None and not 0 <= index < size:
        raise IndexError(f"{name} must be in [0, {size}), got {index}")


def check_static_index(name: str, value, size: int) -> None:
    """A Python int in ``[0, size)`` (layer and loop numbers, which are static)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a Python int (it is static), got {type(value).__name__}")
    if not 0 <= value < size:
        raise IndexError(f"{name} must be in [0, {size}), got {value}")


def first_nonfinite(x) -> tuple[int, tuple[int, ...]] | None:
    """``(count, index of the first)`` of NaN/+-inf elements of concrete ``x``, or None."""
    values = np.asarray(x, dtype=np.float32)
    bad = ~np.isfinite(values)
    if not bad.any():
        return None
    first = np.unravel_index(int(np.flatnonzero(bad)[0]), values.shape)
    return int(bad.sum()), tuple(int(i) for i in first)


def require_finite(name: str, x) -> None:
    """Raise :class:`NonFiniteInputError` if concrete ``x`` holds NaN or +-inf."""
    if not is_concrete(x):
        raise TypeError(f"{name}: checked entry points need concrete arrays, not tracers (call them outside jit)")
    found = first_nonfinite(x)
    if found is not None:
        number, first = found
        value = np.asarray(x, dtype=np.float32)[first]
        raise NonFiniteInputError(
            f"{name} must be finite: {number} element(s) are NaN or +-inf, the first at index "
            f"{first} ({value})"
        )
