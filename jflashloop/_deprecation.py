"""Deprecation warnings of module paths kept importable for one release."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that module ``old`` moved to ``new`` (a :class:`DeprecationWarning`).

    Called at the top level of the old module, so the warning points at the
    line that imported it (``stacklevel=3``: this function, the old module,
    its importer). ``python -m old`` warns again from its ``__main__`` block
    with ``stacklevel=2``, where the warning is shown by default.
    """
    warnings.warn(
        f"{old} moved to {new}; the old path is deprecated and will be removed in the next "
        f"release: import {new} instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
