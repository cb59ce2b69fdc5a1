"""Choosing the backend of an op: one rule for every op.

Every GPU op (exact division, page quantization, decode attention) takes
``implementation=None | "xla" | "pallas" | ...``. :func:`call` resolves it
once per call:

* an explicit name runs that backend alone; a backend that cannot take the
  input raises ``NotImplementedError``, which reaches the caller;
* ``None`` tries the op's automatic order (by default ``"pallas"`` on a GPU,
  ``"xla"`` elsewhere), and a ``NotImplementedError`` hands over to the next
  backend in that order.

The resolved choice is an :class:`Implementation`, which also says whether
a Pallas kernel runs in interpret mode. ``interpret`` is decided here and
passed to the kernel explicitly: by default it is True off a GPU (the only
way a kernel runs there) and False on one, and ``interpret=True`` runs a
kernel's logic in interpret mode on a GPU host too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax

T = TypeVar("T")
DEFAULT_CHOICES = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A resolved backend choice (frozen and hashable: static under ``jit``).

    Attributes:
      backend: ``"xla"`` (plain JAX), ``"pallas"`` (Pallas-Triton kernels) or
        ``"gluon"`` (the Gluon decode kernel).
      interpret: run Pallas kernels in interpret mode (always off a GPU).
    """

    backend: str
    interpret: bool = False


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def _listed(choices: Sequence[str]) -> str:
    names = ["None", *(repr(name) for name in choices)]
    return ", ".join(names[:-1]) + " or " + names[-1]


def resolve(
    implementation: str | Implementation | None,
    *,
    choices: Sequence[str] = DEFAULT_CHOICES,
    interpret: bool | None = None,
) -> Implementation:
    """The :class:`Implementation` for ``implementation``.

    ``None`` is ``"pallas"`` on a GPU and ``"xla"`` elsewhere; an
    :class:`Implementation` is returned as it is (with ``interpret`` applied
    when given), so resolving twice changes nothing.

    Raises:
      ValueError: a name outside ``choices``.
    """
    if isinstance(implementation, Implementation):
        if implementation.backend not in choices:
            raise ValueError(f"implementation must be {_listed(choices)}, got {implementation.backend!r}")
        if interpret is None or interpret == implementation.interpret:
            return implementation
        return dataclasses.replace(implementation, interpret=bool(interpret))
    if implementation is None:
        implementation = "pallas" if on_gpu() and "pallas" in choices else choices[0]
    elif implementation not in choices:
        raise ValueError(f"implementation must be {_listed(choices)}, got {implementation!r}")
    return Implementation(implementation, interpret=not on_gpu() if interpret is None else bool(interpret))


def call(
    implementation: str | Implementation | None,
    backends: Mapping[str, Callable[[Implementation], T]],
    *,
    automatic: Sequence[str] | None = None,
    interpret: bool | None = None,
) -> T:
    """Run an op on its backend.

    Args:
      implementation: ``None`` or one of ``backends``' names (or a resolved
        :class:`Implementation`).
      backends: name -> function of the resolved :class:`Implementation`; a
        function that cannot take the op's input raises ``NotImplementedError``
        before it computes anything.
      automatic: the order tried for ``implementation=None`` (default: the
        one backend :func:`resolve` picks for ``None``).
      interpret: as for :func:`resolve`.
    Raises:
      ValueError: an unknown ``implementation``.
      NotImplementedError: the explicit backend, or the last automatic one,
        cannot take the input.
    """
    choices = tuple(backends)
    if implementation is not None:
        chosen = resolve(implementation, choices=choices, interpret=interpret)
        return backends[chosen.backend](chosen)
    order = tuple(automatic) if automatic is not None else (resolve(None, choices=choices).backend,)
    return first_supported(*(
        lambda name=name: backends[name](resolve(name, choices=choices, interpret=interpret)) for name in order
    ))


def first_supported(*attempts: Callable[[], T]) -> T:
    """The result of the first attempt that does not raise ``NotImplementedError``.

    The last attempt's ``NotImplementedError`` reaches the caller.
    """
    if not attempts:
        raise ValueError("first_supported needs at least one attempt")
    for attempt in attempts[:-1]:
        try:
            return attempt()
        except NotImplementedError:
            continue
    return attempts[-1]()
