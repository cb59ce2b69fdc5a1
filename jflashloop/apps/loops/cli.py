"""``jflashloop loops``: the options of the looped-model report, and its :func:`main`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...codecs import CodecSpec
from ...models.checkpoint import load_checkpoint
from ...models.stdlib_text import default_root, load_corpus
from . import allocation, policies
from .report import describe_inputs, format_report
from .runner import DEFAULT_CHECKPOINT, ReportSettings, run_report


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ReportSettings()
    parser = argparse.ArgumentParser(
        prog="jflashloop loops",
        description="A looped model (tiny Ouro) on the cross-loop 4-bit cache vs four BF16 caches.")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="ouro checkpoint (.npz; default: the packaged ouro_tiny.npz)")
    parser.add_argument("--tokens", type=int, default=defaults.tokens,
                        help="held-out bytes per sequence (prompt + teacher-forced)")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens,
                        help="bytes prefilled into the caches before decoding")
    parser.add_argument("--generate", type=int, default=defaults.generate,
                        help="greedy tokens generated after the text")
    parser.add_argument("--sequences", type=int, default=defaults.sequences,
                        help="held-out windows decoded as one batch")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="picks the windows")
    parser.add_argument("--stdlib", type=Path, default=default_root(),
                        help="standard-library folder of the text (default: this Python's)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the report to this markdown file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--policies", action="store_true",
                        help="compare cross-loop storage policies instead (bytes/token, KL, attention error; "
                             "jflashloop.apps.loops.policies)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="with --policies: one batch of --sequences windows per seed (default: --seed)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="with --policies: only these policies (names of policies.POLICIES)")
    parser.add_argument("--calibration-sequences", type=int, default=None, metavar="N",
                        help="with --policies: windows of the calibration seed the fitted codecs, the maps of "
                             "predicted loops and --allocate's choice are fitted on (default: --sequences)")
    parser.add_argument("--allocate", type=float, nargs="+", default=None, metavar="BYTES",
                        help="(a --policies run) loops 1-2 chosen per layer on calibration windows in at most BYTES "
                             "full-page bytes a token (jflashloop.apps.loops.allocation), measured beside "
                             "--only's policies (default: flashloop)")
    return parser.parse_args(argv)


def allocated_policies(args, checkpoint, corpus, settings, log) -> tuple[dict, str]:
    """``--allocate``: ``({name: policy}, markdown)``, the per-layer choices and their calibration errors."""
    model = checkpoint.config
    found = allocation.sensitivity(checkpoint.params, model, corpus.held_out, settings, log=log)
    chosen, lines = {}, [
        f"Allocated on the calibration windows (seed {policies.CALIBRATION_SEED}, {settings.calibration().sequences} "
        f"windows; FlashLoop's errors there: loop 1 "
        f"{found.flashloop[0]:.4f}, loop 2 {found.flashloop[1]:.4f}):", "",
        "| budget bytes/token | base per layer | loop 2 per layer | loop 1 / loop 2 calibration error | "
        "`fitting.fitted_loops` arguments |", "|---|---|---|---|---|"]
    for budget in args.allocate:
        bases, residuals = allocation.choose(found, budget)
        name = f"allocated {budget:g} bytes"
        chosen[name] = allocation.candidate_policy(model, bases, residuals)
        first, second = allocation.calibration_errors(found, bases, residuals)
        arguments = ", ".join(f"{key}={_short(value)}" for key, value in
                              allocation.fitted_loops_arguments(bases, residuals, model.head_dim).items())
        lines.append(f"| {budget:g} | {', '.join(bases)} | {', '.join(residuals)} | {first:.4f} / {second:.4f} | "
                     f"{arguments} |")
    return chosen, "\n".join(lines) + "\n\n"


def _short(values: tuple) -> str:
    """``(4.0, 3.5)`` or ``(CodecSpec("int3", "token", 64), None)``: a per-layer argument as Python would take it."""
    def one(value):
        if not isinstance(value, CodecSpec):
            return repr(value)
        seed = "" if value.rotation_seed is None else f", rotation_seed={value.rotation_seed}"
        return f'CodecSpec("{value.format}", "{value.axis}", {value.group_size}{seed})'
    return "(" + ", ".join(one(value) for value in values) + ")"


def run_policies(args, checkpoint, corpus) -> str:
    """``--policies``: the sweep of :mod:`jflashloop.apps.loops.policies` as markdown."""
    names = args.only or (["flashloop"] if args.allocate else list(policies.POLICIES))
    unknown = [name for name in names if name not in policies.POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {list(policies.POLICIES)}")
    settings = policies.SweepSettings(tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                                      sequences=args.sequences, seeds=tuple(args.seeds or (args.seed,)),
                                      calibration_sequences=args.calibration_sequences)
    log = (lambda message: None) if args.no_progress else (lambda message: print(message, file=sys.stderr))
    chosen, preface = allocated_policies(args, checkpoint, corpus, settings, log) if args.allocate else ({}, "")
    results = policies.sweep(checkpoint.params, checkpoint.config, corpus.held_out, settings,
                             {**{name: policies.POLICIES[name] for name in names}, **chosen}, log=log)
    return preface + policies.format_table(results)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        settings = ReportSettings(tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                                  generate=args.generate, sequences=args.sequences, seed=args.seed)
    except ValueError as error:
        print(f"jflashloop loops: {error}", file=sys.stderr)
        return 2
    if not args.checkpoint.exists():
        print(f"jflashloop loops: no checkpoint at {args.checkpoint}; train one with "
              "`python bench/train_ouro.py` or pass --checkpoint", file=sys.stderr)
        return 1
    checkpoint = load_checkpoint(args.checkpoint)
    if settings.total_tokens > checkpoint.config.max_position:
        print(f"jflashloop loops: {settings.total_tokens} tokens exceed max_position="
              f"{checkpoint.config.max_position}", file=sys.stderr)
        return 2
    corpus = load_corpus(args.stdlib)
    if args.policies or args.allocate:
        try:
            report = run_policies(args, checkpoint, corpus)
        except ValueError as error:
            print(f"jflashloop loops: {error}", file=sys.stderr)
            return 2
        print(report, end="")
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(report)
        return 0
    results = run_report(checkpoint.params, checkpoint.config, corpus.held_out, settings,
                         progress=not args.no_progress)
    report = format_report(results, describe_inputs(checkpoint, args.checkpoint,
                                                    corpus.description, settings))
    print(report, end="")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report)
    return 0
