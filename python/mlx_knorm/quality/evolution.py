"""How the key-norm / attention relation evolves over training: the eval on each checkpoint.

    python -m mlx_knorm.quality.evolution build/checkpoints/step-* --init \\
        --json docs/results/quality-evolution.json --plot docs/results/quality-evolution.png

For each checkpoint directory written by ``train --checkpoint-dir`` (and, with
``--init``, the run's step-0 model rebuilt from its seed): the held-out loss on
the run's fixed held-out windows, the per-layer Spearman correlation of key
norm with attention received, and the attention-mass recall of keep-low and
of random eviction at one budget, from the eval's full pass (no masked
passes, so no perplexity under eviction).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_lm import load

from ..atomic import save_figure, write_text
from . import data, train
from .eval import evaluate


def checkpoint_row(model, info: dict, sequences, windows, args) -> dict:
    results = evaluate(model, sequences, n_sink=args.n_sink, fractions=(args.budget,), seed=args.seed,
                       policies=("keep-low", "random"), perplexity=False, progress=True)
    budget = results.budgets[0]
    return {
        **info,
        "heldout_loss": round(train.mean_loss(model, windows, 8), 4),
        "full_perplexity": round(results.perplexity("full"), 3),
        "layer_spearman": {layer: round(rho, 4) for layer, rho in results.layer_spearman().items()},
        "budget": budget,
        "keep_low_recall": round(results.mean_recall("keep-low", budget), 4),
        "random_recall": round(results.mean_recall("random", budget), 4),
    }


def markdown_table(rows: list[dict]) -> str:
    layers = list(rows[0]["layer_spearman"])
    budget = rows[0]["budget"]
    header = (["step", "of training", "bytes seen", "held-out loss (nats/byte)"]
              + [f"Spearman layer {i}" for i in layers]
              + [f"keep-low recall @ {budget}", f"random recall @ {budget}"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ([str(row["step"]), f"{row['fraction']:.0%}", f"{row['tokens_seen']:,}", f"{row['heldout_loss']:.3f}"]
                 + [f"{row['layer_spearman'][i]:+.3f}" for i in layers]
                 + [f"{row['keep_low_recall']:.3f}", f"{row['random_recall']:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    labels = [f"{row['step']}\n{row['fraction']:.0%}" for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(x, [row["heldout_loss"] for row in rows], "o-", color="k")
    axes[0].set(ylabel="nats/byte", title="Held-out loss")
    for layer in rows[0]["layer_spearman"]:
        axes[1].plot(x, [row["layer_spearman"][layer] for row in rows], "o-", label=f"layer {layer}")
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[1].set(ylabel="Spearman rho", title="Key norm vs attention received")
    axes[1].legend(fontsize=8)
    budget = rows[0]["budget"]
    axes[2].plot(x, [row["keep_low_recall"] for row in rows], "o-", label="keep-low")
    axes[2].plot(x, [row["random_recall"] for row in rows], "o-", label="random")
    axes[2].set(ylabel="attention-mass recall", title=f"Recall at budget {budget}")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("checkpoint (step, share of training)")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories (with CHECKPOINT.json)")
    parser.add_argument("--init", action="store_true", help="also evaluate the step-0 model of --seed")
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (held-out windows, init)")
    parser.add_argument("--eval-windows", type=int, default=train.HELDOUT_WINDOWS)
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.25, help="budget as a fraction of the sequence")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)

    directories = sorted((Path(c) for c in args.checkpoints),
                         key=lambda d: json.loads((d / "CHECKPOINT.json").read_text())["step"])
    config = json.loads((directories[0] / "config.json").read_text())
    seq_len = config["max_position_embeddings"]
    _, tokenizer = load(str(directories[0]))
    sequences = data.document_sequences(tokenizer, data.heldout_texts(), seq_len, args.n_seqs)
    windows = data.heldout_windows(args.eval_windows, seq_len, args.seed)

    rows = []
    if args.init:
        info = {"step": 0, "fraction": 0.0, "tokens_seen": 0}
        rows.append(checkpoint_row(train.initial_model(config, args.seed), info, sequences, windows, args))
    for directory in directories:
        info = json.loads((directory / "CHECKPOINT.json").read_text())
        info = {key: info[key] for key in ("step", "fraction", "tokens_seen")}
        rows.append(checkpoint_row(load(str(directory))[0], info, sequences, windows, args))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown_table(rows))
    title = f"{args.n_seqs} held-out sequences of {seq_len} bytes; recall and Spearman on the last half"
    if args.plot:
        plot(rows, args.plot, title)
    if args.json:
        settings = {"seq_len": seq_len, "n_seqs": args.n_seqs, "n_sink": args.n_sink, "seed": args.seed,
                    "heldout_windows": f"{args.eval_windows} x {seq_len} bytes"}
        write_text(args.json, json.dumps({**settings, "checkpoints": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
