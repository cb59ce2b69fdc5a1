"""Deprecated: page tiles moved to ``jflashloop/cache`` (``jflashloop.paged_cache.PagedStream``)
and their encoding to the page-quantization op (``jflashloop/ops/_page_quantization.py``).

Every name of the old module stays importable here for one release.
"""

from ._deprecation import moved_module

moved_module("jflashloop.paged_stream", "jflashloop.paged_cache.PagedStream (the tiles of one stream)")

from .cache._layout import PagedStream, bytes_from_words, words_from_bytes  # noqa: E402, F401
from .cache._pages import decode_tiles, empty_stream  # noqa: E402, F401
from .ops import _page_quantization  # noqa: E402
from .ops._page_quantization import encode_tiles  # noqa: E402, F401


def can_encode_page_pairs(rows, head_dim, key_spec, value_spec, implementation=None) -> bool:
    """Whether :func:`encode_page_pairs` takes the one-kernel path for these streams."""
    from .ops import _dispatch

    if _dispatch.resolve(implementation).backend != "pallas":
        return False
    try:
        for spec in (key_spec, value_spec):
            _page_quantization._check_kernel_reads(spec, rows, head_dim, pages_in_place=True)
    except NotImplementedError:
        return False
    return True


def encode_page_pairs(keys, values, page_numbers, key_spec, value_spec, sink_tokens):
    """The K and V tiles of whole pages, sink rows masked (now ``encode_pages``)."""
    return _page_quantization.encode_pages(keys, values, page_numbers, key_spec, value_spec, sink_tokens,
                                           implementation="pallas")
