"""Deprecated: :class:`CodecSpec` and its presets moved to :mod:`jflashloop.codecs`."""

from ._deprecation import moved_module

moved_module("jflashloop.codec_spec", "jflashloop.codecs (CodecSpec, INT4_KEYS, ...)")

from .codecs._spec import *  # noqa: E402, F403
