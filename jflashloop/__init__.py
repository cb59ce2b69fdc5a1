"""jflashloop: 4-bit KV-cache codecs and fused decode attention for JAX.

The public API is what this module re-exports, and the namespaces it
re-exports: :mod:`jflashloop.codecs`, :mod:`jflashloop.paged_cache` (the
cache's operations), :mod:`jflashloop.storage` (byte accounting), :mod:`jflashloop.allocation`
(per-layer policies under a bit budget and their files), :mod:`jflashloop.fitting` (codecs fitted to a
model's own keys, values and queries),
:mod:`jflashloop.checked`, :mod:`jflashloop.persistence` and
:mod:`jflashloop.sharding`. Every other module (a leading underscore, or
inside ``codecs/``, ``cache/`` and ``ops/``) is internal; ``docs/architecture.md``
draws the layers.

Layers, loops, slots and positions are 0-based everywhere: loop 0 is a
looped model's first loop (the base of its residual chain).
"""

from . import allocation as allocation
from . import checked as checked
from . import codecs as codecs
from . import fitting as fitting
from . import paged_cache as paged_cache
from . import persistence as persistence
from . import sharding as sharding
from . import storage as storage
from ._chains import Chain as Chain
from ._chains import Residual as Residual
from ._chains import decode_chain as decode_chain
from ._chains import decode_loop as decode_loop
from ._chains import decode_residual as decode_residual
from ._chains import encode_chain as encode_chain
from ._chains import encode_residual as encode_residual
from ._errors import CacheStateError as CacheStateError
from ._errors import NonFiniteInputError as NonFiniteInputError
from ._errors import PersistenceError as PersistenceError
from ._errors import SaturationError as SaturationError
from .cache._config import CacheConfig as CacheConfig
from .cache._config import LoopStorage as LoopStorage
from .cache._config import Policy as Policy
from .cache._config import sparse_loop as sparse_loop
from .cache._prediction import LoopPrediction as LoopPrediction
from .codecs import E8_KEYS as E8_KEYS
from .codecs import INT4_GROUP_ROTATED_VALUES as INT4_GROUP_ROTATED_VALUES
from .codecs import INT4_KEYS as INT4_KEYS
from .codecs import INT4_VALUES as INT4_VALUES
from .codecs import NVFP4 as NVFP4
from .codecs import CodecSpec as CodecSpec
from .codecs import EncodeStatistics as EncodeStatistics
from .codecs import Packed as Packed
from .codecs import count_saturations as count_saturations
from .codecs import decode as decode
from .codecs import encode as encode
from .codecs import encode_with_statistics as encode_with_statistics
from .codecs import global_scale_from_amax as global_scale_from_amax
from .codecs import int2_lloyd_max as int2_lloyd_max
from .codecs import int3_lloyd_max as int3_lloyd_max
from .codecs import int4_rotated as int4_rotated
from .ops._chunk_attention import chunk_attention as chunk_attention
from .ops._chunk_attention import chunk_attention_reference as chunk_attention_reference
from .ops._decode_attention import decode_attention as decode_attention
from .ops._decode_attention import decode_attention_reference as decode_attention_reference
from .paged_cache import PagedKVCache as PagedKVCache

__version__ = "0.1.0"

# Module paths that moved: importable for one release, with a DeprecationWarning
# (``jflashloop.codec_spec`` as an attribute, and ``import jflashloop.codec_spec``).
_DEPRECATED_MODULES = ("attention", "codec_spec", "nibbles", "paged_stream", "residual", "rotated_codecs")


def __getattr__(name: str):
    if name in _DEPRECATED_MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The public API (sorted; the imports above group it by room).
__all__ = [
    "E8_KEYS",
    "INT4_GROUP_ROTATED_VALUES",
    "INT4_KEYS",
    "INT4_VALUES",
    "NVFP4",
    "CacheConfig",
    "CacheStateError",
    "Chain",
    "CodecSpec",
    "EncodeStatistics",
    "LoopPrediction",
    "LoopStorage",
    "NonFiniteInputError",
    "Packed",
    "PagedKVCache",
    "PersistenceError",
    "Policy",
    "Residual",
    "SaturationError",
    "allocation",
    "checked",
    "chunk_attention",
    "chunk_attention_reference",
    "codecs",
    "count_saturations",
    "decode",
    "decode_attention",
    "decode_attention_reference",
    "decode_chain",
    "decode_loop",
    "decode_residual",
    "encode",
    "encode_chain",
    "encode_residual",
    "encode_with_statistics",
    "fitting",
    "global_scale_from_amax",
    "int2_lloyd_max",
    "int3_lloyd_max",
    "int4_rotated",
    "paged_cache",
    "persistence",
    "sharding",
    "sparse_loop",
    "storage"
]
