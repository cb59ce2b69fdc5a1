"""Deprecated: nibble packing moved to :mod:`jflashloop.codecs`."""

from ._deprecation import moved_module

moved_module("jflashloop.nibbles", "jflashloop.codecs (pack_nibbles, unpack_nibbles)")

from .codecs._packed import pack_nibbles, unpack_nibbles  # noqa: E402, F401
