"""Old module paths and names, kept importable for one release with a ``DeprecationWarning``.

Every message starts with ``"jflashloop"``, so a test run can turn exactly
these warnings into errors (``pyproject.toml``'s ``filterwarnings``) and the
test suite keeps to the new paths.
"""

from __future__ import annotations

import warnings


def warn(message: str, *, stacklevel: int = 3) -> None:
    """Issue a ``DeprecationWarning`` (``message`` starts with ``"jflashloop"``).

    ``stacklevel`` counts from the caller of this function, as
    :func:`warnings.warn` counts from its own caller.
    """
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that module ``old`` moved to ``new``.

    Called at the top level of the old module, so the warning points at the
    line that imported it (``stacklevel=3``: this function, the old module,
    its importer). ``python -m old`` warns again from its ``__main__`` block
    with ``stacklevel=2``, where the warning is shown by default.
    """
    warn(f"{old} moved to {new}; the old path is deprecated and will be removed in the next "
         f"release: import {new} instead", stacklevel=stacklevel)


def moved_module(old: str, new: str) -> None:
    """Called at the top of the module left at an old path: ``old`` is deprecated, use ``new``."""
    warn(f"{old} is deprecated and will be removed in the next release; use {new}", stacklevel=3)
