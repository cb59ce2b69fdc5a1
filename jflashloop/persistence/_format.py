"""The file format of :mod:`jflashloop.persistence`: a checksummed header and 64-byte-aligned arrays.

``docs/reliability.md`` specifies it; :func:`write` and :func:`read` are its
only writer and reader, shared by whole caches and page bundles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import struct
import sys
from collections.abc import Mapping
from typing import BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PersistenceError
from ..cache._config import CacheConfig, LoopStorage
from ..cache._layout import interchange_order, page_order
from ..cache._prediction import LoopPrediction
from ..codecs import CodecSpec

MAGIC = b"JFLASHKV"
FORMAT_VERSION = 1
CACHE_FORMAT = "jflashloop.paged_kv_cache"
BUNDLE_FORMAT = "jflashloop.page_bundle"
ALIGNMENT = 64
_PREFIX = struct.Struct("<8sIQ32s")  # magic, version, header length, header SHA-256
_DTYPES = ("bool", "int8", "int32", "uint8", "uint32", "float16", "float32", "bfloat16", "float8_e4m3fn")


# --------------------------------------------------------------------------- config


def config_to_json(config: CacheConfig) -> dict:
    """A JSON-ready dict of every :class:`CacheConfig` field (each codec as :meth:`CodecSpec.to_json`)."""
    def loops_to(loops):
        return [{**dataclasses.asdict(loop), "key_spec": loop.key_spec.to_json(),
                 "value_spec": loop.value_spec.to_json(),
                 "prediction": None if loop.prediction is None else loop.prediction.to_json()} for loop in loops]

    fields = dataclasses.asdict(config)
    fields["loops"] = loops_to(config.loops)
    if config.layer_loops is not None:
        fields["layer_loops"] = [loops_to(loops) for loops in config.layer_loops]
    return fields


def config_from_json(data: Mapping) -> CacheConfig:
    """Inverse of :func:`config_to_json` (the config validates itself)."""
    try:
        fields = dict(data)

        def loops_from(entries):
            return tuple(
                LoopStorage(
                    key_spec=CodecSpec(**loop["key_spec"]),
                    value_spec=CodecSpec(**loop["value_spec"]),
                    sparse_rows_per_page=loop["sparse_rows_per_page"],
                    direct=loop.get("direct", False),  # files of earlier versions: every later loop a residual
                    prediction=None if loop.get("prediction") is None else LoopPrediction.from_json(loop["prediction"]),
                )
                for loop in entries
            )

        fields["loops"] = loops_from(fields["loops"])
        if fields.get("layer_loops") is not None:  # files of earlier versions have no layer_loops: uniform
            fields["layer_loops"] = tuple(loops_from(layer) for layer in fields["layer_loops"])
        return CacheConfig(**fields)
    except (KeyError, TypeError, ValueError) as error:
        raise PersistenceError(f"the stored config is not a valid CacheConfig: {error}") from error


# --------------------------------------------------------------------------- file format


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """``(pytree path, host array)`` of every array leaf, in pytree order; page payloads in the codec's byte
    order (:func:`~jflashloop.cache._layout.interchange_order`: files hold the FlashLoop-compatible bytes)."""
    leaves = jax.tree_util.tree_flatten_with_path(interchange_order(tree))[0]
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in leaves]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def write(stream: BinaryIO, kind: str, config: CacheConfig, metadata: dict, arrays) -> None:
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


def is_count(value) -> bool:
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
    if not is_count(header.get("data_nbytes")):
        return "header field 'data_nbytes' must be an integer >= 0"
    names = set()
    for index, entry in enumerate(header["arrays"]):
        if not isinstance(entry, dict) or any(not isinstance(entry.get(f), t) for f, t in _ENTRY_FIELDS.items()):
            return f"arrays[{index}] must hold {', '.join(_ENTRY_FIELDS)} of the documented types"
        if entry["dtype"] not in _DTYPES:
            return f"array {entry['name']}: unsupported dtype {entry['dtype']!r}"
        if not all(is_count(v) for v in (entry["offset"], entry["nbytes"], *entry["shape"])):
            return f"array {entry['name']}: offset, nbytes and shape must be integers >= 0"
        if entry["name"] in names:
            return f"array {entry['name']} appears twice"
        names.add(entry["name"])
    return None


def read(stream: BinaryIO, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
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


def stored_config(header: dict, arrays: dict) -> CacheConfig:
    """The header's config, refused before its arrays are laid out if it implies more arrays than stored."""
    config = config_from_json(header["config"])
    if config.num_layers * config.num_loops > len(arrays):
        raise PersistenceError(
            f"the stored config implies at least {config.num_layers} x {config.num_loops} arrays "
            f"(layers x loops), the file holds {len(arrays)}"
        )
    return config


def tree_from_arrays(template, arrays: dict[str, np.ndarray], what: str):
    """Rebuild ``template``'s pytree from named arrays, checking names, shapes and dtypes; page payloads go
    back to the order tiles hold (:func:`~jflashloop.cache._layout.page_order`)."""
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
    return page_order(jax.tree_util.tree_unflatten(treedef, values))
