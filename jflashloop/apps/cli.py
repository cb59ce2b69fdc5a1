"""The ``jflashloop`` command line: ``demo``, ``codecs``, ``eval``, ``allocate``, ``loops``.

``jflashloop ARGS`` (the console script) and ``python -m jflashloop ARGS`` both
run :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflashloop

from . import allocate, demo, evaluation, loops


def _codec_demo(args) -> int:
    rng = np.random.default_rng(args.seed)
    shape = (args.tokens, args.kv_heads, args.head_dim)
    # K-like data: per-channel offsets and a few outlier channels; V-like: flatter.
    offsets = rng.standard_normal((1, shape[1], shape[2])) * 2.0
    outliers = np.where(rng.random((1, shape[1], shape[2])) < 0.05, 6.0, 1.0)
    keys = (rng.standard_normal(shape) * outliers + offsets).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    tensors = {"K": jnp.asarray(keys, jnp.bfloat16), "V": jnp.asarray(values, jnp.bfloat16)}
    specs = {
        "INT4 per-channel G64 (FlashLoop K)": jflashloop.INT4_KEYS,
        "INT4 per-token G64 (FlashLoop V)": jflashloop.INT4_VALUES,
        "INT4 per-token G32": jflashloop.CodecSpec("int4", "token", 32),
        "NVFP4 (E2M1, E4M3/16, FP32)": jflashloop.NVFP4,
    }
    print(f"jflashloop {jflashloop.__version__} on {jax.default_backend()}: "
          f"bfloat16 tensors [tokens={shape[0]}, kv_heads={shape[1]}, channels={shape[2]}]")
    header = f"{'format':38s} {'tensor':>6s} {'bits/elem':>9s} {'vs bf16':>8s} {'rel. error':>10s} {'encode ms':>9s}"
    print(header)
    print("-" * len(header))
    for name, spec in specs.items():
        encode = jax.jit(lambda x, spec=spec: jflashloop.encode(x, spec))
        decode = jax.jit(jflashloop.decode)
        for tensor_name, x in tensors.items():
            packed = jax.block_until_ready(encode(x))
            start = time.perf_counter()
            packed = jax.block_until_ready(encode(x))
            elapsed_ms = 1e3 * (time.perf_counter() - start)
            reconstructed = decode(packed)
            exact = x.astype(jnp.float32)
            error = float(jnp.linalg.norm(reconstructed - exact) / jnp.linalg.norm(exact))
            print(f"{name:38s} {tensor_name:>6s} {packed.bits_per_element:9.3f} "
                  f"{16 / packed.bits_per_element:7.2f}x {error:10.4f} {elapsed_ms:9.2f}")
    return 0


def _add_codec_arguments(command) -> None:
    command.add_argument("--tokens", type=int, default=4096)
    command.add_argument("--kv-heads", type=int, default=8)
    command.add_argument("--head-dim", type=int, default=128)
    command.add_argument("--seed", type=int, default=0)
    command.set_defaults(run=_codec_demo)


def _delegate(command_main):
    def run(args) -> int:
        return command_main(args.arguments)

    return run


# Commands that parse their own options (including --help).
_DELEGATED = {
    "eval": (evaluation.main, "cache policies on SmolLM2's real KV (bench/QUALITY.md)"),
    "allocate": (allocate.main, "per-layer formats for SmolLM2 under a bit budget (a policy JSON file)"),
    "loops": (loops.main, "the looped model on the cross-loop cache"),
}


def main(argv: list[str] | None = None) -> int:
    """Run ``jflashloop ARGS`` (``argv``: the arguments after the program name)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _DELEGATED:
        return _DELEGATED[argv[0]][0](argv[1:])
    parser = argparse.ArgumentParser(prog="jflashloop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(
        commands.add_parser("demo", help="SmolLM2 with BF16, INT4 and NVFP4 caches: one table and a plot")
    )
    _add_codec_arguments(
        commands.add_parser("codecs", help="encode/decode K/V-like tensors: storage and error")
    )
    for name, (command_main, text) in _DELEGATED.items():
        command = commands.add_parser(name, help=text, add_help=False)
        command.add_argument("arguments", nargs=argparse.REMAINDER)
        command.set_defaults(run=_delegate(command_main))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
