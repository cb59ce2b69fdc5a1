"""Deprecated: the rotated and lattice codecs moved to ``jflashloop.codecs`` (``rotate``, ``unrotate``).

Every name of the old module stays importable here for one release.
"""

from ._deprecation import moved_module

moved_module("jflashloop.rotated_codecs", "jflashloop.codecs (rotate, unrotate; encode/decode for the formats)")

from .codecs._rotated import *  # noqa: E402, F403
from .codecs._rotated import _pack_crumbs, _unpack_crumbs  # noqa: E402, F401
