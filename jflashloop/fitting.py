"""Codecs fitted to a model's own keys, values and queries: ``jflashloop.fitting``.

Two fitted formats (:class:`~jflashloop.CodecSpec`, ``docs`` in its docstring) carry per-(kv head, channel)
tables that these functions choose from one layer's calibration tensors:

* ``int_mixed`` keys (:func:`fitted_keys`): each key channel gets its own code width. A channel's score error is
  ``E[q_c^2] * E[range_c^2] / (2^b - 1)^2`` (``q`` the queries of its GQA group, ``range`` the channel's span over
  a quantization group of tokens, ``b`` its width); :func:`fit_key_widths` minimizes the sum under a mean width
  per head, so a page holds INT4's bytes at a mean of 4 bits and fewer below.
* ``int4_scaled`` values (:func:`fitted_values`): each value channel is divided by ``(rms_c / g) ** exponent``
  (``rms_c`` its RMS, ``g`` the head's geometric mean of them) before INT4 per token, so one large channel no
  longer sets every token's step; the attention output is linear in the values, so nothing else changes.

And for a looped model's later loops, :func:`fitted_prediction`: a per-head affine map from the loop before
(:class:`~jflashloop.LoopPrediction`, ``LoopStorage.prediction``), fitted by least squares; through a cache of a
whole config, :func:`fit_predicted_loops` (every predicted loop's map) and :func:`fit_residual_codecs` (a dense
residual loop's codecs fitted to what it stores: the residual against its prediction or the loop before).

On SmolLM2-135M both together cut the held-out attention-output error 1.45x at INT4 G64's bytes
(``bench/QUALITY.md``, "Codes fitted to the model"). Fit on one text and check on another: the tables are
statistics of the calibration text.

Example:
  >>> import numpy as np
  >>> from jflashloop import fitting
  >>> rng = np.random.default_rng(0)
  >>> keys, values = rng.standard_normal((2, 256, 2, 64), dtype=np.float32)
  >>> queries = rng.standard_normal((256, 6, 64), dtype=np.float32)
  >>> spec = fitting.fitted_keys(keys, queries, mean_bits=4.0)
  >>> spec.format, spec.bits_per_element()
  ('int_mixed', 4.5)
  >>> fitting.fitted_values(values).format
  'int4_scaled'
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .cache._config import CacheConfig, LoopStorage, Policy
from .cache._prediction import LoopPrediction
from .codecs import INT4_KEYS, INT4_VALUES, CodecSpec, round_channel_scales

KEY_WIDTHS = (2, 3, 4, 5, 6)
"""The widths :func:`fit_key_widths` chooses from by default."""
VALUE_EXPONENT = 0.75
"""The default exponent of :func:`fit_value_scales` (the best of 0.25, 0.5, 0.75 and 1 on SmolLM2's calibration
text)."""


def _layer_tensor(name: str, x, heads: int | None = None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 3 or 0 in x.shape:
        raise ValueError(f"{name} must be [tokens, heads, head_dim] with no empty axis, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) or not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must hold finite floating-point numbers")
    return x.astype(np.float64)


def key_channel_weights(keys, queries, *, group_size: int = 64, sink_tokens: int = 4) -> np.ndarray:
    """float64 ``[kv_heads, head_dim]``: ``E[q_c^2] * E[range_c^2]`` of every key channel of one layer.

    Args:
      keys: float ``[tokens, kv_heads, head_dim]``, the layer's (post-RoPE) keys on calibration text.
      queries: float ``[query_tokens, q_heads, head_dim]``, the layer's queries: on the same tokens (then the
        sink tokens' queries are left out too) or any other sample of them (e.g. recorded while decoding; all
        count); query head ``j`` reads kv head ``j // (q_heads // kv_heads)``.
      group_size: tokens per key quantization group (the page's groups).
      sink_tokens: leading tokens left out (the cache keeps them exact).
    Raises:
      ValueError: shapes that disagree, non-finite values, or fewer than ``group_size`` tokens after the sinks.
    """
    keys, queries = _layer_tensor("keys", keys), _layer_tensor("queries", queries)
    tokens, heads, head_dim = keys.shape
    if queries.shape[2] != head_dim or queries.shape[1] % heads:
        raise ValueError(f"queries must be [query_tokens, a multiple of kv_heads={heads}, head_dim={head_dim}], "
                         f"got {queries.shape}")
    groups = (tokens - sink_tokens) // group_size
    if groups < 1:
        raise ValueError(f"need at least group_size={group_size} tokens after the {sink_tokens} sink tokens, "
                         f"got {tokens}")
    group = queries.shape[1] // heads
    sample = queries[sink_tokens:] if len(queries) == tokens else queries
    q2 = (sample.reshape(len(sample), heads, group, head_dim) ** 2).mean(axis=(0, 2))
    pages = keys[sink_tokens:sink_tokens + groups * group_size].reshape(groups, group_size, heads, head_dim)
    return q2 * ((pages.max(axis=1) - pages.min(axis=1)) ** 2).mean(axis=0)


def fit_key_widths(weights, mean_bits: float, *, widths=KEY_WIDTHS) -> np.ndarray:
    """int ``[..., D]``: for every row of ``weights`` ``[..., D]`` (non-negative), widths from ``widths`` that sum
    to ``mean_bits * D`` and minimize ``sum_c w_c / (2^b_c - 1)^2``.

    Greedy, one bit at a time to the channel that gains most; optimal, since a channel's gain per bit falls as
    its width grows (ties go to the lower channel index).

    Raises:
      ValueError: ``mean_bits * D`` not a whole number of bits, or outside ``[min(widths), max(widths)] * D``.
    """
    weights = np.asarray(weights, np.float64)
    widths = tuple(sorted(int(w) for w in widths))
    if weights.ndim < 1 or not np.all(np.isfinite(weights) & (weights >= 0)):
        raise ValueError("weights must be a non-empty array of finite, non-negative numbers")
    if widths != tuple(range(widths[0], widths[-1] + 1)) or widths[0] < 1 or widths[-1] > 8:
        raise ValueError(f"widths must be consecutive ints in 1..8, got {widths}")
    channels = weights.shape[-1]
    total = mean_bits * channels
    if abs(total - round(total)) > 1e-9 or not widths[0] * channels <= round(total) <= widths[-1] * channels:
        raise ValueError(f"mean_bits * head_dim = {total:g} must be a whole number of bits in "
                         f"[{widths[0] * channels}, {widths[-1] * channels}]")
    rows = weights.reshape(-1, channels)
    chosen = np.full(rows.shape, widths[0])

    def error(bits):
        return rows / (2.0**bits - 1) ** 2

    for _ in range(round(total) - widths[0] * channels):
        gain = np.where(chosen < widths[-1], error(chosen) - error(chosen + 1), -np.inf)
        chosen[np.arange(len(rows)), np.argmax(gain, axis=-1)] += 1
    return chosen.reshape(weights.shape)


def fit_value_scales(values, *, exponent: float = VALUE_EXPONENT, sink_tokens: int = 4) -> np.ndarray:
    """float32 ``[kv_heads, head_dim]``: ``int4_scaled`` divisors ``(rms_c / g) ** exponent`` of one layer's values
    ``[tokens, kv_heads, head_dim]`` (``rms_c`` over the tokens after the sinks, ``g`` each head's geometric mean of
    its channels' RMS, a channel that is always zero counted at the head's smallest non-zero RMS), rounded to 9
    significant bits (:func:`jflashloop.codecs.round_channel_scales`).
    """
    values = _layer_tensor("values", values)
    if values.shape[0] <= sink_tokens:
        raise ValueError(f"need tokens after the {sink_tokens} sink tokens, got {values.shape[0]}")
    if not 0 <= exponent <= 2:
        raise ValueError(f"exponent must be in [0, 2], got {exponent}")
    rms = np.sqrt((values[sink_tokens:] ** 2).mean(axis=0))  # [H, D]
    floor = np.where(rms > 0, rms, np.inf).min(axis=1, keepdims=True)
    rms = np.where(rms > 0, rms, np.where(np.isfinite(floor), floor, 1.0))
    relative = rms / np.exp(np.log(rms).mean(axis=1, keepdims=True))
    return round_channel_scales(relative**exponent)


def fitted_prediction(previous_keys, previous_values, keys, values, *, sink_tokens: int = 4) -> LoopPrediction:
    """The :class:`~jflashloop.LoopPrediction` of one layer's loop from the loop before it, by least squares.

    Per KV head, ``x ~ previous @ M + b`` for the keys and for the values over the tokens after the sinks (float64
    solve, tables rounded to float32). Fit on the *reconstruction* of the loop before (as the cache decodes it:
    :func:`jflashloop.paged_cache.reconstruct`), since that is what the cache applies the prediction to.

    Args:
      previous_keys, previous_values: float ``[tokens, kv_heads, head_dim]``, the loop before (reconstructed).
      keys, values: float ``[tokens, kv_heads, head_dim]``, the loop to predict (exact), the same tokens.
      sink_tokens: leading tokens left out (the cache keeps them exact).
    Returns:
      A :class:`~jflashloop.LoopPrediction` of ``kv_heads`` heads.
    Raises:
      ValueError: shapes that differ, non-finite inputs, or fewer than ``head_dim + 1`` tokens after the sinks.
    """
    tensors = [_layer_tensor(name, x) for name, x in (("previous_keys", previous_keys),
                                                      ("previous_values", previous_values), ("keys", keys),
                                                      ("values", values))]
    if len({x.shape for x in tensors}) != 1:
        raise ValueError(f"the four tensors must have one shape, got {[x.shape for x in tensors]}")
    tokens, heads, head_dim = tensors[0].shape
    if tokens - sink_tokens < head_dim + 1:
        raise ValueError(f"need at least head_dim + 1 = {head_dim + 1} tokens after the {sink_tokens} sink tokens, "
                         f"got {tokens - sink_tokens}")
    tables = []
    for source, target in ((tensors[0], tensors[2]), (tensors[1], tensors[3])):
        matrices, biases = [], []
        for head in range(heads):
            design = np.concatenate([source[sink_tokens:, head], np.ones((tokens - sink_tokens, 1))], axis=1)
            solution = np.linalg.lstsq(design, target[sink_tokens:, head], rcond=None)[0]  # [D + 1, D]
            matrices.append(solution[:-1])
            biases.append(solution[-1])
        tables += [np.stack(matrices), np.stack(biases)]
    return LoopPrediction.from_arrays(*tables)


def fit_predicted_loops(config: CacheConfig, keys, values, *, loops=None) -> CacheConfig:
    """``config`` with the map of every predicted loop fitted, loop by loop, on calibration sequences.

    Each layer's predicted loop ``r`` (a :class:`~jflashloop.LoopStorage` with a ``prediction``; its current map is
    replaced, e.g. :meth:`~jflashloop.LoopPrediction.identity` as a placeholder) gets :func:`fitted_prediction` of
    loop ``r - 1`` as a cache of ``config``'s policy reconstructs it (with the loops before already fitted) to
    loop ``r``'s exact K/V, over the positions the cache serves from its pages.

    Args:
      config: the cache's configuration (its policy; its pool sizes do not matter).
      keys, values: float ``[sequences, layers, loops, tokens, kv_heads, head_dim]``, calibration sequences (each
        one :func:`jflashloop.paged_cache.prefill`'s input).
      loops: the loops whose maps are fitted (0-based; default every predicted loop); the others keep theirs.
    Returns:
      ``config`` with the fitted maps (per layer: ``layer_loops``), for :meth:`CacheConfig.predicted_loops` or any
      policy with predicted loops. Example: ``fit_predicted_loops(CacheConfig.predicted_loops(predictions=[[
      LoopPrediction.identity(H, D)] * (loops - 2)] * layers, ...), keys, values)``.
    Raises:
      ValueError: arrays of another shape than the config's, or too few page positions for a map
        (:func:`fitted_prediction`).
    """
    keys, values = _calibration_tensors(config, keys, values)
    layers, num_loops = keys.shape[1:3]
    layer_loops = [list(config.layer(layer).loops) for layer in range(layers)]
    for loop in range(1, num_loops) if loops is None else sorted(set(loops) - {0}):
        if all(layer_loops[layer][loop].prediction is None for layer in range(layers)):
            continue
        config = config.with_layer_loops(layer_loops)
        calibration = _CalibrationCache.of(config, keys, values)
        for layer in range(layers):
            if layer_loops[layer][loop].prediction is None:
                continue
            layer_loops[layer][loop] = dataclasses.replace(
                layer_loops[layer][loop], prediction=fitted_prediction(
                    *calibration.reconstruction(layer, loop - 1), *calibration.exact(layer, loop), sink_tokens=0))
    return config.with_layer_loops(layer_loops)


def fit_residual_codecs(config: CacheConfig, keys, values, queries, *, loop: int, mean_bits=4.0, value_spec=None,
                        layers=None) -> CacheConfig:
    """``config`` with loop ``loop``'s dense residual stored in codecs fitted to that residual, layer by layer.

    A residual loop stores ``x - reference``: the loop before as the cache reconstructs it, or its
    :class:`~jflashloop.LoopPrediction` of it (``LoopStorage.prediction``), or nothing for a direct loop. Each layer's
    loop ``loop`` gets :func:`fitted_keys` (``int_mixed``, ``mean_bits``) and :func:`fitted_values`
    (``int4_scaled``) of that residual on calibration sequences, through a cache of ``config``'s policy (the loops
    before as it stores them; fit a predicted loop's map first, :func:`fit_predicted_loops`, then its codecs, then
    the maps of the loops after it again, since they predict from this loop's reconstruction).

    Args:
      config: the cache's configuration; loop ``loop`` (1 <= loop < loops) is dense (no sparse rows) in every layer.
      keys, values: float ``[sequences, layers, loops, tokens, kv_heads, head_dim]``, calibration sequences.
      queries: float ``[sequences, layers, loops, query_tokens, q_heads, head_dim]``, the model's queries on them
        (any positions: :func:`key_channel_weights`).
      loop: the residual loop (0-based; the base is coded on its own: :func:`fitted_policy`).
      mean_bits: the keys' mean width (``mean_bits * head_dim`` a multiple of 32): one for every layer, or a sequence
        of one per layer of the config.
      value_spec: the values' codec; None (default): :func:`fitted_values` of the residual; one for every layer, or a
        sequence of one per layer of the config.
      layers: the layers to fit (0-based; default every layer); the others keep their storage.
    Returns:
      ``config`` with per-layer loops (``layer_loops``) whose loop ``loop`` stores fitted codecs.
    Raises:
      ValueError: arrays of another shape than the config's, ``loop`` out of range, a loop with sparse rows, per-layer
        sequences of another length than the layers, or too few page positions for a key group.
    """
    keys, values = _calibration_tensors(config, keys, values)
    queries = np.asarray(queries, np.float32)
    sequences, num_layers, loops = keys.shape[:3]
    if queries.ndim != 6 or queries.shape[:3] != keys.shape[:3] or queries.shape[5] != config.head_dim:
        raise ValueError(f"queries must be [sequences={sequences}, layers={num_layers}, loops={loops}, query_tokens, "
                         f"q_heads, head_dim={config.head_dim}], got {queries.shape}")
    if not 1 <= loop < loops:
        raise ValueError(f"loop must be a residual loop, 1 <= loop < {loops}, got {loop}")
    mean_bits = _per_layer("mean_bits", mean_bits, num_layers, _width)
    value_spec = _per_layer("value_spec", value_spec, num_layers, functools.partial(_codec_spec, "value_spec"))
    chosen = range(num_layers) if layers is None else sorted(set(int(layer) for layer in layers))
    if any(not 0 <= layer < num_layers for layer in chosen):
        raise ValueError(f"layers must be in [0, {num_layers}), got {list(layers)}")
    layer_loops = [list(config.layer(layer).loops) for layer in range(num_layers)]
    if any(layer_loops[layer][loop].is_sparse for layer in chosen):
        raise ValueError(f"loop {loop} stores sparse rows; fitted codecs are dense")
    calibration = _CalibrationCache.of(config, keys, values)
    for layer in chosen:
        storage = layer_loops[layer][loop]
        exact = calibration.exact(layer, loop)
        if storage.direct:
            residual = exact
        else:
            before = calibration.reconstruction(layer, loop - 1)
            reference = storage.prediction.apply(*before) if storage.prediction is not None else before
            residual = [x - np.asarray(r) for x, r in zip(exact, reference, strict=True)]
        layer_queries = queries[:, layer, loop].reshape(-1, *queries.shape[4:])
        layer_loops[layer][loop] = dataclasses.replace(
            storage, key_spec=fitted_keys(residual[0], layer_queries, mean_bits[layer], group_size=config.page_size,
                                          sink_tokens=0),
            value_spec=fitted_values(residual[1], sink_tokens=0) if value_spec[layer] is None else value_spec[layer])
    return config.with_layer_loops(layer_loops)


def fitted_codecs(keys, values, queries, mean_bits: float = 4.0, *, group_size: int = 64, sink_tokens: int = 4
                  ) -> tuple[CodecSpec, CodecSpec]:
    """``(int_mixed key spec, int4_scaled value spec)`` of one layer from several calibration sequences: the key
    channels' weights (:func:`key_channel_weights`) averaged over the sequences, the value divisors
    (:func:`fitted_values`) over all their tokens after the sinks.

    Args:
      keys, values: float ``[sequences, tokens, kv_heads, head_dim]``.
      queries: float ``[sequences, query_tokens, q_heads, head_dim]``, each sequence's queries.
      mean_bits: the keys' mean width; group_size: tokens per key group; sink_tokens: leading tokens left out.
    Raises:
      ValueError: arrays of other shapes, or what :func:`key_channel_weights` raises.
    """
    keys, values, queries = (np.asarray(x, np.float32) for x in (keys, values, queries))
    if keys.ndim != 4 or values.shape != keys.shape or queries.ndim != 4 or len(queries) != len(keys):
        raise ValueError("keys and values must be [sequences, tokens, kv_heads, head_dim] of one shape and queries "
                         f"[sequences, query_tokens, q_heads, head_dim], got {keys.shape}, {values.shape}, "
                         f"{queries.shape}")
    weights = np.mean([key_channel_weights(k, q, group_size=group_size, sink_tokens=sink_tokens)
                       for k, q in zip(keys, queries, strict=True)], axis=0)
    return (keys_from_weights(weights, mean_bits, group_size=group_size),
            fitted_values(values[:, sink_tokens:].reshape(-1, *values.shape[2:]), sink_tokens=0))


def fitted_loops(keys, values, queries, *, base_bits=3.5, loop_bits=3.5, loop_values=None, **config) -> CacheConfig:
    """A fitted looped layout at FlashLoop's quality in fewer bytes: a :class:`~jflashloop.CacheConfig` fitted to a
    looped model's calibration sequences.

    Loop 0 (the base) in fitted codecs at a mean key width of ``base_bits`` (:func:`fitted_keys` with the base's
    queries, key weights averaged over the sequences; :func:`fitted_values`); loop 1 predicted from loop 0
    (:func:`fit_predicted_loops`) with its dense residual against the prediction in codecs fitted to that residual
    at ``loop_bits`` (:func:`fit_residual_codecs`); every later loop predicted from the loop before with no rows
    (their maps fitted last, from loop 1 as the cache stores it). On the shipped looped checkpoint (``bench/LOOPS.md``,
    "Loop 2's residual in codecs fitted to it"): 2,176 bytes a token, 7.53x less than four BF16 loop caches, with
    0.61x the teacher-forced KL of FlashLoop's policy and less attention error in every loop. Widths and value
    codecs chosen per layer reach 7.88x there at FlashLoop's quality on every measure: ``base_bits=(4, 3, 3.5,
    3.5), loop_bits=(4, 3, 3, 3), loop_values=(None, INT3, None, INT3)`` (``INT3 = CodecSpec("int3", "token",
    64)``; 2,080 bytes a token). The fused kernels do not read fitted codecs (the reference path reads this cache);
    :meth:`CacheConfig.predicted_loops` is the fused layout (7.11x).

    Args:
      keys, values: float ``[sequences, layers, loops, tokens, kv_heads, head_dim]``, calibration sequences (each
        :func:`jflashloop.paged_cache.prefill`'s input; ``loops >= 2``).
      queries: float ``[sequences, layers, loops, query_tokens, q_heads, head_dim]``, the model's queries on them.
      base_bits, loop_bits: mean key widths of loop 0 and of loop 1's residual (each times ``head_dim`` a multiple
        of 32): one for every layer, or a sequence of one per layer.
      loop_values: loop 1's value codec: None (default) fits ``int4_scaled`` values to the residual
        (:func:`fitted_values`), a :class:`~jflashloop.CodecSpec` stores it as given; one for every layer, or a
        sequence of one per layer.
      **config: the other :class:`~jflashloop.CacheConfig` fields (``num_pages``, ``max_sequences``,
        ``max_pages_per_sequence``, ``page_size``, ``sink_tokens``, ``recent_tokens``...); the key groups are a page.
    Returns:
      The config, with per-layer loops (``layer_loops``).
    Raises:
      ValueError: arrays of other shapes (fewer than 2 loops), per-layer sequences of another length than the
        layers, widths that are not whole 32-bit rows, or fewer calibration tokens than a key group or a map needs.
    """
    keys, values, queries = (np.asarray(x, np.float32) for x in (keys, values, queries))
    if keys.ndim != 6 or values.shape != keys.shape or keys.shape[2] < 2 or queries.ndim != 6 or \
            queries.shape[:3] != keys.shape[:3] or queries.shape[5] != keys.shape[5]:
        raise ValueError("keys and values must be [sequences, layers, loops >= 2, tokens, kv_heads, head_dim] of one "
                         "shape and queries [sequences, layers, loops, query_tokens, q_heads, head_dim], got "
                         f"{keys.shape}, {values.shape}, {queries.shape}")
    _, layers, loops, _, heads, head_dim = keys.shape
    base_bits, loop_bits = (_per_layer(name, x, layers, _width) for name, x in (("base_bits", base_bits),
                                                                               ("loop_bits", loop_bits)))
    loop_values = _per_layer("loop_values", loop_values, layers, functools.partial(_codec_spec, "loop_values"))
    shape = CacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, **config)
    sinks, group = shape.sink_tokens, shape.page_size
    identity = LoopPrediction.identity(heads, head_dim)
    per_layer = []
    for layer in range(layers):
        base = LoopStorage(*fitted_codecs(keys[:, layer, 0], values[:, layer, 0], queries[:, layer, 0],
                                          base_bits[layer], group_size=group, sink_tokens=sinks))
        per_layer.append((base, LoopStorage(INT4_KEYS, INT4_VALUES, prediction=identity),
                          *[LoopStorage(INT4_VALUES, INT4_VALUES, 0, prediction=identity)] * (loops - 2)))
    fitted = fit_predicted_loops(dataclasses.replace(shape, loops=per_layer[0]).with_layer_loops(per_layer),
                                 keys, values, loops=[1])
    fitted = fit_residual_codecs(fitted, keys, values, queries, loop=1, mean_bits=loop_bits, value_spec=loop_values)
    return fit_predicted_loops(fitted, keys, values, loops=range(2, loops))


def _per_layer(name: str, value, layers: int, convert) -> tuple:
    """``convert(value)`` for each of ``layers`` layers: one value for all, or a sequence of one per layer."""
    if value is None or isinstance(value, CodecSpec) or np.ndim(value) == 0:
        return (convert(value),) * layers
    chosen = tuple(convert(x) for x in value)
    if len(chosen) != layers:
        raise ValueError(f"{name} must be one value or one per layer ({layers} layers), got {len(chosen)}")
    return chosen


def _width(bits) -> float:
    try:
        return float(bits)
    except (TypeError, ValueError):
        raise ValueError(f"key widths must be numbers, got {bits!r}") from None


def _codec_spec(name: str, spec) -> CodecSpec | None:
    if spec is not None and not isinstance(spec, CodecSpec):
        raise ValueError(f"{name} must be None, a CodecSpec or one of those per layer, got {spec!r}")
    return spec


def _calibration_tensors(config: CacheConfig, keys, values) -> tuple[np.ndarray, np.ndarray]:
    keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    if keys.shape != values.shape or keys.ndim != 6 or keys.shape[1:3] != (config.num_layers, config.num_loops) or \
            keys.shape[4:] != (config.num_kv_heads, config.head_dim):
        raise ValueError(f"keys and values must be [sequences, layers={config.num_layers}, loops={config.num_loops}, "
                         f"tokens, kv_heads={config.num_kv_heads}, head_dim={config.head_dim}], got {keys.shape} and "
                         f"{values.shape}")
    return keys, values


@functools.cache
def _jitted_prefill():
    import jax  # the cache is a JAX structure; the rest of this module is numpy

    from . import paged_cache

    return jax.jit(paged_cache.prefill)


@dataclasses.dataclass(frozen=True)
class _CalibrationCache:
    """Calibration sequences prefilled into a cache of one policy, and the page positions it serves."""

    cache: object
    served: tuple[np.ndarray, ...]  # per sequence: the positions read from pages
    keys: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, config: CacheConfig, keys: np.ndarray, values: np.ndarray) -> _CalibrationCache:
        from . import paged_cache

        sequences, tokens = keys.shape[0], keys.shape[3]
        pages = -(-tokens // config.page_size)
        cache = paged_cache.create(dataclasses.replace(config, num_pages=sequences * pages, max_sequences=sequences,
                                                       max_pages_per_sequence=pages))
        for sequence in range(sequences):
            cache = _jitted_prefill()(cache, sequence, keys[sequence], values[sequence])
        served = tuple(np.flatnonzero(np.asarray(paged_cache.sequence_regions(cache, s)["pages"]))
                       for s in range(sequences))
        return cls(cache, served, keys, values)

    def reconstruction(self, layer: int, loop: int) -> list[np.ndarray]:
        """float32 ``[K, V]``, each ``[served tokens of every sequence, H, D]``: the loop as the cache decodes it."""
        from . import paged_cache

        decoded = [paged_cache.reconstruct(self.cache, layer, loop, s)[:2] for s in range(len(self.served))]
        return [np.concatenate([np.asarray(d[i])[at] for d, at in zip(decoded, self.served, strict=True)])
                for i in (0, 1)]

    def exact(self, layer: int, loop: int) -> list[np.ndarray]:
        """float32 ``[K, V]`` of the calibration tensors at the same positions."""
        return [np.concatenate([x[s, layer, loop][at] for s, at in enumerate(self.served)])
                for x in (self.keys, self.values)]


def keys_from_weights(weights, mean_bits: float = 4.0, *, group_size: int = 64, widths=KEY_WIDTHS) -> CodecSpec:
    """The ``int_mixed`` key spec (per channel over ``group_size`` tokens) of :func:`fit_key_widths` of
    ``weights`` float ``[kv_heads, head_dim]`` (e.g. :func:`key_channel_weights` averaged over several samples)."""
    chosen = fit_key_widths(weights, mean_bits, widths=widths)
    return CodecSpec("int_mixed", "channel", group_size, channel_bits=chosen.tolist())


def fitted_keys(keys, queries, mean_bits: float = 4.0, *, group_size: int = 64, sink_tokens: int = 4,
                widths=KEY_WIDTHS) -> CodecSpec:
    """The ``int_mixed`` key spec of one layer: :func:`keys_from_weights` of :func:`key_channel_weights`.

    ``mean_bits * head_dim`` must be a multiple of 32 for a cache's pages (a row in whole 32-bit words): at
    head_dim 64, means of 3, 3.5, 4, 4.5, ...; the spec then stores ``mean_bits + 32 / group_size`` bits per
    element. Arguments as in those functions.
    """
    weights = key_channel_weights(keys, queries, group_size=group_size, sink_tokens=sink_tokens)
    return keys_from_weights(weights, mean_bits, group_size=group_size, widths=widths)


def fitted_values(values, *, group_size: int = 64, exponent: float = VALUE_EXPONENT,
                  sink_tokens: int = 4) -> CodecSpec:
    """The ``int4_scaled`` value spec of one layer (per token over ``group_size`` channels): the divisors of
    :func:`fit_value_scales`."""
    scales = fit_value_scales(values, exponent=exponent, sink_tokens=sink_tokens)
    return CodecSpec("int4_scaled", "token", group_size, channel_scale=scales.tolist())


def fitted_policy(keys, values, queries, mean_bits: float = 4.0, *, name: str = "fitted", group_size: int = 64,
                  value_group_size: int = 64, sink_tokens: int = Policy.sink_tokens, recent_tokens: int | None = Policy.recent_tokens,
                  page_size: int = Policy.page_size) -> Policy:
    """A per-layer :class:`~jflashloop.Policy` of fitted codecs for a whole model: layer ``l`` takes
    :func:`fitted_keys` and :func:`fitted_values` of its own tensors.

    Args:
      keys, values: float ``[layers, tokens, kv_heads, head_dim]``, the model's (post-RoPE) K/V on calibration
        text.
      queries: float ``[layers, tokens, q_heads, head_dim]``, its queries on the same tokens.
      mean_bits: mean key width (``mean_bits * head_dim`` a multiple of 32).
      group_size: tokens per key group (must divide ``page_size``); value_group_size: channels per value group.
      name, sink_tokens, recent_tokens, page_size: the policy's.
    Returns:
      ``Policy`` with ``layer_specs``; ``policy.cache_config(num_layers=layers, num_kv_heads=..., head_dim=...,
      max_tokens=...)`` makes the cache, :func:`jflashloop.allocation.save_policy` its file.

    Example:
      >>> import numpy as np
      >>> from jflashloop import fitting
      >>> rng = np.random.default_rng(0)
      >>> keys, values = rng.standard_normal((2, 2, 256, 2, 64), dtype=np.float32)
      >>> queries = rng.standard_normal((2, 256, 4, 64), dtype=np.float32)
      >>> policy = fitting.fitted_policy(keys, values, queries)
      >>> len(policy.layer_specs), policy.layer_specs[1][0].format
      (2, 'int_mixed')
    """
    keys, values, queries = np.asarray(keys), np.asarray(values), np.asarray(queries)
    if keys.ndim != 4 or values.shape != keys.shape or queries.ndim != 4 or len(queries) != len(keys):
        raise ValueError("keys and values must be [layers, tokens, kv_heads, head_dim] of one shape and queries "
                         f"[layers, tokens, q_heads, head_dim], got {keys.shape}, {values.shape}, {queries.shape}")
    specs = tuple((fitted_keys(keys[layer], queries[layer], mean_bits, group_size=group_size,
                               sink_tokens=sink_tokens),
                   fitted_values(values[layer], group_size=value_group_size, sink_tokens=sink_tokens))
                  for layer in range(len(keys)))
    return Policy(name, specs[0][0], specs[0][1], sink_tokens, recent_tokens, page_size, layer_specs=specs)
