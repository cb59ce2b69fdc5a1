"""Page bundles: one sequence's pages and windows, off any cache, to offload or move to another cache."""

from __future__ import annotations

import dataclasses
import io
from typing import BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PersistenceError
from .._validation import check_index
from ..cache._config import CacheConfig
from ..cache._layout import LayerPool, PagedKVCache
from ..cache._state import create
from ._atomic import file_path, write_file
from ._format import (
    BUNDLE_FORMAT,
    is_count,
    named_leaves,
    read,
    stored_config,
    tree_from_arrays,
    write,
)

# Config fields two caches must share for pages to move between them.
_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "loops", "page_size", "sink_tokens",
                  "recent_tokens", "window_dtype")


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
    held = row >= 0
    columns = np.arange(np.argmin(held) if not held.all() else held.size, dtype=np.int32)  # up to a lost page
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
    if (columns != np.arange(columns.size)).any():
        raise PersistenceError(
            f"bundle.page_columns must be 0 .. {columns.size - 1} (a sequence's pages up to its first lost "
            f"page; none is stored after one), got {columns.tolist()}"
        )
    if not 0 <= bundle.length <= c.max_tokens_per_sequence:
        raise PersistenceError(f"bundle.length {bundle.length} is outside [0, {c.max_tokens_per_sequence}]")
    template = _bundle_template(c, columns.size)
    tree_from_arrays(template, dict(named_leaves(bundle.layers)), "page bundle")


def _layout(config: CacheConfig, name: str):
    """A layout field; "loops" is every layer's policy (per-layer configs compare layer by layer)."""
    if name == "loops" and not config.is_uniform:
        return tuple(config.layer(index).loops for index in range(config.num_layers))
    return getattr(config, name)


def _check_compatible(destination: CacheConfig, source: CacheConfig) -> None:
    different = [name for name in _LAYOUT_FIELDS if _layout(destination, name) != _layout(source, name)]
    if different:
        details = ", ".join(
            f"{name}: bundle {_layout(source, name)!r} vs cache {_layout(destination, name)!r}" for name in different
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
        page_refs=cache.page_refs.at[page_ids].set(1),
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
    write(stream, BUNDLE_FORMAT, bundle.config, _bundle_metadata(bundle), named_leaves(bundle.layers))
    return stream.getvalue()


def pages_from_bytes(data: bytes) -> PageBundle:
    """Inverse of :func:`pages_to_bytes` (same checks as :func:`load_pages`)."""
    return _bundle_from_stream(io.BytesIO(data))


def save_pages(path, bundle: PageBundle) -> None:
    """Write a :class:`PageBundle` to ``path`` (``str``, ``bytes`` or ``os.PathLike``), as :func:`save` does."""
    _check_bundle(bundle)
    write_file(path, BUNDLE_FORMAT, bundle.config, _bundle_metadata(bundle), named_leaves(bundle.layers))


def load_pages(path) -> PageBundle:
    """Read a :class:`PageBundle` written by :func:`save_pages` (bit-identical arrays).

    ``path``: ``str``, ``bytes`` or ``os.PathLike``.

    Raises:
      PersistenceError: corrupt, truncated or version-mismatched file; nothing is loaded.
    """
    with open(file_path(path), "rb") as stream:
        return _bundle_from_stream(stream)


_BUNDLE_COUNTS = ("length", "error_flags", "nonfinite_count", "saturation_count")


def _is_int32_count(value) -> bool:
    return is_count(value) and value < 2**31


def _bundle_from_stream(stream: BinaryIO) -> PageBundle:
    header, arrays = read(stream, BUNDLE_FORMAT)
    config = stored_config(header, arrays)
    metadata = header["metadata"]
    columns = metadata.get("page_columns")
    if not isinstance(columns, list) or not all(_is_int32_count(column) for column in columns):
        raise PersistenceError("page bundle file has malformed metadata: page_columns must be a list of int32 >= 0")
    for key in _BUNDLE_COUNTS:
        if not _is_int32_count(metadata.get(key)):
            raise PersistenceError(f"page bundle file has malformed metadata: {key} must be an int32 >= 0")
    columns = np.asarray(columns, np.int32).reshape(-1)
    bundle = PageBundle(
        layers=tree_from_arrays(_bundle_template(config, columns.size), arrays, "page bundle file"),
        page_columns=columns,
        config=config,
        **{key: metadata[key] for key in _BUNDLE_COUNTS},
    )
    _check_bundle(bundle)
    return bundle
