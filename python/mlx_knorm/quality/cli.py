"""``python -m mlx_knorm eval`` (any mlx-lm model or GGUF file, any text) and ``python -m mlx_knorm demo``.

mlx-lm, tqdm and matplotlib are imported here, not at package import, so that
``python -m mlx_knorm info`` works with MLX alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..models.cli import MODEL_HELP, add_weight_arguments
from . import BUDGET_FRACTIONS, MODEL_DIR, QUERY_CHUNK

DEFAULT_SEQ_LEN = 1024
DEMO_PROMPT = '"""Utilities for reading configuration files."""\n\nimport os\nimport sys\n\n\ndef '


def _fractions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"every budget must be a fraction in (0, 1], got {text!r}")
    return values


def _layers(text: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load(model: str | None, args=None):
    """``(model, tokenizer, config)`` through ``mlx_knorm.models.load``: the shipped model when ``model`` is None.

    ``args``: the parsed command line, for its GGUF weight options (``--dtype``, ``--requantize``).
    """
    from ..models import load as load_model

    return load_model(str(model or MODEL_DIR), return_config=True, dtype=getattr(args, "dtype", None),
                      requantize=getattr(args, "requantize", None))


def eval_command(args) -> int:
    from . import data
    from .eval import evaluate, markdown_table, plot

    model, tokenizer, config = load(args.model, args)
    seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, config.get("max_position_embeddings") or DEFAULT_SEQ_LEN)
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
        sequences = data.text_sequences(tokenizer, text, seq_len, args.n_seqs)
        source = args.text
    else:
        sequences = data.document_sequences(tokenizer, data.heldout_texts(), seq_len, args.n_seqs)
        source = "held-out Python standard library files"
    results = evaluate(model, sequences, n_sink=args.n_sink, skip_layers=args.skip_layers,
                       fractions=args.budgets, seed=args.seed, query_chunk=args.query_chunk, progress=True)
    name = args.model or "shipped byte-level model"
    print(markdown_table(results))
    print()
    print(results.verdict())
    if args.plot:
        plot(results, args.plot, title=Path(name).name)
        print(f"plot: {args.plot}")
    if args.json:
        report = {"model": name, "text": source, "skip_layers": args.skip_layers, "seed": args.seed,
                  **results.report()}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def demo_command(args) -> int:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..cache import make_knorm_cache

    model, tokenizer, _ = load(args.model, args)
    cache = make_knorm_cache(model, budget=args.budget, n_sink=args.n_sink)
    mx.random.seed(args.seed)
    print(args.prompt, end="")
    for response in stream_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                                    sampler=make_sampler(temp=args.temp), prompt_cache=cache):
        print(response.text, end="", flush=True)
    kept = sum(c.knorm_kept_bytes for c in cache)
    full = sum(c.full_seq_bytes for c in cache)
    print(f"\n\n--- {cache[0].offset} tokens seen, {cache[0].size()} kept per head (budget {args.budget}); "
          f"K+V at float16: {kept / 1024:.1f} KiB kept vs {full / 1024:.1f} KiB for a full cache, "
          f"{100 * (1 - kept / full):.1f}% saved")
    return 0


def register(commands) -> None:
    """Add the ``eval`` and ``demo`` subcommands to ``python -m mlx_knorm``."""
    ev = commands.add_parser(
        "eval", help="compare eviction policies on an mlx-lm model (the shipped byte-level one by default)",
        description="Teacher-forced, exact comparison of keep-low, keep-high, sinks + recent window and "
                    "random eviction against the full cache: perplexity, attention-mass recall, and the "
                    "per-layer Spearman correlation of key norm with attention received.")
    ev.add_argument("--model", help=f"{MODEL_HELP} (default: the shipped byte-level model)")
    ev.add_argument("--text", help="UTF-8 text file to take the sequences from "
                                   "(default: held-out Python standard library files)")
    ev.add_argument("--seq-len", type=_positive,
                    help=f"tokens per sequence, BOS included (default: {DEFAULT_SEQ_LEN}, or the model's "
                         "max_position_embeddings if smaller)")
    ev.add_argument("--n-seqs", type=_positive, default=8, help="number of sequences")
    ev.add_argument("--budgets", type=_fractions, default=list(BUDGET_FRACTIONS),
                    help="cache budgets as fractions of --seq-len, comma-separated")
    ev.add_argument("--n-sink", type=int, default=4, help="protected first tokens, for every policy")
    ev.add_argument("--skip-layers", type=_layers, default=[],
                    help="layers left uncompressed, comma-separated (as make_knorm_cache's skip_layers)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the random-eviction policy")
    ev.add_argument("--query-chunk", type=_positive, default=QUERY_CHUNK,
                    help="query rows per attention block (memory: heads x rows x seq-len floats)")
    ev.add_argument("--plot", help="write a plot (PNG) here")
    ev.add_argument("--json", help="write the numbers as JSON here")
    add_weight_arguments(ev)
    ev.set_defaults(func=eval_command)

    demo = commands.add_parser("demo", help="generate under make_knorm_cache (the shipped model by default)")
    demo.add_argument("--model", help=f"{MODEL_HELP} (default: the shipped byte-level model)")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=400)
    demo.add_argument("--budget", type=int, default=128)
    demo.add_argument("--n-sink", type=int, default=4)
    demo.add_argument("--temp", type=float, default=0.8)
    demo.add_argument("--seed", type=int, default=0)
    add_weight_arguments(demo)
    demo.set_defaults(func=demo_command)
