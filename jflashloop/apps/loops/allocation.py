"""``jflashloop loops --allocate BYTES``: a looped model's two dense loops chosen per layer under a byte budget.

The fitted cross-loop layout (:func:`jflashloop.fitting.fitted_loops`: the base in fitted codecs, loop 2 predicted
from loop 1 with a dense residual in codecs fitted to it, later loops predicted with nothing stored) leaves two
choices in every layer: the base's codecs and loop 2's residual codecs. On the calibration windows
(:data:`~jflashloop.apps.loops.policies.CALIBRATION_SEED`, never one of the measured seeds):

1. :func:`sensitivity`: each base candidate's loop-1 attention error per layer (:data:`BASES`, every layer in that
   codec) and each residual candidate's loop-2 error per layer (:func:`residual_entries`: keys fitted at a mean
   width of :data:`RESIDUAL_KEYS`, values of :data:`RESIDUAL_VALUES`; measured over the ``fit`` base, so loop 2's
   errors are those of one base), beside FlashLoop's policy's mean loop-1 and loop-2 errors;
2. :func:`choose`: the per-layer pairs (base, residual) that bring both loops closest under FlashLoop's errors, the
   least ``max(loop-1 error / FlashLoop's, loop-2 error / FlashLoop's)`` (means over layers) among the exact
   knapsacks of :func:`weighted_choice` for loop-1 weights from 1/8 to 8 (:data:`WEIGHTS`), with the two loops'
   full-page bytes per token, every layer, at most the budget.

The chosen policies (one entry per layer for loops 1-2, ``"pred"`` after) are measured with FlashLoop's on the
held-out windows by the sweep (:func:`~jflashloop.apps.loops.policies.sweep`); :func:`fitted_loops_arguments`
gives the same layout as :func:`jflashloop.fitting.fitted_loops`'s per-layer arguments.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from ... import allocation
from ...models import ouro
from . import policies

BASES = ("fit", "fit3.5", "fit3")
"""The base's candidates: fitted codecs at a mean key width of 4, 3.5 and 3 bits (:data:`policies.FITTED_CODECS`)."""
RESIDUAL_KEYS = ("fit5", "fit4.5", "fit", "fit3.5", "fit3")
"""Loop 2's residual key candidates: keys fitted to the residual at these mean widths."""
RESIDUAL_VALUES = ("fit", "int4", "int3", "int3lm")
"""Loop 2's residual value candidates: values fitted to the residual (``int4_scaled``), INT4 G64, INT3 G64 or the 3-bit
Lloyd-Max ``int3_lloyd_max`` (3.25 bits at head_dim 64; the residual is zero-centred)."""


def residual_entries() -> list[str]:
    """Loop 2's candidates as sweep entries: ``"pred fit3.5"`` (fitted values) or ``"pred fit3/int3"``."""
    return [f"{policies.PREDICTED} {key}" + ("" if value == "fit" else f"/{value}")
            for key, value in itertools.product(RESIDUAL_KEYS, RESIDUAL_VALUES)]


def candidate_policy(model: ouro.OuroConfig, base, residual) -> tuple:
    """The looped policy of ``base`` and ``residual`` (entries, or tuples of one per layer) in loops 1-2, every later
    loop predicted with nothing stored."""
    return (base, residual, *[policies.PREDICTED] * (model.loops - 2))


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """Calibration errors and costs of the candidates.

    Attributes:
      base_errors: float64 ``[layers, len(BASES)]``: loop 1's attention error per layer with each base.
      residual_errors: float64 ``[layers, residuals]``: loop 2's, with each of :func:`residual_entries`.
      base_bits, residual_bits: float64 ``[len(BASES)]``, ``[residuals]``: bits per K/V element each stores
        (metadata included).
      flashloop: FlashLoop's policy's loop-1 and loop-2 attention errors, means over layers.
      elements: K/V elements of one loop and layer a token (``2 x kv_heads x head_dim``).
    """

    base_errors: np.ndarray
    residual_errors: np.ndarray
    base_bits: np.ndarray
    residual_bits: np.ndarray
    flashloop: tuple[float, float]
    elements: int


def sensitivity(params, model: ouro.OuroConfig, held_out: np.ndarray, settings: policies.SweepSettings, *,
                log=print) -> Sensitivity:
    """Every candidate's per-layer calibration errors (module docstring, step 1): ``len(BASES) + residuals + 1``
    caches of the calibration windows (``settings.calibration_sequences`` of them), each with its fitted codecs and
    maps."""
    if model.loops < 2:
        raise ValueError(f"a looped allocation needs at least 2 loops, got {model.loops}")
    candidates = {("base", base): candidate_policy(model, base, f"{policies.PREDICTED} fit") for base in BASES}
    candidates.update({("residual", entry): candidate_policy(model, "fit", entry) for entry in residual_entries()})
    candidates[("flashloop", "")] = policies.FLASHLOOP[:model.loops]
    seed = policies.CALIBRATION_SEED
    settings = settings.calibration()  # the calibration windows: the fits' and the errors'
    reference = policies.reference_run(params, model, held_out, settings, seed)
    fitted = policies.fitted_specs(params, model, held_out, candidates.values(), settings, seed)
    errors, bits = {}, {}
    for index, (name, policy) in enumerate(candidates.items(), 1):
        predicted = policies.fitted_predicted_loops(params, model, held_out, policy, settings, fitted, seed)
        _, errors[name] = policies.prefilled_errors(model, policy, reference, settings, fitted, predicted)
        config = policies.policy_config(policy, model, 1, policies.PAGE_SIZE, fitted=fitted, predicted=predicted)
        loop = 0 if name[0] == "base" else 1
        storage = config.layer(0).loops[loop]
        bits[name] = (storage.key_spec.bits_per_element() + storage.value_spec.bits_per_element()) / 2
        log(f"[{index}/{len(candidates)}] {name[0]} {name[1]}: loop {loop + 1} errors "
            + " ".join(f"{e:.3f}" for e in errors[name][loop]))
        jax.clear_caches()  # each candidate's cache functions are compiled for it alone (0.4 GiB each, kept otherwise)
    residuals = residual_entries()
    flashloop = errors[("flashloop", "")]
    return Sensitivity(
        base_errors=np.stack([errors[("base", base)][0] for base in BASES], axis=1),
        residual_errors=np.stack([errors[("residual", entry)][1] for entry in residuals], axis=1),
        base_bits=np.array([bits[("base", base)] for base in BASES]),
        residual_bits=np.array([bits[("residual", entry)] for entry in residuals]),
        flashloop=(float(flashloop[0].mean()), float(flashloop[1].mean())),
        elements=2 * model.kv_heads * model.head_dim)


WEIGHTS = tuple(float(w) for w in np.geomspace(1 / 8, 8, 25))
"""Loop 1's weights (against loop 2's 1, each error over FlashLoop's) that :func:`choose` tries."""


def weighted_choice(found: Sensitivity, bytes_per_token: float, weight: float = 1.0) -> np.ndarray:
    """int64 ``[layers]``: indices into the ``[bases x residuals]`` pairs of :func:`jflashloop.allocation.allocate`'s
    exact choice: the least sum over layers of ``weight x`` loop 1's error over FlashLoop's plus loop 2's over
    FlashLoop's, the two loops storing at most ``bytes_per_token`` full-page bytes a token over all layers.

    Raises:
      ValueError: a budget below the cheapest pairs.
    """
    layers = found.base_errors.shape[0]
    errors = (weight * found.base_errors[:, :, None] / found.flashloop[0]
              + found.residual_errors[:, None, :] / found.flashloop[1])  # [layers, bases, residuals]
    bits = found.base_bits[:, None] + found.residual_bits[None, :]  # both loops' bits per element
    return allocation.allocate(errors.reshape(layers, -1), bits.reshape(-1),
                               8 * bytes_per_token / (layers * found.elements))


def pairs_entries(picks) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(bases, residuals)`` entries of pair indices (:func:`weighted_choice`)."""
    residuals = residual_entries()
    return (tuple(BASES[p // len(residuals)] for p in picks), tuple(residuals[p % len(residuals)] for p in picks))


def choose(found: Sensitivity, bytes_per_token: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(bases, residuals)``, one entry per layer, within ``bytes_per_token`` (module docstring, step 2): of the
    :func:`weighted_choice` for each of :data:`WEIGHTS`, the least larger loop error over FlashLoop's (ties: the
    smaller sum of both).

    Raises:
      ValueError: a budget below the cheapest pairs.
    """
    best = None
    for weight in WEIGHTS:
        bases, residuals = pairs_entries(weighted_choice(found, bytes_per_token, weight))
        first, second = calibration_errors(found, bases, residuals)
        ratios = (first / found.flashloop[0], second / found.flashloop[1])
        key = (max(ratios), sum(ratios))
        if best is None or key < best[0]:
            best = (key, bases, residuals)
    return best[1], best[2]


def chosen_policy(model: ouro.OuroConfig, found: Sensitivity, bytes_per_token: float) -> tuple:
    """The sweep policy of :func:`choose` (per-layer entries in loops 1-2)."""
    return candidate_policy(model, *choose(found, bytes_per_token))


def calibration_errors(found: Sensitivity, bases, residuals) -> tuple[float, float]:
    """The mean loop-1 and loop-2 calibration errors of per-layer ``bases`` and ``residuals``."""
    rows = np.arange(len(bases))
    residual_index = residual_entries()
    return (float(found.base_errors[rows, [BASES.index(b) for b in bases]].mean()),
            float(found.residual_errors[rows, [residual_index.index(r) for r in residuals]].mean()))


def fitted_loops_arguments(bases, residuals, head_dim: int) -> dict:
    """The same layout as :func:`jflashloop.fitting.fitted_loops` arguments: ``base_bits``, ``loop_bits`` and
    ``loop_values`` (None for fitted values, else the value spec of :data:`RESIDUAL_VALUES`), one per layer."""
    keys, values = zip(*(entry.removeprefix(policies.PREDICTED).strip().partition("/")[::2] for entry in residuals),
                       strict=True)
    return dict(base_bits=tuple(policies.FITTED_CODECS[b] for b in bases),
                loop_bits=tuple(policies.FITTED_CODECS[k] for k in keys),
                loop_values=tuple(None if v in ("", "fit") else policies._spec(v, False, head_dim) for v in values))
