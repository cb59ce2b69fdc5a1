"""Property-based tests (hypothesis): codecs against the oracles on adversarial
inputs, and random interleavings of cache operations against a dense model.

Example counts come from the settings profile (``tests/conftest.py``): "ci" by
default, ``HYPOTHESIS_PROFILE=long`` for many more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jflashloop
import jflashloop_reference as reference
from jflashloop import CacheConfig, LoopStorage, paged_cache, persistence
from jflashloop.codecs import encode_with_statistics
from tests.bits import assert_bits_equal, assert_matches_affine_oracle
from tests.builders import History, oracle_sequence

F32 = np.float32
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Values where codecs are most likely to go wrong: signed zeros, subnormals,
# the float16 and E4M3 limits and the points where rounding overflows them,
# exact rounding ties, the float32 extremes and non-finite values.
EXTREMES = [
    0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.1754944e-38, 2.0**-24, 2.0**-25, 6e-8, 0.25, 0.5, 0.75,
    1.0, -1.0, 1.25, 1.5, 2.5, 3.5, 5.0, 6.0, 7.5, 14.5, 15.0, 448.0, 464.0, 2688.0, 65504.0,
    -65504.0, 65519.996, 65520.0, -65520.0, 1e5, -1e5, 3e38, -3e38, FLOAT32_MAX, -FLOAT32_MAX,
    float("inf"), float("-inf"), float("nan"),
]
NARROW_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]

elements = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from(EXTREMES),
    st.floats(-8.0, 8.0, width=32),
)


@st.composite
def codec_inputs(draw, shapes):
    """float32 ``[T, H, C]`` arrays: arbitrary, constant, on a rounding grid, or narrowed."""
    shape = draw(st.sampled_from(shapes))
    size = int(np.prod(shape))
    kind = draw(st.sampled_from(["arbitrary", "constant", "grid", "narrow"]))
    if kind == "constant":
        values = np.full(size, draw(elements), F32)
        for index in draw(st.lists(st.integers(0, size - 1), max_size=2)):
            values[index] = draw(elements)
    elif kind == "grid":
        # Multiples of half a step of a scale: INT4 and E2M1 rounding ties.
        scale = draw(st.sampled_from([1.0, 0.1, 1e-3, 1 / 6, 4096.0, 1e-30, 2e37]))
        steps = draw(st.lists(st.integers(-30, 30), min_size=size, max_size=size))
        values = (np.asarray(steps, np.float64) * 0.5 * scale).astype(F32)
    else:
        values = np.asarray(draw(st.lists(elements, min_size=size, max_size=size)), F32)
        if kind == "narrow":
            dtype = draw(st.sampled_from(NARROW_DTYPES[1:]))
            with np.errstate(over="ignore"):
                values = values.astype(dtype).astype(F32)
    return values.reshape(shape)


@functools.partial(jax.jit, static_argnames=("spec",))
def _encode_decode(x, spec):
    packed, statistics = encode_with_statistics(x, spec)
    return packed, statistics, jflashloop.decode(packed, jnp.float32)


@functools.partial(jax.jit)
def _encode_decode_nvfp4_given(x, global_scale):
    packed, statistics = encode_with_statistics(x, jflashloop.NVFP4, global_scale=global_scale)
    return packed, statistics, jflashloop.decode(packed, jnp.float32)


INT4_SHAPES = [(1, 1, 1), (2, 1, 3), (5, 2, 7), (9, 1, 16), (17, 1, 5)]
INT4_SPECS = [
    jflashloop.CodecSpec(format="int4", axis=axis, group_size=group)
    for axis in ("channel", "token") for group in (1, 3, 4, 64)
]
NVFP4_SHAPES = [(1, 1, 1), (2, 1, 17), (3, 2, 16), (1, 1, 33), (4, 1, 7)]


@given(x=codec_inputs(INT4_SHAPES), spec=st.sampled_from(INT4_SPECS))
def test_int4_matches_oracle_on_any_input(x, spec):
    packed, statistics, decoded = _encode_decode(jnp.asarray(x), spec)
    assert_matches_affine_oracle(packed, statistics, decoded, x, spec, reference.encode_int4, reference.decode_int4)
    # Never a NaN out, and stored metadata always finite.
    assert np.isfinite(np.asarray(packed.minimum, np.float32)).all()
    assert np.isfinite(np.asarray(packed.scale, np.float32)).all()
    assert not np.isnan(np.asarray(decoded)).any()


global_scales = st.one_of(
    st.none(),
    st.sampled_from([1e-3, 2.0**-116, 1.0, 1 / 6, 1e30]),
    st.floats(min_value=2.0**-116, max_value=float(np.float32(1e30)), width=32),
)


@given(x=codec_inputs(NVFP4_SHAPES), global_scale=global_scales)
def test_nvfp4_matches_oracle_on_any_input(x, global_scale):
    if global_scale is None:
        packed, statistics, decoded = _encode_decode(jnp.asarray(x), jflashloop.NVFP4)
    else:
        packed, statistics, decoded = _encode_decode_nvfp4_given(jnp.asarray(x), jnp.float32(global_scale))
    expected = reference.encode_nvfp4(x, None if global_scale is None else F32(global_scale))
    assert_bits_equal(packed.payload, expected["payload"], "payload")
    assert_bits_equal(np.asarray(packed.scale).view(np.uint8), expected["scale"], "scale")
    assert_bits_equal(packed.global_scale, expected["global_scale"], "global scale")
    assert int(statistics.nonfinite) == expected["nonfinite"]
    assert int(statistics.saturated) == expected["saturated"]
    oracle_decoded = reference.decode_nvfp4(
        expected["payload"], expected["scale"], expected["global_scale"], x.shape
    )
    assert_bits_equal(decoded, oracle_decoded, "decoded")
    assert not np.isnan(np.asarray(decoded)).any()


@given(x=codec_inputs(INT4_SHAPES), spec=st.sampled_from(INT4_SPECS))
def test_int4_error_is_bounded_for_finite_unsaturated_input(x, spec):
    assume(np.isfinite(x).all() and np.abs(x).max() < 1e4)
    packed, statistics, decoded = _encode_decode(jnp.asarray(x), spec)
    assume(int(statistics.saturated) == 0)
    # Within one group, |error| <= scale / 2 plus the float16 rounding of min and scale.
    scale = np.asarray(packed.scale, np.float32)
    bound = (scale.max() * 0.5 + scale.max() * 15 * 2.0**-11 + np.abs(x).max() * 2.0**-10 + 1e-6)
    assert np.abs(np.asarray(decoded) - x).max() <= bound


# --------------------------------------------------------------------------- the cache


def machine_config() -> CacheConfig:
    """One layer, three loops (INT4 base, dense NVFP4 residual, sparse INT4 residual).

    The pool (6 pages) holds fewer than two full sequences (4 pages each), so
    it runs out; the recent window (24 tokens) is wider than a page, so the
    ring is not a whole number of pages and a token dropped at capacity would
    land on a kept one.
    """
    key_spec = jflashloop.CodecSpec("int4", "channel", 16)
    return CacheConfig(
        num_layers=1, num_kv_heads=1, head_dim=16, num_pages=6, max_sequences=3,
        max_pages_per_sequence=4, page_size=16, sink_tokens=4, recent_tokens=24,
        loops=(
            LoopStorage(key_spec, jflashloop.INT4_VALUES),
            LoopStorage(jflashloop.NVFP4, jflashloop.NVFP4),
            LoopStorage(jflashloop.INT4_VALUES, jflashloop.INT4_VALUES, 4),
        ),
    )


CONFIG = machine_config()
CAPACITY = CONFIG.max_tokens_per_sequence
PADDED = CAPACITY  # every prefill has this many (padded) tokens: one compiled shape
PAGE = CONFIG.page_size
Q_HEADS = 2  # GQA: two query heads per KV head
_prefill = jax.jit(paged_cache.prefill)
_append = jax.jit(paged_cache.append)
_free = jax.jit(paged_cache.free)
_fork = jax.jit(paged_cache.fork)
_commit = jax.jit(paged_cache.commit)


@jax.jit
def _write_tokens(cache, keys, values):
    """``write_token`` of every loop (``keys``, ``values``: ``[1, loops, sequences, H, D]``)."""
    for loop in range(CONFIG.num_loops):
        cache = paged_cache.write_token(cache, 0, loop, keys[0, loop], values[0, loop])
    return cache


@functools.partial(jax.jit, static_argnames=("loop", "include_pending"))
def _reconstruct(cache, loop, slot, include_pending=False):
    return paged_cache.reconstruct(cache, 0, loop, slot, include_pending=include_pending)


@functools.partial(jax.jit, static_argnames=("include_pending",))
def _attention(queries, cache, include_pending):
    """Attention over the last loop (which reads every loop's stream; regions do not depend on the loop)."""
    return jflashloop.decode_attention_reference(
        queries, cache, 0, CONFIG.num_loops - 1, include_pending=include_pending)


def _tokens(seed: int, tokens: int, batch: int | None = None, nonfinite: int = 0):
    """Looped K/V like a model's (bfloat16 values), ``[1, loops, (batch,) tokens, H, D]``."""
    rng = np.random.default_rng(seed)
    lead = ((batch,) if batch else ()) + (tokens,)
    shape = (1, *lead, CONFIG.num_kv_heads, CONFIG.head_dim)

    def one():
        loops = [rng.standard_normal(shape) + 2 * rng.standard_normal()]
        for _ in range(CONFIG.num_loops - 1):
            loops.append(loops[-1] + 0.2 * rng.standard_normal(shape))
        stacked = np.stack(loops, axis=1).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        flat = stacked.reshape(-1)
        for index in rng.choice(flat.size, nonfinite, replace=False) if nonfinite else []:
            flat[index] = rng.choice([np.nan, np.inf, -np.inf])
        return stacked

    return one(), one()


def _stored(x: np.ndarray) -> np.ndarray:
    """What the cache stores for bfloat16-valued input K/V: non-finite and subnormal as 0."""
    x = np.where(np.isfinite(x), x, np.float32(0)).astype(np.float32)
    return np.where(np.abs(x) < 2.0**-126, np.copysign(np.float32(0), x), x).astype(np.float32)


# Prompt lengths; the edges come often: empty, inside the sink window, page boundaries, full.
LENGTHS = st.one_of(st.sampled_from([0, 2, PAGE - 1, PAGE, CAPACITY - 1, CAPACITY]), st.integers(0, CAPACITY))


class CacheMachine(RuleBasedStateMachine):
    """Random prefill / append / decode step / free / transfer / fork / save-load against the exact history.

    The model also tracks the pool: each sequence's full pages (``pages``:
    per slot, one model page id per full page, None where the pool had run
    out), how many block-table entries hold each page (``references``: a
    fork shares its source's pages) and how many pages are free.
    """

    @initialize(lengths=st.lists(LENGTHS, min_size=CONFIG.max_sequences, max_size=CONFIG.max_sequences),
                seed=st.integers(0, 2**32 - 1))
    def start(self, lengths, seed):
        """Every run starts with all slots in use, often with more pages than the pool holds."""
        self.cache = paged_cache.create(CONFIG)
        self.history = History(CONFIG, CAPACITY + 1)
        self.active = np.zeros(CONFIG.max_sequences, bool)
        self.flags = np.zeros(CONFIG.max_sequences, np.int64)
        self.nonfinite = np.zeros(CONFIG.max_sequences, np.int64)
        self.pages = [[] for _ in range(CONFIG.max_sequences)]
        self.references = {}  # model page id -> block-table entries holding it
        self.next_page = 0
        self.free_pages = CONFIG.num_pages
        for slot, length in enumerate(lengths):
            self._prefill(slot, length, seed + slot, 0)

    def _free_slots(self):
        return [int(s) for s in np.flatnonzero(~self.active)]

    def _take_page(self, slot):
        """A page filled for ``slot``: stored if the pool has one and no earlier page was lost, else lost and flagged."""
        stored = self.free_pages > 0 and all(page is not None for page in self.pages[slot])
        self.pages[slot].append(self._new_page() if stored else None)
        if not stored:
            self.flags[slot] |= paged_cache.ERROR_OUT_OF_PAGES

    def _new_page(self):
        page = self.next_page
        self.next_page += 1
        self.references[page] = 1
        self.free_pages -= 1
        return page

    def _release(self, slot):
        """``slot``'s pages lose a reference each; a page nobody holds is free again."""
        for page in self.pages[slot]:
            if page is not None:
                self.references[page] -= 1
                if not self.references[page]:
                    del self.references[page]
                    self.free_pages += 1
        self.pages[slot] = []

    def _stored_pages(self, slot):
        """Leading stored pages of ``slot`` (reading stops at the first lost one)."""
        return int(np.cumprod([page is not None for page in self.pages[slot]]).sum())

    def _commit(self, keys, values):
        """The model of one committed decode token of every active slot."""
        room = self.active & (self.history.lengths < CAPACITY)
        self.flags[self.active & ~room] |= paged_cache.ERROR_SEQUENCE_FULL
        self.history.append(_stored(keys), _stored(values), room)
        for slot in np.flatnonzero(room):  # pages are granted in slot order
            if self.history.lengths[slot] % PAGE == 0:
                self._take_page(slot)

    @precondition(lambda self: not self.active.all())
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), nonfinite=st.sampled_from([0, 0, 0, 2]))
    def prefill(self, data, seed, nonfinite):
        slot = data.draw(st.sampled_from(self._free_slots()), label="slot")
        self._prefill(slot, data.draw(LENGTHS, label="length"), seed, nonfinite)

    def _prefill(self, slot, length, seed, nonfinite):
        keys, values = _tokens(seed, PADDED, nonfinite=nonfinite)
        self.cache = _prefill(self.cache, slot, keys, values, length)
        self.history.prefill(slot, _stored(keys), _stored(values), length)
        self.active[slot] = True
        counted = int((~np.isfinite(keys[:, :, :length])).sum() + (~np.isfinite(values[:, :, :length])).sum())
        self.nonfinite[slot] = counted
        self.flags[slot] = paged_cache.ERROR_NONFINITE_INPUT if counted else 0
        for _ in range(length // PAGE):
            self._take_page(slot)

    @rule(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 20))
    def append(self, seed, steps):
        for step in range(steps):
            keys, values = _tokens(seed + step, 1, batch=CONFIG.max_sequences)
            keys, values = keys[:, :, :, 0], values[:, :, :, 0]
            self.cache = _append(self.cache, keys, values)
            self._commit(keys, values)

    @rule(seed=st.integers(0, 2**32 - 1))
    def decode_step(self, seed):
        """Write a token, check what attention sees before the commit (every slot), commit."""
        keys, values = _tokens(seed, 1, batch=CONFIG.max_sequences)
        keys, values = keys[:, :, :, 0], values[:, :, :, 0]
        self.cache = _write_tokens(self.cache, keys, values)
        room = self.active & (self.history.lengths < CAPACITY)
        self.history.append(_stored(keys), _stored(values), room)
        self.history.lengths[room] -= 1  # pending, not committed
        self._compare_with_oracle(include_pending=True)
        self._compare_attention(include_pending=True, seed=seed)
        self.cache = _commit(self.cache)
        self._commit(keys, values)

    @rule(seed=st.integers(0, 2**32 - 1))
    def attention_matches_oracle(self, seed):
        self._compare_attention(include_pending=False, seed=seed)
        # No token was written: the pending position of an active slot holds an old
        # token, but an inactive slot must still see nothing.
        queries = np.random.default_rng(seed).standard_normal((CONFIG.max_sequences, Q_HEADS, 16)).astype(F32)
        out = np.asarray(_attention(jnp.asarray(queries), self.cache, True))
        assert not out[~self.active].any(), "an inactive slot attended to something"

    @precondition(lambda self: self.active.any())
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from([int(s) for s in np.flatnonzero(self.active)]), label="slot")
        self.cache = _free(self.cache, slot)
        self.active[slot] = False
        self.history.lengths[slot] = 0
        self.flags[slot] = self.nonfinite[slot] = 0
        self._release(slot)

    @precondition(lambda self: self.active.any() and not self.active.all())
    @rule(data=st.data(), through_bytes=st.booleans())
    def transfer(self, data, through_bytes):
        source = data.draw(st.sampled_from([int(s) for s in np.flatnonzero(self.active)]), label="source")
        target = data.draw(st.sampled_from(self._free_slots()), label="target")
        stored = [page for page in self.pages[source] if page is not None]
        freed = sum(self.references[page] == 1 for page in stored)
        assume(self.free_pages + freed >= len(stored))  # the import takes a page for each stored one
        bundle = persistence.export_pages(self.cache, source)
        if through_bytes:
            bundle = persistence.pages_from_bytes(persistence.pages_to_bytes(bundle))
        self.cache = persistence.import_pages(_free(self.cache, source), target, bundle)
        for name in ("keys", "values"):
            getattr(self.history, name)[:, :, target] = getattr(self.history, name)[:, :, source]
        self.history.lengths[target] = self.history.lengths[source]
        self.history.lengths[source] = 0
        for array in (self.active, self.flags, self.nonfinite):
            array[target], array[source] = array[source], 0
        lost = len(self.pages[source]) - len(stored)
        self._release(source)
        self.pages[target] = [self._new_page() for _ in stored] + [None] * lost

    @precondition(lambda self: self.active.any() and not self.active.all())
    @rule(data=st.data())
    def fork(self, data):
        """A free slot starts with all of an active one's tokens: its pages shared, its windows copied."""
        source = data.draw(st.sampled_from([int(s) for s in np.flatnonzero(self.active)]), label="source")
        target = data.draw(st.sampled_from(self._free_slots()), label="target")
        self.cache = _fork(self.cache, source, target)
        for name in ("keys", "values"):
            getattr(self.history, name)[:, :, target] = getattr(self.history, name)[:, :, source]
        self.history.lengths[target] = self.history.lengths[source]
        for array in (self.active, self.flags, self.nonfinite):
            array[target] = array[source]
        self.pages[target] = list(self.pages[source])
        for page in self.pages[target]:
            if page is not None:
                self.references[page] += 1

    @rule()
    def save_and_load(self):
        loaded = persistence.cache_from_bytes(persistence.cache_to_bytes(self.cache))
        for before, after in zip(jax.tree.leaves(self.cache), jax.tree.leaves(loaded), strict=True):
            assert_bits_equal(after, before, "reloaded array")
        self.cache = loaded

    @rule()
    def reconstruct_matches_oracle(self):
        self._compare_with_oracle()

    def _oracle(self, slot, loop, include_pending):
        """The model's K, V ``[visible, H, D]`` and readable mask ``[visible]`` of ``slot``."""
        keys, values = oracle_sequence(
            self.cache, self.history.keys, self.history.values, 0, loop, slot,
            include_pending=include_pending, stored_pages=self._stored_pages(slot),
        )
        readable = reference.paged_cache.readable_positions(
            length=int(self.history.lengths[slot]), visible=keys.shape[0], page_size=PAGE,
            sink_tokens=CONFIG.sink_tokens, recent_tokens=CONFIG.recent_tokens,
            stored_pages=self._stored_pages(slot),
        )
        return keys, values, readable

    def _compare_with_oracle(self, include_pending=False):
        """``reconstruct`` of every slot and loop: the oracle's bits; an inactive slot sees nothing."""
        for slot in range(CONFIG.max_sequences):
            for loop in range(CONFIG.num_loops):
                keys, values, visible = _reconstruct(self.cache, loop, slot, include_pending=include_pending)
                expected_k, expected_v, _ = self._oracle(slot, loop, include_pending)
                assert int(visible) == expected_k.shape[0]
                where = f"slot {slot} loop {loop + 1}"
                assert_bits_equal(np.asarray(keys)[: int(visible)], expected_k, f"keys {where}")
                assert_bits_equal(np.asarray(values)[: int(visible)], expected_v, f"values {where}")
                assert not np.asarray(keys)[int(visible):].any(), f"keys beyond visible, {where}"

    def _compare_attention(self, *, include_pending, seed):
        """Reference attention of every slot against float64 attention over the oracle's readable positions."""
        queries = np.random.default_rng(seed).standard_normal((CONFIG.max_sequences, Q_HEADS, 16)).astype(F32)
        out = np.asarray(_attention(jnp.asarray(queries), self.cache, include_pending))
        loop = CONFIG.num_loops - 1
        for slot in range(CONFIG.max_sequences):
            keys, values, readable = self._oracle(slot, loop, include_pending)
            expected = reference.attention.decode_attention(
                queries[slot], keys[readable], values[readable], int(readable.sum()))
            if not readable.any():
                assert not out[slot].any(), f"slot {slot} attended with nothing visible"
                continue
            error = np.linalg.norm(out[slot] - expected) / np.linalg.norm(expected)
            assert error < 1e-5, (slot, loop, error)

    @invariant()
    def bookkeeping_is_consistent(self):
        if not hasattr(self, "cache"):
            return
        paged_cache.validate(self.cache)
        np.testing.assert_array_equal(np.asarray(self.cache.active), self.active)
        np.testing.assert_array_equal(np.asarray(self.cache.lengths), np.where(self.active, self.history.lengths, 0))
        np.testing.assert_array_equal(np.asarray(self.cache.error_flags), self.flags)
        np.testing.assert_array_equal(np.asarray(self.cache.nonfinite_counts), self.nonfinite)
        assert not np.asarray(self.cache.saturation_counts).any()
        assert int(self.cache.page_free.sum()) == self.free_pages
        ids = {}  # model page id -> the cache's page id: one to one
        for slot in range(CONFIG.max_sequences):
            row = np.asarray(self.cache.block_tables[slot])
            expected = np.zeros(CONFIG.max_pages_per_sequence, bool)
            expected[: len(self.pages[slot])] = [page is not None for page in self.pages[slot]]
            np.testing.assert_array_equal(row >= 0, expected, err_msg=f"stored pages of slot {slot}")
            for column, page in enumerate(self.pages[slot]):
                if page is not None:
                    assert ids.setdefault(page, int(row[column])) == int(row[column]), (slot, column, "shared page")
        assert len(set(ids.values())) == len(ids), "two model pages in one cache page"

    def teardown(self):
        if hasattr(self, "cache"):
            note(f"lengths {self.history.lengths.tolist()}, active {self.active.tolist()}, pages {self.pages}")
            self._compare_with_oracle()


_profile = settings()
CacheMachine.TestCase.settings = settings(
    _profile,
    max_examples=max(3, _profile.max_examples // 5),
    stateful_step_count=10 if _profile.max_examples < 100 else 30,
)
TestCacheMachine = CacheMachine.TestCase
