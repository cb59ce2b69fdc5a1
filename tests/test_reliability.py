"""Bad input gives a clear error or a documented, counted outcome.

``BAD_INPUTS`` is the table of ``docs/reliability.md``: every row is tried
here and must raise the listed exception with a message naming the argument
and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflashloop
from jflashloop import (
    CacheConfig,
    CacheStateError,
    LoopStorage,
    NonFiniteInputError,
    Packed,
    SaturationError,
    checked,
    paged_cache,
    persistence,
)
from jflashloop.apps.loops import policies as loop_policies
from jflashloop_pallas_kernels import decode_attention as pallas_decode
from jflashloop_pallas_kernels import nvfp4_pages
from jflashloop_triton_kernels import compile_check
from jflashloop_triton_kernels import decode_attention as gluon_decode
from jflashloop_triton_kernels import launch as gluon_launch

CONFIG = CacheConfig(
    num_layers=1, num_kv_heads=1, head_dim=16, num_pages=6, max_sequences=2, max_pages_per_sequence=3,
    page_size=16, recent_tokens=8,
    loops=(
        LoopStorage(jflashloop.CodecSpec("int4", "channel", 16), jflashloop.INT4_VALUES),
        LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 4),
    ),
)
TOKENS = 48  # = capacity
_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append)


def kv(tokens=TOKENS, seed=0, layout=None):
    rng = np.random.default_rng(seed)
    shape = layout or (1, 2, tokens, 1, 16)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


@functools.cache
def one_active_cache():
    """Slot 0 holds 20 tokens (1 page); slot 1 is free."""
    keys, values = kv()
    return _prefill(paged_cache.create(CONFIG), 0, keys, values, 20)


def x3(shape=(4, 2, 8), dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _tampered_packed():
    packed = jflashloop.encode(x3(), jflashloop.INT4_VALUES)
    return dataclasses.replace(packed, scale=packed.scale.astype(jnp.float32))


def _residual():
    return jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES)


def _prefill_eager(slot=1, length=20, tokens=TOKENS, cache=None, layout=None, dtype=np.float32):
    keys, values = kv(tokens, layout=layout)
    cache = one_active_cache() if cache is None else cache
    return paged_cache.prefill(cache, slot, keys.astype(dtype), values.astype(dtype), length)


def _with_inf(x):
    x = x.copy()
    x[0, 1, 7, 0, 3] = np.inf
    return x


def _queries(dtype):
    return jnp.ones((2, 2, 16), dtype)


def _corrupt(**changes):
    return dataclasses.replace(one_active_cache(), **changes)


def _saved(change=None) -> bytes:
    """``one_active_cache()`` in the file format, its prefix changed by ``change(bytearray)``."""
    data = bytearray(persistence.cache_to_bytes(one_active_cache()))
    if change:
        change(data)
    return bytes(data)


def _with_header(header_bytes: bytes) -> bytes:
    """A file with the given header bytes, under a valid checksum."""
    prefix = struct.pack("<8sIQ32s", persistence.MAGIC, persistence.FORMAT_VERSION, len(header_bytes),
                         hashlib.sha256(header_bytes).digest())
    return prefix + header_bytes + b"\0" * (-(len(prefix) + len(header_bytes)) % 64)


def _import_into_a_full_cache():
    bundle = persistence.export_pages(one_active_cache(), 0)
    return persistence.import_pages(_corrupt(page_refs=jnp.ones((6,), jnp.int32)), 1, bundle)


BAD_INPUTS = [
    # id, call, exception, message excerpt
    ("encode: rank 2", lambda: jflashloop.encode(jnp.ones((4, 8)), jflashloop.INT4_KEYS),
     ValueError, "x must have rank 3"),
    ("encode: empty axis", lambda: jflashloop.encode(jnp.ones((0, 2, 8)), jflashloop.INT4_KEYS),
     ValueError, "no empty axis"),
    ("encode: int32 input", lambda: jflashloop.encode(x3(dtype=jnp.int32), jflashloop.INT4_KEYS),
     TypeError, "float32, bfloat16 or float16"),
    ("encode: spec not a CodecSpec", lambda: jflashloop.encode(x3(), ("int4", "token", 64)),
     TypeError, "spec must be a CodecSpec"),
    ("encode: global_scale with INT4", lambda: jflashloop.encode(x3(), jflashloop.INT4_KEYS, global_scale=1.0),
     ValueError, "NVFP4 only"),
    ("encode: global_scale 0", lambda: jflashloop.encode(x3(), jflashloop.NVFP4, global_scale=0.0),
     ValueError, "finite positive float32 number >= 2\\*\\*-116"),
    ("encode: global_scale NaN", lambda: jflashloop.encode(x3(), jflashloop.NVFP4, global_scale=float("nan")),
     ValueError, "global_scale must be one finite"),
    ("encode: global_scale 2**-120", lambda: jflashloop.encode(x3(), jflashloop.NVFP4, global_scale=2.0**-120),
     ValueError, "2\\*\\*-116"),
    ("encode: global_scale 1e39 (inf as a float32)",
     lambda: jflashloop.encode(x3(), jflashloop.NVFP4, global_scale=1e39),
     ValueError, "global_scale must be one finite positive float32 number .* got 1e\\+39 \\(inf as a float32\\)"),
    ("encode: global_scale vector", lambda: jflashloop.encode(x3(), jflashloop.NVFP4, global_scale=np.ones(3)),
     ValueError, "global_scale must be a scalar"),
    ("encode: unknown implementation", lambda: jflashloop.encode(x3(), jflashloop.NVFP4, implementation="cuda"),
     ValueError, "implementation must be None, 'xla' or 'pallas'"),
    ("CacheConfig: int3 pages at head_dim 16",
     lambda: dataclasses.replace(CONFIG, loops=(LoopStorage(jflashloop.CodecSpec("int3", "channel", 16),
                                                            jflashloop.CodecSpec("int3", "token", 16)),)),
     ValueError, "int3 pages need head_dim divisible by 32"),
    ("CacheConfig: int3_lloyd_max pages at head_dim 16",
     lambda: dataclasses.replace(CONFIG, loops=(LoopStorage(jflashloop.int3_lloyd_max(16, 0),
                                                            jflashloop.int3_lloyd_max(16, 1)),)),
     ValueError, "int3_lloyd_max pages need head_dim divisible by 32"),
    ("CacheConfig: int2 pages at head_dim 8",
     lambda: dataclasses.replace(CONFIG, head_dim=8, loops=(LoopStorage(jflashloop.CodecSpec("int2", "channel", 16),
                                                                        jflashloop.CodecSpec("int2", "token", 8)),)),
     ValueError, "int2 pages need head_dim divisible by 16"),
    ("CacheConfig: float recent_tokens", lambda: dataclasses.replace(CONFIG, recent_tokens=3.5),
     TypeError, "CacheConfig.recent_tokens must be an int, got float 3.5"),
    ("CacheConfig: float sink_tokens", lambda: dataclasses.replace(CONFIG, sink_tokens=2.0),
     TypeError, "CacheConfig.sink_tokens must be an int, got float 2.0"),
    ("CacheConfig: float page_size", lambda: dataclasses.replace(CONFIG, page_size=16.0),
     TypeError, "CacheConfig.page_size must be an int, got float 16.0"),
    ("CacheConfig: bool recent_tokens", lambda: dataclasses.replace(CONFIG, recent_tokens=True),
     TypeError, "CacheConfig.recent_tokens must be an int, got bool True"),
    ("CacheConfig: a count beyond int32", lambda: dataclasses.replace(CONFIG, num_pages=2**31),
     ValueError, "CacheConfig.num_pages must be < 2\\*\\*31 \\(the cache indexes with int32\\), got 2147483648"),
    ("CacheConfig: float sparse_rows_per_page",
     lambda: dataclasses.replace(CONFIG, loops=(CONFIG.loops[0], LoopStorage(jflashloop.INT4_VALUES,
                                                                             jflashloop.INT4_VALUES, 3.5))),
     TypeError, "CacheConfig.loops\\[1\\].sparse_rows_per_page must be an int, got float 3.5"),
    ("CacheConfig: a loop that is not a LoopStorage",
     lambda: dataclasses.replace(CONFIG, loops=(CONFIG.loops[0], (jflashloop.INT4_VALUES,) * 2)),
     TypeError, "CacheConfig.loops\\[1\\] must be a LoopStorage, got tuple"),
    ("CacheConfig: layer_loops for another layer count",
     lambda: dataclasses.replace(CONFIG, layer_loops=(CONFIG.loops, CONFIG.loops)),
     ValueError, "CacheConfig.layer_loops must be None or a tuple of num_layers=1 tuples of LoopStorage"),
    ("CacheConfig: a layer with a sparse base",
     lambda: dataclasses.replace(CONFIG, layer_loops=((jflashloop.LoopStorage(jflashloop.INT4_VALUES,
                                                                             jflashloop.INT4_VALUES, 4),
                                                       CONFIG.loops[1]),)),
     ValueError, "CacheConfig.layer_loops\\[0\\]\\[0\\] \\(the base\\) must be dense"),
    ("CacheConfig: a sparse loop marked direct",
     lambda: dataclasses.replace(CONFIG, loops=(CONFIG.loops[0], dataclasses.replace(CONFIG.loops[1], direct=True))),
     ValueError, "CacheConfig.loops\\[1\\]: a direct loop is stored whole, so it must be dense"),
    ("CacheConfig: direct not a bool",
     lambda: dataclasses.replace(CONFIG, loops=(CONFIG.loops[0], dataclasses.replace(CONFIG.loops[0], direct=1))),
     TypeError, "CacheConfig.loops\\[1\\].direct must be a bool, got int"),
    ("CacheConfig.flashloop: a direct loop with one loop",
     lambda: CacheConfig.flashloop(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                                   max_pages_per_sequence=4, num_loops=1, direct_loop=True),
     ValueError, "direct_loop stores loop 1 on its own: it needs num_loops >= 2"),
    ("CacheConfig.compact_loops: one loop",
     lambda: CacheConfig.compact_loops(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=4, max_sequences=1,
                                       max_pages_per_sequence=4, num_loops=1),
     ValueError, "compact_loops stores a direct loop 1: it needs num_loops >= 2, got 1"),
    ("CodecSpec: NVFP4 on the channel axis", lambda: jflashloop.CodecSpec("nvfp4", "channel", 16),
     ValueError, "NVFP4 stores one E4M3 scale per 16"),
    ("CodecSpec: group_size 0", lambda: jflashloop.CodecSpec("int4", "token", 0),
     ValueError, "group_size must be >= 1"),
    ("decode: not a Packed", lambda: jflashloop.decode(np.zeros(4)), TypeError, "packed must be a Packed"),
    ("decode: int8 output dtype", lambda: jflashloop.decode(jflashloop.encode(x3(), jflashloop.NVFP4), jnp.int8),
     TypeError, "dtype must be float32, bfloat16 or float16"),
    ("decode: tampered metadata dtype", lambda: jflashloop.decode(_tampered_packed()),
     ValueError, "packed.scale must be float16"),
    ("encode_residual: shapes differ",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((9, 1, 8)), jflashloop.INT4_VALUES),
     ValueError, "must equal predecessor shape"),
    ("encode_residual: int predecessor",
     lambda: jflashloop.encode_residual(x3(), x3(dtype=jnp.int32), jflashloop.INT4_VALUES),
     TypeError, "predecessor must have dtype"),
    ("encode_residual: unsorted positions",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, np.array([3, 1])),
     ValueError, "sorted and unique"),
    ("encode_residual: duplicate positions",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, np.array([1, 1])),
     ValueError, "sorted and unique"),
    ("encode_residual: position out of range",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, np.array([0, 10])),
     ValueError, "positions must lie in \\[0, 10\\)"),
    ("encode_residual: empty positions",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, np.array([], np.int32)),
     ValueError, "positions must hold at least one position"),
    ("encode_residual: float positions",
     lambda: jflashloop.encode_residual(x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, np.array([0.5])),
     TypeError, "positions must be integers"),
    ("encode_residual: float positions under jit",
     lambda: jax.jit(jflashloop.encode_residual, static_argnums=2)(
         x3((10, 1, 8)), x3((10, 1, 8)), jflashloop.INT4_VALUES, jnp.array([0.5])),
     TypeError, "positions must be integers"),
    ("decode_residual: predecessor of another shape", lambda: jflashloop.decode_residual(_residual(), x3((10, 1, 4))),
     ValueError, "predecessor must have shape \\[tokens=10, kv_heads=1, channels=8\\]"),
    ("decode_residual: predecessor of another dtype",
     lambda: jflashloop.decode_residual(_residual(), x3((10, 1, 8), jnp.int32)),
     TypeError, "predecessor must have dtype"),
    ("encode_chain: loops of different shapes",
     lambda: jflashloop.encode_chain([x3(), x3((4, 2, 4))], jflashloop.INT4_KEYS, [jflashloop.INT4_VALUES], [None]),
     ValueError, "loops\\[1\\] has shape"),
    ("decode_loop: loop 1 of a one-loop chain", lambda: jflashloop.decode_loop(
        jflashloop.encode_chain([x3()], jflashloop.INT4_KEYS, [], []), 1), ValueError, "loop must be in \\[0, 1\\)"),
    ("prefill: wrong layout", lambda: _prefill_eager(layout=(1, 3, 20, 1, 16)),
     ValueError, "keys must be \\[layers=1, loops=2, tokens, kv_heads=1, head_dim=16\\]"),
    ("prefill: int keys", lambda: _prefill_eager(dtype=np.int32), TypeError, "keys must have a floating dtype"),
    ("prefill: slot out of range", lambda: _prefill_eager(slot=2), IndexError, "slot must be in \\[0, 2\\), got 2"),
    ("prefill: negative slot", lambda: _prefill_eager(slot=-1), IndexError, "slot must be in \\[0, 2\\), got -1"),
    ("prefill: float slot", lambda: _prefill_eager(slot=1.0), TypeError, "slot must be an int"),
    ("prefill: slot already active", lambda: _prefill_eager(slot=0), ValueError, "slot 0 is already active"),
    ("prefill: length > tokens", lambda: _prefill_eager(length=21, tokens=20),
     ValueError, "length must be in \\[0, tokens=20\\], got 21"),
    ("prefill: length < 0", lambda: _prefill_eager(length=-1), ValueError, "length must be in \\[0, tokens=48\\]"),
    ("prefill: longer than a sequence may be", lambda: _prefill_eager(length=49, tokens=64),
     ValueError, "exceeds the sequence capacity max_pages_per_sequence \\* page_size = 3 \\* 16 = 48"),
    ("prefill: not enough free pages",
     lambda: _prefill_eager(cache=_corrupt(page_refs=jnp.ones((6,), jnp.int32).at[5].set(0)), length=48),
     ValueError, "needs 3 free pages, the pool has 1"),
    ("append: wrong layout", lambda: paged_cache.append(one_active_cache(), *kv(layout=(1, 2, 1, 1, 16))),
     ValueError, "keys must be \\[layers=1, loops=2, max_sequences=2, kv_heads=1, head_dim=16\\]"),
    ("write_token: loop out of range",
     lambda: paged_cache.write_token(one_active_cache(), 0, 2, *kv(layout=(2, 1, 16))),
     IndexError, "loop must be in \\[0, 2\\), got 2"),
    ("reconstruct: slot out of range", lambda: paged_cache.reconstruct(one_active_cache(), 0, 0, 5),
     IndexError, "slot must be in \\[0, 2\\), got 5"),
    ("decode_attention: int queries", lambda: jflashloop.decode_attention(_queries(jnp.int32), one_active_cache(), 0, 0),
     TypeError, "queries must have a floating dtype \\(float32, bfloat16, float16\\), got int32"),
    ("decode_attention: bool queries", lambda: jflashloop.decode_attention(_queries(bool), one_active_cache(), 0, 0),
     TypeError, "queries must have a floating dtype .*got bool"),
    ("decode_attention: complex queries",
     lambda: jflashloop.decode_attention(_queries(jnp.complex64), one_active_cache(), 0, 0),
     TypeError, "queries must have a floating dtype .*got complex64"),
    ("decode_attention (fused): int queries",
     lambda: jflashloop.decode_attention(_queries(jnp.int32), one_active_cache(), 0, 0, implementation="pallas"),
     TypeError, "queries must have a floating dtype .*got int32"),
    ("codecs.rotation_matrix: a length that is not a power of two",
     lambda: jflashloop.codecs.rotation_matrix(None, 96), ValueError, "power-of-two length, got 96"),
    ("codecs.rotate_by_product: a length that is not a power of two",
     lambda: jflashloop.codecs.rotate_by_product(jnp.ones((2, 96)), 5), ValueError, "power-of-two length, got 96"),
    ("nvfp4_pages.to_page_order: int32 words",
     lambda: nvfp4_pages.to_page_order(jnp.zeros(4, jnp.int32)), TypeError, "must be uint32, got int32"),
    ("nvfp4_pages.from_page_order: int32 words",
     lambda: nvfp4_pages.from_page_order(np.zeros(4, np.int32)), TypeError, "must be uint32, got int32"),
    ("decode_attention: KernelConfig(target_programs=0)", lambda: pallas_decode.KernelConfig(target_programs=0),
     ValueError, "KernelConfig.target_programs must be >= 1, got 0"),
    ("launch.wave_fitted_splits: no splits", lambda: gluon_launch.wave_fitted_splits(304, 520, 0, sm_count=132),
     ValueError, "wave_fitted_splits needs positive sizes, got pairs=304, max_pages=520, splits=0"),
    ("launch.resident_programs: pages of no tokens", lambda: gluon_launch.resident_programs(page_size=0),
     ValueError, "resident_programs needs positive sizes, got head_dim=128, streams=1, stages=2, page_size=0, "
                 "value_group=64"),
    ("launch.resident_programs: a format the kernel does not read",
     lambda: gluon_launch.resident_programs(format="int8"), ValueError,
     "resident_programs reads 'int4', 'nvfp4' or 'int4_rotated' pages, got format='int8'"),
    ("launch.register_resident_programs: no registers", lambda: gluon_launch.register_resident_programs(0),
     ValueError, "register_resident_programs needs positive sizes, got registers=0, warps=1"),
    ("launch.shared_resident_programs: negative shared memory", lambda: gluon_launch.shared_resident_programs(-1),
     ValueError, "shared_resident_programs needs block_bytes >= 0, got -1"),
    ("launch.preferred_persistent_programs: no blocks an SM", lambda: gluon_launch.preferred_persistent_programs(
        format="int4", head_dim=128, streams=1, sparse_rows=(), stages=2, overlap=False, items=2112, sm_count=132,
        resident=0), ValueError, "preferred_persistent_programs needs resident >= 1, got 0"),
    ("decode_attention.preferred_merge: no partials", lambda: gluon_decode.preferred_merge(0, in_kernel=True),
     ValueError, "preferred_merge needs positive sizes, got slots=0, row_blocks=1"),
    ("compile_check.loop_instructions: PTX text instead of a cubin",
     lambda: compile_check.loop_instructions(b".version 8.4"), ValueError,
     "loop_instructions needs a cubin \\(an ELF image: CompiledKernel.asm\\['cubin'\\]\\), got b'.ver'"),
    ("free: slot out of range", lambda: paged_cache.free(one_active_cache(), 2), IndexError, "slot must be in"),
    ("validate: a page held twice, counted once",
     lambda: paged_cache.validate(_corrupt(
         block_tables=one_active_cache().block_tables.at[1, 0].set(one_active_cache().block_tables[0, 0]),
         active=jnp.array([True, True]), lengths=jnp.array([20, 16]))),
     CacheStateError, "held by block_tables at \\(slot, column\\) \\[\\(0, 0\\), \\(1, 0\\)\\] but page_refs\\[0\\] = 1"),
    ("validate: a page held twice by one sequence",
     lambda: paged_cache.validate(_corrupt(
         block_tables=one_active_cache().block_tables.at[0, 1].set(one_active_cache().block_tables[0, 0]),
         page_refs=one_active_cache().page_refs.at[0].set(2), lengths=jnp.array([40, 0]))),
     CacheStateError, "is held more than once by one sequence"),
    ("validate: a page shared at different columns",
     lambda: paged_cache.validate(_corrupt(
         block_tables=one_active_cache().block_tables.at[1, 0].set(5).at[1, 1].set(0),
         page_refs=one_active_cache().page_refs.at[0].set(2).at[5].set(1), active=jnp.array([True, True]),
         lengths=jnp.array([20, 32]))),
     CacheStateError, "is shared at different block-table columns"),
    ("fork: the same slot twice", lambda: paged_cache.fork(one_active_cache(), 0, 0), ValueError,
     "source_slot and target_slot must differ, got 0 twice"),
    ("fork: an inactive source", lambda: paged_cache.fork(one_active_cache(), 1, 0), ValueError,
     "source_slot 1 holds no sequence"),
    ("fork: an active target",
     lambda: paged_cache.fork(_corrupt(active=jnp.array([True, True]), lengths=jnp.array([20, 16])), 0, 1),
     ValueError, "target_slot 1 is already active \\(it holds 16 tokens\\)"),
    ("fork: tokens beyond the source", lambda: paged_cache.fork(one_active_cache(), 0, 1, 21), ValueError,
     "tokens must be in \\[0, lengths\\[0\\]=20\\], got 21"),
    ("validate: block-table entry outside the pool",
     lambda: paged_cache.validate(_corrupt(block_tables=one_active_cache().block_tables.at[0, 0].set(6))),
     CacheStateError, "is outside the pool \\[0, 6\\)"),
    ("validate: page_refs disagrees with block tables",
     lambda: paged_cache.validate(_corrupt(page_refs=jnp.zeros((6,), jnp.int32))),
     CacheStateError, "held by block_tables at \\(slot, column\\) \\[\\(0, 0\\)\\] but page_refs\\[0\\] = 0"),
    ("validate: length beyond capacity",
     lambda: paged_cache.validate(_corrupt(lengths=jnp.array([49, 0]))),
     CacheStateError, "is outside \\[0, max_tokens_per_sequence=48\\]"),
    ("validate: inactive slot holding pages",
     lambda: paged_cache.validate(_corrupt(active=jnp.array([False, False]))),
     CacheStateError, "inactive slot 0 holds pages"),
    ("validate: wrong array dtype",
     lambda: paged_cache.validate(_corrupt(lengths=jnp.array([20, 0], jnp.float32))),
     CacheStateError, "lengths must be int32"),
    ("load: other format version", lambda: persistence.cache_from_bytes(_saved(lambda d: d.__setitem__(8, 2))),
     persistence.PersistenceError, "unsupported format version 2; this jflashloop reads version 1"),
    ("load: damaged header length",
     lambda: persistence.cache_from_bytes(_saved(lambda d: d.__setitem__(slice(12, 20), b"\xff" * 8))),
     persistence.PersistenceError, "file is truncated: expected 18446744073709551615 bytes of the header"),
    ("load: hand-built header without arrays", lambda: persistence.cache_from_bytes(_with_header(b"[]")),
     persistence.PersistenceError, "the header is a JSON list, not an object"),
    ("load: hand-built header with a mistyped field",
     lambda: persistence.cache_from_bytes(_with_header(json.dumps({
         "format": persistence.CACHE_FORMAT, "format_version": 1, "config": {}, "metadata": {},
         "data_nbytes": 0, "arrays": [{"name": ".lengths"}]}).encode())),
     persistence.PersistenceError, "arrays\\[0\\] must hold name, dtype, shape, offset, nbytes, sha256"),
    ("save: a path that is not str, bytes or os.PathLike", lambda: persistence.save(3, one_active_cache()),
     TypeError, "path must be a str, bytes or os.PathLike, got int"),
    ("import_pages: no room", _import_into_a_full_cache,
     persistence.PersistenceError, "the bundle needs 1 free pages, this cache has 0"),
    ("import_pages: other layout",
     lambda: persistence.import_pages(paged_cache.create(dataclasses.replace(CONFIG, recent_tokens=16)), 0,
                                      persistence.export_pages(one_active_cache(), 0)),
     persistence.PersistenceError, "the bundle's pages do not fit this cache's layout \\(recent_tokens: bundle 8 vs cache 16\\)"),
    ("checked.encode: NaN", lambda: checked.encode(x3().at[1, 0, 3].set(jnp.nan), jflashloop.INT4_KEYS),
     NonFiniteInputError, "x must be finite: 1 element\\(s\\) are NaN or \\+-inf, the first at index \\(1, 0, 3\\)"),
    ("checked.encode: INT4 metadata beyond float16",
     lambda: checked.encode(x3().at[0, 0, 0].set(1e6), jflashloop.INT4_VALUES),
     SaturationError, "float16 min or scale would exceed 65504"),
    ("checked.encode: global_scale 1e39",
     lambda: checked.encode(x3((4, 2, 16)), jflashloop.NVFP4, global_scale=1e39),
     ValueError, "global_scale must be one finite positive float32 number"),
    ("checked.encode: negative global_scale",
     lambda: checked.encode(x3((4, 2, 16)), jflashloop.NVFP4, global_scale=-1.0),
     ValueError, "global_scale must be one finite positive float32 number .* got -1.0"),
    ("checked.encode: int4_rotated beyond 2**64",
     lambda: checked.encode(x3((2, 1, 16)).at[0, 0, 3].set(1e38), jflashloop.int4_rotated(16)),
     SaturationError, "x: 1 element\\(s\\) would saturate \\(its magnitude is beyond int4_rotated's input limit 2\\*\\*64\\)"),
    ("checked.encode: NVFP4 beyond the given global scale",
     lambda: checked.encode(x3() * 100, jflashloop.NVFP4, global_scale=1e-3),
     SaturationError, "6 \\* 448 \\* global_scale"),
    ("checked.encode_residual: overflowing difference",
     lambda: checked.encode_residual(x3() * 3e38, x3() * -3e38, jflashloop.INT4_VALUES),
     SaturationError, "overflow float32"),
    ("checked.prefill: inf in the prompt",
     lambda: checked.prefill(paged_cache.create(CONFIG), 0, _with_inf(kv()[0]), kv()[1], 20),
     NonFiniteInputError, "keys must be finite"),
    ("checked.prefill: saturation",
     lambda: checked.prefill(paged_cache.create(CONFIG), 0, kv()[0] * np.float32(1e5), kv()[1], 20),
     SaturationError, "values would be stored at their format's limit in slot\\(s\\) \\{0: "),
    ("checked.append: wrong sequence count",
     lambda: checked.append(one_active_cache(), *kv(layout=(1, 2, 3, 1, 16))),
     ValueError, "keys must be \\[layers=1, loops=2, max_sequences=2, kv_heads=1, head_dim=16\\], got shape \\(1, 2, 3"),
    ("checked.append: nested lists", lambda: checked.append(one_active_cache(), *[x.tolist() for x in kv(layout=(1, 2, 2, 1, 16))]),
     TypeError, "keys must be an array \\[layers=1, loops=2, max_sequences=2, kv_heads=1, head_dim=16\\], got list"),
    ("checked.append: under jit", lambda: jax.jit(checked.append)(one_active_cache(), *kv(layout=(1, 2, 2, 1, 16))),
     TypeError, "checked.append: checked mode needs concrete arrays, but cache is traced"),
    ("checked.prefill: nested lists",
     lambda: checked.prefill(paged_cache.create(CONFIG), 0, *[x.tolist() for x in kv()], 20),
     TypeError, "keys must be an array \\[layers=1, loops=2, tokens, kv_heads=1, head_dim=16\\], got list"),
    ("checked.prefill: wrong layout", lambda: checked.prefill(paged_cache.create(CONFIG), 0, *kv(layout=(1, 3, 20, 1, 16))),
     ValueError, "keys must be \\[layers=1, loops=2, tokens, kv_heads=1, head_dim=16\\], got shape \\(1, 3, 20"),
    ("checked.prefill: under jit (a traced slot)",
     lambda: jax.jit(lambda slot: checked.prefill(one_active_cache(), slot, *kv(), 20))(1),
     TypeError, "checked.prefill: checked mode needs concrete arrays, but slot is traced"),
    ("checked.encode: under jit", lambda: jax.jit(lambda x: checked.encode(x, jflashloop.INT4_VALUES))(x3()),
     TypeError, "checked.encode: checked mode needs concrete arrays, but x is traced"),
    ("prefill: nested lists", lambda: paged_cache.prefill(paged_cache.create(CONFIG), 0, *[x.tolist() for x in kv()]),
     TypeError, "keys must be an array \\[layers=1, loops=2, tokens, kv_heads=1, head_dim=16\\], got list"),
    ("checked.append: full sequence",
     lambda: checked.append(_corrupt(lengths=jnp.array([48, 0]), block_tables=jnp.array([[0, 1, 2], [-1, -1, -1]]),
                                     page_refs=jnp.array([1] * 3 + [0] * 3, jnp.int32)),
                            *kv(layout=(1, 2, 2, 1, 16))),
     ValueError, "already hold max_pages_per_sequence \\* page_size = 48 tokens"),
    ("append_tokens: counts out of range",
     lambda: paged_cache.append_tokens(one_active_cache(), *kv(layout=(1, 2, 2, 3, 1, 16)), jnp.asarray([1, 4])),
     ValueError, "counts must be in \\[0, chunk=3\\], got counts\\[1\\] = 4"),
    ("append_tokens: no chunk axis",
     lambda: paged_cache.append_tokens(one_active_cache(), *kv(layout=(1, 2, 2, 1, 16)), jnp.asarray([1, 1])),
     ValueError, "keys must be \\[layers=1, loops=2, max_sequences=2, chunk, kv_heads=1, head_dim=16\\], "
                 "got shape \\(1, 2, 2, 1, 16\\)"),
    ("chunk_attention: another chunk length",
     lambda: jflashloop.chunk_attention(jnp.ones((2, 3, 1, 16)), one_active_cache(), 0, 0, jnp.ones((2, 2, 1, 16)),
                                        jnp.ones((2, 2, 1, 16)), jnp.asarray([1, 1])),
     ValueError, "keys must be \\[max_sequences, chunk, kv_heads, head_dim\\] = \\(2, 3, 1, 16\\), got \\(2, 2, 1, 16\\)"),
    ("allocation.allocate: a budget below the cheapest assignment",
     lambda: jflashloop.allocation.allocate(np.ones((2, 2)), np.array([4.5, 2.25]), 2.0),
     ValueError, "budget 2.0 is below the cheapest assignment, 2.2500 bits per element on average"),
    ("allocation.allocate: costs of another shape",
     lambda: jflashloop.allocation.allocate(np.ones((2, 3)), np.ones(4), 4.0),
     ValueError, "costs must be \\[candidates\\] or \\[layers, candidates\\] = \\(2, 3\\), got \\(4,\\)"),
    ("allocation.candidate_bits: context_tokens 0",
     lambda: jflashloop.allocation.candidate_bits(
         jflashloop.allocation.Candidate("int4", jflashloop.INT4_KEYS, jflashloop.INT4_VALUES),
         num_kv_heads=1, head_dim=64, context_tokens=0),
     ValueError, "context_tokens must be at least 1, got 0"),
    ("allocation.policy_from_json: another version",
     lambda: jflashloop.allocation.policy_from_json({"format": "jflashloop.layer_policy", "version": 9}),
     ValueError, "layer policy version 9 is not supported \\(this library reads version 1\\)"),
    ("allocation.policy_from_json: a layer's codec not a CodecSpec",
     lambda: jflashloop.allocation.policy_from_json({
         "format": "jflashloop.layer_policy", "version": 1, "name": "p", "sink_tokens": 4, "recent_tokens": 16,
         "page_size": 64, "layers": [{"keys": {"format": "int4", "axis": "channel", "group_size": 0},
                                      "values": {"format": "int4", "axis": "token", "group_size": 64}}]}),
     ValueError, "layers\\[0\\].keys is not a valid CodecSpec: CodecSpec.group_size must be >= 1, got 0"),
    ("SweepSettings: calibration_sequences 0",
     lambda: loop_policies.SweepSettings(calibration_sequences=0),
     ValueError, "calibration_sequences must be at least 1 \\(or None\\), got 0"),
    ("CodecSpec int_mixed: heads whose widths sum differently",
     lambda: jflashloop.CodecSpec("int_mixed", "channel", 64, channel_bits=[[4, 4], [4, 3]]),
     ValueError, "CodecSpec.channel_bits: every head's widths must sum to the same row width, got \\[8, 7\\]"),
    ("CodecSpec int4_scaled: a divisor of more than 9 significant bits",
     lambda: jflashloop.CodecSpec("int4_scaled", "token", 64, channel_scale=[[0.1]]),
     ValueError, "CodecSpec.channel_scale entries must have at most 9 significant bits "
                 "\\(jflashloop.codecs.round_channel_scales makes them\\), got 0.1"),
    ("encode: a fitted spec of other kv heads or channels",
     lambda: jflashloop.encode(jnp.zeros((2, 3, 4)), jflashloop.CodecSpec("int_mixed", "channel", 64,
                                                                          channel_bits=[[4] * 4] * 2)),
     ValueError, "int_mixed was fitted for \\[kv_heads, channels\\] = \\[2, 4\\], got a tensor with \\[3, 4\\]"),
    ("CacheConfig: int_mixed rows that are not whole words",
     lambda: CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=2, page_size=16, loops=(LoopStorage(
                             jflashloop.CodecSpec("int_mixed", "channel", 16, channel_bits=[[4] * 14 + [2, 2]]),
                             jflashloop.INT4_VALUES),)),
     ValueError, "CacheConfig.loops\\[0\\].key_spec: int_mixed pages need each head's widths to sum to a "
                 "multiple of 32 bits \\(a row in whole 32-bit words\\), got 60"),
    ("sharding.local_config: a spec fitted per kv head split over the model axis",
     lambda: jflashloop.sharding.local_config(
         CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_pages=4, max_sequences=1,
                     max_pages_per_sequence=2, page_size=16, loops=(LoopStorage(
                         jflashloop.CodecSpec("int_mixed", "channel", 16, channel_bits=[[4] * 16, [5, 3] * 8]),
                         jflashloop.INT4_VALUES),)),
         types.SimpleNamespace(shape={"data": 1, "model": 2})),
     ValueError, "a int_mixed codec fitted per kv head cannot be split over mesh axis 'model': every shard runs "
                 "one static spec, so its heads' channel_bits rows must be equal"),
    ("fitting.fit_key_widths: a mean width that is not a whole number of bits",
     lambda: jflashloop.fitting.fit_key_widths(np.ones(4), 4.1),
     ValueError, "mean_bits \\* head_dim = 16.4 must be a whole number of bits in \\[8, 24\\]"),
    ("fitting.key_channel_weights: fewer tokens than a group after the sinks",
     lambda: jflashloop.fitting.key_channel_weights(np.ones((40, 1, 8), np.float32), np.ones((40, 2, 8), np.float32)),
     ValueError, "need at least group_size=64 tokens after the 4 sink tokens, got 40"),
    ("codecs.round_channel_scales: a zero, negative or non-finite scale",
     lambda: jflashloop.codecs.round_channel_scales([1.0, 0.0]),
     ValueError, "channel scales must be finite and positive"),
    ("fitting.fitted_policy: tensors that are not [layers, tokens, heads, head_dim]",
     lambda: jflashloop.fitting.fitted_policy(np.ones((8, 1, 8)), np.ones((8, 1, 8)), np.ones((8, 2, 8))),
     ValueError, "keys and values must be \\[layers, tokens, kv_heads, head_dim\\] of one shape and queries "
                 "\\[layers, tokens, q_heads, head_dim\\], got \\(8, 1, 8\\), \\(8, 1, 8\\), \\(8, 2, 8\\)"),
    ("CodecSpec.for_heads: heads outside a fitted spec's table",
     lambda: jflashloop.CodecSpec("int_mixed", "channel", 64, channel_bits=[[4] * 8] * 2).for_heads(1, 3),
     ValueError, "heads 1..2 are outside the spec's 2 kv heads"),
    ("allocation.Candidate.per_layer: layers that store different bits",
     lambda: jflashloop.allocation.Candidate.per_layer("mixed", [
         (jflashloop.CodecSpec("int_mixed", "channel", 64, channel_bits=[[4] * 8]), jflashloop.INT4_VALUES),
         (jflashloop.CodecSpec("int_mixed", "channel", 64, channel_bits=[[5] * 8]), jflashloop.INT4_VALUES)]),
     ValueError, "candidate 'mixed': every layer must store the same bits per element, got "
                 "\\[\\(4.5, 4.5\\), \\(5.5, 4.5\\)\\]"),
    ("LoopPrediction: tables of the wrong size",
     lambda: jflashloop.LoopPrediction(2, 16, b"\0" * 8, b"\0" * 8),
     ValueError, "LoopPrediction.key_table must be 2176 bytes \\(float32 \\[2, 17, 16\\]\\), got 8"),
    ("LoopPrediction.from_arrays: a non-finite entry",
     lambda: jflashloop.LoopPrediction.from_arrays(np.full((1, 8, 8), np.inf), np.zeros((1, 8)), np.eye(8)[None],
                                                   np.zeros((1, 8))),
     ValueError, "LoopPrediction.key_table must hold finite numbers"),
    ("CacheConfig: a prediction on the base",
     lambda: CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=2, page_size=16, loops=(LoopStorage(
                             prediction=jflashloop.LoopPrediction.identity(1, 16)),)),
     ValueError, "CacheConfig.loops\\[0\\]: only a residual loop \\(not the base, not direct\\) is predicted "
                 "from the loop before it"),
    ("CacheConfig: a loop with no rows and no prediction",
     lambda: CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=2, page_size=16,
                         loops=(LoopStorage(), LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 0))),
     ValueError, "CacheConfig.loops\\[1\\]: a loop with no rows \\(sparse_rows_per_page=0\\) needs a prediction "
                 "\\(without one it would only repeat the loop before it\\)"),
    ("CacheConfig: a prediction of other heads",
     lambda: CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=2, page_size=16, loops=(LoopStorage(), LoopStorage(
                             prediction=jflashloop.LoopPrediction.identity(1, 16)))),
     ValueError, "CacheConfig.loops\\[1\\].prediction maps 1 KV heads of head_dim 16; the cache has 2 of 16"),
    ("CacheConfig.with_layer_loops: not one list of loops per layer",
     lambda: CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                         max_pages_per_sequence=2).with_layer_loops([(LoopStorage(),)]),
     ValueError, "with_layer_loops needs one sequence of LoopStorage per layer \\(2\\), got 1"),
    ("CacheConfig.predicted_loops: not one list of predictions per layer",
     lambda: CacheConfig.predicted_loops(predictions=[[jflashloop.LoopPrediction.identity(1, 16)]], num_layers=2,
                                         num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                                         max_pages_per_sequence=2),
     ValueError, "predictions must hold one non-empty sequence of LoopPrediction per layer \\(2\\), all of one "
                 "length"),
    ("fitting.fitted_prediction: too few tokens for the map",
     lambda: jflashloop.fitting.fitted_prediction(*np.ones((4, 10, 1, 16))),
     ValueError, "need at least head_dim \\+ 1 = 17 tokens after the 4 sink tokens, got 6"),
    ("decode_attention(implementation='pallas'): a predicted loop that stores rows",
     lambda: jflashloop.decode_attention(
         jnp.zeros((1, 1, 16)), jflashloop.paged_cache.create(CacheConfig(
             num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1, max_pages_per_sequence=2,
             loops=(LoopStorage(), LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 4,
                                               prediction=jflashloop.LoopPrediction.identity(1, 16))))),
         0, 1, implementation="pallas", interpret=True),
     NotImplementedError, "the fused kernels do not read a predicted loop that stores rows or a dense residual "
                          "\\(LoopStorage.prediction with sparse_rows_per_page other than 0\\)"),
    ("fitting.fit_predicted_loops: arrays of another shape than the config's",
     lambda: jflashloop.fitting.fit_predicted_loops(
         CacheConfig.predicted_loops(predictions=[[jflashloop.LoopPrediction.identity(1, 16)]], num_layers=1,
                                     num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                                     max_pages_per_sequence=2),
         *np.ones((2, 1, 1, 3, 8, 1, 8))),
     ValueError, "keys and values must be \\[sequences, layers=1, loops=3, tokens, kv_heads=1, head_dim=16\\], got "
                 "\\(1, 1, 3, 8, 1, 8\\) and \\(1, 1, 3, 8, 1, 8\\)"),
    ("fitting.fit_residual_codecs: a loop with sparse rows",
     lambda: jflashloop.fitting.fit_residual_codecs(
         CacheConfig.flashloop(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                               max_pages_per_sequence=2, num_loops=3),
         *np.ones((2, 1, 1, 3, 8, 1, 16)), np.ones((1, 1, 3, 2, 1, 16)), loop=2),
     ValueError, "loop 2 stores sparse rows; fitted codecs are dense"),
    ("fitting.fit_residual_codecs: a layer out of range",
     lambda: jflashloop.fitting.fit_residual_codecs(
         CacheConfig.flashloop(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, max_sequences=1,
                               max_pages_per_sequence=2, num_loops=3),
         *np.ones((2, 1, 1, 3, 8, 1, 16)), np.ones((1, 1, 3, 2, 1, 16)), loop=1, layers=[1]),
     ValueError, "layers must be in \\[0, 1\\), got \\[1\\]"),
    ("fitting.fitted_codecs: sequences of another shape",
     lambda: jflashloop.fitting.fitted_codecs(np.ones((2, 80, 1, 16)), np.ones((2, 80, 1, 8)), np.ones((2, 4, 1, 16))),
     ValueError, "keys and values must be \\[sequences, tokens, kv_heads, head_dim\\] of one shape and queries "
                 "\\[sequences, query_tokens, q_heads, head_dim\\], got \\(2, 80, 1, 16\\), \\(2, 80, 1, 8\\), "
                 "\\(2, 4, 1, 16\\)"),
    ("fitting.fitted_loops: fewer than two loops",
     lambda: jflashloop.fitting.fitted_loops(*np.ones((3, 1, 1, 1, 8, 1, 16)), num_pages=4, max_sequences=1,
                                             max_pages_per_sequence=2),
     ValueError, "keys and values must be \\[sequences, layers, loops >= 2, tokens, kv_heads, head_dim\\] of one "
                 "shape and queries \\[sequences, layers, loops, query_tokens, q_heads, head_dim\\], got "
                 "\\(1, 1, 1, 8, 1, 16\\), \\(1, 1, 1, 8, 1, 16\\), \\(1, 1, 1, 8, 1, 16\\)"),
    ("fitting.fitted_loops: per-layer widths of another length than the layers",
     lambda: jflashloop.fitting.fitted_loops(*np.ones((3, 1, 1, 2, 8, 1, 16)), base_bits=(4, 3), num_pages=4,
                                             max_sequences=1, max_pages_per_sequence=2),
     ValueError, "base_bits must be one value or one per layer \\(1 layers\\), got 2"),
    ("fitting.fitted_loops: a value codec that is not a CodecSpec",
     lambda: jflashloop.fitting.fitted_loops(*np.ones((3, 1, 1, 2, 8, 1, 16)), loop_values="int3", num_pages=4,
                                             max_sequences=1, max_pages_per_sequence=2),
     ValueError, "loop_values must be None, a CodecSpec or one of those per layer, got 'int3'"),
    ("sharding.local_config: a prediction fitted per kv head split over the model axis",
     lambda: jflashloop.sharding.local_config(
         CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_pages=4, max_sequences=1,
                     max_pages_per_sequence=2, loops=(LoopStorage(), LoopStorage(
                         prediction=jflashloop.LoopPrediction.from_arrays(
                             np.stack([np.eye(16), 2 * np.eye(16)]), np.zeros((2, 16)), np.stack([np.eye(16)] * 2),
                             np.zeros((2, 16)))))),
         types.SimpleNamespace(shape={"data": 1, "model": 2})),
     ValueError, "a loop prediction fitted per kv head cannot be split over mesh axis 'model': every shard runs "
                 "one static config, so its heads' tables must be equal"),
]


@pytest.mark.parametrize("call, error, message", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_gives_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------- jitted outcomes


def test_jitted_prefill_flags_what_it_cannot_raise():
    cache = one_active_cache()
    keys, values = kv()
    # An active slot: replaced, its pages returned first (no leak), flagged.
    replaced = _prefill(cache, 0, keys, values, 40)
    paged_cache.validate(replaced)
    assert int(replaced.error_flags[0]) == paged_cache.ERROR_SLOT_REPLACED
    assert int(replaced.page_free.sum()) == CONFIG.num_pages - 2
    # A length beyond the prompt: clamped to the prompt and flagged.
    clamped = _prefill(cache, 1, keys[:, :, :20], values[:, :, :20], 30)
    assert int(clamped.lengths[1]) == 20 and clamped.error_flags[1] & paged_cache.ERROR_INVALID_LENGTH
    # An out-of-range slot: nothing happens (no page taken, no slot touched).
    ignored = _prefill(cache, 7, keys, values, 40)
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(ignored), strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    with pytest.raises(RuntimeError, match="replaced a sequence"):
        paged_cache.check(replaced)


def test_jitted_free_of_an_out_of_range_slot_changes_nothing():
    cache = one_active_cache()
    freed = jax.jit(paged_cache.free)(cache, 5)
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(freed), strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_prefill_beyond_capacity_keeps_the_windows_of_the_kept_tokens():
    config = dataclasses.replace(CONFIG, max_pages_per_sequence=2)  # 32 tokens
    keys, values = kv(48)
    cache = _prefill(paged_cache.create(config), 0, keys, values, 48)
    assert int(cache.lengths[0]) == 32 and cache.error_flags[0] & paged_cache.ERROR_SEQUENCE_FULL
    reconstructed, _, visible = paged_cache.reconstruct(cache, 0, 0, 0)
    stored = keys[0, 0, :32].astype(jnp.bfloat16).astype(np.float32)
    # The most recent (unquantized) tokens are tokens 24..31, not the dropped 40..47.
    np.testing.assert_array_equal(np.asarray(reconstructed)[24:32], stored[24:32])
    assert int(visible) == 32


def test_jitted_reconstruct_of_a_slot_out_of_range_reads_nothing():
    keys, values = kv(seed=4)
    cache = _prefill(one_active_cache(), 1, keys, values, 30)  # both slots hold tokens
    jitted = jax.jit(paged_cache.reconstruct, static_argnums=(1, 2), static_argnames="include_pending")
    for slot in (2, 5, -1):  # JAX indexing would clamp 2 and 5 and wrap -1 to slot 1
        for include_pending in (False, True):
            k, v, visible = jitted(cache, 0, 1, jnp.int32(slot), include_pending=include_pending)
            assert int(visible) == 0 and not np.asarray(k).any() and not np.asarray(v).any(), slot


@pytest.mark.parametrize("spec", [jflashloop.INT4_VALUES, jflashloop.NVFP4])
def test_jitted_residual_positions_follow_the_documented_rule(spec):
    rng = np.random.default_rng(0)
    target, predecessor = (jnp.asarray(rng.standard_normal((10, 1, 16)), jnp.float32) for _ in range(2))

    @jax.jit
    def round_trip(positions):
        return jflashloop.decode_residual(jflashloop.encode_residual(target, predecessor, spec, positions), predecessor)

    def same(a, b):
        np.testing.assert_array_equal(np.asarray(round_trip(jnp.array(a))), np.asarray(round_trip(jnp.array(b))))

    same([5, 1, 3], [1, 3, 5])  # each row updates its own position, in any order
    same([1, 1, 3], [1, 3, 3])  # a repeated position is applied once (its first row)
    np.testing.assert_array_equal(np.asarray(round_trip(jnp.array([1, 1, 3])))[[1, 3]],
                                  np.asarray(round_trip(jnp.array([1, 3])))[[1, 3]])
    same([-1, 3, 10], [3, 3, 3])  # positions outside [0, tokens) are ignored (never wrapped)
    untouched = np.asarray(round_trip(jnp.array([-1, 3, 10])))
    np.testing.assert_array_equal(np.delete(untouched, 3, axis=0), np.delete(np.asarray(predecessor), 3, axis=0))


# --------------------------------------------------------------------------- checked mode


def test_checked_entry_points_match_the_unchecked_ones_bit_for_bit():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20, 2, 16)), jnp.float32)
    for spec in (jflashloop.INT4_KEYS, jflashloop.NVFP4):
        a, b = checked.encode(x, spec), jflashloop.encode(x, spec)
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
    keys, values = kv()
    mine = checked.prefill(paged_cache.create(CONFIG), 0, keys, values, 37)
    plain = _prefill(paged_cache.create(CONFIG), 0, keys, values, 37)
    step = kv(layout=(1, 2, 2, 1, 16), seed=3)
    mine, plain = checked.append(mine, *step), _append(plain, *step)
    for leaf_a, leaf_b in zip(jax.tree.leaves(mine), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))


def test_checked_allows_saturation_when_asked():
    x = x3().at[0, 0, 0].set(1e6)
    packed = checked.encode(x, jflashloop.INT4_VALUES, allow_saturation=True)
    assert float(jnp.abs(packed.scale.astype(jnp.float32)).max()) == 65504.0


def test_checked_append_ignores_nonfinite_values_of_inactive_slots():
    cache = one_active_cache()
    keys, values = kv(layout=(1, 2, 2, 1, 16))
    keys[:, :, 1] = np.nan  # slot 1 is not active: never read
    appended = checked.append(cache, keys, values)
    assert int(appended.lengths[0]) == 21
    keys[:, :, 0, 0, 0] = np.inf
    with pytest.raises(NonFiniteInputError, match="keys \\(active sequences\\) must be finite"):
        checked.append(cache, keys, values)


def test_checked_prefill_rejects_saturation():
    keys, values = kv()
    keys[0, 0, 5, 0, 0] = 2e5  # beyond float16: the base K group saturates
    with pytest.raises(SaturationError, match="saturation_counts"):
        checked.prefill(paged_cache.create(CONFIG), 0, keys, values, 20)


def test_packed_type_is_checked_before_decoding():
    packed = jflashloop.encode(x3(), jflashloop.INT4_VALUES)
    bad = Packed(packed.payload[:, :, :2], packed.scale, packed.minimum, None, packed.spec, packed.shape)
    with pytest.raises(ValueError, match=r"packed\.payload must be uint8"):
        jflashloop.decode(bad)
