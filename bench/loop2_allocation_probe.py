"""How far per-layer codec choices take the looped model's two dense loops: the attention error of loop 1 (the
base) and of loop 2 (predicted from loop 1, with a dense residual against the prediction) per layer and codec, and
the per-layer choice of fewest errors under a byte budget for both loops (bench/LOOPS.md, "Loop 2's residual in
fitted codecs").

Candidates, per layer: the base in the fitted codecs at a mean key width of 4, 3.5 or 3 bits (``fit``,
``fit3.5``, ``fit3``: ``int_mixed`` keys, ``int4_scaled`` values, fitted to loop 1 as ``jflashloop loops
--policies`` fits them); loop 2's residual against its fitted prediction in ``int_mixed`` keys at a mean of 5,
4.5, 4, 3.5, 3 or 2.5 bits fitted to that residual (or INT4 G64 keys), each with ``int4_scaled`` values fitted to the
residual, INT4 G64 or INT3 G64 values (:func:`jflashloop.fitting.fit_residual_codecs` and the ``"pred"`` entries'
maps, :func:`jflashloop.apps.loops.policies.fitted_predicted_loops`). Loops 3 and 4 are predicted with no rows and
store nothing, so the two dense loops are the whole cache.

Errors: the sweep's protocol (448-byte windows, 320 prefilled, the model's queries at the last 8 prompt positions,
float64 attention, relative error per layer), on the calibration windows (seed 100) and the held-out seeds 0, 1, 2.
The allocation chooses on the calibration errors alone: every per-layer choice of the base whose mean loop-1 error
is at most FlashLoop's (0.045), then loop 2's per-layer codecs of least mean error in the bytes left; the held-out
errors of that choice are printed beside it.

A second table ("balanced") chooses by the least ``max(loop-1 error / 0.045, loop-2 error / 0.046)`` instead.
``jflashloop loops --allocate BYTES`` makes such a choice for any looped checkpoint (the exact knapsack of
``jflashloop.allocation`` at each of several weights of the two loops, :mod:`jflashloop.apps.loops.allocation`) and
measures it on held-out windows.

Usage: ``python bench/loop2_allocation_probe.py [--budgets 2176 2112 2080 2048]`` (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import jax.numpy as jnp
import numpy as np

from jflashloop import fitting
from jflashloop.apps.loops import policies
from jflashloop.apps.loops.metrics import attention_errors
from jflashloop.apps.loops.runner import (
    DEFAULT_CHECKPOINT,
    _forward,
    held_out_windows,
    model_queries,
    prefill_cross_loop_cache,
    reconstruct_every_loop,
)
from jflashloop.codecs import CodecSpec
from jflashloop.models.checkpoint import load_checkpoint
from jflashloop.models.stdlib_text import default_root, load_corpus

SETTINGS = policies.SweepSettings(tokens=448, prompt_tokens=320, sequences=8, seeds=(0, 1, 2))
SEEDS = (policies.CALIBRATION_SEED, 0, 1, 2)
BASES = ("fit", "fit3.5", "fit3")
KEY_CODES = ("int4", 5.0, 4.5, 4.0, 3.5, 3.0, 2.5)  # INT4 G64, or int_mixed at this mean width
VALUE_CODES = ("scaled", "int4", "int3")
FLASHLOOP_LOOP_1, FLASHLOOP_LOOP_2 = 0.045, 0.046
"""FlashLoop's loop-1 and loop-2 attention errors in the sweep (bench/LOOPS.md)."""


def element_bits(key, value) -> float:
    """Bits per element of loop 2's residual (K and V, metadata included)."""
    return ((4.5 if key == "int4" else key + 0.5) + (3.5 if value == "int3" else 4.5)) / 2


def residual_configs(params, model, held_out, fitted) -> dict:
    """``{(key code, value code): CacheConfig}``: base ``fit``, loop 2 predicted with each residual code."""
    policy = ("fit", "pred fit", "pred", "pred")
    predicted = policies.fitted_predicted_loops(params, model, held_out, policy, SETTINGS, fitted)
    config = policies.policy_config(policy, model, SETTINGS.sequences, SETTINGS.tokens, fitted=fitted,
                                    predicted=predicted)
    token_ids = jnp.asarray(held_out_windows(held_out, SETTINGS.sequences, SETTINGS.tokens,
                                             policies.CALIBRATION_SEED))
    _, keys, values, _ = _forward(params, model, token_ids)
    keys, values = (np.asarray(x).transpose(2, 1, 0, 3, 4, 5) for x in (keys, values))
    queries = np.asarray(model_queries(params, model, token_ids, 32)).transpose(2, 1, 0, 3, 4, 5)
    by_bits = {bits: fitting.fit_residual_codecs(config, keys, values, queries, loop=1, mean_bits=bits)
               for bits in KEY_CODES if bits != "int4"}
    configs = {}
    for key, value in itertools.product(KEY_CODES, VALUE_CODES):
        layers = []
        for layer in range(model.layers):
            loops = list(config.layer(layer).loops)
            fitted_loop = by_bits[key if key != "int4" else 4.0].layer(layer).loops[1]
            key_spec = CodecSpec("int4", "channel", 64) if key == "int4" else fitted_loop.key_spec
            value_spec = {"scaled": fitted_loop.value_spec, "int4": CodecSpec("int4", "token", 64),
                          "int3": CodecSpec("int3", "token", 64)}[value]
            loops[1] = dataclasses.replace(loops[1], key_spec=key_spec, value_spec=value_spec)
            layers.append(tuple(loops))
        configs[(key, value)] = config.with_layer_loops(tuple(layers))
    return configs


def layer_errors(params, model, held_out, configs: dict, loop: int) -> dict:
    """``{(seed, name): float64 [layers]}``: loop ``loop``'s attention error per layer with each config."""
    errors = {}
    for seed in SEEDS:
        token_ids = jnp.asarray(held_out_windows(held_out, SETTINGS.sequences, SETTINGS.tokens, seed))
        _, keys, values, _ = _forward(params, model, token_ids)
        prompt = SETTINGS.prompt_tokens
        keys, values = keys[:, :, :, :prompt], values[:, :, :, :prompt]
        queries = np.asarray(model_queries(params, model, token_ids[:, :prompt], SETTINGS.query_positions))
        positions = np.arange(prompt - SETTINGS.query_positions, prompt)
        for name, config in configs.items():
            stored = reconstruct_every_loop(prefill_cross_loop_cache(config, keys, values), SETTINGS.sequences, prompt)
            errors[(seed, name)] = attention_errors(
                queries[loop:loop + 1], np.asarray(keys[loop:loop + 1]), np.asarray(values[loop:loop + 1]),
                np.asarray(stored[0][loop:loop + 1]), np.asarray(stored[1][loop:loop + 1]), positions)[0]
    return errors


def best_choices(base_errors, loop2_errors, layers: int, budget: float, balanced: bool = False) -> tuple:
    """The calibration-optimal per-layer choice under ``budget`` bytes a token (both loops, every layer): the least
    loop-2 error among base choices within FlashLoop's loop-1 error, or (``balanced``) the least of the larger of
    the two loops' errors over FlashLoop's (0.045, 0.046)."""
    elements = 2 * 4 * 64  # K and V elements of one loop and layer a token (4 KV heads x head_dim 64)
    base_bytes = {"fit": 4.5, "fit3.5": 4.25, "fit3": 4.0}
    seed = policies.CALIBRATION_SEED
    best = None
    loop2 = list(itertools.product(KEY_CODES, VALUE_CODES))
    loop2_table = np.stack([loop2_errors[(seed, code)] for code in loop2], axis=1)  # [layers, codes]
    loop2_bytes = np.array([element_bits(*code) * elements / 8 for code in loop2])
    combos = np.array(list(itertools.product(range(len(loop2)), repeat=layers)))  # [choices, layers]
    combo_bytes = loop2_bytes[combos].sum(axis=1)
    combo_errors = loop2_table[np.arange(layers), combos].mean(axis=1)
    for bases in itertools.product(BASES, repeat=layers):
        error_1 = np.mean([base_errors[(seed, base)][layer] for layer, base in enumerate(bases)])
        room = budget - sum(base_bytes[base] * elements / 8 for base in bases)
        fits = np.flatnonzero(combo_bytes <= room)
        if (error_1 > FLASHLOOP_LOOP_1 and not balanced) or not fits.size:
            continue
        pick = fits[np.argmin(combo_errors[fits])]
        score = max(error_1 / FLASHLOOP_LOOP_1, combo_errors[pick] / FLASHLOOP_LOOP_2) if balanced else \
            combo_errors[pick]
        if best is None or score < best[0]:
            best = (score, combo_errors[pick], error_1, bases, tuple(loop2[code] for code in combos[pick]))
    return None if best is None else best[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[2304, 2240, 2176, 2112, 2080, 2048])
    args = parser.parse_args()
    start = time.perf_counter()
    checkpoint = load_checkpoint(DEFAULT_CHECKPOINT)
    params, model = checkpoint.params, checkpoint.config
    held_out = load_corpus(default_root()).held_out
    fitted = policies.fitted_specs(params, model, held_out, [(base, "pred", "pred", "pred") for base in BASES],
                                   SETTINGS)
    bases = {base: policies.policy_config((base, "int4", "int4 16", "int4 7"), model, SETTINGS.sequences,
                                          SETTINGS.tokens, fitted=fitted) for base in BASES}
    base_errors = layer_errors(params, model, held_out, bases, 0)
    loop2_errors = layer_errors(params, model, held_out, residual_configs(params, model, held_out, fitted), 1)
    print(f"errors measured ({time.perf_counter() - start:.0f} s)\n")
    print("| loop | codes | bits/element | calibration (seed 100) per layer | held-out mean (seeds 0-2) |")
    print("|---|---|---|---|---|")
    for base in BASES:
        held = np.mean([base_errors[(seed, base)].mean() for seed in SETTINGS.seeds])
        print(f"| 1 | {base} | | {' / '.join(f'{e:.3f}' for e in base_errors[(100, base)])} | {held:.4f} |")
    for code in itertools.product(KEY_CODES, VALUE_CODES):
        held = np.mean([loop2_errors[(seed, code)].mean() for seed in SETTINGS.seeds])
        calibration = " / ".join(f"{e:.3f}" for e in loop2_errors[(100, code)])
        print(f"| 2 | keys {code[0]}, values {code[1]} | {element_bits(*code):.3f} | {calibration} | {held:.4f} |")
    for balanced in (False, True):
        print(f"\n{'balanced' if balanced else 'least loop-2 error'}:\n")
        print("| budget bytes/token | vs four BF16 | base per layer | loop 2 per layer (keys/values) "
              "| loop 1 calibration / held-out | loop 2 calibration / held-out |")
        print("|---|---|---|---|---|---|")
        for budget in args.budgets:
            best = best_choices(base_errors, loop2_errors, model.layers, budget, balanced)
            if best is None:
                print(f"| {budget:.0f} | {16384 / budget:.2f}x | none within FlashLoop's loop-1 error | | | |")
                continue
            error_2, error_1, chosen_bases, codes = best
            held_1 = np.mean([np.mean([base_errors[(seed, base)][layer] for layer, base in enumerate(chosen_bases)])
                              for seed in SETTINGS.seeds])
            held_2 = np.mean([np.mean([loop2_errors[(seed, code)][layer] for layer, code in enumerate(codes)])
                              for seed in SETTINGS.seeds])
            print(f"| {budget:.0f} | {16384 / budget:.2f}x | {', '.join(chosen_bases)} | "
                  f"{', '.join(f'{k}/{v}' for k, v in codes)} | {error_1:.4f} / {held_1:.4f} | "
                  f"{error_2:.4f} / {held_2:.4f} |")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
