"""Deprecated path of :mod:`jflashloop.apps.cli` (removed in the next release).

``python -m jflashloop.cli ARGS`` still runs; ``python -m jflashloop ARGS`` and
the ``jflashloop`` console script are the supported forms.
"""

import sys

from ._deprecation import warn_moved
from .apps.cli import main as main

warn_moved(__name__, "jflashloop.apps.cli")

if __name__ == "__main__":
    warn_moved("python -m jflashloop.cli", "python -m jflashloop", stacklevel=2)
    sys.exit(main())
