"""Byte accounting of the paged cache (exact) and capacity planning: ``jflashloop.storage``.

Re-exported from ``jflashloop/cache/_storage.py``. Loops are indexed from 0:
``page_bytes(config).loops[0]`` is the base.
"""

from .cache._storage import OURO_1_4B as OURO_1_4B
from .cache._storage import OURO_2_6B as OURO_2_6B
from .cache._storage import CacheBytes as CacheBytes
from .cache._storage import ModelShape as ModelShape
from .cache._storage import PageBytes as PageBytes
from .cache._storage import bytes_per_token as bytes_per_token
from .cache._storage import cache_bytes as cache_bytes
from .cache._storage import config_for as config_for
from .cache._storage import describe_windows as describe_windows
from .cache._storage import head_token_bytes as head_token_bytes
from .cache._storage import page_bytes as page_bytes
from .cache._storage import pool_page_bytes as pool_page_bytes
from .cache._storage import sequence_bytes as sequence_bytes
from .cache._storage import shared_prefix_bytes as shared_prefix_bytes
from .cache._storage import sharing_table as sharing_table
from .cache._storage import storage_table as storage_table
from .cache._storage import tokens_that_fit as tokens_that_fit
from .cache._storage import unquantized_bytes_per_token as unquantized_bytes_per_token
from .cache._storage import window_bytes_per_sequence as window_bytes_per_sequence

__all__ = [
    "OURO_1_4B",
    "OURO_2_6B",
    "CacheBytes",
    "ModelShape",
    "PageBytes",
    "bytes_per_token",
    "cache_bytes",
    "config_for",
    "describe_windows",
    "head_token_bytes",
    "page_bytes",
    "pool_page_bytes",
    "sequence_bytes",
    "shared_prefix_bytes",
    "sharing_table",
    "storage_table",
    "tokens_that_fit",
    "unquantized_bytes_per_token",
    "window_bytes_per_sequence",
]
