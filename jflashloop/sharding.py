"""The paged cache and decode attention on a ``jax.sharding.Mesh``.

Two mesh axes (names configurable):

* ``"data"`` splits the sequences: each data shard owns ``max_sequences / D``
  sequence slots **and its own pool** of ``num_pages / D`` pages. Block
  tables hold shard-local page ids, so a sequence never points into another
  shard's pool.
* ``"model"`` splits the KV heads (and with them their pages, metadata and
  window tokens, and the query heads of their GQA groups): each model shard
  holds ``num_kv_heads / M`` heads of every page.

Every operation runs the single-device code on each shard's local cache
through ``jax.shard_map`` (the fused Pallas kernel on GPU runs per shard), so
nothing is gathered: attention compiles to no collective at all; ``prefill``
and ``append`` contain one all-reduce over the model axis of a few int32 per
sequence (the error flags and the NaN/saturation counters, which any head
may raise), and ``prefill`` reads the replicated prompt. Per-page
quantization groups and NVFP4 tensor scales are per (page, KV head) tile,
which is what makes the head split free of cross-device reductions.

The global :class:`~jflashloop.PagedKVCache` returned by :func:`create`
carries the *global* :class:`~jflashloop.CacheConfig` (total pages, total
sequences, all heads); :func:`local_config` gives the per-shard one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import paged_cache
from .cache._config import CacheConfig
from .ops._decode_attention import decode_attention
from .paged_cache import PagedKVCache


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Names of the mesh axes that split sequences and KV heads."""

    data: str = "data"
    model: str = "model"


def _axis_size(mesh: Mesh, name: str) -> int:
    return mesh.shape[name] if name in mesh.shape else 1


def local_config(config: CacheConfig, mesh: Mesh, axes: MeshAxes = MeshAxes()) -> CacheConfig:
    """The configuration each shard sees; raises ``ValueError`` when a size does not divide."""
    data, model = _axis_size(mesh, axes.data), _axis_size(mesh, axes.model)
    for what, value, size, axis in (
        ("num_kv_heads", config.num_kv_heads, model, axes.model),
        ("max_sequences", config.max_sequences, data, axes.data),
        ("num_pages", config.num_pages, data, axes.data),
    ):
        if value % size:
            raise ValueError(
                f"CacheConfig.{what}={value} must be divisible by the size of mesh axis "
                f"{axis!r} ({size})"
            )
    heads = config.num_kv_heads // model
    return dataclasses.replace(
        config,
        loops=_local_loops(config.loops, heads, axes),
        layer_loops=None if config.layer_loops is None else tuple(
            _local_loops(loops, heads, axes) for loops in config.layer_loops),
        num_kv_heads=heads,
        max_sequences=config.max_sequences // data,
        num_pages=config.num_pages // data,
    )


def _local_spec(spec, heads: int, axes: MeshAxes):
    """A fitted format's spec for a shard of ``heads`` kv heads: its table cut to ``heads`` rows, which every shard
    shares (one static spec runs on every shard), so the heads' rows must be equal."""
    if spec.fitted_table is None or len(spec.fitted_table[1]) == heads:
        return spec
    name, table = spec.fitted_table
    if len(set(table)) != 1:
        raise ValueError(f"a {spec.format} codec fitted per kv head cannot be split over mesh axis {axes.model!r}: "
                         f"every shard runs one static spec, so its heads' {name} rows must be equal")
    return spec.for_heads(0, heads)


def _local_prediction(prediction, heads: int, axes: MeshAxes):
    """A loop's prediction for a shard of ``heads`` kv heads, under the same rule as :func:`_local_spec`."""
    if prediction is None or prediction.num_kv_heads == heads:
        return prediction
    if not prediction.same_for_every_head:
        raise ValueError(f"a loop prediction fitted per kv head cannot be split over mesh axis {axes.model!r}: "
                         "every shard runs one static config, so its heads' tables must be equal")
    return prediction.for_heads(0, heads)


def _local_loops(loops, heads: int, axes: MeshAxes):
    return tuple(dataclasses.replace(loop, key_spec=_local_spec(loop.key_spec, heads, axes),
                                     value_spec=_local_spec(loop.value_spec, heads, axes),
                                     prediction=_local_prediction(loop.prediction, heads, axes)) for loop in loops)


def cache_partition_specs(cache: PagedKVCache, axes: MeshAxes = MeshAxes()):
    """A pytree of ``PartitionSpec`` matching ``cache`` (pool split by heads and pages)."""
    d, m = axes.data, axes.model

    def pool_spec(leaf):  # [heads, pages, ...]
        return P(m, d, *([None] * (leaf.ndim - 2)))

    def layer_specs(layer: paged_cache.LayerPool):
        window = P(None, d, m, None, None)  # [loops, sequences, heads, tokens, D]
        return dataclasses.replace(
            layer,
            loops=jax.tree.map(pool_spec, layer.loops),
            sink_keys=window, sink_values=window, ring_keys=window, ring_values=window,
        )

    per_sequence = {}
    for field in dataclasses.fields(cache):
        value = getattr(cache, field.name)
        if field.name in ("layers", "config"):
            continue
        if field.name == "block_tables":
            per_sequence[field.name] = P(d, None)
        elif field.name == "page_refs":
            per_sequence[field.name] = P(d)
        elif value.shape[:1] == (cache.config.max_sequences,) and value.ndim == 1:
            per_sequence[field.name] = P(d)
        else:
            raise ValueError(f"no sharding rule for PagedKVCache.{field.name} of shape {value.shape}")
    return dataclasses.replace(
        cache, layers=tuple(layer_specs(layer) for layer in cache.layers), **per_sequence
    )


def cache_shardings(cache: PagedKVCache, mesh: Mesh, axes: MeshAxes = MeshAxes()):
    """``NamedSharding`` for every leaf of ``cache``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_partition_specs(cache, axes),
                        is_leaf=lambda x: isinstance(x, P))


@functools.cache
def _template(config: CacheConfig) -> PagedKVCache:
    """The shapes and dtypes of an empty cache of ``config`` (traced once per config)."""
    return jax.eval_shape(lambda: paged_cache.create(config))


def create(config: CacheConfig, mesh: Mesh, axes: MeshAxes = MeshAxes()) -> PagedKVCache:
    """An empty sharded cache: the global arrays, each placed on its shards."""
    local_config(config, mesh, axes)  # validates divisibility
    template = _template(config)
    shardings = cache_shardings(template, mesh, axes)
    return jax.jit(lambda: paged_cache.create(config), out_shardings=shardings)()


def _with_config(cache: PagedKVCache, config: CacheConfig) -> PagedKVCache:
    return dataclasses.replace(cache, config=config)


_COUNTER_FIELDS = ("nonfinite_counts", "saturation_counts")
_FLAG_BITS = 16


def _combine_over_heads(before: PagedKVCache, after: PagedKVCache, mesh: Mesh, axes: MeshAxes) -> PagedKVCache:
    """Merge what each model shard's heads flagged or counted for a sequence.

    Flag bits are OR-ed and counter increments summed over the model axis:
    one all-reduce of ``[sequences, 16 + 2]`` int32 per call (the only
    collective of prefill and append, and only when heads are split).
    """
    if _axis_size(mesh, axes.model) == 1:
        return after
    bits = jnp.arange(_FLAG_BITS, dtype=jnp.int32)
    flags = (after.error_flags[:, None] >> bits) & 1
    increments = [getattr(after, f) - getattr(before, f) for f in _COUNTER_FIELDS if hasattr(after, f)]
    total = jax.lax.psum(jnp.concatenate([flags, *[i[:, None] for i in increments]], axis=1), axes.model)
    merged_flags = jnp.sum(jnp.where(total[:, :_FLAG_BITS] > 0, 1 << bits, 0), axis=1).astype(jnp.int32)
    counters = {
        f: getattr(before, f) + total[:, _FLAG_BITS + i]
        for i, f in enumerate(f for f in _COUNTER_FIELDS if hasattr(after, f))
    }
    return dataclasses.replace(after, error_flags=merged_flags, **counters)


def _shard_mapped(function, mesh, in_specs, out_specs):
    return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.cache
def _prefill_function(mesh, local, global_config, axes, implementation):
    template = _template(global_config)
    specs = cache_partition_specs(template, axes)
    kv_spec = P(None, None, None, axes.model, None)

    def body(cache, slot, keys, values, length):
        cache = _with_config(cache, local)
        shard = jax.lax.axis_index(axes.data) if axes.data in mesh.shape else 0
        owner = slot // local.max_sequences
        updated = jax.lax.cond(
            owner == shard,
            lambda c: paged_cache.prefill(c, slot % local.max_sequences, keys, values, length,
                                          implementation=implementation),
            lambda c: c,
            cache,
        )
        return _with_config(_combine_over_heads(cache, updated, mesh, axes), global_config)

    return jax.jit(_shard_mapped(body, mesh, (specs, P(), kv_spec, kv_spec, P()), specs), donate_argnums=0)


def prefill(cache: PagedKVCache, mesh: Mesh, slot: int | jax.Array, keys, values, length=None, *,
            axes: MeshAxes = MeshAxes(), implementation: str | None = None) -> PagedKVCache:
    """Sharded :func:`jflashloop.paged_cache.prefill` of global sequence ``slot``.

    ``keys``/``values`` ``[layers, loops, tokens, kv_heads, D]`` are split over
    heads on the model axis; only the data shard owning ``slot`` changes. The
    cache is donated.
    """
    if not 0 <= int(slot) < cache.config.max_sequences:
        raise ValueError(f"slot must be in [0, {cache.config.max_sequences}), got {slot}")
    local = local_config(cache.config, mesh, axes)
    tokens = keys.shape[2]
    length = jnp.asarray(tokens if length is None else length, jnp.int32)
    run = _prefill_function(mesh, local, cache.config, axes, implementation)
    return run(cache, jnp.asarray(slot, jnp.int32), keys, values, length)


@functools.cache
def _fork_function(mesh, local, global_config, axes, whole):
    template = _template(global_config)
    specs = cache_partition_specs(template, axes)

    def body(cache, source, target, tokens):
        cache = _with_config(cache, local)
        shard = jax.lax.axis_index(axes.data) if axes.data in mesh.shape else 0
        updated = jax.lax.cond(
            source // local.max_sequences == shard,
            lambda c: paged_cache.fork(c, source % local.max_sequences, target % local.max_sequences,
                                       None if whole else tokens),
            lambda c: c,
            cache,
        )
        return _with_config(updated, global_config)

    return jax.jit(_shard_mapped(body, mesh, (specs, P(), P(), P()), specs), donate_argnums=0)


def fork(cache: PagedKVCache, mesh: Mesh, source_slot: int, target_slot: int, tokens=None, *,
         axes: MeshAxes = MeshAxes()) -> PagedKVCache:
    """Sharded :func:`jflashloop.paged_cache.fork` of global sequence slots (no communication).

    Both slots must belong to the same data shard (each shard has its own
    page pool; a page cannot be shared across pools). The cache is donated.

    Raises:
      ValueError: a slot out of range, or slots of different data shards.
    """
    local = local_config(cache.config, mesh, axes)
    for name, slot in (("source_slot", source_slot), ("target_slot", target_slot)):
        if not 0 <= int(slot) < cache.config.max_sequences:
            raise ValueError(f"{name} must be in [0, {cache.config.max_sequences}), got {slot}")
    source_shard, target_shard = int(source_slot) // local.max_sequences, int(target_slot) // local.max_sequences
    if source_shard != target_shard:
        raise ValueError(
            f"a fork stays within a data shard: slot {source_slot} is on data shard {source_shard}, "
            f"slot {target_slot} on {target_shard} ({local.max_sequences} slots per shard)"
        )
    run = _fork_function(mesh, local, cache.config, axes, tokens is None)
    return run(cache, jnp.asarray(source_slot, jnp.int32), jnp.asarray(target_slot, jnp.int32),
               jnp.asarray(0 if tokens is None else tokens, jnp.int32))


@functools.cache
def _append_function(mesh, local, global_config, axes, implementation):
    template = _template(global_config)
    specs = cache_partition_specs(template, axes)
    step_spec = P(None, None, axes.data, axes.model, None)

    def body(cache, keys, values):
        before = _with_config(cache, local)
        cache = paged_cache.append(before, keys, values, implementation=implementation)
        return _with_config(_combine_over_heads(before, cache, mesh, axes), global_config)

    return jax.jit(_shard_mapped(body, mesh, (specs, step_spec, step_spec), specs), donate_argnums=0)


def append(cache: PagedKVCache, mesh: Mesh, keys, values, *, axes: MeshAxes = MeshAxes(),
           implementation: str | None = None) -> PagedKVCache:
    """Sharded :func:`jflashloop.paged_cache.append`: no communication at all.

    ``keys``/``values`` ``[layers, loops, max_sequences, kv_heads, D]``, split
    over sequences (data axis) and heads (model axis). The cache is donated.
    """
    local = local_config(cache.config, mesh, axes)
    run = _append_function(mesh, local, cache.config, axes, implementation)
    return run(cache, keys, values)


@functools.cache
def _attention_function(mesh, local, global_config, axes, layer, loop, include_pending, implementation,
                        kernel_config):
    template = _template(global_config)
    specs = cache_partition_specs(template, axes)
    query_spec = P(axes.data, axes.model, None)

    def body(queries, cache):
        return decode_attention(
            queries, _with_config(cache, local), layer, loop, include_pending=include_pending,
            implementation=implementation, kernel_config=kernel_config,
        )

    return jax.jit(_shard_mapped(body, mesh, (query_spec, specs), query_spec))


def decode_attention_sharded(
    queries, cache: PagedKVCache, mesh: Mesh, layer: int, loop: int, *, axes: MeshAxes = MeshAxes(),
    include_pending: bool = True, implementation: str | None = None, kernel_config=None,
):
    """Sharded :func:`jflashloop.decode_attention`: each shard attends over its heads.

    ``queries`` ``[max_sequences, q_heads, D]`` are split over sequences and
    query heads (a KV head's GQA group stays on its shard). Returns float32
    ``[max_sequences, q_heads, D]`` with the same sharding.
    """
    local = local_config(cache.config, mesh, axes)
    q_heads = queries.shape[1]
    model = _axis_size(mesh, axes.model)
    if q_heads % model:
        raise ValueError(f"query heads ({q_heads}) must be divisible by the size of mesh axis "
                         f"{axes.model!r} ({model})")
    run = _attention_function(mesh, local, cache.config, axes, layer, loop, include_pending, implementation,
                              kernel_config)
    return run(queries, cache)


def reconstruct(cache: PagedKVCache, mesh: Mesh, layer: int, loop: int, slot: int, *,
                axes: MeshAxes = MeshAxes()):
    """Dense float32 K/V of global sequence ``slot`` (host-side reference; gathers one sequence)."""
    local = local_config(cache.config, mesh, axes)
    data = _axis_size(mesh, axes.data)
    model = _axis_size(mesh, axes.model)
    shard, local_slot = divmod(int(slot), local.max_sequences)
    host = jax.device_get(cache)
    keys_parts, values_parts = [], []
    for head_shard in range(model):
        local_cache = _host_shard(host, local, data, model, shard, head_shard)
        k, v, visible = paged_cache.reconstruct(local_cache, layer, loop, local_slot)
        keys_parts.append(k)
        values_parts.append(v)
    return jnp.concatenate(keys_parts, axis=1), jnp.concatenate(values_parts, axis=1), visible


def _host_shard(cache: PagedKVCache, local: CacheConfig, data: int, model: int, data_index: int,
                model_index: int) -> PagedKVCache:
    """The local cache of shard (``data_index``, ``model_index``) cut out of host arrays."""
    specs = cache_partition_specs(cache)
    sizes = {"data": (data, data_index), "model": (model, model_index)}

    def cut(leaf, spec):
        index = []
        for dim, name in enumerate(tuple(spec) + (None,) * (leaf.ndim - len(spec))):
            if name is None:
                index.append(slice(None))
            else:
                count, which = sizes[name]
                width = leaf.shape[dim] // count
                index.append(slice(which * width, (which + 1) * width))
        return jnp.asarray(leaf[tuple(index)])

    cut_leaves = jax.tree.map(cut, cache, specs, is_leaf=lambda x: isinstance(x, P))
    return _with_config(cut_leaves, local)
