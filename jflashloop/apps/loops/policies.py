"""Cross-loop storage policies against each other: bytes per token, logit KL and attention error.

``jflashloop loops --policies`` runs every policy of :data:`POLICIES` (or the
ones named with ``--only``) on the same held-out windows of several seeds and
writes one table: the bytes per token of full pages
(:mod:`jflashloop.storage`), the ratio to four BF16 loop caches, the
teacher-forced KL against the four BF16 caches and the attention-output error
of every loop, with the Pareto front (fewest bytes for a given KL) in bold.

A policy is one entry per loop, the base first: ``"int4"`` (dense INT4 G64, K
per channel over the page, V per token), ``"int2"`` (dense INT2 Lloyd-Max K
and V), ``"int4/int2"`` (K INT4, V INT2) and so on, or ``"<codec> <rows>"`` for
a sparse residual of ``rows`` rows per 64-token page (codecs per token:
``int4``, ``int3``, ``nvfp4``, ``int2``, ``int2a``, ``int3lm``; ``int3`` is INT3 G64, K per
channel when dense; ``int2`` is INT2 Lloyd-Max, ``int2a`` the affine INT2 G64,
the ``"int2"`` format; ``int3lm`` the 3-bit Lloyd-Max ``int3_lloyd_max``; ``fit`` and ``fit3.5``: the codecs fitted to each layer and loop on calibration windows,
``int_mixed`` keys at a mean width of 4, 3.5 or 3 bits (``fit4.5``, ``fit5``: 4.5 and 5) and ``int4_scaled`` values, :mod:`jflashloop.fitting`, for the
base and direct loops, or fitted to a predicted loop's residual: ``"pred fit3.5"``); ``"direct <codec>"`` is a dense loop stored on its own rather
than as a residual against the loop before it (``LoopStorage.direct``), and
``"direct <codec> @a-b"`` only in layers ``a..b`` (1-based; the other layers
store that loop as a residual: per-layer policies, ``CacheConfig.layer_loops``); ``"pred"`` is a loop predicted
from the loop before it with no rows (``LoopStorage.prediction``, a map fitted to each layer on the calibration
windows: :func:`fitted_predicted_loops`), ``"pred <codec> <rows>"`` one with sparse rows against the prediction and
``"pred <codec>"`` one with a dense residual against it (``"pred fit"``, ``"pred fit3.5"``...: in codecs fitted to that
residual, :func:`jflashloop.fitting.fit_residual_codecs`; ``"pred fit3/int3"``: fitted keys, INT3 values;
``"pred fit3/int3lm"``: fitted keys, ``int3_lloyd_max`` values).
An entry may also be a tuple of one such string per layer (a per-layer policy, e.g. one chosen on
calibration windows by ``bench/loop2_allocation_probe.py``). :func:`loop_storage` reads one entry. The
tables count loops as the report does (loops run: loop 1 is the base).
"""

from __future__ import annotations

import dataclasses
import math
import time
from fractions import Fraction
from typing import Any

import jax.numpy as jnp
import numpy as np

from ... import CacheConfig, fitting, storage
from ...cache._config import LoopStorage
from ...cache._prediction import LoopPrediction
from ...codecs import INT4_KEYS, INT4_VALUES, NVFP4, CodecSpec, int2_lloyd_max, int3_lloyd_max
from ...models import ouro
from ...models.cache_hooks import looped_paged_attention_hook
from ..float64_metrics import kl_divergence
from .metrics import attention_errors
from .runner import (
    PAGE_SIZE,
    RECENT_TOKENS,
    _forward,
    bfloat16_dense_attention,
    bfloat16_loop_caches,
    decode_tokens,
    held_out_windows,
    model_queries,
    prefill_cross_loop_cache,
    reconstruct_every_loop,
)

Entry = str | tuple[str, ...]
"""One loop's storage in a policy: one entry, or one per layer (layer 1 first)."""

FLASHLOOP = ("int4", "int4", "int4 16", "int4 7")
"""FlashLoop's policy at 64-token pages: INT4 base, dense INT4 residual, sparse INT4 rows for 25 % and
10 % of each page (rounded up)."""

COMPACT_LOOPS = ("int4", "direct int4", "int2a 24", "int2a 10")
"""``CacheConfig.compact_loops``'s policy at 64-token pages: INT4 base, dense INT4 loop 2 stored on its own,
affine INT2 G64 rows for 37.5 % and 15 % of each page."""

ALLOCATED_8X = (("fit3.5", "fit3", "fit3.5", "fit"),
                ("pred fit/int4", "pred fit3.5/int3lm", "pred fit3/int3lm", "pred fit3/int3lm"), "pred", "pred")
"""The shipped looped checkpoint's layout at 2,040 bytes a token (8.03x four BF16 caches) with FlashLoop's policy's
quality or better in every loop and in KL (``bench/LOOPS.md``, "Fits on more calibration windows"): per layer, the
base in fitted codecs (mean key widths 3.5, 3, 3.5, 4), loop 2 predicted from loop 1 with its residual's keys fitted
(4, 3.5, 3, 3) and values in INT4 G64 then ``int3_lloyd_max``, loops 3-4 predicted with nothing stored; as
``jflashloop loops --allocate 2040 --calibration-sequences 24`` chose it. Fitted on 24 calibration windows."""

FITTED_CODECS = {"fit5": 5.0, "fit4.5": 4.5, "fit": 4.0, "fit3.5": 3.5, "fit3": 3.0}
"""The fitted codecs of a dense loop coded on its own: the mean key width (values: ``int4_scaled``)."""
CALIBRATION_SEED = 100
"""The held-out windows the fitted codecs and predictions are fitted on (the measured seeds are 0, 1, 2)."""
PREDICTED = "pred"
"""A loop predicted from the loop before it (``LoopStorage.prediction``, fitted per layer: :func:`fitted_predicted_loops`)."""

POLICIES: dict[str, tuple[Entry, ...]] = {
    "flashloop": FLASHLOOP,
    "compact loops": COMPACT_LOOPS,
    "flashloop, nvfp4 rows": ("int4", "int4", "nvfp4 16", "nvfp4 7"),
    "flashloop, int2 rows": ("int4", "int4", "int2 16", "int2 7"),
    "flashloop, rows 8/1": ("int4", "int4", "int4 8", "int4 1"),
    "flashloop, rows 1/1": ("int4", "int4", "int4 1", "int4 1"),
    "flashloop, int2 rows 24/1": ("int4", "int4", "int2 24", "int2 1"),
    "flashloop, int2 rows 32/16": ("int4", "int4", "int2 32", "int2 16"),
    "flashloop, int2 rows 24/10": ("int4", "int4", "int2 24", "int2 10"),
    "flashloop, int2 rows 16/8": ("int4", "int4", "int2 16", "int2 8"),
    "int2 loop 2, int2 rows 32/2": ("int4", "int2", "int2 32", "int2 2"),
    "int2 loop 2": ("int4", "int2", "int4 16", "int4 7"),
    "int2 loop 2, int2 rows": ("int4", "int2", "int2 24", "int2 10"),
    "int2 base": ("int2", "int4", "int4 16", "int4 7"),
    "int2 base, rows 12/5": ("int2", "int4", "int4 12", "int4 5"),
    "int2 base, int2 rows": ("int2", "int4", "int2 24", "int2 10"),
    "int2 V base": ("int4/int2", "int4", "int4 16", "int4 7"),
    "int2 V loop 2, rows 2/1": ("int4", "int4/int2", "int2 2", "int2 1"),
    "int2 K loop 2, rows 2/1": ("int4", "int2/int4", "int2 2", "int2 1"),
    "int3 loop 2": ("int4", "int3", "int4 16", "int4 7"),
    "int3 loop 2, int3 rows": ("int4", "int3", "int3 16", "int3 7"),
    "int3 loop 2, int2 rows 24/10": ("int4", "int3", "int2 24", "int2 10"),
    "int3 loop 2, rows 8/2": ("int4", "int3", "int4 8", "int4 2"),
    "int3 base": ("int3", "int4", "int4 16", "int4 7"),
    "int3 loops 1-2, int2 rows 24/10": ("int3", "int3", "int2 24", "int2 10"),
    "int3 loops 1-2, int2 rows 16/4": ("int3", "int3", "int2 16", "int2 4"),
    "flashloop, direct loop 2": ("int4", "direct int4", "int4 16", "int4 7"),
    "direct loop 2, int2 rows 24/10": ("int4", "direct int4", "int2 24", "int2 10"),
    "direct loop 2, int2 rows 16/8": ("int4", "direct int4", "int2 16", "int2 8"),
    "direct int3 loop 2": ("int4", "direct int3", "int4 16", "int4 7"),
    "direct int3 loop 2, int2 rows 24/10": ("int4", "direct int3", "int2 24", "int2 10"),
    "direct int3 loop 2, int2 rows 16/4": ("int4", "direct int3", "int2 16", "int2 4"),
    "flashloop, direct loop 2 in layers 1-2": ("int4", "direct int4 @1-2", "int4 16", "int4 7"),
    "direct loop 2, affine int2 rows 24/10": ("int4", "direct int4", "int2a 24", "int2a 10"),
    "direct loop 2, affine int2 rows 32/16": ("int4", "direct int4", "int2a 32", "int2a 16"),
    "direct loop 2, affine int2 rows 16/8": ("int4", "direct int4", "int2a 16", "int2a 8"),
    "direct loop 2, affine int2 rows 16/16": ("int4", "direct int4", "int2a 16", "int2a 16"),
    "direct loop 2, affine int2 rows 32/8": ("int4", "direct int4", "int2a 32", "int2a 8"),
    "direct loop 2, affine int2 rows 20/8": ("int4", "direct int4", "int2a 20", "int2a 8"),
    "direct loop 2, affine int2 rows 20/6": ("int4", "direct int4", "int2a 20", "int2a 6"),
    "direct loop 2, affine int2 rows 24/6": ("int4", "direct int4", "int2a 24", "int2a 6"),
    "fitted compact loops": ("fit", "direct fit", "int2a 24", "int2a 10"),
    "fitted, affine int2 rows 16/8": ("fit", "direct fit", "int2a 16", "int2a 8"),
    "fitted, affine int2 rows 16/4": ("fit", "direct fit", "int2a 16", "int2a 4"),
    "fitted 3.5, affine int2 rows 24/10": ("fit3.5", "direct fit3.5", "int2a 24", "int2a 10"),
    "fitted, predicted loops 3-4": ("fit", "direct fit", "pred", "pred"),
    "fitted, predicted, affine int2 rows 8/4": ("fit", "direct fit", "pred int2a 8", "pred int2a 4"),
    "fitted, predicted, affine int2 rows 16/8": ("fit", "direct fit", "pred int2a 16", "pred int2a 8"),
    "predicted loops 3-4": ("int4", "direct int4", "pred", "pred"),
    "direct affine int2 loop 2, predicted loops 3-4": ("int4", "direct int2a", "pred", "pred"),
    "direct affine int2 K loop 2, predicted loops 3-4": ("int4", "direct int2a/int4", "pred", "pred"),
    "fitted 3.5, predicted loops 3-4": ("fit3.5", "direct fit3.5", "pred", "pred"),
    "fitted 3.5 base, predicted loops 3-4": ("fit3.5", "direct fit", "pred", "pred"),
    "fitted 3, predicted loops 3-4": ("fit3", "direct fit3", "pred", "pred"),
    "fitted 3 base, predicted loops 3-4": ("fit3", "direct fit", "pred", "pred"),
    "fitted, predicted int3 loop 2, predicted loops 3-4": ("fit", "pred int3", "pred", "pred"),
    "fitted, predicted int4 loop 2, predicted loops 3-4": ("fit", "pred int4", "pred", "pred"),
    "fitted, predicted int4/int3 loop 2, predicted loops 3-4": ("fit", "pred int4/int3", "pred", "pred"),
    "fitted, predicted int3/int4 loop 2, predicted loops 3-4": ("fit", "pred int3/int4", "pred", "pred"),
    "fitted 3.5 base, predicted int4 loop 2, predicted loops 3-4": ("fit3.5", "pred int4", "pred", "pred"),
    "fitted 3.5 base, predicted int4/int3 loop 2, predicted loops 3-4": ("fit3.5", "pred int4/int3", "pred", "pred"),
    "fitted, predicted fitted loop 2, predicted loops 3-4": ("fit", "pred fit", "pred", "pred"),
    "fitted, predicted fitted 3.5 loop 2, predicted loops 3-4": ("fit", "pred fit3.5", "pred", "pred"),
    "fitted 3.5, predicted fitted 3.5 loop 2, predicted loops 3-4": ("fit3.5", "pred fit3.5", "pred", "pred"),
    "fitted 3.5, predicted fitted 3 loop 2, predicted loops 3-4": ("fit3.5", "pred fit3", "pred", "pred"),
    "fitted, predicted fitted 3 loop 2, predicted loops 3-4": ("fit", "pred fit3", "pred", "pred"),
    # per layer, as bench/loop2_allocation_probe.py chose them on the calibration windows for 2,112, 2,080 (the
    # balanced choice) and 2,048 bytes
    "allocated 7.76x, predicted loops 3-4": (("fit", "fit3.5", "fit3.5", "fit3.5"),
                                             ("pred fit", "pred fit3/int3", "pred fit3.5", "pred fit3/int3"),
                                             "pred", "pred"),
    "allocated 7.88x, predicted loops 3-4": (("fit", "fit3", "fit3.5", "fit3.5"),
                                             ("pred fit", "pred fit3/int3", "pred fit3", "pred fit3/int3"),
                                             "pred", "pred"),
    "allocated 8x, predicted loops 3-4": (("fit", "fit3.5", "fit3.5", "fit3.5"),
                                          ("pred fit3.5", "pred fit3/int3", "pred fit3/int3", "pred fit3/int3"),
                                          "pred", "pred"),
    "allocated 8.03x": ALLOCATED_8X,
}


def _spec(codec: str, dense_key: bool, head_dim: int) -> CodecSpec:
    if codec == "int4":
        return INT4_KEYS if dense_key else INT4_VALUES
    if codec == "int3":
        return CodecSpec("int3", "channel", 64) if dense_key else CodecSpec("int3", "token", 64)
    if codec == "nvfp4":
        return NVFP4
    if codec == "int2":
        return int2_lloyd_max(head_dim, 0)
    if codec == "int2a":
        return CodecSpec("int2", "channel", 64) if dense_key else CodecSpec("int2", "token", 64)
    if codec == "int3lm":
        return int3_lloyd_max(head_dim, 0)
    raise ValueError(f"unknown residual codec {codec!r} (int4, int3, nvfp4, int2, int2a or int3lm)")


def _predicted(entry: str | tuple[str, ...]) -> bool:
    """Whether ``entry`` (one string, or one per layer: predicted in every layer or in none) is predicted."""
    if not isinstance(entry, str):
        kinds = {_predicted(layer_entry) for layer_entry in _layer_entries(entry)}
        if len(kinds) != 1:
            raise ValueError(f"a loop is predicted in every layer or in none, got {entry!r}")
        return kinds.pop()
    return entry == PREDICTED or entry.startswith(PREDICTED + " ")


def _layer_entries(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    """The strings of an entry: itself, or its one per layer."""
    return (entry,) if isinstance(entry, str) else entry


def _residual_codecs(entry: str) -> tuple[str, str] | None:
    """``(key codec, value codec)`` of a predicted loop whose residual is in fitted codecs (``"pred fit3.5"``:
    ``("fit3.5", "fit")``; ``"pred fit3/int3"``: fitted keys, INT3 values), else None."""
    key, _, value = entry.removeprefix(PREDICTED).strip().partition("/")
    return (key, value or "fit") if _predicted(entry) and key in FITTED_CODECS else None


def loop_storage(entry: str, head_dim: int, fitted: dict | None = None, *, layer: int = 0, loop: int = 0,
                 prediction: LoopPrediction | None = None) -> LoopStorage:
    """One loop's :class:`LoopStorage` from ``"codec"``, ``"kcodec/vcodec"`` (dense), ``"codec rows"`` (sparse),
    ``"direct codec"`` (dense, stored on its own) or ``"pred"`` / ``"pred codec rows"`` / ``"pred codec"``
    (predicted from the loop before with ``prediction``: no rows, sparse rows or a dense residual against it); a
    fitted codec (:data:`FITTED_CODECS`) takes
    layer ``layer``'s specs of loop ``loop`` from ``fitted`` (:func:`fitted_specs`). A predicted loop with a fitted
    residual (``"pred fit3.5"``, or ``"pred fit3/int3"`` with plain INT3 values) comes out with INT4 codecs in the
    fitted ones' place, for :func:`jflashloop.fitting.fit_residual_codecs` to replace (:func:`fitted_predicted_loops`)."""
    if _predicted(entry):
        if prediction is None:
            raise ValueError(f"{entry!r} in loop {loop + 1} needs a prediction fitted to it (fitted_predicted_loops)")
        rest = entry.removeprefix(PREDICTED).strip()
        codecs = _residual_codecs(entry)
        if codecs is not None:
            values = INT4_VALUES if codecs[1] == "fit" else _spec(codecs[1], False, head_dim)
            return LoopStorage(INT4_KEYS, values, prediction=prediction)
        storage = loop_storage(rest, head_dim, fitted, layer=layer, loop=loop) if rest else LoopStorage(
            INT4_VALUES, INT4_VALUES, 0)
        if storage.direct:
            raise ValueError(f"a predicted loop is a residual against its prediction, got {entry!r}")
        return dataclasses.replace(storage, prediction=prediction)
    direct = entry.startswith("direct ")
    if direct:
        storage = loop_storage(entry.removeprefix("direct "), head_dim, fitted, layer=layer, loop=loop)
        if storage.is_sparse:
            raise ValueError(f"a direct loop is dense, got {entry!r}")
        return dataclasses.replace(storage, direct=True)
    if entry in FITTED_CODECS:
        if fitted is None or (entry, loop) not in fitted:
            raise ValueError(f"{entry!r} in loop {loop + 1} needs codecs fitted to it (fitted_specs)")
        return LoopStorage(*fitted[(entry, loop)][layer])
    codecs, _, rows = entry.partition(" ")
    key_codec, _, value_codec = codecs.partition("/")
    value_codec = value_codec or key_codec
    sparse = bool(rows)
    return LoopStorage(_spec(key_codec, not sparse, head_dim), _spec(value_codec, False, head_dim),
                       int(rows) if sparse else None)


def _entry_in_layer(entry: str | tuple[str, ...], layer: int) -> str:
    """``entry`` as layer ``layer`` (0-based) stores it: a tuple holds one entry per layer; ``"direct <codec> @a-b"``
    is ``"direct <codec>"`` in layers ``a..b`` (1-based) and ``"<codec>"`` elsewhere."""
    if not isinstance(entry, str):
        return entry[layer]
    text, at, layers = entry.partition(" @")
    if not at:
        return entry
    first, _, last = layers.partition("-")
    if not text.startswith("direct ") or not first.isdigit() or not (last or first).isdigit():
        raise ValueError(f"a per-layer entry is 'direct <codec> @a-b', got {entry!r}")
    inside = int(first) <= layer + 1 <= int(last or first)
    return text if inside else text.removeprefix("direct ")


def policy_config(policy: tuple[Entry, ...], model: ouro.OuroConfig, sequences: int, max_tokens: int,
                  recent_tokens: int | None = RECENT_TOKENS, fitted: dict | None = None,
                  predicted: dict | None = None) -> CacheConfig:
    """A cache for ``model`` storing its loops as ``policy`` (4 sink tokens, ``recent_tokens`` recent
    ones, 64-token pages; per-layer loops where an entry names layers or a codec is fitted, ``fitted`` holding
    those codecs: :func:`fitted_specs`; ``predicted``: ``{loop: [LoopStorage per layer]}``, the fitted storage of
    every predicted loop, :func:`fitted_predicted_loops`).

    Raises:
      ValueError: a ``"pred ..."`` entry without its loop in ``predicted``, a loop in ``predicted`` whose entry
        is not predicted, or a per-layer entry of another length than the model's layers or predicted in only some.
    """
    pages = math.ceil(max_tokens / PAGE_SIZE)
    predicted = predicted or {}
    uneven = [entry for entry in policy if not isinstance(entry, str) and len(entry) != model.layers]
    if uneven:
        raise ValueError(f"a per-layer entry holds one entry per layer ({model.layers}), got {uneven}")
    predicted_loops = [loop for loop, entry in enumerate(policy) if _predicted(entry)]  # (checks per-layer entries)
    stray = [loop for loop in predicted if loop not in predicted_loops]
    if stray:
        raise ValueError(f"loops {[loop + 1 for loop in stray]} are not predicted in {policy}")
    per_layer = tuple(tuple(predicted[loop][layer] if loop in predicted else
                            loop_storage(_entry_in_layer(entry, layer), model.head_dim, fitted, layer=layer, loop=loop)
                            for loop, entry in enumerate(policy))
                      for layer in range(model.layers))
    return CacheConfig(num_layers=model.layers, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
                       num_pages=sequences * pages, max_sequences=sequences, max_pages_per_sequence=pages,
                       loops=per_layer[0], page_size=PAGE_SIZE, recent_tokens=recent_tokens).with_layer_loops(per_layer)


def fitted_specs(params, model: ouro.OuroConfig, held_out: np.ndarray, policies, settings: SweepSettings,
                 seed: int = CALIBRATION_SEED) -> dict:
    """``{(codec, loop): [(key_spec, value_spec) per layer]}`` for every fitted codec a policy stores in a loop.

    Fitted (:mod:`jflashloop.fitting`) to that loop's own K/V (the loops that use them are coded on their own)
    on ``settings.calibration_sequences`` held-out windows of ``seed`` (:meth:`SweepSettings.calibration`), with the
    model's queries at the last 32 positions.

    Raises:
      ValueError: a fitted codec in a loop that is a residual (neither the base nor direct) or sparse.
    """
    wanted = set()
    for policy in policies:
        for loop, entry in ((loop, text) for loop, entries in enumerate(policy) for text in _layer_entries(entries)):
            codec = entry.removeprefix("direct ").partition(" @")[0]
            if codec in FITTED_CODECS:
                if loop and not entry.startswith("direct "):
                    raise ValueError(f"{entry!r}: a fitted codec stores a loop on its own (the base or direct)")
                wanted.add((codec, loop))
            elif codec.partition(" ")[0] in FITTED_CODECS:
                raise ValueError(f"{entry!r}: fitted codecs are dense")
    if not wanted:
        return {}
    settings = settings.calibration()
    token_ids = jnp.asarray(held_out_windows(held_out, settings.sequences, settings.tokens, seed))
    _, keys, values, _ = _forward(params, model, token_ids)
    queries = np.asarray(model_queries(params, model, token_ids, 32), np.float32)
    keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)

    fitted = {}
    for codec, loop in sorted(wanted):
        fitted[(codec, loop)] = [
            fitting.fitted_codecs(keys[loop, layer], values[loop, layer], queries[loop, layer], FITTED_CODECS[codec],
                                  group_size=PAGE_SIZE, sink_tokens=CacheConfig.sink_tokens)
            for layer in range(model.layers)]
    return fitted


def fitted_predicted_loops(params, model: ouro.OuroConfig, held_out: np.ndarray, policy: tuple[Entry, ...],
                           settings: SweepSettings, fitted: dict | None = None, seed: int = CALIBRATION_SEED) -> dict:
    """``{loop: [LoopStorage per layer]}``: the fitted storage of every predicted loop of ``policy`` (``"pred ..."``
    entries), for :func:`policy_config`'s ``predicted``.

    On ``settings.calibration_sequences`` held-out windows of ``seed`` (:meth:`SweepSettings.calibration`), through the
    policy's own cache: the maps by :func:`jflashloop.fitting.fit_predicted_loops`, loop by loop (each predicted loop
    from the loop before as that cache reconstructs it), each followed by the codecs of its residual where they are
    fitted (``"pred fit3.5"``: :func:`jflashloop.fitting.fit_residual_codecs`, with the model's queries at the last 32
    positions)."""
    loops = [loop for loop, entry in enumerate(policy) if _predicted(entry)]
    if not loops:
        return {}
    settings = settings.calibration()
    token_ids = jnp.asarray(held_out_windows(held_out, settings.sequences, settings.tokens, seed))
    _, keys, values, _ = _forward(params, model, token_ids)  # [loops, layers, windows, T, H, D]
    keys, values = (np.asarray(x).transpose(2, 1, 0, 3, 4, 5) for x in (keys, values))
    identity = LoopPrediction.identity(model.kv_heads, model.head_dim)
    placeholders = {loop: [loop_storage(_entry_in_layer(policy[loop], layer), model.head_dim, prediction=identity)
                           for layer in range(model.layers)] for loop in loops}
    config = policy_config(policy, model, settings.sequences, settings.tokens, fitted=fitted, predicted=placeholders)
    queries = None
    for loop in loops:  # each map, then the codecs of its residual, in loop order
        config = fitting.fit_predicted_loops(config, keys, values, loops=[loop])
        codecs = [_residual_codecs(_entry_in_layer(policy[loop], layer)) for layer in range(model.layers)]
        layers = [layer for layer, pair in enumerate(codecs) if pair is not None]  # residuals in fitted codecs
        if not layers:
            continue
        if queries is None:
            queries = np.asarray(model_queries(params, model, token_ids, 32)).transpose(2, 1, 0, 3, 4, 5)
        pairs = [pair or ("fit", "fit") for pair in codecs]  # (the layers not fitted keep their storage)
        config = fitting.fit_residual_codecs(
            config, keys, values, queries, loop=loop, layers=layers,
            mean_bits=[FITTED_CODECS[key] for key, _ in pairs],
            value_spec=[None if value == "fit" else _spec(value, False, model.head_dim) for _, value in pairs])
    return {loop: [config.layer(layer).loops[loop] for layer in range(model.layers)] for loop in loops}


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """Windows of ``tokens`` bytes, ``prompt_tokens`` prefilled, the rest teacher forced; one batch of ``sequences``
    windows per seed. The fitted codecs and maps (and ``jflashloop loops --allocate``'s choice) are fitted on
    ``calibration_sequences`` windows of :data:`CALIBRATION_SEED` (None: ``sequences``)."""

    tokens: int = 512
    prompt_tokens: int = 192
    sequences: int = 8
    seeds: tuple[int, ...] = (0, 1, 2)
    query_positions: int = 8
    calibration_sequences: int | None = None

    def __post_init__(self):
        if self.calibration_sequences is not None and self.calibration_sequences < 1:
            raise ValueError(f"calibration_sequences must be at least 1 (or None), got {self.calibration_sequences}")

    def calibration(self) -> SweepSettings:
        """These settings with ``sequences`` the calibration windows' count (the batch of the fits)."""
        return dataclasses.replace(self, sequences=self.calibration_sequences or self.sequences,
                                   calibration_sequences=None)


def reference_run(params, model: ouro.OuroConfig, held_out: np.ndarray, settings: SweepSettings, seed: int
                  ) -> dict[str, Any]:
    """One seed's windows, their K/V, the BF16 caches' teacher-forced logits and the model's queries."""
    windows = held_out_windows(held_out, settings.sequences, settings.tokens + 1, seed)
    token_ids = jnp.asarray(windows[:, :settings.tokens])
    _, keys, values, _ = _forward(params, model, token_ids)
    prompt = slice(0, settings.prompt_tokens)
    bf16 = bfloat16_loop_caches(keys[:, :, :, prompt], values[:, :, :, prompt], settings.tokens)
    bf16_logits, _ = decode_tokens(params, model, bfloat16_dense_attention, bf16,
                                   token_ids[:, settings.prompt_tokens:], settings.prompt_tokens,
                                   donate_state=True)
    queries = model_queries(params, model, token_ids[:, prompt], settings.query_positions)
    return {"token_ids": token_ids, "keys": keys, "values": values, "bf16_logits": bf16_logits,
            "queries": np.asarray(queries)}


def prefilled_errors(model: ouro.OuroConfig, policy: tuple[Entry, ...], reference: dict[str, Any],
                     settings: SweepSettings, fitted: dict | None = None, predicted: dict | None = None):
    """``(cache, attention)``: the reference windows' prompts prefilled into the policy's cache, and each loop's and
    layer's attention error, float64 ``[loops, layers]`` (:func:`~jflashloop.apps.loops.metrics.attention_errors`,
    the model's queries at the prompt's last ``settings.query_positions`` positions)."""
    config = policy_config(policy, model, settings.sequences, settings.tokens, fitted=fitted, predicted=predicted)
    prompt = settings.prompt_tokens
    keys, values = reference["keys"][:, :, :, :prompt], reference["values"][:, :, :, :prompt]
    cache = prefill_cross_loop_cache(config, keys, values)
    stored_keys, stored_values = reconstruct_every_loop(cache, settings.sequences, prompt)
    positions = np.arange(prompt - settings.query_positions, prompt)
    return cache, attention_errors(reference["queries"], np.asarray(keys), np.asarray(values),
                                   np.asarray(stored_keys), np.asarray(stored_values), positions)


def measure(params, model: ouro.OuroConfig, policy: tuple[Entry, ...], reference: dict[str, Any],
            settings: SweepSettings, fitted: dict | None = None, predicted: dict | None = None
            ) -> dict[str, np.ndarray]:
    """``kl`` float64 ``[sequences]`` (mean over teacher-forced steps) and ``attention`` ``[loops]`` (mean over layers)."""
    cache, attention = prefilled_errors(model, policy, reference, settings, fitted, predicted)
    prompt = settings.prompt_tokens
    hook = looped_paged_attention_hook(model.layers, model.loops)
    logits, _ = decode_tokens(params, model, hook, cache, reference["token_ids"][:, prompt:], prompt)
    kl = kl_divergence(reference["bf16_logits"], logits).mean(axis=0)
    return {"kl": kl, "attention": attention.mean(axis=1)}


def bytes_per_token(config: CacheConfig) -> tuple[float, Fraction]:
    """Full-page bytes per token over all layers, and the exact ratio to four BF16 loop caches."""
    bf16 = storage.unquantized_bytes_per_token(config) * config.num_layers
    total = storage.pool_page_bytes(config)
    return total / config.page_size, Fraction(bf16 * config.page_size, total)


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """Which ``(bytes, kl)`` points no other point beats in both (fewer or equal bytes and lower KL)."""
    return [not any((b <= bytes_ and k < kl) or (b < bytes_ and k <= kl) for b, k in points)
            for bytes_, kl in points]


def sweep(params, model: ouro.OuroConfig, held_out: np.ndarray, settings: SweepSettings,
          policies: dict[str, tuple[str, ...]], *, log=print) -> dict[str, Any]:
    """Every policy on every seed's windows: per policy ``kl`` ``[seeds, sequences]``, ``attention``
    ``[seeds, loops]``, ``bytes_per_token`` and ``ratio``."""
    results = {name: {"kl": [], "attention": []} for name in policies}
    start = time.perf_counter()
    fitted = fitted_specs(params, model, held_out, policies.values(), settings)
    predicted = {name: fitted_predicted_loops(params, model, held_out, policy, settings, fitted)
                   for name, policy in policies.items()}
    for seed in settings.seeds:
        reference = reference_run(params, model, held_out, settings, seed)
        for name, policy in policies.items():
            measured = measure(params, model, policy, reference, settings, fitted, predicted[name])
            results[name]["kl"].append(measured["kl"])
            results[name]["attention"].append(measured["attention"])
            log(f"seed {seed} {name}: KL {measured['kl'].mean():.3e} attention "
                + " ".join(f"{e:.3f}" for e in measured["attention"])
                + f" ({time.perf_counter() - start:.0f} s)")
    for name, policy in policies.items():
        per_token, ratio = bytes_per_token(policy_config(policy, model, 1, PAGE_SIZE, fitted=fitted,
                                                         predicted=predicted[name]))
        results[name] = {"policy": policy, "kl": np.array(results[name]["kl"]),
                         "attention": np.array(results[name]["attention"]),
                         "bytes_per_token": per_token, "ratio": ratio}
    return {"settings": settings, "policies": results, "seconds": time.perf_counter() - start}


def describe_policy(policy: tuple[Entry, ...]) -> str:
    """``"int4 · int4 · int4 16 · int4 7"``: each loop's storage, loop 1 (the base) first (a per-layer entry as
    ``[layer 1, layer 2, ...]``)."""
    return " · ".join(entry if isinstance(entry, str) else f"[{', '.join(entry)}]" for entry in policy)


def format_table(results: dict[str, Any], baseline: str = "flashloop") -> str:
    """Markdown: one row per policy, fewest bytes first; the Pareto front (bytes vs KL) in bold.

    KL is the mean over every sequence and teacher-forced step of all seeds,
    with the lowest and highest per-seed mean; "vs FlashLoop" counts the
    sequences whose KL is at most the baseline's on the same windows.
    Attention errors are per loop (1-based, loops run), mean over layers and seeds.
    """
    policies = results["policies"]
    names = sorted(policies, key=lambda name: (policies[name]["bytes_per_token"], name))
    front = dict(zip(names, pareto_front([(policies[n]["bytes_per_token"], policies[n]["kl"].mean())
                                          for n in names]), strict=True))
    reference = policies[baseline]["kl"] if baseline in policies else None
    loops = policies[names[0]]["attention"].shape[1]
    header = ["policy", "loops 1 · 2 · 3 · 4", "bytes/token", "vs four BF16", "mean KL (nats)",
              "per-seed range", "sequences with KL ≤ FlashLoop's",
              *(f"attn err loop {loop + 1}" for loop in range(loops))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        entry = policies[name]
        per_seed = entry["kl"].mean(axis=1)
        wins = "" if reference is None else f"{int(np.sum(entry['kl'] <= reference))}/{entry['kl'].size}"
        cells = [f"**{name}**" if front[name] else name, describe_policy(entry["policy"]),
                 f"{entry['bytes_per_token']:,.1f}",
                 f"{float(entry['ratio']):.2f}x", f"{entry['kl'].mean():.2e}",
                 f"{per_seed.min():.2e}-{per_seed.max():.2e}", wins,
                 *(f"{value:.3f}" for value in entry["attention"].mean(axis=0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
