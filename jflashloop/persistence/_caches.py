"""Saving and loading a whole :class:`~jflashloop.PagedKVCache`, every array bit for bit."""

from __future__ import annotations

import dataclasses
import io
from typing import BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PersistenceError
from ..cache._config import CacheConfig
from ..cache._inspect import bookkeeping_problems
from ..cache._layout import PagedKVCache
from ..cache._state import create
from ._atomic import file_path, write_file
from ._format import CACHE_FORMAT, named_leaves, read, stored_config, tree_from_arrays, write


def cache_to_bytes(cache: PagedKVCache) -> bytes:
    """The file format of :func:`save`, in memory."""
    stream = io.BytesIO()
    write(stream, CACHE_FORMAT, cache.config, {}, named_leaves(cache))
    return stream.getvalue()


def cache_from_bytes(data: bytes, *, config: CacheConfig | None = None) -> PagedKVCache:
    """Inverse of :func:`cache_to_bytes` (same checks as :func:`load`)."""
    return _cache_from_stream(io.BytesIO(data), config)


def save(path, cache: PagedKVCache) -> None:
    """Write every array of ``cache`` (and its config) to ``path``, atomically.

    Args:
      path: file to create or replace (``str``, ``bytes`` or ``os.PathLike``).
      cache: the cache; pending (written, uncommitted) ring tokens are saved too.

    The data are written to a temporary file in the same folder, fsync'ed and
    renamed over ``path``, and the folder is fsync'ed: after a crash or power
    loss ``path`` holds the old file or the new one, whole. Temporary files
    left by interrupted saves of ``path`` are removed first
    (:func:`remove_stale_temporaries` gives the rule).
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    write_file(path, CACHE_FORMAT, cache.config, {}, named_leaves(cache))


def load(path, *, config: CacheConfig | None = None) -> PagedKVCache:
    """Read a cache written by :func:`save`: bit-identical arrays.

    One exception: a file written by an earlier version may hold pages
    stored after a sequence's lost page (block-table entry -1); no attention
    or reconstruction reads those, and this version keeps a sequence's pages
    a prefix of its block-table row, so they are released (entries set to
    -1, pages marked free).

    Args:
      path: the file (``str``, ``bytes`` or ``os.PathLike``).
      config: if given, the stored config must equal it.
    Raises:
      PersistenceError: corrupt, truncated or version-mismatched file, or a
        config mismatch, or inconsistent bookkeeping; nothing is loaded.
    """
    with open(file_path(path), "rb") as stream:
        return _cache_from_stream(stream, config)


def _cache_from_stream(stream: BinaryIO, expected: CacheConfig | None) -> PagedKVCache:
    header, arrays = read(stream, CACHE_FORMAT)
    stored = stored_config(header, arrays)
    if expected is not None and stored != expected:
        raise PersistenceError(f"the file's config {stored} differs from the expected {expected}")
    template = jax.eval_shape(lambda: create(stored))
    host = _release_pages_after_lost(tree_from_arrays(template, _refs_from_free_list(arrays), "cache file"))
    problems = bookkeeping_problems(host)
    if problems:
        raise PersistenceError("cache file has inconsistent bookkeeping: " + "; ".join(problems[:10]))
    return jax.tree.map(jnp.asarray, host)


def _release_pages_after_lost(host: PagedKVCache) -> PagedKVCache:
    """``host`` (numpy leaves) with every page after a sequence's first lost page released."""
    tables = np.asarray(host.block_tables)
    full_pages = np.asarray(host.lengths) // host.config.page_size
    columns = np.arange(tables.shape[1])
    lost = (tables < 0) & (columns[None, :] < full_pages[:, None])
    first_lost = np.where(lost.any(axis=1), lost.argmax(axis=1), tables.shape[1])
    after = (columns[None, :] > first_lost[:, None]) & (tables >= 0)
    if not after.any():
        return host
    page_refs = np.array(host.page_refs)
    released = tables[after]
    np.subtract.at(page_refs, released[(released >= 0) & (released < page_refs.shape[0])], 1)
    return dataclasses.replace(host, block_tables=np.where(after, -1, tables).astype(tables.dtype),
                               page_refs=page_refs)


def _refs_from_free_list(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Files of earlier versions hold ``.page_free`` (bool; no page was shared): reference counts from it."""
    if ".page_free" not in arrays or ".page_refs" in arrays:
        return arrays
    converted = {name: array for name, array in arrays.items() if name != ".page_free"}
    page_free = arrays[".page_free"]
    if page_free.dtype != np.bool_:
        raise PersistenceError(f"cache file array .page_free must be bool, got {page_free.dtype}")
    converted[".page_refs"] = (~page_free).astype(np.int32)
    return converted
