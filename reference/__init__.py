"""Independent numpy scalar oracles that define jflashloop's semantics.

Installed as ``jflashloop_reference``. Plain element-by-element numpy and
Python: slow, small and obviously right. Never imports jax or jflashloop.
"""

from . import attention, fitted, floats, int2, int3, int4, nvfp4, paged_cache
from .fitted import decode_int4_scaled, decode_int_mixed, encode_int4_scaled, encode_int_mixed
from .int2 import decode_int2, encode_int2, pack_crumbs, unpack_crumbs
from .int3 import decode_int3, encode_int3, pack_triplets, unpack_triplets
from .int4 import decode_int4, encode_int4, pack_nibbles, unpack_nibbles
from .nvfp4 import decode_nvfp4, encode_nvfp4, global_scale_from_amax

__all__ = [
    "attention",
    "decode_int2",
    "decode_int3",
    "decode_int4",
    "decode_int4_scaled",
    "decode_int_mixed",
    "decode_nvfp4",
    "encode_int2",
    "encode_int3",
    "encode_int4",
    "encode_int4_scaled",
    "encode_int_mixed",
    "encode_nvfp4",
    "fitted",
    "floats",
    "global_scale_from_amax",
    "int2",
    "int3",
    "int4",
    "nvfp4",
    "pack_crumbs",
    "pack_nibbles",
    "pack_triplets",
    "paged_cache",
    "unpack_crumbs",
    "unpack_nibbles",
    "unpack_triplets",
]
