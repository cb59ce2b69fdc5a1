"""Lossless save/load of a :class:`~jflashloop.PagedKVCache`, and page transfer.

Two things can be stored, in one file format (specified in
``docs/reliability.md``):

* a whole cache (:func:`save`, :func:`load`): every array bit for bit (page
  payloads in the codec's byte order, converted from and to the order tiles
  hold: :func:`jflashloop.cache._layout.interchange_order`);
* one sequence's pages (:func:`export_pages` -> :class:`PageBundle` ->
  :func:`save_pages` / :func:`load_pages` -> :func:`import_pages`): the
  sequence's page tiles of every layer and loop, its sink and ring windows,
  length, flags and counters, for offload or for moving a sequence to another
  cache (another server) with a different pool, slot and page ids.

File layout (all integers little-endian)::

    offset 0   8 bytes   magic b"JFLASHKV"
    offset 8   uint32    format version (FORMAT_VERSION)
    offset 12  uint64    header length H
    offset 20  32 bytes  SHA-256 of the header bytes
    offset 52  H bytes   header: UTF-8 JSON (see below)
    ...        zero padding to a multiple of 64 bytes: the data section starts there
    data       each array's raw C-order little-endian bytes at its 64-byte-aligned offset;
               every padding byte is zero

The JSON header holds ``format`` ("jflashloop.paged_kv_cache" or
"jflashloop.page_bundle"), ``format_version``, ``config`` (every
:class:`CacheConfig` field), ``metadata`` (bundle only: length, page columns,
flags, counters), ``data_nbytes`` and ``arrays``: one entry per array with
``name`` (its pytree path), ``dtype``, ``shape``, ``offset`` (from the data
start), ``nbytes`` and ``sha256``.

Loading checks the magic, the version, the header checksum, the file size,
the header's fields and their JSON types, that padding is zero, every
array's name, dtype, shape and SHA-256, and (for a cache) its bookkeeping
(:func:`jflashloop.paged_cache.validate`) before building anything: a
corrupt, truncated, hand-built or version-mismatched file raises
:class:`PersistenceError` and loads nothing. Every size read from the file
is checked against the file's size before anything of that size is allocated.
"""

from .._errors import CacheStateError as CacheStateError
from .._errors import PersistenceError as PersistenceError
from ._atomic import STALE_AFTER_SECONDS as STALE_AFTER_SECONDS
from ._atomic import TEMPORARY_MARK as TEMPORARY_MARK
from ._atomic import remove_stale_temporaries as remove_stale_temporaries
from ._bundles import PageBundle as PageBundle
from ._bundles import export_pages as export_pages
from ._bundles import import_pages as import_pages
from ._bundles import load_pages as load_pages
from ._bundles import pages_from_bytes as pages_from_bytes
from ._bundles import pages_to_bytes as pages_to_bytes
from ._bundles import save_pages as save_pages
from ._caches import cache_from_bytes as cache_from_bytes
from ._caches import cache_to_bytes as cache_to_bytes
from ._caches import load as load
from ._caches import save as save
from ._format import ALIGNMENT as ALIGNMENT
from ._format import BUNDLE_FORMAT as BUNDLE_FORMAT
from ._format import CACHE_FORMAT as CACHE_FORMAT
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import MAGIC as MAGIC
from ._format import config_from_json as config_from_json
from ._format import config_to_json as config_to_json

__all__ = [
    "FORMAT_VERSION",
    "CacheStateError",
    "PageBundle",
    "PersistenceError",
    "cache_from_bytes",
    "cache_to_bytes",
    "export_pages",
    "import_pages",
    "load",
    "load_pages",
    "pages_from_bytes",
    "pages_to_bytes",
    "remove_stale_temporaries",
    "save",
    "save_pages",
]
