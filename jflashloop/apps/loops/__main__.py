"""``python -m jflashloop.apps.loops``: the same as ``jflashloop loops``."""

import sys

from .cli import main

sys.exit(main())
