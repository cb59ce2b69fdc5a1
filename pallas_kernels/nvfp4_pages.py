"""The bit order of NVFP4 payload bytes inside a paged cache's tiles.

The codec (``jflashloop.encode``, the FlashLoop byte format, persistence
files) packs two E2M1 codes per byte, channel ``2i`` in the low nibble:
``s_o m_o2 m_o1 m_o0 s_e m_e2 m_e1 m_e0`` (bit 7 to bit 0; ``e`` the even
channel, ``o`` the odd one, ``s`` the sign, ``m`` the 3-bit magnitude).

A cache's NVFP4 tiles hold each byte in *page order* instead:
``s_e m_o2 m_o1 m_o0 m_e2 m_e1 m_e0 s_o``. A float16 whose high byte is
``s << 7 | m << 1`` (low byte 0) is the E2M1 value / 2**14, so the even
channels' high bytes of a 32-bit word are one ``and`` (``0x8E8E8E8E``) and
the odd ones' four instructions: five a word where the codec order takes
seven (``triton_kernels.gluon_decode``). The map is a fixed permutation of
each byte's bits, so it commutes with every token, word and page move the
cache makes.

Both functions take uint32 words (numpy or jax arrays, inside kernels too)
and return the same shape and dtype. Zero maps to zero, so an empty pool is
the same in either order. The numpy oracle is
``jflashloop_reference.paged_cache.nvfp4_page_bytes``.
"""

from __future__ import annotations

import numpy as np

_KEPT = np.uint32(0x70707070)  # the odd channel's magnitude stays at bits 4-6
_EVEN_MAGNITUDE = np.uint32(0x07070707)  # bits 0-2 <-> 1-3
_EVEN_SIGN = np.uint32(0x08080808)  # bit 3 <-> 7
_ODD_SIGN = np.uint32(0x80808080)  # bit 7 <-> 0


def _checked(words):
    if np.dtype(words.dtype) != np.uint32:
        raise TypeError(f"NVFP4 payload words must be uint32, got {words.dtype}")
    return words


def to_page_order(words):
    """Codec-order uint32 words ``[...]`` -> page order (same shape, uint32).

    Raises:
      TypeError: ``words`` is not uint32.
    """
    words = _checked(words)
    return ((words & _KEPT) | ((words & _EVEN_MAGNITUDE) << 1) | ((words & _EVEN_SIGN) << 4)
            | ((words & _ODD_SIGN) >> 7))


def from_page_order(words):
    """Page-order uint32 words ``[...]`` -> codec order (same shape, uint32); inverse of :func:`to_page_order`.

    Raises:
      TypeError: ``words`` is not uint32.
    """
    words = _checked(words)
    return ((words & _KEPT) | ((words >> 1) & _EVEN_MAGNITUDE) | ((words >> 4) & _EVEN_SIGN)
            | ((words << 7) & _ODD_SIGN))
