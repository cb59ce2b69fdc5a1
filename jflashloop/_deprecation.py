"""Old module paths and names, kept importable for one release with a ``DeprecationWarning``.

Every message starts with ``"jflashloop"``, so a test run can turn exactly
these warnings into errors (``pyproject.toml``'s ``filterwarnings``) and the
test suite keeps to the new paths.
"""

from __future__ import annotations

import warnings


def warn(message: str, *, stacklevel: int = 3) -> None:
    """Issue a ``DeprecationWarning`` (``message`` starts with ``"jflashloop"``)."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def moved_module(old: str, new: str) -> None:
    """Called at the top of the module left at an old path: ``old`` moved to ``new``."""
    warn(f"{old} is deprecated and will be removed in the next release; use {new}", stacklevel=3)
