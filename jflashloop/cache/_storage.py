"""Byte accounting for a paged cross-loop cache (exact), and capacity planning.

Loops are indexed from 0, as everywhere in jflashloop: ``page_bytes(config).loops[0]``
is the base.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from .. import _deprecation
from ._config import CacheConfig, LoopStorage


def _stream_tile_bytes(spec, rows: int, head_dim: int) -> int:
    """Bytes of one (page, head) tile: payload + metadata (+ NVFP4 tile scale)."""
    return spec.nbytes((rows, 1, head_dim))


@dataclasses.dataclass(frozen=True)
class PageBytes:
    """Bytes one full page occupies in one layer (all KV heads).

    Attributes:
      loops: one count per loop, indexed from 0 (the base first); a sparse
        loop counts its compact rows and its int8 row positions (shared by K
        and V).
      total: the sum over the loops.

    ``page_bytes(config)["loop1"]`` (1-based string keys) and ``["total"]``
    still work for one release, with a ``DeprecationWarning``:
    ``["loop<r>"]`` is ``.loops[r - 1]``.
    """

    loops: tuple[int, ...]
    total: int

    def __eq__(self, other) -> bool:
        if isinstance(other, PageBytes):
            return (self.loops, self.total) == (other.loops, other.total)
        if isinstance(other, Mapping):  # the old dict {"loop1": ..., "total": ...}
            _deprecation.warn("jflashloop.storage.page_bytes(config) is a PageBytes, not a dict; compare "
                              "it with a PageBytes (.loops is 0-based)")
            old = {f"loop{index + 1}": value for index, value in enumerate(self.loops)}
            return {**old, "total": self.total} == dict(other)
        return NotImplemented

    def __getitem__(self, key: str) -> int:
        if key == "total":
            _deprecation.warn('jflashloop.storage.page_bytes(config)["total"] is deprecated; use .total')
            return self.total
        if isinstance(key, str) and key.startswith("loop") and key[4:].isdigit() and 1 <= int(key[4:]) <= len(self.loops):
            _deprecation.warn(
                f'jflashloop.storage.page_bytes(config)["{key}"] (1-based) is deprecated; use '
                f".loops[{int(key[4:]) - 1}] (0-based, like every other loop index)"
            )
            return self.loops[int(key[4:]) - 1]
        raise KeyError(key)


def page_bytes(config: CacheConfig) -> PageBytes:
    """Bytes one full page occupies in one layer (all KV heads), per loop and total.

    With a per-layer policy pass one layer's config (``config.layer(i)``);
    :func:`pool_page_bytes` sums a page id over every layer.

    Raises:
      ValueError: ``config`` stores its layers differently.
    """
    if not config.is_uniform:
        raise ValueError("the config stores its layers differently: page_bytes(config.layer(i)) gives layer i's "
                         "bytes, pool_page_bytes(config) the sum over layers")
    per_loop = []
    for index, storage in enumerate(config.loops):
        rows = config.rows(index)
        if rows == 0:  # a predicted loop with no rows stores nothing
            per_loop.append(0)
            continue
        per_head = _stream_tile_bytes(storage.key_spec, rows, config.head_dim)
        per_head += _stream_tile_bytes(storage.value_spec, rows, config.head_dim)
        if storage.is_sparse:
            per_head += rows  # int8 row positions
        per_loop.append(per_head * config.num_kv_heads)
    return PageBytes(loops=tuple(per_loop), total=sum(per_loop))


def pool_page_bytes(config: CacheConfig) -> int:
    """Bytes of one page id over every layer (each layer's pool holds that page in its own policy)."""
    return sum(page_bytes(config.layer(index)).total for index in range(config.num_layers))


def head_token_bytes(key_spec, value_spec, head_dim: int) -> int:
    """Bytes one token of one KV head occupies with ``key_spec`` K and ``value_spec`` V."""
    shape = (1, 1, head_dim)
    return key_spec.nbytes(shape) + value_spec.nbytes(shape)


def bytes_per_token(config: CacheConfig) -> float:
    """Bytes per token per layer in full pages (all loops, K and V, all KV heads; the mean over layers)."""
    return pool_page_bytes(config) / config.num_layers / config.page_size


def unquantized_bytes_per_token(config: CacheConfig, dtype=jnp.bfloat16) -> int:
    """Bytes per token per layer if every loop's K and V were stored in ``dtype``."""
    return config.num_loops * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def window_bytes_per_sequence(config: CacheConfig) -> int:
    """Per layer and sequence: the sink and the ring of recent/unfilled tokens."""
    tokens = config.sink_tokens + config.window_tokens
    itemsize = jnp.dtype(config.window_dtype).itemsize
    return tokens * config.num_loops * 2 * config.num_kv_heads * config.head_dim * itemsize


def sequence_bytes(config: CacheConfig, tokens: int) -> int:
    """Exact bytes one sequence of ``tokens`` tokens holds, over all layers."""
    pages = tokens // config.page_size
    return pages * pool_page_bytes(config) + config.num_layers * window_bytes_per_sequence(config)


def shared_prefix_bytes(config: CacheConfig, sequences: int, prefix_tokens: int, own_tokens: int = 0, *,
                        shared: bool = True) -> int:
    """Exact bytes of ``sequences`` sequences that start with one ``prefix_tokens``-token prompt.

    Each sequence then holds ``own_tokens`` more tokens of its own. With
    ``shared=True`` the prompt's full pages are stored once
    (:func:`~jflashloop.paged_cache.fork` at ``prefix_tokens``; the prompt's
    partial last page becomes each sequence's own); with ``shared=False``
    every sequence holds its own copy (``sequences * sequence_bytes``). All
    layers, windows included.
    """
    page_size = config.page_size
    pages_each = (prefix_tokens + own_tokens) // page_size
    prefix_pages = prefix_tokens // page_size if shared else 0
    pages = prefix_pages + sequences * (pages_each - prefix_pages)
    return pages * pool_page_bytes(config) + config.num_layers * sequences * window_bytes_per_sequence(config)


@dataclasses.dataclass(frozen=True)
class CacheBytes:
    """What a live cache holds (all layers), from :func:`cache_bytes`.

    Attributes:
      pages: pages in use (each stored once, however many sequences share it).
      page_references: block-table entries holding a page (``pages`` plus one
        per extra sharer).
      bytes: pages in use plus every active sequence's windows.
      bytes_without_sharing: the same if every reference were its own page.
    """

    pages: int
    page_references: int
    bytes: int
    bytes_without_sharing: int


def cache_bytes(cache) -> CacheBytes:
    """Bytes the pages and windows of ``cache``'s sequences hold, with and without sharing (host-side)."""
    config = cache.config
    page_refs = np.asarray(cache.page_refs)
    pages, references = int((page_refs > 0).sum()), int(page_refs.sum())
    per_page = pool_page_bytes(config)
    windows = int(np.asarray(cache.active).sum()) * config.num_layers * window_bytes_per_sequence(config)
    return CacheBytes(pages, references, pages * per_page + windows, references * per_page + windows)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_loops: int


OURO_1_4B = ModelShape("Ouro-1.4B", num_layers=24, num_kv_heads=16, head_dim=128, num_loops=4)
OURO_2_6B = ModelShape("Ouro-2.6B", num_layers=48, num_kv_heads=16, head_dim=128, num_loops=4)


def config_for(model: ModelShape, **overrides) -> CacheConfig:
    """FlashLoop-default :class:`CacheConfig` for ``model`` (pool sizes are placeholders)."""
    arguments = dict(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        num_pages=1, max_sequences=1, max_pages_per_sequence=1, num_loops=model.num_loops,
    )
    arguments.update(overrides)
    return CacheConfig.flashloop(**arguments)


def sharing_table(model: ModelShape, sequences: int = 64, prefix_tokens: int = 4096,
                  own_tokens: tuple[int, ...] = (0, 1024), **overrides) -> str:
    """Markdown: the memory of ``sequences`` sequences sharing a ``prefix_tokens``-token prompt.

    One row per entry of ``own_tokens`` (each sequence's tokens after the
    prompt): GiB with every sequence holding its own copy of the prompt's
    pages, GiB with them shared (:func:`shared_prefix_bytes`), and the BF16
    cache of every loop for comparison. All layers, windows included.
    """
    config = config_for(model, **overrides)
    lines = [
        f"| {model.name}, {sequences} sequences, {prefix_tokens:,}-token shared prompt | own tokens each "
        "| no sharing | sharing | saved | BF16, every loop |",
        "|---|---|---|---|---|---|",
    ]
    for own in own_tokens:
        alone = shared_prefix_bytes(config, sequences, prefix_tokens, own, shared=False)
        shared = shared_prefix_bytes(config, sequences, prefix_tokens, own)
        bf16 = sequences * (prefix_tokens + own) * config.num_layers * unquantized_bytes_per_token(config)
        lines.append(f"| | {own:,} | {alone / 2**30:.2f} GiB | {shared / 2**30:.2f} GiB | "
                     f"{alone / shared:.2f}x | {bf16 / 2**30:.1f} GiB |")
    return "\n".join(lines)


def tokens_that_fit(config: CacheConfig, gibibytes: float, sequences: int = 1) -> int:
    """Tokens (summed over ``sequences`` sequences) whose cache fits in ``gibibytes``.

    Counts whole pages plus each sequence's fixed windows, over all layers.
    """
    budget = gibibytes * 2**30 - sequences * config.num_layers * window_bytes_per_sequence(config)
    if budget <= 0:
        return 0
    pages = int(budget // pool_page_bytes(config))
    return pages * config.page_size


def storage_table(model: ModelShape, context_tokens: int = 32768, **overrides) -> str:
    """A markdown table: bytes per token for ``model`` in BF16 vs the default cache."""
    config = config_for(model, **overrides)
    bf16 = unquantized_bytes_per_token(config) * config.num_layers
    pages = page_bytes(config)
    lines = [
        f"| {model.name}, {model.num_loops} loops, all {model.num_layers} layers | bytes/token | vs BF16 |",
        "|---|---|---|",
        f"| BF16, every loop | {bf16:,.0f} | 1.00x |",
    ]
    for index, storage in enumerate(config.loops):
        per_token = pages.loops[index] / config.page_size * config.num_layers
        kind = _describe(storage, config.page_size)
        lines.append(f"| loop {index}: {kind} | {per_token:,.1f} | |")
    full = bytes_per_token(config) * config.num_layers
    lines.append(f"| **jflashloop, full pages** | **{full:,.1f}** | **{bf16 / full:.2f}x** |")
    with_windows = sequence_bytes(config, context_tokens) / context_tokens
    lines.append(
        f"| jflashloop incl. windows at {context_tokens:,} tokens | {with_windows:,.1f} | "
        f"{bf16 / with_windows:.2f}x |"
    )
    return "\n".join(lines)


def _describe(storage: LoopStorage, page_size: int) -> str:
    def spec_name(spec):
        return f"{spec.format.upper()} {spec.axis} G{spec.group_size}"

    what = f"K {spec_name(storage.key_spec)}, V {spec_name(storage.value_spec)}"
    if storage.prediction is not None:
        if storage.sparse_rows_per_page == 0:
            return "predicted from the loop before (no rows stored)"
        what += ", against a prediction from the loop before"
    if storage.is_sparse:
        share = storage.sparse_rows_per_page / page_size
        return f"sparse residual {storage.sparse_rows_per_page}/{page_size} rows ({share:.1%}), {what}"
    return f"stored on its own (direct), {what}" if storage.direct else what


def describe_windows(config: CacheConfig) -> str:
    """One line on what the unquantized windows cost per sequence."""
    per_sequence = window_bytes_per_sequence(config) * config.num_layers
    equivalent = per_sequence / (bytes_per_token(config) * config.num_layers)
    return (
        f"windows: {config.sink_tokens} sink + {config.window_tokens} ring tokens x {config.num_loops} loops "
        f"in {config.window_dtype} = {per_sequence / 2**20:.2f} MiB per sequence "
        f"(as much as {math.ceil(equivalent):,} packed tokens)"
    )
