"""Oracle of what a paged cross-loop cache holds for one sequence.

Given the exact history of every loop and the sparse rows the cache chose,
rebuild the float32 K/V of a loop position by position from the scalar codec
oracles: full pages as a closed-loop residual chain of per-(page, head)
tiles, the sink and recent windows from the history itself.
"""

from __future__ import annotations

import numpy as np

from . import rotations
from .fitted import decode_int4_scaled, decode_int_mixed, encode_int4_scaled, encode_int_mixed
from .int2 import decode_int2, encode_int2
from .int3 import decode_int3, encode_int3
from .int4 import decode_int4, encode_int4
from .nvfp4 import decode_nvfp4, encode_nvfp4


def round_trip(tile: np.ndarray, codec, head: int = 0) -> np.ndarray:
    """Encode then decode a float32 ``[rows, 1, D]`` tile (of kv head ``head``) with ``codec``.

    ``codec`` is ``(format, axis, group_size)`` or, for the rotated formats,
    ``(format, axis, group_size, rotation_seed)``, or, for the fitted formats,
    ``(format, axis, group_size, None, table)`` with ``table`` the ``[H, D]``
    widths (``int_mixed``) or divisors (``int4_scaled``), of which the tile
    takes row ``head``; NVFP4 uses the tile's own amax.
    """
    fmt, axis, group_size = codec[:3]
    if fmt == "int_mixed":
        widths = np.asarray(codec[4])[head:head + 1]
        e = encode_int_mixed(tile, group_size, widths)
        return decode_int_mixed(e["payload"], e["minimum"], e["scale"], group_size, widths, tile.shape)
    if fmt == "int4_scaled":
        scales = np.asarray(codec[4], np.float32)[head:head + 1]
        e = encode_int4_scaled(tile, group_size, scales)
        return decode_int4_scaled(e["payload"], e["minimum"], e["scale"], group_size, scales, tile.shape)
    if fmt in ROW_CODECS:
        seed = codec[3] if len(codec) > 3 else None
        rows = [ROW_CODECS[fmt](tile[r, 0], group_size, seed) for r in range(tile.shape[0])]
        return np.asarray(rows, np.float32)[:, None, :]
    if fmt in AFFINE_CODECS:
        encode, decode = AFFINE_CODECS[fmt]
        e = encode(tile, axis, group_size)
        return decode(e["payload"], e["minimum"], e["scale"], axis, group_size, tile.shape)
    e = encode_nvfp4(tile)
    return decode_nvfp4(e["payload"], e["scale"], e["global_scale"], tile.shape)


# Where each bit of an NVFP4 payload byte goes in a cache tile (page order): codec bit -> tile bit. The codec
# byte is ``s_o m_o2 m_o1 m_o0 s_e m_e2 m_e1 m_e0`` (bit 7 first; e: the even channel), the tile byte
# ``s_e m_o2 m_o1 m_o0 m_e2 m_e1 m_e0 s_o``.
NVFP4_PAGE_BIT = {0: 1, 1: 2, 2: 3, 3: 7, 4: 4, 5: 5, 6: 6, 7: 0}


def nvfp4_page_bytes(payload: np.ndarray) -> np.ndarray:
    """NVFP4 payload bytes (uint8, any shape, the codec's order) as a cache tile holds them (uint8)."""
    payload = np.asarray(payload, np.uint8)
    out = np.zeros_like(payload)
    for source, target in NVFP4_PAGE_BIT.items():
        out |= ((payload >> source) & 1) << target
    return out


def _round_trip_int4_rotated(vector, group_size, seed):
    return rotations.decode_int4_rotated_vector(*rotations.encode_int4_rotated_vector(vector, seed), seed)


def _round_trip_int2(vector, group_size, seed):
    return rotations.decode_int2_lloyd_max_vector(*rotations.encode_int2_lloyd_max_vector(vector, seed), seed)


def _round_trip_int3_lloyd_max(vector, group_size, seed):
    return rotations.decode_int3_lloyd_max_vector(*rotations.encode_int3_lloyd_max_vector(vector, seed), seed)


def _round_trip_e8(vector, group_size, seed):
    codes, scales = rotations.encode_e8_vector(vector, group_size)
    return rotations.decode_e8_vector(codes, scales, len(vector), group_size)


def _round_trip_int4_group_rotated(vector, group_size, seed):
    codes, scales = rotations.encode_int4_group_rotated_vector(vector, group_size)
    return rotations.decode_int4_group_rotated_vector(codes, scales, group_size)


AFFINE_CODECS = {"int4": (encode_int4, decode_int4), "int3": (encode_int3, decode_int3),
                 "int2": (encode_int2, decode_int2)}
ROW_CODECS = {
    "int4_rotated": _round_trip_int4_rotated,
    "int2_lloyd_max": _round_trip_int2,
    "int3_lloyd_max": _round_trip_int3_lloyd_max,
    "e8": _round_trip_e8,
    "int4_group_rotated": _round_trip_int4_group_rotated,
}


def reconstruct_pages(history, page_size, sink_tokens, loops, row_positions, loop, pages):
    """float32 ``[pages * page_size, H, D]`` reconstruction of loop ``loop`` (0-based).

    Args:
      history: float32 ``[loops, tokens, H, D]`` (values as the cache stores them).
      loops: per loop ``(key_codec, value_codec, sparse_rows or None)`` or
        ``(key_codec, value_codec, sparse_rows or None, direct)`` -- only
        one of K or V is rebuilt here, so pass the codec of that stream as
        ``key_codec``; a ``direct`` (dense) loop is coded on its own, like
        loop 0, and later loops against it.
      row_positions: per loop, None or int ``[H, pages_total, rows]`` (-1 unused).
      pages: number of full pages to rebuild.
    """
    _, _, heads, head_dim = history.shape
    out = np.zeros((pages * page_size, heads, head_dim), np.float32)
    for page in range(pages):
        rows = slice(page * page_size, (page + 1) * page_size)
        for head in range(heads):
            tiles = history[:, rows, head, :].astype(np.float32).copy()  # [loops, P, D]
            if page == 0:
                for r in range(sink_tokens):
                    tiles[:, r] = tiles[:, sink_tokens]
            reconstruction = None
            for loop_index in range(loop + 1):
                codec, _, sparse_rows, *direct = loops[loop_index]
                if reconstruction is None or (direct and direct[0]):
                    reconstruction = round_trip(tiles[loop_index][:, None, :], codec, head)[:, 0, :]
                    continue
                residual = (tiles[loop_index] - reconstruction).astype(np.float32)
                if sparse_rows is None:
                    decoded = round_trip(residual[:, None, :], codec, head)[:, 0, :]
                    reconstruction = (reconstruction + decoded).astype(np.float32)
                    continue
                positions = [int(p) for p in row_positions[loop_index][head, page] if p >= 0]
                compact = np.zeros((sparse_rows, head_dim), np.float32)
                for row, position in enumerate(positions):
                    compact[row] = residual[position]
                decoded = round_trip(compact[:, None, :], codec, head)[:, 0, :]
                reconstruction = reconstruction.copy()
                for row, position in enumerate(positions):
                    reconstruction[position] = np.float32(reconstruction[position] + decoded[row])
            out[rows, head, :] = reconstruction
    return out


def readable_positions(*, length, visible, page_size, sink_tokens, recent_tokens, stored_pages=None):
    """bool ``[visible]``: the positions whose K/V a sequence still holds.

    A position is read from the sink window (``t < sink_tokens``), from a
    packed page, or from the ring, which holds the latest ``max(recent_tokens,
    page_size)`` positions. Pages are read up to the first one that was not
    stored (``stored_pages`` leading pages; default all ``length //
    page_size``); a position after it that has left the ring is lost.
    """
    pages = length // page_size if stored_pages is None else min(length // page_size, stored_pages)
    window_start = min(visible - recent_tokens, pages * page_size)
    ring_start = max(window_start, visible - max(recent_tokens, page_size))
    return np.array([t < sink_tokens or t < window_start or t >= ring_start for t in range(visible)], bool)


def reconstruct_sequence(
    history, *, length, visible, page_size, sink_tokens, recent_tokens, loops, row_positions, loop,
    stored_pages=None,
):
    """float32 ``[visible, H, D]``: what attention must see for loop ``loop``.

    ``length`` is the committed token count (it decides the packed pages);
    ``visible`` is ``length`` or ``length + 1`` with a pending token;
    ``stored_pages`` is as for :func:`readable_positions`, whose lost
    positions are zero here.
    """
    pages = length // page_size if stored_pages is None else min(length // page_size, stored_pages)
    out = np.array(history[loop, :visible], np.float32)
    packed = reconstruct_pages(history, page_size, sink_tokens, loops, row_positions, loop, pages)
    window_start = min(visible - recent_tokens, pages * page_size)
    readable = readable_positions(
        length=length, visible=visible, page_size=page_size, sink_tokens=sink_tokens,
        recent_tokens=recent_tokens, stored_pages=stored_pages,
    )
    for t in range(visible):
        if t >= sink_tokens and t < window_start:
            out[t] = packed[t]
        elif not readable[t]:
            out[t] = 0.0
    return out
