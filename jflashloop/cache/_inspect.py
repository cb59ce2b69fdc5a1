"""Reading a cache back on the host side: reconstruction, error flags, consistency checks.

* :func:`reconstruct`: the reference decode of one sequence's K/V to dense
  float32 (what attention must see), and :func:`sequence_regions`, where
  each of its positions is read from (``jflashloop.cache._regions``);
* :func:`check`: raise the error flags that ``jit`` could only set;
* :func:`validate`: check the whole structure (after loading or a transfer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import CacheStateError
from .._validation import check_index, check_static_index
from ._config import CacheConfig
from ._layout import (
    ERROR_NONFINITE_INPUT,
    ERROR_OUT_OF_PAGES,
    ERROR_SATURATED,
    ERROR_TEXT,
    WARNING_BITS,
    PagedKVCache,
)
from ._pages import unpack_pages
from ._regions import regions, ring_slot, stored_pages, visible_tokens
from ._state import create


def _sequence_view(cache: PagedKVCache, slot: jax.Array, include_pending: bool):
    """``(index, visible, regions)`` of ``slot`` for :func:`reconstruct` and attention.

    ``index`` is ``slot`` clipped into range; a ``slot`` outside ``[0,
    max_sequences)`` (a tracer under ``jit``) sees nothing: ``visible`` 0 and
    every region empty, so it never reads another slot.
    """
    c = cache.config
    positions = c.max_tokens_per_sequence + int(include_pending)
    index = jnp.clip(slot, 0, c.max_sequences - 1)
    inside = (slot >= 0) & (slot < c.max_sequences)
    visible = jnp.where(inside, visible_tokens(cache, include_pending=include_pending)[index], 0)
    masks = regions(c, cache.lengths[index], visible, stored_pages(cache)[index]).masks(positions)
    return index, visible, masks


def sequence_regions(
    cache: PagedKVCache, slot: jax.Array | int, *, include_pending: bool = False
) -> dict[str, jax.Array]:
    """The region masks (``jflashloop.cache._regions``) of sequence ``slot``, as :func:`reconstruct` reads it.

    Returns:
      bool ``[positions]`` masks ``sink``, ``ring`` and ``pages``, with
      ``positions = max_tokens_per_sequence + include_pending``; attention
      attends exactly to their union. All empty for an inactive slot and,
      under ``jit``, for a slot outside ``[0, max_sequences)``.
    """
    check_index("slot", slot, cache.config.max_sequences)
    return _sequence_view(cache, jnp.asarray(slot, jnp.int32), include_pending)[2]


def reconstruct(
    cache: PagedKVCache, layer: int, loop: int, slot: jax.Array | int, *, include_pending: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference decode of one sequence's loop-``loop`` K/V to dense float32.

    Args:
      layer, loop: 0-based Python ints.
      slot: the sequence slot, in ``[0, max_sequences)`` (checked when
        concrete; under ``jit`` a slot out of range reads as an empty slot:
        ``visible`` 0 and zeros).
      include_pending: also show the token written by :func:`write_token` and
        not yet committed.
    Returns:
      ``(keys, values, visible)``: float32 ``[positions, kv_heads, head_dim]``
      with ``positions = max_tokens + include_pending`` (zero beyond
      ``visible`` and at positions lost with a page, see
      :func:`sequence_regions`) and the int32 number of visible tokens
      (:func:`visible_tokens`: 0 for an inactive slot, at most
      ``max_tokens_per_sequence``, so the last position is zero when
      ``include_pending``).
    """
    c = cache.config
    check_static_index("layer", layer, c.num_layers)
    check_static_index("loop", loop, c.num_loops)
    check_index("slot", slot, c.max_sequences)
    return _reconstruct(cache, layer, loop, jnp.asarray(slot, jnp.int32), include_pending)


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _reconstruct(cache: PagedKVCache, layer: int, loop: int, slot: jax.Array, include_pending: bool):
    """:func:`reconstruct` after its argument checks, compiled (eager calls stay fast)."""
    c = cache.config
    pool = cache.layers[layer]
    slot, visible, masks = _sequence_view(cache, slot, include_pending)
    pages = jnp.maximum(cache.block_tables[slot], 0)  # -1 (lost) entries are masked out below
    tiles = tuple(loop_tiles.take(pages) for loop_tiles in pool.loops)
    page_keys, page_values = unpack_pages(tiles, loop, c.layer(layer))
    positions = c.max_tokens_per_sequence + int(include_pending)
    shape = (c.max_tokens_per_sequence, c.num_kv_heads, c.head_dim)
    page_keys, page_values = page_keys.reshape(shape), page_values.reshape(shape)
    if include_pending:  # the shape callers rely on (a full sequence drops its pending token)
        page_keys = jnp.pad(page_keys, ((0, 1), (0, 0), (0, 0)))
        page_values = jnp.pad(page_values, ((0, 1), (0, 0), (0, 0)))
    shape = (positions, c.num_kv_heads, c.head_dim)
    t = jnp.arange(positions)
    ring_k = pool.ring_keys[loop, slot][:, ring_slot(c, t)].transpose(1, 0, 2).astype(jnp.float32)
    ring_v = pool.ring_values[loop, slot][:, ring_slot(c, t)].transpose(1, 0, 2).astype(jnp.float32)
    sink_index = jnp.minimum(t, max(c.sink_tokens - 1, 0))
    if c.sink_tokens:
        sink_k = pool.sink_keys[loop, slot][:, sink_index].transpose(1, 0, 2).astype(jnp.float32)
        sink_v = pool.sink_values[loop, slot][:, sink_index].transpose(1, 0, 2).astype(jnp.float32)
    else:
        sink_k = sink_v = jnp.zeros(shape, jnp.float32)

    def combine(sink, ring, paged):
        out = jnp.where(masks["pages"][:, None, None], paged, 0.0)
        out = jnp.where(masks["ring"][:, None, None], ring, out)
        return jnp.where(masks["sink"][:, None, None], sink, out)

    return combine(sink_k, ring_k, page_keys), combine(sink_v, ring_v, page_values), visible


def check(cache: PagedKVCache, *, allow_saturation: bool = True) -> None:
    """Raise ``RuntimeError`` on the host if any sequence has an error flag set.

    Args:
      allow_saturation: when False, ``ERROR_SATURATED`` (values stored at their
        format's limit, see ``saturation_counts``) raises too.
    """
    flags = np.asarray(cache.error_flags)
    ignored = WARNING_BITS if allow_saturation else 0
    messages = []
    for slot in np.flatnonzero(flags & ~ignored):
        reasons = [text for bit, text in ERROR_TEXT.items() if flags[slot] & bit & ~ignored]
        counts = []
        if flags[slot] & ERROR_NONFINITE_INPUT:
            counts.append(f"nonfinite_counts={int(cache.nonfinite_counts[slot])}")
        if flags[slot] & ERROR_SATURATED & ~ignored:
            counts.append(f"saturation_counts={int(cache.saturation_counts[slot])}")
        suffix = f" ({', '.join(counts)})" if counts else ""
        messages.append(f"sequence slot {slot}: " + "; ".join(reasons) + suffix)
    if messages:
        raise RuntimeError("PagedKVCache errors: " + " | ".join(messages))


@functools.lru_cache(maxsize=64)
def _expected_leaf_shapes(config: CacheConfig) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    """``(keystr path, shape, dtype)`` of every array of an empty cache of ``config``, in pytree order
    (worked out once per config: tracing ``create`` costs more than the checks that use it)."""
    template = jax.eval_shape(lambda: create(config))
    leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    return tuple((jax.tree_util.keystr(path), tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in leaves)


def structure_problems(cache: PagedKVCache) -> list[str]:
    """Every array of ``cache`` whose shape or dtype differs from what its config implies."""
    expected = {name: (shape, dtype) for name, shape, dtype in _expected_leaf_shapes(cache.config)}
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    actual = {jax.tree_util.keystr(path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in leaves}
    problems = [f"missing array {name}" for name in expected if name not in actual]
    problems += [f"unexpected array {name}" for name in actual if name not in expected]
    for name, (shape, dtype) in expected.items():
        if name in actual and actual[name] != (shape, dtype):
            problems.append(f"{name} must be {dtype} {shape}, got {actual[name][1]} {actual[name][0]}")
    return problems


def bookkeeping_problems(cache: PagedKVCache) -> list[str]:
    """Host-side consistency of block tables, free list, lengths, flags and sparse rows.

    Returns a list of human-readable problems (empty when consistent).
    """
    c = cache.config
    tables = np.asarray(cache.block_tables)
    lengths = np.asarray(cache.lengths)
    active = np.asarray(cache.active)
    page_refs = np.asarray(cache.page_refs)
    flags = np.asarray(cache.error_flags)
    problems = []
    outside = (tables < -1) | (tables >= c.num_pages)
    for slot, column in zip(*np.nonzero(outside), strict=True):
        problems.append(
            f"block_tables[{slot}, {column}] = {tables[slot, column]} is outside the pool [0, {c.num_pages}) and not -1"
        )
    owners: dict[int, list[tuple[int, int]]] = {}
    for slot, column in zip(*np.nonzero((tables >= 0) & ~outside), strict=True):
        owners.setdefault(int(tables[slot, column]), []).append((int(slot), int(column)))
    for page, places in owners.items():
        slots = [slot for slot, _ in places]
        if len(set(slots)) < len(slots):
            problems.append(f"page {page} is held more than once by one sequence, at (slot, column) {places}")
        if len({column for _, column in places}) > 1:
            problems.append(f"page {page} is shared at different block-table columns {places} (a page holds "
                            "the positions of one column)")
        if page_refs[page] != len(places):
            problems.append(f"page {page} is held by block_tables at (slot, column) {places} but "
                            f"page_refs[{page}] = {page_refs[page]}")
    for page in np.flatnonzero(page_refs != 0):
        if int(page) not in owners:
            problems.append(f"page {page} has page_refs[{page}] = {page_refs[page]} but no block table holds it")
    for slot in range(c.max_sequences):
        held = np.flatnonzero(tables[slot] >= 0)
        if not active[slot]:
            if held.size:
                problems.append(f"inactive slot {slot} holds pages {tables[slot, held].tolist()}")
            if lengths[slot]:
                problems.append(f"inactive slot {slot} has length {lengths[slot]} (must be 0)")
            continue
        if not 0 <= lengths[slot] <= c.max_tokens_per_sequence:
            problems.append(
                f"lengths[{slot}] = {lengths[slot]} is outside [0, max_tokens_per_sequence="
                f"{c.max_tokens_per_sequence}]"
            )
            continue
        full_pages = int(lengths[slot]) // c.page_size
        beyond = held[held >= full_pages]
        if beyond.size:
            problems.append(
                f"slot {slot} holds pages at block-table columns {beyond.tolist()} beyond its "
                f"{full_pages} full page(s) (length {lengths[slot]})"
            )
        missing = [column for column in range(full_pages) if tables[slot, column] < 0]
        after = held[held > missing[0]] if missing else held[:0]
        if after.size:
            problems.append(
                f"slot {slot} holds pages at block-table columns {after.tolist()} after its lost page at "
                f"column {missing[0]} (no page is stored after a lost one)"
            )
        if missing and not flags[slot] & ERROR_OUT_OF_PAGES:
            problems.append(
                f"slot {slot} (length {lengths[slot]}) has no page at block-table columns {missing} "
                "and no ERROR_OUT_OF_PAGES flag"
            )
    for layer_index, layer in enumerate(cache.layers):
        for loop_index, loop_tiles in enumerate(layer.loops):
            if loop_tiles.row_positions is None:
                continue
            positions = np.asarray(loop_tiles.row_positions)[:, sorted(owners)].astype(np.int32)
            if ((positions < -1) | (positions >= c.page_size)).any():
                problems.append(
                    f"layers[{layer_index}].loops[{loop_index}].row_positions of used pages must be "
                    f"in [-1, page_size={c.page_size})"
                )
            used = np.where(positions < 0, c.page_size + 1, positions)
            if (np.diff(used, axis=-1) <= 0).any():
                problems.append(
                    f"layers[{layer_index}].loops[{loop_index}].row_positions of used pages must be "
                    "strictly increasing, with unused rows (-1) last"
                )
    return problems


def validate(cache: PagedKVCache) -> None:
    """Check on the host that ``cache`` is internally consistent (after loading or transfer).

    Checks: every array has the shape and dtype its config implies; block
    tables hold -1 or page ids inside the pool; ``page_refs`` counts each
    page's block-table entries exactly (a shared page sits at the same
    column of every row that holds it, and at most once per row);
    lengths are within capacity; an active sequence holds a page for each of
    its full pages (unless flagged ``ERROR_OUT_OF_PAGES``; then none after
    the first lost one) and none beyond;
    inactive slots hold no pages and length 0; sparse row positions of used
    pages are in range and increasing.

    Raises:
      CacheStateError: listing every problem found.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    problems = structure_problems(cache)
    if not problems:
        problems = bookkeeping_problems(cache)
    if problems:
        shown = problems[:20]
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise CacheStateError("inconsistent PagedKVCache: " + "; ".join(shown) + more)
