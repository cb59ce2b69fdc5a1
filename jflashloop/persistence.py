"""Lossless save/load of a :class:`~jflashloop.PagedKVCache`, and page transfer.

Two things can be stored, in one file format (specified in
``docs/reliability.md``):

* a whole cache (:func:`save`, :func:`load`): every array bit for bit;
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

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import re
import secrets
import struct
import sys
import time
from collections.abc import Mapping
from typing import BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from .cache_config import CacheConfig, LoopStorage
from .codecs import CodecSpec
from .paged_cache import (
    LayerPool,
    PagedKVCache,
    bookkeeping_problems,
    create,
)
from .validation import CacheStateError, check_index

MAGIC = b"JFLASHKV"
FORMAT_VERSION = 1
CACHE_FORMAT = "jflashloop.paged_kv_cache"
BUNDLE_FORMAT = "jflashloop.page_bundle"
ALIGNMENT = 64
_PREFIX = struct.Struct("<8sIQ32s")  # magic, version, header length, header SHA-256
_DTYPES = ("bool", "int8", "int32", "uint8", "uint32", "float16", "float32", "bfloat16", "float8_e4m3fn")
# Config fields two caches must share for pages to move between them.
_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "loops", "page_size", "sink_tokens",
                  "recent_tokens", "window_dtype")


class PersistenceError(ValueError):
    """A file or bundle is corrupt, truncated, of another format version, or does not fit."""


# --------------------------------------------------------------------------- config


def config_to_json(config: CacheConfig) -> dict:
    """A JSON-ready dict of every :class:`CacheConfig` field."""
    return dataclasses.asdict(config)


def config_from_json(data: Mapping) -> CacheConfig:
    """Inverse of :func:`config_to_json` (the config validates itself)."""
    try:
        fields = dict(data)
        fields["loops"] = tuple(
            LoopStorage(
                key_spec=CodecSpec(**loop["key_spec"]),
                value_spec=CodecSpec(**loop["value_spec"]),
                sparse_rows_per_page=loop["sparse_rows_per_page"],
            )
            for loop in fields["loops"]
        )
        return CacheConfig(**fields)
    except (KeyError, TypeError, ValueError) as error:
        raise PersistenceError(f"the stored config is not a valid CacheConfig: {error}") from error


# --------------------------------------------------------------------------- file format


def _named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """``(pytree path, host array)`` of every array leaf, in pytree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in leaves]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _write(stream: BinaryIO, kind: str, config: CacheConfig, metadata: dict, arrays) -> None:
    """Write the header and arrays (``[(name, numpy array)]``) in the file format."""
    if sys.byteorder != "little":
        raise NotImplementedError("jflashloop files are little-endian; big-endian hosts are not supported")
    entries, offset = [], 0
    for name, array in arrays:
        if array.dtype.name not in _DTYPES:
            raise TypeError(f"array {name} has dtype {array.dtype}, which the format does not store")
        data = np.ascontiguousarray(array)
        entries.append(
            {
                "name": name,
                "dtype": array.dtype.name,
                "shape": list(array.shape),
                "offset": offset,
                "nbytes": data.nbytes,
                "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
            }
        )
        offset = _aligned(offset + data.nbytes)
    header = {
        "format": kind,
        "format_version": FORMAT_VERSION,
        "config": config_to_json(config),
        "metadata": metadata,
        "data_nbytes": offset,
        "arrays": entries,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes), hashlib.sha256(header_bytes).digest())
    stream.write(prefix + header_bytes)
    position = _PREFIX.size + len(header_bytes)
    stream.write(b"\0" * (_aligned(position) - position))
    written = 0
    for entry, (_, array) in zip(entries, arrays, strict=True):
        stream.write(b"\0" * (entry["offset"] - written))
        stream.write(np.ascontiguousarray(array).tobytes())
        written = entry["offset"] + entry["nbytes"]
    stream.write(b"\0" * (offset - written))


def _remaining(stream: BinaryIO) -> int:
    """Bytes between the stream's position and its end (the stream must be seekable)."""
    position = stream.tell()
    end = stream.seek(0, io.SEEK_END)
    stream.seek(position)
    return end - position


def _read_exactly(stream: BinaryIO, size: int, what: str) -> bytes:
    """``size`` bytes, refused before anything is allocated if the file holds fewer."""
    available = _remaining(stream)
    if size > available:
        raise PersistenceError(f"file is truncated: expected {size} bytes of {what}, got {available}")
    data = stream.read(size)
    if len(data) != size:
        raise PersistenceError(f"file is truncated: expected {size} bytes of {what}, got {len(data)}")
    return data


def _is_count(value) -> bool:
    """A JSON integer >= 0 (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_ENTRY_FIELDS = {"name": str, "dtype": str, "shape": list, "offset": int, "nbytes": int, "sha256": str}


def _header_problem(header, kind: str) -> str | None:
    """Why a parsed JSON header is not one of ``kind`` (None when its fields are well formed)."""
    if not isinstance(header, dict):
        return f"the header is a JSON {type(header).__name__}, not an object"
    if header.get("format") != kind:
        return f"file holds {header.get('format')!r}, expected {kind!r}"
    if header.get("format_version") != FORMAT_VERSION:
        return f"header format_version {header.get('format_version')} != {FORMAT_VERSION}"
    for key, kind_of_value in (("config", dict), ("metadata", dict), ("arrays", list)):
        if not isinstance(header.get(key), kind_of_value):
            return f"header field {key!r} must be a JSON {kind_of_value.__name__}"
    if not _is_count(header.get("data_nbytes")):
        return "header field 'data_nbytes' must be an integer >= 0"
    names = set()
    for index, entry in enumerate(header["arrays"]):
        if not isinstance(entry, dict) or any(not isinstance(entry.get(f), t) for f, t in _ENTRY_FIELDS.items()):
            return f"arrays[{index}] must hold {', '.join(_ENTRY_FIELDS)} of the documented types"
        if entry["dtype"] not in _DTYPES:
            return f"array {entry['name']}: unsupported dtype {entry['dtype']!r}"
        if not all(_is_count(v) for v in (entry["offset"], entry["nbytes"], *entry["shape"])):
            return f"array {entry['name']}: offset, nbytes and shape must be integers >= 0"
        if entry["name"] in names:
            return f"array {entry['name']} appears twice"
        names.add(entry["name"])
    return None


def _read(stream: BinaryIO, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Read and verify a file; returns ``(header, {name: array})``.

    Every size read from the file is checked against what the file holds
    before anything of that size is allocated.
    """
    prefix = _read_exactly(stream, _PREFIX.size, "the fixed prefix")
    magic, version, header_length, header_digest = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise PersistenceError(f"not a jflashloop file: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise PersistenceError(
            f"unsupported format version {version}; this jflashloop reads version {FORMAT_VERSION}"
        )
    header_bytes = _read_exactly(stream, header_length, "the header")
    if hashlib.sha256(header_bytes).digest() != header_digest:
        raise PersistenceError("header checksum mismatch: the header is corrupt")
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise PersistenceError(f"the header is not valid JSON: {error}") from error
    problem = _header_problem(header, kind)
    if problem:
        raise PersistenceError(problem)
    position = _PREFIX.size + header_length
    if any(_read_exactly(stream, _aligned(position) - position, "the header padding")):
        raise PersistenceError("the padding after the header is not zero: the file is corrupt")
    data = _read_exactly(stream, header["data_nbytes"], "array data")
    if stream.read(1):
        raise PersistenceError("file has trailing bytes after its data section")
    covered = np.zeros(len(data), bool)
    arrays = {}
    for entry in header["arrays"]:
        name = entry["name"]
        dtype = np.dtype(jnp.dtype(entry["dtype"]))
        shape = tuple(entry["shape"])
        nbytes = math.prod(shape) * dtype.itemsize
        start = entry["offset"]
        if nbytes != entry["nbytes"] or start + nbytes > len(data):
            raise PersistenceError(f"array {name}: inconsistent size or offset in the header")
        raw = data[start : start + nbytes]
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise PersistenceError(f"array {name}: SHA-256 mismatch, the data is corrupt")
        arrays[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        covered[start : start + nbytes] = True
    if np.frombuffer(data, np.uint8)[~covered].any():
        raise PersistenceError("the padding between arrays is not zero: the file is corrupt")
    return header, arrays


def _stored_config(header: dict, arrays: dict) -> CacheConfig:
    """The header's config, refused before its arrays are laid out if it implies more arrays than stored."""
    config = config_from_json(header["config"])
    if config.num_layers * config.num_loops > len(arrays):
        raise PersistenceError(
            f"the stored config implies at least {config.num_layers} x {config.num_loops} arrays "
            f"(layers x loops), the file holds {len(arrays)}"
        )
    return config


def _file_path(path) -> str:
    """``path`` (``str``, ``bytes`` or ``os.PathLike``) as a ``str`` (``os.fsdecode``).

    Raises:
      TypeError: anything else (an int would otherwise open a file descriptor).
    """
    try:
        return os.fsdecode(path)
    except TypeError:
        raise TypeError(f"path must be a str, bytes or os.PathLike, got {type(path).__name__}") from None


TEMPORARY_MARK = ".tmp-"
"""A save writes ``<name>.tmp-<pid>-<8 hex digits>`` next to ``<name>``, then renames it."""
STALE_AFTER_SECONDS = 600.0
"""A leftover temporary file is removed only once it is this old (and its writer is gone)."""


def _temporary_pattern(name: str) -> re.Pattern:
    """Temporary files of target ``name``: ``<name>.tmp-<pid>`` (older versions) or ``<name>.tmp-<pid>-<hex8>``."""
    return re.compile(re.escape(name) + re.escape(TEMPORARY_MARK) + r"(\d+)(?:-[0-9a-f]{8})?")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine; True whenever that cannot be told.

    Only POSIX can ask without side effects (``os.kill(pid, 0)``; on Windows
    ``os.kill`` terminates the process).
    """
    if os.name != "posix" or pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, owned by another user
        return True
    return True


def remove_stale_temporaries(path) -> list[str]:
    """Remove the temporary files an interrupted save of ``path`` left behind.

    A file next to ``path`` is removed only if all of these hold: its name is
    ``<name>.tmp-<pid>`` or ``<name>.tmp-<pid>-<8 hex digits>`` for this very
    target; no process ``<pid>`` runs on this machine (POSIX; elsewhere
    nothing is removed); and it was last modified at least
    :data:`STALE_AFTER_SECONDS` ago (so a writer on another machine sharing
    the folder, whose PID means nothing here, is not disturbed while it writes).
    Other files, including other targets' temporaries, are never touched.

    Returns:
      The paths removed.
    """
    path = _file_path(path)
    directory, name = os.path.split(os.path.abspath(path))
    pattern = _temporary_pattern(name)
    now = time.time()
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or _process_alive(int(match.group(1))):
                continue
            try:
                if not entry.is_file(follow_symlinks=False) or now - entry.stat().st_mtime < STALE_AFTER_SECONDS:
                    continue
                os.remove(entry.path)
            except FileNotFoundError:  # another process cleaned it first
                continue
            removed.append(entry.path)
    return removed


def _fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems without folder fsync
            raise
    finally:
        os.close(descriptor)


def _write_file(path, kind, config, metadata, arrays) -> None:
    """Write durably and atomically, as databases do.

    Stale temporaries of ``path`` are removed first (:func:`remove_stale_temporaries`).
    The data go to a new temporary file in the same folder, which is flushed
    and fsync'ed, then renamed over ``path`` (``os.replace``: readers see the
    old file or the new one, never a mix); the folder is then fsync'ed so
    the rename survives a power loss. On any error the temporary file is removed.
    """
    path = _file_path(path)
    remove_stale_temporaries(path)
    temporary = f"{path}{TEMPORARY_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "xb") as stream:
            _write(stream, kind, config, metadata, arrays)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _tree_from_arrays(template, arrays: dict[str, np.ndarray], what: str):
    """Rebuild ``template``'s pytree from named arrays, checking names, shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    missing = sorted(set(names) - set(arrays))
    unexpected = sorted(set(arrays) - set(names))
    if missing or unexpected:
        raise PersistenceError(f"{what}: missing arrays {missing[:5]}, unexpected arrays {unexpected[:5]}")
    values = []
    for name, (_, leaf) in zip(names, leaves, strict=True):
        array = arrays[name]
        if array.shape != tuple(leaf.shape) or array.dtype != np.dtype(leaf.dtype):
            raise PersistenceError(
                f"{what}: array {name} is {array.dtype} {array.shape}, its config implies "
                f"{np.dtype(leaf.dtype)} {tuple(leaf.shape)}"
            )
        values.append(array)
    return jax.tree_util.tree_unflatten(treedef, values)


# --------------------------------------------------------------------------- whole cache


def cache_to_bytes(cache: PagedKVCache) -> bytes:
    """The file format of :func:`save`, in memory."""
    stream = io.BytesIO()
    _write(stream, CACHE_FORMAT, cache.config, {}, _named_leaves(cache))
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
    _write_file(path, CACHE_FORMAT, cache.config, {}, _named_leaves(cache))


def load(path, *, config: CacheConfig | None = None) -> PagedKVCache:
    """Read a cache written by :func:`save`: bit-identical arrays.

    Args:
      path: the file (``str``, ``bytes`` or ``os.PathLike``).
      config: if given, the stored config must equal it.
    Raises:
      PersistenceError: corrupt, truncated or version-mismatched file, or a
        config mismatch, or inconsistent bookkeeping; nothing is loaded.
    """
    with open(_file_path(path), "rb") as stream:
        return _cache_from_stream(stream, config)


def _cache_from_stream(stream: BinaryIO, expected: CacheConfig | None) -> PagedKVCache:
    header, arrays = _read(stream, CACHE_FORMAT)
    stored = _stored_config(header, arrays)
    if expected is not None and stored != expected:
        raise PersistenceError(f"the file's config {stored} differs from the expected {expected}")
    template = jax.eval_shape(lambda: create(stored))
    host = _tree_from_arrays(template, arrays, "cache file")
    problems = bookkeeping_problems(host)
    if problems:
        raise PersistenceError("cache file has inconsistent bookkeeping: " + "; ".join(problems[:10]))
    return jax.tree.map(jnp.asarray, host)


# --------------------------------------------------------------------------- page bundles


@dataclasses.dataclass(frozen=True)
class PageBundle:
    """One sequence's pages and windows, off any cache (host numpy arrays).

    Attributes:
      layers: one :class:`~jflashloop.paged_cache.LayerPool` per layer whose
        ``loops`` hold the sequence's ``n`` page tiles (page axis 1, in
        block-table column order) and whose windows are the sequence's own:
        sink ``[loops, kv_heads, sink_tokens, head_dim]``, ring ``[loops,
        kv_heads, window_tokens, head_dim]``.
      page_columns: int32 ``[n]``: the block-table column (page number within
        the sequence) of each tile.
      length: committed tokens.
      error_flags, nonfinite_count, saturation_count: the sequence's flags and counters.
      config: the source cache's :class:`CacheConfig`.
    """

    layers: tuple[LayerPool, ...]
    page_columns: np.ndarray
    length: int
    error_flags: int
    nonfinite_count: int
    saturation_count: int
    config: CacheConfig

    @property
    def num_pages(self) -> int:
        return int(self.page_columns.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self.layers))


def _bundle_template(config: CacheConfig, num_pages: int):
    """Shapes of a bundle's ``layers`` for ``num_pages`` pages."""
    def one_sequence(cache):
        pages = jnp.zeros((num_pages,), jnp.int32)
        return tuple(
            LayerPool(
                loops=tuple(loop_tiles.take(pages) for loop_tiles in layer.loops),
                sink_keys=layer.sink_keys[:, 0],
                sink_values=layer.sink_values[:, 0],
                ring_keys=layer.ring_keys[:, 0],
                ring_values=layer.ring_values[:, 0],
            )
            for layer in cache.layers
        )

    return jax.eval_shape(lambda: one_sequence(create(config)))


def export_pages(cache: PagedKVCache, slot: int) -> PageBundle:
    """Copy sequence ``slot``'s pages (every layer and loop), windows and length to the host.

    Args:
      cache: a concrete cache (call outside ``jit``).
      slot: an active slot in ``[0, max_sequences)``.
    Returns:
      :class:`PageBundle`; the cache is unchanged (free the slot to release it).
    """
    c = cache.config
    check_index("slot", slot, c.max_sequences)
    slot = int(slot)
    if not bool(cache.active[slot]):
        raise ValueError(f"slot {slot} is not active: there is no sequence to export")
    row = np.asarray(cache.block_tables[slot])
    columns = np.flatnonzero(row >= 0).astype(np.int32)
    page_ids = jnp.asarray(row[columns], jnp.int32)
    layers = tuple(
        LayerPool(
            loops=tuple(loop_tiles.take(page_ids) for loop_tiles in layer.loops),
            sink_keys=layer.sink_keys[:, slot],
            sink_values=layer.sink_values[:, slot],
            ring_keys=layer.ring_keys[:, slot],
            ring_values=layer.ring_values[:, slot],
        )
        for layer in cache.layers
    )
    return PageBundle(
        layers=jax.tree.map(np.asarray, jax.device_get(layers)),
        page_columns=columns,
        length=int(cache.lengths[slot]),
        error_flags=int(cache.error_flags[slot]),
        nonfinite_count=int(cache.nonfinite_counts[slot]),
        saturation_count=int(cache.saturation_counts[slot]),
        config=c,
    )


def _check_bundle(bundle: PageBundle) -> None:
    """The bundle's arrays must match its config and page count; columns in order."""
    if not isinstance(bundle, PageBundle):
        raise TypeError(f"bundle must be a PageBundle, got {type(bundle).__name__}")
    c = bundle.config
    columns = np.asarray(bundle.page_columns)
    if columns.ndim != 1 or (columns.size and (np.diff(columns) <= 0).any()) or (columns < 0).any():
        raise PersistenceError("bundle.page_columns must be strictly increasing non-negative ints")
    if not 0 <= bundle.length <= c.max_tokens_per_sequence:
        raise PersistenceError(f"bundle.length {bundle.length} is outside [0, {c.max_tokens_per_sequence}]")
    template = _bundle_template(c, columns.size)
    _tree_from_arrays(template, dict(_named_leaves(bundle.layers)), "page bundle")


def _check_compatible(destination: CacheConfig, source: CacheConfig) -> None:
    different = [name for name in _LAYOUT_FIELDS if getattr(destination, name) != getattr(source, name)]
    if different:
        details = ", ".join(
            f"{name}: bundle {getattr(source, name)!r} vs cache {getattr(destination, name)!r}" for name in different
        )
        raise PersistenceError(f"the bundle's pages do not fit this cache's layout ({details})")


def import_pages(cache: PagedKVCache, slot: int, bundle: PageBundle) -> PagedKVCache:
    """Put a sequence exported by :func:`export_pages` into free slot ``slot`` of ``cache``.

    Allocates new page ids (the lowest free ones) in ``cache``, copies every
    layer's and loop's tiles there bit for bit, rewrites the slot's block-table
    row, and restores the windows, length, flags and counters. ``cache`` may
    have another pool size, slot count or block-table width than the source;
    its layout (model shape, codecs, page size, windows) must be the same.

    Raises:
      IndexError, ValueError: slot out of range or active; PersistenceError:
        incompatible layout, a sequence longer than this cache allows, too few
        free pages, or a malformed bundle. Nothing is changed then.
    """
    c = cache.config
    check_index("slot", slot, c.max_sequences)
    slot = int(slot)
    _check_bundle(bundle)
    _check_compatible(c, bundle.config)
    if bool(cache.active[slot]):
        raise ValueError(f"slot {slot} is already active; free it first (paged_cache.free)")
    columns = np.asarray(bundle.page_columns, np.int32)
    if bundle.length > c.max_tokens_per_sequence or (columns.size and columns[-1] >= c.max_pages_per_sequence):
        raise PersistenceError(
            f"the sequence ({bundle.length} tokens, block-table columns up to "
            f"{int(columns[-1]) if columns.size else -1}) does not fit max_pages_per_sequence="
            f"{c.max_pages_per_sequence} of this cache"
        )
    free_ids = np.flatnonzero(np.asarray(cache.page_free))
    if free_ids.size < columns.size:
        raise PersistenceError(f"the bundle needs {columns.size} free pages, this cache has {free_ids.size}")
    page_ids = jnp.asarray(free_ids[: columns.size], jnp.int32)
    layers = []
    for layer, source in zip(cache.layers, bundle.layers, strict=True):
        loops = tuple(
            pool.put(page_ids, jax.tree.map(jnp.asarray, tiles))
            for pool, tiles in zip(layer.loops, source.loops, strict=True)
        )
        layers.append(
            LayerPool(
                loops=loops,
                sink_keys=layer.sink_keys.at[:, slot].set(source.sink_keys),
                sink_values=layer.sink_values.at[:, slot].set(source.sink_values),
                ring_keys=layer.ring_keys.at[:, slot].set(source.ring_keys),
                ring_values=layer.ring_values.at[:, slot].set(source.ring_values),
            )
        )
    row = np.full((c.max_pages_per_sequence,), -1, np.int32)
    row[columns] = free_ids[: columns.size]
    return dataclasses.replace(
        cache,
        layers=tuple(layers),
        block_tables=cache.block_tables.at[slot].set(jnp.asarray(row)),
        lengths=cache.lengths.at[slot].set(bundle.length),
        active=cache.active.at[slot].set(True),
        page_free=cache.page_free.at[page_ids].set(False),
        error_flags=cache.error_flags.at[slot].set(bundle.error_flags),
        nonfinite_counts=cache.nonfinite_counts.at[slot].set(bundle.nonfinite_count),
        saturation_counts=cache.saturation_counts.at[slot].set(bundle.saturation_count),
    )


def _bundle_metadata(bundle: PageBundle) -> dict:
    return {
        "length": int(bundle.length),
        "page_columns": [int(column) for column in bundle.page_columns],
        "error_flags": int(bundle.error_flags),
        "nonfinite_count": int(bundle.nonfinite_count),
        "saturation_count": int(bundle.saturation_count),
    }


def pages_to_bytes(bundle: PageBundle) -> bytes:
    """The file format of :func:`save_pages`, in memory (e.g. to send to another server)."""
    _check_bundle(bundle)
    stream = io.BytesIO()
    _write(stream, BUNDLE_FORMAT, bundle.config, _bundle_metadata(bundle), _named_leaves(bundle.layers))
    return stream.getvalue()


def pages_from_bytes(data: bytes) -> PageBundle:
    """Inverse of :func:`pages_to_bytes` (same checks as :func:`load_pages`)."""
    return _bundle_from_stream(io.BytesIO(data))


def save_pages(path, bundle: PageBundle) -> None:
    """Write a :class:`PageBundle` to ``path`` (``str``, ``bytes`` or ``os.PathLike``), as :func:`save` does."""
    _check_bundle(bundle)
    _write_file(path, BUNDLE_FORMAT, bundle.config, _bundle_metadata(bundle), _named_leaves(bundle.layers))


def load_pages(path) -> PageBundle:
    """Read a :class:`PageBundle` written by :func:`save_pages` (bit-identical arrays).

    ``path``: ``str``, ``bytes`` or ``os.PathLike``.

    Raises:
      PersistenceError: corrupt, truncated or version-mismatched file; nothing is loaded.
    """
    with open(_file_path(path), "rb") as stream:
        return _bundle_from_stream(stream)


_BUNDLE_COUNTS = ("length", "error_flags", "nonfinite_count", "saturation_count")


def _is_int32_count(value) -> bool:
    return _is_count(value) and value < 2**31


def _bundle_from_stream(stream: BinaryIO) -> PageBundle:
    header, arrays = _read(stream, BUNDLE_FORMAT)
    config = _stored_config(header, arrays)
    metadata = header["metadata"]
    columns = metadata.get("page_columns")
    if not isinstance(columns, list) or not all(_is_int32_count(column) for column in columns):
        raise PersistenceError("page bundle file has malformed metadata: page_columns must be a list of int32 >= 0")
    for key in _BUNDLE_COUNTS:
        if not _is_int32_count(metadata.get(key)):
            raise PersistenceError(f"page bundle file has malformed metadata: {key} must be an int32 >= 0")
    columns = np.asarray(columns, np.int32).reshape(-1)
    bundle = PageBundle(
        layers=_tree_from_arrays(_bundle_template(config, columns.size), arrays, "page bundle file"),
        page_columns=columns,
        config=config,
        **{key: metadata[key] for key in _BUNDLE_COUNTS},
    )
    _check_bundle(bundle)
    return bundle


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
