"""jflashloop: 4-bit KV-cache codecs and fused decode attention for JAX."""

from . import checked as checked
from . import codecs as codecs
from . import paged_cache as paged_cache
from . import paged_stream as paged_stream
from . import persistence as persistence
from . import storage as storage
from .attention import decode_attention as decode_attention
from .attention import decode_attention_reference as decode_attention_reference
from .cache_config import CacheConfig as CacheConfig
from .cache_config import LoopStorage as LoopStorage
from .cache_config import sparse_loop as sparse_loop
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
from .codecs import int4_rotated as int4_rotated
from .paged_cache import PagedKVCache as PagedKVCache
from .residual import Chain as Chain
from .residual import Residual as Residual
from .residual import decode_chain as decode_chain
from .residual import decode_residual as decode_residual
from .residual import encode_chain as encode_chain
from .residual import encode_residual as encode_residual
from .validation import CacheStateError as CacheStateError
from .validation import NonFiniteInputError as NonFiniteInputError
from .validation import SaturationError as SaturationError

__version__ = "0.1.0"

# Module paths that moved: importable for one release, with a DeprecationWarning.
_DEPRECATED_MODULES = ("codec_spec", "nibbles", "rotated_codecs")


def __getattr__(name: str):
    if name in _DEPRECATED_MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    "LoopStorage",
    "NonFiniteInputError",
    "Packed",
    "PagedKVCache",
    "Residual",
    "SaturationError",
    "checked",
    "codecs",
    "count_saturations",
    "decode",
    "decode_attention",
    "decode_attention_reference",
    "decode_chain",
    "decode_residual",
    "encode",
    "encode_chain",
    "encode_residual",
    "encode_with_statistics",
    "global_scale_from_amax",
    "int2_lloyd_max",
    "int4_rotated",
    "paged_cache",
    "paged_stream",
    "persistence",
    "sparse_loop",
    "storage",
]
