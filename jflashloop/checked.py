"""Checked mode: eager entry points that reject what the jitted API counts.

The ordinary API never raises on values inside ``jit``: non-finite K/V and
values beyond a format's range are stored by a documented rule and counted
(:class:`~jflashloop.codecs.EncodeStatistics`, the cache's
``nonfinite_counts`` / ``saturation_counts`` and ``error_flags``). The
functions here take the same arguments, run outside ``jit`` (they need
concrete arrays), and raise instead:

* :class:`~jflashloop.NonFiniteInputError` (a ``ValueError``) for
  any NaN or +-inf in the data that would be stored;
* :class:`~jflashloop.SaturationError` (a ``ValueError``) when a
  value would be stored beyond its format's range, unless
  ``allow_saturation=True``;
* ``ValueError`` / ``IndexError`` for every condition the cache would only
  flag (slot in use, too few free pages, a full sequence).

They then run the ordinary jitted computation, so results are bit-identical
to the unchecked API. The checks cost one pass over the inputs on the host.
Arguments of the wrong kind or shape raise the unchecked API's ``TypeError``
/ ``ValueError`` (naming the argument and the expected layout) before any
value is read; called under ``jit`` (with traced arguments) every function
here raises ``TypeError``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from . import _chains, paged_cache
from ._errors import SaturationError
from ._validation import require_concrete, require_finite
from .codecs import CodecSpec, Packed
from .codecs import _api as codecs
from .codecs._spec import AFFINE_FORMATS
from .paged_cache import PagedKVCache


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def _encode_with_statistics(x, global_scale, spec, implementation):
    return codecs.encode_with_statistics(x, spec, global_scale=global_scale, implementation=implementation)


_prefill = jax.jit(paged_cache.prefill, static_argnames=("implementation",))
_append = jax.jit(paged_cache.append, static_argnames=("implementation",))


def _raise_on_statistics(name: str, statistics, spec: CodecSpec, allow_saturation: bool) -> None:
    nonfinite, saturated = int(statistics.nonfinite), int(statistics.saturated)
    if nonfinite:
        raise SaturationError(
            f"{name}: {nonfinite} element(s) overflow float32 before encoding (e.g. a difference of two "
            "huge finite values)"
        )
    if saturated and not allow_saturation:
        if spec.format in AFFINE_FORMATS:
            limit = "its group's float16 min or scale would exceed 65504"
        elif spec.format == "int4_rotated":
            limit = "its magnitude is beyond int4_rotated's input limit 2**64"
        else:
            limit = "it is at least 7/6 of the largest value the global scale can represent (6 * 448 * global_scale)"
        raise SaturationError(
            f"{name}: {saturated} element(s) would saturate ({limit}); pass allow_saturation=True to "
            "store them saturated"
        )


def encode(
    x,
    spec: CodecSpec,
    *,
    global_scale=None,
    implementation: str | None = None,
    allow_saturation: bool = False,
) -> Packed:
    """:func:`jflashloop.encode` that rejects non-finite and (by default) saturating input.

    Raises:
      NonFiniteInputError: ``x`` holds NaN or +-inf.
      SaturationError: some element would be stored saturated.
    """
    require_concrete("checked.encode", x=x, global_scale=global_scale)
    codecs.check_input(x, spec)
    codecs.check_global_scale(global_scale, spec)
    require_finite("x", x)
    packed, statistics = _encode_with_statistics(x, global_scale, spec, implementation)
    _raise_on_statistics("x", statistics, spec, allow_saturation)
    return packed


def encode_residual(
    target,
    predecessor,
    spec: CodecSpec,
    positions=None,
    *,
    implementation: str | None = None,
    allow_saturation: bool = False,
) -> _chains.Residual:
    """:func:`jflashloop.encode_residual` that rejects non-finite and saturating input.

    Raises:
      NonFiniteInputError: ``target`` or ``predecessor`` holds NaN or +-inf.
      SaturationError: the difference overflows float32 or would saturate.
    """
    require_concrete("checked.encode_residual", target=target, predecessor=predecessor, positions=positions)
    require_finite("target", target)
    require_finite("predecessor", predecessor)
    encoded = _chains.encode_residual(target, predecessor, spec, positions, implementation=implementation)
    rows, _ = _chains.residual_rows(target, predecessor, encoded.positions)
    statistics = codecs.count_saturations(rows, spec, implementation=implementation)
    _raise_on_statistics("target - predecessor", statistics, spec, allow_saturation)
    return encoded


def _raise_on_new_saturation(before: PagedKVCache, after: PagedKVCache) -> None:
    grown = np.flatnonzero(np.asarray(after.saturation_counts) > np.asarray(before.saturation_counts))
    if grown.size:
        counts = {int(s): int(after.saturation_counts[s]) for s in grown}
        raise SaturationError(
            f"values would be stored at their format's limit in slot(s) {counts} "
            "(slot: saturation_counts); pass allow_saturation=True to accept"
        )


def prefill(
    cache: PagedKVCache,
    slot,
    keys,
    values,
    length=None,
    *,
    implementation: str | None = None,
    allow_saturation: bool = False,
) -> PagedKVCache:
    """:func:`jflashloop.paged_cache.prefill`, raising instead of flagging.

    Raises:
      IndexError / ValueError: slot out of range or active, length out of
        range or beyond capacity, too few free pages (as eager ``prefill``).
      NonFiniteInputError: NaN or +-inf among the first ``length`` tokens.
      SaturationError: a value would be stored at its format's limit.
    """
    require_concrete("checked.prefill", cache=cache, slot=slot, keys=keys, values=values, length=length)
    paged_cache.check_prefill_arrays(cache, keys, values)
    tokens = keys.shape[2]
    length = tokens if length is None else length
    paged_cache.check_prefill_values(cache, slot, tokens, length)
    kept = int(length)
    require_finite("keys", np.asarray(keys)[:, :, :kept])
    require_finite("values", np.asarray(values)[:, :, :kept])
    updated = _prefill(cache, slot, keys, values, length, implementation=implementation)
    if not allow_saturation:
        _raise_on_new_saturation(cache, updated)
    paged_cache.check(updated)
    return updated


def append(
    cache: PagedKVCache,
    keys,
    values,
    *,
    implementation: str | None = None,
    allow_saturation: bool = False,
) -> PagedKVCache:
    """:func:`jflashloop.paged_cache.append`, raising instead of flagging.

    Raises:
      NonFiniteInputError: NaN or +-inf in an active sequence's new token.
      ValueError: an active sequence is already full, or the pool has fewer
        free pages than sequences that complete a page with this token.
      SaturationError: a value would be stored at its format's limit.
    """
    require_concrete("checked.append", cache=cache, keys=keys, values=values)
    paged_cache.check_append_arrays(cache, keys, values)
    c = cache.config
    active = np.asarray(cache.active)
    lengths = np.asarray(cache.lengths)
    full = np.flatnonzero(active & (lengths >= c.max_tokens_per_sequence))
    if full.size:
        raise ValueError(
            f"slot(s) {full.tolist()} already hold max_pages_per_sequence * page_size = "
            f"{c.max_tokens_per_sequence} tokens; nothing more can be appended"
        )
    completing = int((active & ((lengths + 1) % c.page_size == 0)).sum())
    available = int(np.asarray(cache.page_free).sum())
    if completing > available:
        raise ValueError(
            f"{completing} sequence(s) complete a page with this token, the pool has {available} free pages"
        )
    require_finite("keys (active sequences)", np.asarray(keys)[:, :, active])
    require_finite("values (active sequences)", np.asarray(values)[:, :, active])
    updated = _append(cache, keys, values, implementation=implementation)
    if not allow_saturation:
        _raise_on_new_saturation(cache, updated)
    paged_cache.check(updated)
    return updated
