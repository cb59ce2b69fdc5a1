"""Per-layer storage policies chosen under a bit budget, and their JSON files: ``jflashloop.allocation``.

Layers of a model differ in how much a format's error costs them. Given each
layer's error with each candidate format (measured by the caller, e.g. the
attention-output error with the model's own queries, ``jflashloop allocate``)
and each candidate's storage cost, :func:`allocate` picks one candidate per
layer that minimizes the summed error under an average-cost budget (an exact
multiple-choice knapsack). :func:`candidate_bits` prices a candidate as the
bits per K/V element one sequence really stores at a stated context length,
the unquantized sink and recent windows included.

A chosen policy is a :class:`~jflashloop.Policy` with ``layer_specs``;
:func:`save_policy` writes it as a small versioned JSON document and
:func:`load_policy` reads it back (validated), ready for
``policy.cache_config(...)``, the :class:`~jflashloop.CacheConfig` with one
storage policy per layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .cache._config import Policy
from .cache._storage import sequence_bytes
from .codecs import CodecSpec

POLICY_FORMAT = "jflashloop.layer_policy"
POLICY_VERSION = 1
COST_RESOLUTION = 1024
"""Costs are rounded up to multiples of ``1 / COST_RESOLUTION`` bit for the exact search (so a chosen
policy never exceeds its budget)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One per-layer choice: a key codec and a value codec.

    Attributes:
      name: a label for tables.
      key_spec, value_spec: the codecs (a one-loop cache's K and V); with ``layer_specs``, layer 0's.
      layer_specs: None (every layer takes ``key_spec``/``value_spec``), or one ``(key_spec, value_spec)`` per
        layer: a family fitted to each layer (:mod:`jflashloop.fitting`) whose layers store the same bytes.
    """

    name: str
    key_spec: CodecSpec
    value_spec: CodecSpec
    layer_specs: tuple[tuple[CodecSpec, CodecSpec], ...] | None = None

    def specs(self, layer: int) -> tuple[CodecSpec, CodecSpec]:
        """``(key_spec, value_spec)`` of layer ``layer``."""
        return (self.key_spec, self.value_spec) if self.layer_specs is None else self.layer_specs[layer]

    @classmethod
    def per_layer(cls, name: str, layer_specs) -> Candidate:
        """A candidate of one ``(key_spec, value_spec)`` per layer (``layer_specs``, a sequence of pairs).

        Raises:
          ValueError: no layers, or layers whose codecs store different bytes (the allocation prices a
            candidate once).
        """
        layer_specs = tuple((key, value) for key, value in layer_specs)
        if not layer_specs:
            raise ValueError(f"candidate {name!r} needs at least one layer's specs")
        costs = {(key.bits_per_element(), value.bits_per_element()) for key, value in layer_specs}
        if len(costs) != 1:
            raise ValueError(f"candidate {name!r}: every layer must store the same bits per element, got "
                             f"{sorted(costs)}")
        return cls(name, layer_specs[0][0], layer_specs[0][1], layer_specs)


def candidate_bits(candidate: Candidate, *, num_kv_heads: int, head_dim: int, context_tokens: int,
                   sink_tokens: int = Policy.sink_tokens, recent_tokens: int | None = Policy.recent_tokens,
                   page_size: int = Policy.page_size) -> float:
    """Bits per K/V element of one layer of one sequence of ``context_tokens`` tokens, windows included.

    The exact bytes of :func:`jflashloop.storage.sequence_bytes` (full pages in
    the candidate's codecs, the sink and ring windows in bfloat16) over the
    ``context_tokens x 2 x num_kv_heads x head_dim`` elements they hold.

    Raises:
      ValueError: ``context_tokens < 1``, or codecs the cache cannot hold.
    """
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
    policy = Policy(candidate.name, candidate.key_spec, candidate.value_spec, sink_tokens, recent_tokens, page_size)
    config = policy.cache_config(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 max_tokens=context_tokens)
    return 8 * sequence_bytes(config, context_tokens) / (context_tokens * 2 * num_kv_heads * head_dim)


def allocate(errors, costs, budget: float) -> np.ndarray:
    """The candidate of each layer minimizing the summed error with mean cost at most ``budget``.

    An exact multiple-choice knapsack over costs rounded up to
    ``1 / COST_RESOLUTION`` (dynamic programming over the total cost): no
    other assignment with mean rounded cost within the budget has a smaller
    summed error. Ties go to the cheaper total, then the lower candidate
    index.

    Args:
      errors: float ``[layers, candidates]``: layer ``l``'s error with candidate ``c``.
      costs: float ``[candidates]`` or ``[layers, candidates]``: bits per element.
      budget: the most the mean cost over the layers may be.
    Returns:
      int64 ``[layers]``: the chosen candidate of every layer.
    Raises:
      ValueError: wrong shapes, non-finite or negative values, or a budget
        below the cheapest assignment.
    """
    errors = np.asarray(errors, np.float64)
    if errors.ndim != 2 or 0 in errors.shape:
        raise ValueError(f"errors must be [layers, candidates] with both at least 1, got shape {errors.shape}")
    layers, candidates = errors.shape
    costs = np.asarray(costs, np.float64)
    if costs.shape not in ((candidates,), errors.shape):
        raise ValueError(f"costs must be [candidates] or [layers, candidates] = {errors.shape}, got {costs.shape}")
    costs = np.broadcast_to(costs, errors.shape)
    for name, x in (("errors", errors), ("costs", costs)):
        if not np.all(np.isfinite(x)) or np.any(x < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    if not math.isfinite(budget):
        raise ValueError(f"budget must be finite, got {budget}")
    units = np.ceil(costs * COST_RESOLUTION - 1e-9).astype(np.int64)
    capacity = math.floor(budget * layers * COST_RESOLUTION + 1e-9)
    cheapest = int(units.min(axis=1).sum())
    if capacity < cheapest:
        raise ValueError(f"budget {budget} is below the cheapest assignment, "
                         f"{cheapest / COST_RESOLUTION / layers:.4f} bits per element on average")
    width = capacity + 1
    best = np.full(width, np.inf)
    best[0] = 0.0
    picks = np.zeros((layers, width), np.int32)
    for layer in range(layers):
        options = np.full((candidates, width), np.inf)
        for c in range(candidates):
            shift = units[layer, c]
            if shift < width:
                options[c, shift:] = best[:width - shift] + errors[layer, c]
        picks[layer] = np.argmin(options, axis=0)  # the first minimum: the lower index on ties
        best = options[picks[layer], np.arange(width)]
    total = int(np.argmin(best))  # the first minimum: the cheapest total on ties
    choice = np.zeros(layers, np.int64)
    for layer in range(layers - 1, -1, -1):
        choice[layer] = picks[layer, total]
        total -= units[layer, choice[layer]]
    return choice


def policy_for(name: str, candidates: Sequence[Candidate], choice: Sequence[int], *,
               sink_tokens: int = Policy.sink_tokens, recent_tokens: int | None = Policy.recent_tokens,
               page_size: int = Policy.page_size) -> Policy:
    """The :class:`~jflashloop.Policy` giving layer ``l`` the codecs of ``candidates[choice[l]]`` (its layer
    ``l``'s, for a per-layer candidate)."""
    specs = tuple(candidates[c].specs(layer) for layer, c in enumerate(choice))
    return Policy(name, specs[0][0], specs[0][1], sink_tokens, recent_tokens, page_size, layer_specs=specs)


# --------------------------------------------------------------------------- files


def policy_to_json(policy: Policy, metadata: Mapping[str, Any] | None = None) -> dict:
    """A JSON-ready document of a per-layer ``policy`` (``layer_specs`` set) and free-form ``metadata``."""
    if policy.layer_specs is None:
        raise ValueError(f"policy {policy.name!r} has no layer_specs: a policy file holds one pair per layer")
    return {
        "format": POLICY_FORMAT,
        "version": POLICY_VERSION,
        "name": policy.name,
        "sink_tokens": policy.sink_tokens,
        "recent_tokens": policy.recent_tokens,
        "page_size": policy.page_size,
        "layers": [{"keys": k.to_json(), "values": v.to_json()} for k, v in policy.layer_specs],
        "metadata": dict(metadata or {}),
    }


def _spec_from_json(entry, where: str) -> CodecSpec:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be an object with the CodecSpec fields, got {type(entry).__name__}")
    fields = {f.name for f in dataclasses.fields(CodecSpec)}
    unknown = set(entry) - fields
    if unknown:
        raise ValueError(f"{where} has unknown fields {sorted(unknown)} (CodecSpec has {sorted(fields)})")
    try:
        return CodecSpec(**entry)
    except (TypeError, ValueError) as failure:
        raise ValueError(f"{where} is not a valid CodecSpec: {failure}") from None


def policy_from_json(data: Mapping) -> Policy:
    """The :class:`~jflashloop.Policy` of a document written by :func:`policy_to_json` (validated).

    Raises:
      ValueError: another format or version, a missing or mistyped field, a
        layer whose codecs are not valid :class:`~jflashloop.CodecSpec`.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a policy document is a JSON object, got {type(data).__name__}")
    if data.get("format") != POLICY_FORMAT:
        raise ValueError(f"not a jflashloop layer policy: format {data.get('format')!r}, expected {POLICY_FORMAT!r}")
    if data.get("version") != POLICY_VERSION:
        raise ValueError(f"layer policy version {data.get('version')!r} is not supported (this library reads "
                         f"version {POLICY_VERSION})")
    for key in ("sink_tokens", "recent_tokens", "page_size"):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    if not isinstance(data.get("name"), str):
        raise ValueError(f"name must be a string, got {data.get('name')!r}")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError("layers must be a non-empty list of {'keys': ..., 'values': ...} objects")
    specs = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, Mapping) or set(layer) != {"keys", "values"}:
            raise ValueError(f"layers[{index}] must be an object with exactly 'keys' and 'values'")
        specs.append((_spec_from_json(layer["keys"], f"layers[{index}].keys"),
                      _spec_from_json(layer["values"], f"layers[{index}].values")))
    if not isinstance(data.get("metadata", {}), Mapping):
        raise ValueError("metadata must be an object")
    return Policy(data["name"], specs[0][0], specs[0][1], data["sink_tokens"], data["recent_tokens"],
                  data["page_size"], layer_specs=tuple(specs))


def save_policy(path: str | os.PathLike, policy: Policy, metadata: Mapping[str, Any] | None = None) -> None:
    """Write :func:`policy_to_json` of ``policy`` to ``path`` (UTF-8 JSON, indented)."""
    text = json.dumps(policy_to_json(policy, metadata), indent=1, sort_keys=False)
    # A fitted codec's table row (a list of numbers) on one line, not one number a line.
    text = re.sub(r"\[\s*([-+0-9.eE]+(?:,\s*[-+0-9.eE]+)*)\s*\]",
                  lambda match: "[" + ", ".join(item.strip() for item in match.group(1).split(",")) + "]", text)
    with open(os.fsdecode(path), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")


def load_policy(path: str | os.PathLike) -> Policy:
    """Read a policy file written by :func:`save_policy`.

    Example:
      >>> policy = load_policy("policy.json")  # doctest: +SKIP
      >>> config = policy.cache_config(num_layers=30, num_kv_heads=3, head_dim=64, max_tokens=4096)  # doctest: +SKIP

    Raises:
      ValueError: the file is not valid JSON or not a valid layer policy
        (:func:`policy_from_json`).
    """
    with open(os.fsdecode(path), encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as failure:
            raise ValueError(f"{os.fsdecode(path)} is not JSON: {failure}") from None
    return policy_from_json(data)
