"""Train the tiny byte-level looped model (``OuroConfig.tiny()``) and save a checkpoint.

Usage (GPU defaults; about 3000 steps of 64 x 256 bytes)::

    python bench/train_ouro.py
    python bench/train_ouro.py --steps 20 --batch 4 --seq 64 --out /tmp/ouro.npz   # CPU smoke run

Data (:mod:`jflashloop.models.stdlib_text`): every ``.py`` file of the
running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``,
skipping ``site-packages`` and ``dist-packages``), sorted by relative path and
concatenated as raw bytes (tokens 0..255). Files whose sorted index is a
multiple of 20 (about 5 %) are held out. The corpus therefore depends on the
Python version; the checkpoint records the version, the file counts and a
SHA-256 of both byte streams.

Training: AdamW (b1 0.9, b2 0.95, weight decay on matrices only) with linear
warmup then cosine decay to 10 % of the peak rate, global-norm gradient
clipping, and the loss averaged over the exits of all loops, uniformly unless
``--loop-weights`` says otherwise (see
:func:`jflashloop.models.ouro.multi_exit_loss`). Training windows are drawn
uniformly at random on the device from the training bytes; the step is jitted.

Evaluation: held-out cross-entropy (nats/byte) after 1, 2, ..., ``--loops``
loops on a fixed set of evenly spaced held-out windows. The exit of loop ``r``
does not depend on later loops, so one forward pass gives every loop count.

Cost of the defaults (tiny config: 3.35 M parameters, of which 3.22 M in the
4 shared blocks, applied 4 times): per token, a forward pass is
``2 * (4 loops * (4 * 802816 block-matmul weights + 65536 LM-head weights))``
= 26.2 MFLOP plus attention ``4 * seq * hidden * 16 block applications``
= 4.2 MFLOP at seq 256 (masked half included), so ~30.4 MFLOP; training is ~3x
that, 91 MFLOP/token. One step of 64 x 256 tokens is ~1.5 TFLOP and 3000 steps
~4.5 PFLOP: at an effective 30-60 TFLOP/s on one H200 (the matrices are narrow,
256 to 704 columns; XLA's default precision may run float32 matmuls on TF32
tensor cores) that is roughly 1.5-2.5 minutes plus compilation;
``--compute-dtype bfloat16`` (weights cast per step, so the residual stream is
bfloat16 too; optimizer state stays float32) trades accuracy for speed.
The script prints its own FLOP estimate and measured rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ImportError as error:  # the trainer's one dependency beyond the package's own
    raise SystemExit("bench/train_ouro.py needs optax: pip install 'jflashloop[train]'") from error

from jflashloop.models import ouro
from jflashloop.models.checkpoint import save_checkpoint
from jflashloop.models.stdlib_text import default_root, evaluation_windows, load_corpus

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPOSITORY_ROOT / "jflashloop" / "models" / "data" / "ouro_tiny.npz"


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def sample_windows(data: jax.Array, key: jax.Array, batch: int, length: int) -> jax.Array:
    """Uniformly random windows of ``data`` (uint8 ``[N]``): int32 ``[batch, length]``."""
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - length + 1)
    window = jax.vmap(lambda start: jax.lax.dynamic_slice(data, (start,), (length,)))
    return window(starts).astype(jnp.int32)


# --------------------------------------------------------------------------
# Model cost
# --------------------------------------------------------------------------


def training_flops_per_token(config: ouro.OuroConfig, loops: int, sequence: int) -> float:
    """Approximate training FLOPs per token (3x the forward matmul and attention FLOPs)."""
    block_weights = config.hidden * (2 * config.heads + 2 * config.kv_heads) * config.head_dim
    block_weights += 3 * config.hidden * config.mlp_hidden
    matmul = 2 * loops * (config.layers * block_weights + config.hidden * config.vocab_size)
    attention = 4 * sequence * config.heads * config.head_dim * config.layers * loops
    return 3.0 * (matmul + attention)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay and global-norm clipping; no decay on vectors."""
    warmup = min(args.warmup, max(args.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
        decay_steps=max(args.steps, warmup + 1), end_value=args.lr * args.final_lr_fraction)
    decay_mask = lambda params: jax.tree_util.tree_map(lambda leaf: leaf.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )


def cast_floats(params: ouro.Params, dtype: Any) -> ouro.Params:
    """The parameter pytree with every leaf cast to ``dtype`` (a no-op for float32)."""
    return jax.tree_util.tree_map(lambda leaf: leaf.astype(dtype), params)


def make_train_step(config: ouro.OuroConfig, optimizer: optax.GradientTransformation,
                    args: argparse.Namespace, compute_dtype: Any):
    """A jitted ``(params, optimizer_state, data, step) -> (params, optimizer_state, metrics)``.

    ``data`` is the uint8 training stream on the device; ``metrics`` holds the
    training loss (float32 scalar), the per-loop losses ``[loops]`` and the
    gradient global norm.
    """
    base_key = jax.random.PRNGKey(args.seed + 1)

    def objective(params, batch):
        return ouro.multi_exit_loss(cast_floats(params, compute_dtype), config, batch, args.loops,
                                    args.loop_weights)

    def train_step(params, optimizer_state, data, step):
        batch = sample_windows(data, jax.random.fold_in(base_key, step), args.batch, args.seq + 1)
        (loss, per_loop), gradients = jax.value_and_grad(objective, has_aux=True)(params, batch)
        updates, optimizer_state = optimizer.update(gradients, optimizer_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "per_loop": per_loop,
                   "gradient_norm": optax.global_norm(gradients)}
        return params, optimizer_state, metrics

    return jax.jit(train_step, donate_argnums=(0, 1))


def make_evaluator(config: ouro.OuroConfig, args: argparse.Namespace, compute_dtype: Any):
    """``(params, windows [N, seq + 1]) -> numpy float64 [loops]`` held-out nats/byte."""
    @jax.jit
    def batch_losses(params, batch):
        return ouro.loss_per_loop(cast_floats(params, compute_dtype), config, batch, args.loops)

    def evaluate(params, windows: np.ndarray) -> np.ndarray:
        totals = np.zeros(args.loops)
        chunks = range(0, windows.shape[0], args.batch)
        for start in chunks:
            totals += np.asarray(batch_losses(params, jnp.asarray(windows[start:start + args.batch])))
        return totals / len(chunks)

    return evaluate


def format_losses(losses: np.ndarray) -> str:
    return " ".join(f"{loss:.4f}" for loss in losses)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="bytes per training sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    parser.add_argument("--final-lr-fraction", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient global-norm limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", type=int, default=4, help="loops used in training")
    parser.add_argument("--loop-weights", type=float, nargs="+", default=None,
                        help="training weight of each loop's exit (default: uniform)")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="matmul dtype; master weights and optimizer stay float32")
    parser.add_argument("--eval-windows", type=int, default=1024,
                        help="held-out windows of seq + 1 bytes (rounded up to a batch multiple)")
    parser.add_argument("--eval-every", type=int, default=1000,
                        help="held-out evaluation interval in steps (0: only at the end)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="stop training after this many seconds (0: no limit); the checkpoint "
                             "records the steps actually taken")
    parser.add_argument("--stdlib", type=Path, default=default_root(),
                        help="folder of the corpus")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT, help="checkpoint path")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or args.loops < 1:
        parser.error("--steps, --batch and --loops must be >= 1 and --seq >= 2")
    if args.loop_weights is not None:
        if len(args.loop_weights) != args.loops or min(args.loop_weights) < 0:
            parser.error("--loop-weights needs one non-negative weight per loop")
        args.loop_weights = tuple(args.loop_weights)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    compute_dtype = jnp.dtype(args.compute_dtype)
    config = dataclasses.replace(ouro.OuroConfig.tiny(), loops=args.loops)
    corpus = load_corpus(args.stdlib)
    data = corpus.description
    print(f"backend={jax.default_backend()} devices={jax.devices()}")
    print(f"data: {data['train_files']} train files ({data['train_bytes'] / 1e6:.1f} MB), "
          f"{data['held_out_files']} held-out files ({data['held_out_bytes'] / 1e6:.2f} MB) "
          f"from {data['stdlib_path']} (Python {data['python_version']})")

    params = ouro.init_params(config, jax.random.PRNGKey(args.seed))
    flops_per_step = training_flops_per_token(config, args.loops, args.seq) * args.batch * args.seq
    print(f"model: {ouro.param_count(params):,} parameters, {config}")
    print(f"cost: {flops_per_step / 1e12:.3f} TFLOP/step, "
          f"{flops_per_step * args.steps / 1e15:.3f} PFLOP for {args.steps} steps", flush=True)

    optimizer = make_optimizer(args)
    optimizer_state = optimizer.init(params)
    train_step = make_train_step(config, optimizer, args, compute_dtype)
    evaluate = make_evaluator(config, args, compute_dtype)
    window_count = math.ceil(args.eval_windows / args.batch) * args.batch
    windows = evaluation_windows(corpus.held_out, window_count, args.seq + 1)
    train_data = jnp.asarray(corpus.train)

    start = time.perf_counter()
    first_step_seconds = 0.0
    evaluation_seconds = 0.0
    history = []
    done = 0
    for step in range(args.steps):
        params, optimizer_state, metrics = train_step(params, optimizer_state, train_data,
                                                      jnp.int32(step))
        if step == 0:
            jax.block_until_ready(metrics)
            first_step_seconds = time.perf_counter() - start
        done = step + 1
        if done % args.log_every == 0 or done == args.steps or step == 0:
            loss = float(metrics["loss"])
            elapsed = time.perf_counter() - start
            rate = (done - 1) / max(elapsed - first_step_seconds - evaluation_seconds, 1e-9)
            remaining = (args.steps - done) / rate if done > 1 else float("nan")
            print(f"step {done:6d}/{args.steps} ({100 * done / args.steps:5.1f}%) "
                  f"loss {loss:.4f} per-loop [{format_losses(np.asarray(metrics['per_loop']))}] "
                  f"grad-norm {float(metrics['gradient_norm']):.3f} "
                  f"{rate:6.2f} steps/s elapsed {elapsed:6.1f}s eta {remaining:6.1f}s", flush=True)
            history.append({"step": done, "train_loss": loss})
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            evaluation_start = time.perf_counter()
            losses = evaluate(params, windows)
            evaluation_seconds += time.perf_counter() - evaluation_start
            print(f"  held-out nats/byte by loop count: [{format_losses(losses)}]", flush=True)
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            print(f"time budget of {args.time_budget:.0f}s reached after {done} steps", flush=True)
            break
    jax.block_until_ready(params)
    steps_taken = done
    total_seconds = time.perf_counter() - start
    steady_seconds = total_seconds - first_step_seconds - evaluation_seconds
    steady_rate = (steps_taken - 1) / steady_seconds if steps_taken > 1 else float("nan")

    held_out = evaluate(params, windows)
    print(f"held-out loss on {window_count} windows x {args.seq} bytes:")
    for loops, loss in enumerate(held_out, start=1):
        print(f"  loops={loops}: {loss:.4f} nats/byte ({loss / math.log(2):.4f} bits/byte)")
    timing = {
        "total_seconds": round(total_seconds, 2),
        "first_step_seconds_with_compile": round(first_step_seconds, 2),
        "steps_per_second_after_compile": round(steady_rate, 3),
        "tflop_per_second_after_compile": round(steady_rate * flops_per_step / 1e12, 3),
    }
    print(f"timing: {steps_taken} steps in {total_seconds:.1f}s; first step (compile) "
          f"{first_step_seconds:.1f}s; {steady_rate:.2f} steps/s after it "
          f"(~{timing['tflop_per_second_after_compile']:.2f} TFLOP/s) "
          f"on {jax.default_backend()}", flush=True)

    info = {
        "seed": args.seed,
        "steps": steps_taken,
        "arguments": {key: (str(value) if isinstance(value, Path) else value)
                      for key, value in vars(args).items()},
        "data": corpus.description,
        "objective": "weighted mean of next-byte cross-entropy over the exits of all loops",
        "loop_weights": list(args.loop_weights or [1.0] * args.loops),
        "held_out_windows": window_count,
        "held_out_loss_nats_per_byte_by_loops": {
            str(loops): float(loss) for loops, loss in enumerate(held_out, start=1)},
        "final_train_loss": history[-1]["train_loss"],
        "train_loss_history": history,
        "timing": timing,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "jax_version": jax.__version__,
    }
    checksum = save_checkpoint(args.out, params, config, info)
    print(f"checkpoint: {args.out} (arrays sha256 {checksum[:16]}...)")
    print(json.dumps({"held_out_loss_nats_per_byte_by_loops":
                      info["held_out_loss_nats_per_byte_by_loops"], **timing}))
    return info


if __name__ == "__main__":
    main()
