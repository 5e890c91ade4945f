"""Train the shipped byte-level llama on the Python standard library.

    python -m mlx_knorm.quality.train --checkpoint-dir build/checkpoints

The defaults are the shipped run (docs/results/quality-shipped-model.md).
The model is mlx-lm's own ``llama`` class and the output directory gets a
byte-level tokenizer, so ``mlx_lm.load`` loads the result and every
checkpoint. Every random choice (init, batch offsets, held-out windows)
derives from ``--seed``.

    python -m mlx_knorm.quality.train --measure 2x1024,8x512,16x256

times the training step instead, eager and compiled, for each batch x
sequence length, in one warm process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tqdm import tqdm

from ..atomic import atomic_path, write_text
from . import MODEL_DIR, data
from .byte_tokenizer import write_byte_tokenizer

HELDOUT_WINDOWS = 64  # fixed held-out windows the run reports its loss on


def model_config(args) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": args.dim,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.ffn,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }


def build_model(config: dict) -> llama.Model:
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def initial_model(config: dict, seed: int) -> llama.Model:
    """The model at step 0 of a run with this ``seed``."""
    mx.random.seed(seed)
    return build_model(config)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def mean_loss(model, windows: np.ndarray, batch_size: int) -> float:
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        total += loss_fn(model, mx.array(chunk, dtype=mx.int32)).item() * len(chunk)
    return total / len(windows)


def make_step(model, optimizer, compiled: bool):
    """One AdamW step with gradient clipping; ``mx.compile``d over model and optimizer state."""
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step(batch):
        loss, grads = value_and_grad(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    if compiled:
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    return step, state


def make_optimizer(lr: float, steps: int) -> optim.Optimizer:
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr / 10)],
        [warmup],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=0.1)


def save_model(model, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors", suffix=".safetensors") as weights:
        mx.save_safetensors(str(weights), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    write_byte_tokenizer(out)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def checkpoint_steps(fractions: list[float], steps: int) -> list[int]:
    return sorted({max(1, round(f * steps)) for f in fractions})


def train(args) -> dict:
    np_rng = np.random.default_rng(args.seed)
    train_files, heldout_files = data.split_files()
    train_tokens = data.concat(data.read_bytes(train_files))
    heldout_tokens = data.concat(data.read_bytes(heldout_files))
    eval_windows = data.heldout_windows(args.eval_windows, args.seq_len, args.seed)

    config = model_config(args)
    model = initial_model(config, args.seed)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    optimizer = make_optimizer(args.lr, args.steps)
    step, state = make_step(model, optimizer, compiled=True)

    saves = checkpoint_steps(args.checkpoints, args.steps) if args.checkpoint_dir else []
    checkpoints = []
    step_seconds = 0.0
    started = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", mininterval=30)
    smooth = None
    for index in bar:
        batch = mx.array(data.random_windows(train_tokens, args.batch, args.seq_len, np_rng), dtype=mx.int32)
        tick = time.perf_counter()
        loss = step(batch)
        mx.eval(state, loss)
        step_seconds += time.perf_counter() - tick
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smooth:.3f}")
        if index in saves:
            path = Path(args.checkpoint_dir) / f"step-{index:05d}"
            save_model(model, config, path)
            record = {
                "step": index, "fraction": round(index / args.steps, 4),
                "tokens_seen": index * args.batch * args.seq_len,
                "heldout_loss": round(mean_loss(model, eval_windows, args.batch), 4),
                "train_loss_smoothed": round(smooth, 4),
                "wall_seconds": round(time.perf_counter() - started, 1),
                "load_average_1min": load_average(), "path": str(path),
            }
            write_text(path / "CHECKPOINT.json", json.dumps(record, indent=2) + "\n")
            checkpoints.append(record)
            tqdm.write(json.dumps(record))
    wall_seconds = time.perf_counter() - started

    heldout_loss = mean_loss(model, eval_windows, args.batch)
    out = Path(args.out)
    save_model(model, config, out)
    tokens_seen = args.steps * args.batch * args.seq_len
    report = {
        "command": "python -m mlx_knorm.quality.train " + shlex.join(sys.argv[1:]),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "parameters": n_params,
        "model_bytes": (out / "model.safetensors").stat().st_size,
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_bytes": int(len(train_tokens)),
        "heldout_bytes": int(len(heldout_tokens)),
        "tokens_seen": tokens_seen,
        "wall_seconds": round(wall_seconds, 1),
        "step_seconds": round(step_seconds, 1),
        "tokens_per_second": round(tokens_seen / step_seconds),
        "load_average_1min_at_end": load_average(),
        "final_train_loss_smoothed": round(smooth, 4),
        "heldout_windows": f"{args.eval_windows} x {args.seq_len} bytes",
        "heldout_loss": round(heldout_loss, 4),
        "heldout_bits_per_byte": round(heldout_loss / math.log(2), 4),
        "unigram_heldout_loss": round(data.unigram_cross_entropy(train_tokens, heldout_tokens), 4),
        "bigram_heldout_loss": round(data.bigram_cross_entropy(train_tokens, heldout_tokens), 4),
        "checkpoints": checkpoints,
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "machine": f"{platform.machine()} {platform.system()}, cpu, {os.cpu_count()} cores",
    }
    write_text(out / "TRAINING.json", json.dumps(report, indent=2) + "\n")
    return report


def measure(args) -> list[dict]:
    """Median tokens/s of the step, eager and compiled, for each ``BxT`` in ``args.measure``."""
    train_tokens = data.concat(data.read_bytes(data.split_files()[0]))
    rng = np.random.default_rng(args.seed)
    rows = []
    for shape in args.measure:
        batch_size, seq_len = shape
        for compiled in (False, True):
            mx.random.seed(args.seed)
            model = build_model({**model_config(args), "max_position_embeddings": seq_len})
            step, state = make_step(model, make_optimizer(args.lr, args.steps), compiled)
            times = []
            for _ in range(args.measure_steps + 1):  # the first step compiles and warms up
                batch = mx.array(data.random_windows(train_tokens, batch_size, seq_len, rng), dtype=mx.int32)
                tick = time.perf_counter()
                mx.eval(state, step(batch))
                times.append(time.perf_counter() - tick)
            seconds = float(np.median(times[1:]))
            row = {"batch": batch_size, "seq_len": seq_len, "compiled": compiled,
                   "step_seconds": round(seconds, 3), "tokens_per_second": round(batch_size * seq_len / seconds),
                   "load_average_1min": load_average()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxT,BxT,..., got {text!r}") from None
    if not all(len(s) == 2 and min(s) >= 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected BxT,BxT,... with positive sizes, got {text!r}")
    return shapes


def _fractions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"checkpoint fractions must lie in (0, 1], got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(MODEL_DIR))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=192)
    parser.add_argument("--eval-windows", type=int, default=HELDOUT_WINDOWS)
    parser.add_argument("--checkpoint-dir", help="save checkpoints (mlx-lm model directories) here")
    parser.add_argument("--checkpoints", type=_fractions, default=[0.05, 0.1, 0.25, 0.5, 1.0],
                        help="fractions of --steps at which to save a checkpoint")
    parser.add_argument("--measure", type=_shapes, help="time the step for these BxT shapes and exit")
    parser.add_argument("--measure-steps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.measure:
        measure(args)
        return 0
    report = train(args)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
