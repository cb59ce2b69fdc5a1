"""Deprecated path of :mod:`jflashloop.apps.evaluation` (removed in the next release).

``python -m jflashloop.evaluation`` still runs; ``jflashloop eval`` is the supported form.
"""

import sys

from ._deprecation import warn_moved
from .apps.evaluation import evaluate as evaluate
from .apps.evaluation import main as main
from .apps.evaluation import markdown_table as markdown_table

warn_moved(__name__, "jflashloop.apps.evaluation")

if __name__ == "__main__":
    warn_moved("python -m jflashloop.evaluation", "jflashloop eval", stacklevel=2)
    sys.exit(main())
