"""Optional tqdm progress bars on stderr (tqdm comes with the ``demo`` extra)."""

from __future__ import annotations

import sys
from collections.abc import Iterable


def bar(total: int, description: str):
    """A tqdm bar of ``total`` steps, or ``None`` without tqdm (shown only on a terminal)."""
    try:
        from tqdm import tqdm
    except ImportError:  # run without a bar
        return None
    return tqdm(total=total, desc=description, leave=False, disable=not sys.stderr.isatty())


def iterate(iterable: Iterable, description: str, enabled: bool) -> Iterable:
    """``tqdm(iterable)`` on stderr when enabled and tqdm is installed; else ``iterable``."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, file=sys.stderr, leave=False, disable=None)
