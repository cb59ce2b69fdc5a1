"""``python -m jflashloop ARGS``: the ``jflashloop`` command (:mod:`jflashloop.apps.cli`)."""

import sys

from .apps.cli import main

sys.exit(main())
