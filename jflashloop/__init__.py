"""jflashloop: 4-bit KV-cache codecs and fused decode attention for JAX."""

from .codec_spec import INT4_KEYS as INT4_KEYS
from .codec_spec import INT4_VALUES as INT4_VALUES
from .codec_spec import NVFP4 as NVFP4
from .codec_spec import CodecSpec as CodecSpec
from .codecs import decode as decode
from .codecs import encode as encode
from .nvfp4 import global_scale_from_amax as global_scale_from_amax
from .packed import Packed as Packed

__version__ = "0.1.0"

__all__ = [
    "INT4_KEYS",
    "INT4_VALUES",
    "NVFP4",
    "CodecSpec",
    "Packed",
    "decode",
    "encode",
    "global_scale_from_amax",
]
