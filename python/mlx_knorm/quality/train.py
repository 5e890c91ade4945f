"""Train the shipped byte-level llama on the Python standard library.

    python -m mlx_knorm.quality.train --out python/mlx_knorm/quality/model

The defaults are the shipped run (about 12 minutes on a busy 2-core CPU;
sized for that, so the model is small and undertrained). The model is
mlx-lm's own ``llama`` class, so ``mlx_lm.utils.load_model``
loads the result. Every random choice (init, batch offsets, held-out windows)
derives from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
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

from . import MODEL_DIR
from . import data


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


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def mean_loss(model, windows: np.ndarray, batch_size: int) -> float:
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        total += loss_fn(model, mx.array(chunk, dtype=mx.int32)).item() * len(chunk)
    return total / len(windows)


def train(args) -> dict:
    np_rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    train_files, heldout_files = data.split_files()
    train_tokens = data.concat(data.read_bytes(train_files))
    heldout_tokens = data.concat(data.read_bytes(heldout_files))

    config = model_config(args)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

    warmup = max(1, args.steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, args.lr, warmup),
         optim.cosine_decay(args.lr, args.steps - warmup, args.lr / 10)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.1)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch):
        loss, grads = value_and_grad(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    smooth = None
    for _ in bar:
        batch = mx.array(data.random_windows(train_tokens, args.batch, args.seq_len, np_rng), dtype=mx.int32)
        loss = step(batch)
        mx.eval(state, loss)
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smooth:.3f}")
    train_seconds = time.perf_counter() - start

    # Fixed held-out windows, drawn from their own seeded generator so the
    # number is comparable across runs with different step counts.
    eval_windows = data.random_windows(heldout_tokens, args.eval_windows, args.seq_len,
                                       np.random.default_rng(args.seed + 1))
    heldout_loss = mean_loss(model, eval_windows, args.batch)
    unigram = data.unigram_cross_entropy(train_tokens, heldout_tokens)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    report = {
        "command": "python -m mlx_knorm.quality.train " + shlex.join(sys.argv[1:]),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "parameters": n_params,
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_bytes": int(len(train_tokens)),
        "heldout_bytes": int(len(heldout_tokens)),
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss_smoothed": round(smooth, 4),
        "heldout_loss": round(heldout_loss, 4),
        "heldout_bits_per_byte": round(heldout_loss / math.log(2), 4),
        "unigram_heldout_loss": round(unigram, 4),
        "unigram_bits_per_byte": round(unigram / math.log(2), 4),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "machine": f"{platform.machine()} {platform.system()}, cpu",
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(MODEL_DIR))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=192)
    parser.add_argument("--eval-windows", type=int, default=32)
    args = parser.parse_args(argv)
    report = train(args)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
