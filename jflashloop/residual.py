"""Deprecated: the residual chains moved to ``jflashloop`` itself (``jflashloop.encode_chain``, ...).

Every name of the old module stays importable here for one release.
"""

from ._deprecation import moved_module

moved_module("jflashloop.residual", "jflashloop (encode_chain, decode_loop, encode_residual, ...)")

from ._chains import *  # noqa: E402, F403
from ._chains import _check_positions  # noqa: E402, F401
