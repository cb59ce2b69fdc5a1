"""Deprecated path of :mod:`jflashloop.apps.demo` (removed in the next release)."""

from ._deprecation import warn_moved
from .apps.demo import QUESTION as QUESTION
from .apps.demo import add_arguments as add_arguments
from .apps.demo import run as run

warn_moved(__name__, "jflashloop.apps.demo")
