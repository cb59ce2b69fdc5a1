"""The codecs: how one ``[tokens, kv_heads, channels]`` tensor is stored in 2-4.5 bits.

Public names (also re-exported by :mod:`jflashloop`): the format descriptor
:class:`CodecSpec` and its presets, :func:`encode` / :func:`decode`, the
encode statistics, :class:`Packed`, nibble packing, and the rotations that
queries take for rotated keys. The modules of this folder are internal:

* ``_spec``: :class:`CodecSpec`, the presets, bits and bytes per format;
* ``_packed``: :class:`Packed`, nibble, 3-bit and 2-bit packing;
* ``_floats``: exact-float helpers (float16 / E4M3 rounding, saturating casts);
* ``_statistics``: :class:`EncodeStatistics` and each format's saturation rule;
* ``_int4`` (the affine formats, ``int4``, ``int3`` and ``int2``), ``_nvfp4``, ``_rotated``: one format family each;
* ``_api``: the entry points, which check arguments and dispatch on the format.
"""

from ._api import count_saturations as count_saturations
from ._api import decode as decode
from ._api import encode as encode
from ._api import encode_with_statistics as encode_with_statistics
from ._nvfp4 import global_scale_from_amax as global_scale_from_amax
from ._packed import Packed as Packed
from ._packed import pack_crumbs as pack_crumbs
from ._packed import pack_nibbles as pack_nibbles
from ._packed import pack_triplets as pack_triplets
from ._packed import unpack_crumbs as unpack_crumbs
from ._packed import unpack_nibbles as unpack_nibbles
from ._packed import unpack_triplets as unpack_triplets
from ._rotated import rotate as rotate
from ._rotated import rotate_by_product as rotate_by_product
from ._rotated import rotation_matrix as rotation_matrix
from ._rotated import unrotate as unrotate
from ._spec import E8_KEYS as E8_KEYS
from ._spec import INT4_GROUP_ROTATED_VALUES as INT4_GROUP_ROTATED_VALUES
from ._spec import INT4_KEYS as INT4_KEYS
from ._spec import INT4_VALUES as INT4_VALUES
from ._spec import NVFP4 as NVFP4
from ._spec import CodecSpec as CodecSpec
from ._spec import int2_lloyd_max as int2_lloyd_max
from ._spec import int3_lloyd_max as int3_lloyd_max
from ._spec import int4_rotated as int4_rotated
from ._spec import round_channel_scales as round_channel_scales
from ._statistics import EncodeStatistics as EncodeStatistics

__all__ = [
    "E8_KEYS",
    "INT4_GROUP_ROTATED_VALUES",
    "INT4_KEYS",
    "INT4_VALUES",
    "NVFP4",
    "CodecSpec",
    "EncodeStatistics",
    "Packed",
    "count_saturations",
    "decode",
    "encode",
    "encode_with_statistics",
    "global_scale_from_amax",
    "int2_lloyd_max",
    "int3_lloyd_max",
    "int4_rotated",
    "pack_crumbs",
    "pack_nibbles",
    "pack_triplets",
    "rotate",
    "rotate_by_product",
    "rotation_matrix",
    "unpack_crumbs",
    "unpack_nibbles",
    "unpack_triplets",
    "unrotate",
]
