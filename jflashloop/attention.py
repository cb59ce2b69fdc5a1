"""Deprecated: decode attention moved to the decode-attention op (``jflashloop/ops/_decode_attention.py``).

``jflashloop.decode_attention`` and ``jflashloop.decode_attention_reference``
are the public names; every name of the old module stays importable here
for one release (``kernel_inputs_formats`` is now ``loop_formats(cache.config, loop)``).
"""

from ._deprecation import moved_module

moved_module("jflashloop.attention", "jflashloop.decode_attention / jflashloop.decode_attention_reference")

from .ops._decode_attention import (  # noqa: E402, F401
    FUSED_FORMATS,
    decode_attention,
    decode_attention_reference,
    gluon_unsupported_reason,
    kernel_inputs,
    kernel_rotations,
    rotated_inputs,
    unrotated_output,
)
from .ops._decode_attention import check_arguments as _check_arguments  # noqa: E402, F401
from .ops._decode_attention import gluon_is_default as _gluon_is_default  # noqa: E402


def gluon_is_default(queries, cache, loop) -> bool:
    """Whether the automatic choice on a GPU is the Gluon kernel (the rule, and the kernel reads the cache)."""
    return _gluon_is_default(cache.config, loop) and gluon_unsupported_reason(queries, cache, loop) is None


def kernel_inputs_formats(cache, loop):
    """The static stream formats of loops ``0..loop`` (now ``loop_formats(cache.config, loop)``)."""
    from .ops._decode_attention import loop_formats

    return loop_formats(cache.config, loop)
