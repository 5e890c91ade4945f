"""``python -m mlx_knorm eval`` and ``python -m mlx_knorm demo`` on the shipped model.

mlx-lm, tqdm and matplotlib are imported here, not at package import, so that
``python -m mlx_knorm info`` works with MLX alone.
"""

from __future__ import annotations

import json

from . import MODEL_DIR

DEMO_PROMPT = '"""Utilities for reading configuration files."""\n\nimport os\nimport sys\n\n\ndef '


def load():
    from mlx_lm.utils import load_model

    model, _ = load_model(MODEL_DIR)
    return model


def eval_command(args) -> int:
    from . import data
    from .eval import evaluate, markdown_table, plot

    sequences = data.heldout_sequences(args.seq_len, args.n_seqs)
    results = evaluate(load(), sequences, n_sink=args.n_sink, seed=args.seed, progress=True)
    print(markdown_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        report = {
            "seq_len": results.seq_len, "n_seqs": results.n_seqs, "n_sink": args.n_sink,
            "budgets": results.budgets, "full_perplexity": results.perplexity("full"),
            "perplexity": {f"{p}@{b}": results.perplexity(p, b) for p, b in results.nll if b},
            "recall": {f"{p}@{b}": results.mean_recall(p, b) for p, b in results.recall if b},
            "layer_spearman": results.layer_spearman(),
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def demo_command(args) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from ..cache import make_knorm_cache

    model = load()
    prompt = args.prompt.encode()
    cache = make_knorm_cache(model, budget=args.budget, n_sink=args.n_sink)
    mx.random.seed(args.seed)
    out = bytearray()
    steps = generate_step(mx.array(list(prompt), dtype=mx.uint32), model, max_tokens=args.max_tokens,
                          sampler=make_sampler(temp=args.temp), prompt_cache=cache)
    for token, _ in steps:
        out.append(int(token))
    print(prompt.decode(errors="replace") + out.decode(errors="replace"))
    kept = sum(c.knorm_kept_bytes for c in cache)
    full = sum(c.full_seq_bytes for c in cache)
    print(f"\n--- {cache[0].offset} tokens seen, {cache[0].size()} kept per head (budget {args.budget}); "
          f"K+V at float16: {kept / 1024:.1f} KiB kept vs {full / 1024:.1f} KiB for a full cache, "
          f"{100 * (1 - kept / full):.1f}% saved")
    return 0


def register(commands) -> None:
    """Add the ``eval`` and ``demo`` subcommands to ``python -m mlx_knorm``."""
    ev = commands.add_parser("eval", help="compare eviction policies on the shipped byte-level model")
    ev.add_argument("--seq-len", type=int, default=1024, help="held-out sequence length (bytes)")
    ev.add_argument("--n-seqs", type=int, default=8, help="number of held-out sequences")
    ev.add_argument("--n-sink", type=int, default=4, help="protected first tokens, for every policy")
    ev.add_argument("--seed", type=int, default=0, help="seed of the random-eviction policy")
    ev.add_argument("--plot", help="write a plot (PNG) here")
    ev.add_argument("--json", help="write the numbers as JSON here")
    ev.set_defaults(func=eval_command)

    demo = commands.add_parser("demo", help="generate with the shipped model under make_knorm_cache")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=400)
    demo.add_argument("--budget", type=int, default=128)
    demo.add_argument("--n-sink", type=int, default=4)
    demo.add_argument("--temp", type=float, default=0.8)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=demo_command)
