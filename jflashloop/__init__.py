"""jflashloop: 4-bit KV-cache codecs and fused decode attention for JAX."""

from . import paged_cache as paged_cache
from . import paged_stream as paged_stream
from . import storage as storage
from .attention import decode_attention as decode_attention
from .attention import decode_attention_reference as decode_attention_reference
from .cache_config import CacheConfig as CacheConfig
from .cache_config import LoopStorage as LoopStorage
from .cache_config import sparse_loop as sparse_loop
from .codec_spec import INT4_KEYS as INT4_KEYS
from .codec_spec import INT4_VALUES as INT4_VALUES
from .codec_spec import NVFP4 as NVFP4
from .codec_spec import CodecSpec as CodecSpec
from .codecs import decode as decode
from .codecs import encode as encode
from .nvfp4 import global_scale_from_amax as global_scale_from_amax
from .packed import Packed as Packed
from .paged_cache import PagedKVCache as PagedKVCache
from .residual import Chain as Chain
from .residual import Residual as Residual
from .residual import decode_chain as decode_chain
from .residual import decode_residual as decode_residual
from .residual import encode_chain as encode_chain
from .residual import encode_residual as encode_residual

__version__ = "0.1.0"

__all__ = [
    "INT4_KEYS",
    "INT4_VALUES",
    "NVFP4",
    "CacheConfig",
    "Chain",
    "CodecSpec",
    "LoopStorage",
    "Packed",
    "PagedKVCache",
    "Residual",
    "decode",
    "decode_attention",
    "decode_attention_reference",
    "decode_chain",
    "decode_residual",
    "encode",
    "encode_chain",
    "encode_residual",
    "global_scale_from_amax",
    "paged_cache",
    "sparse_loop",
    "storage",
]
