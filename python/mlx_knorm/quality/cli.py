"""``python -m mlx_knorm eval`` (any mlx-lm model or GGUF file, any text), ``needle`` and ``demo``.

mlx-lm, tqdm and matplotlib are imported here, not at package import, so that
``python -m mlx_knorm info`` works with MLX alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from ..defaults import DEFAULT_N_SINK, DEFAULT_RECENT_SHARE, DEFAULT_SKIP_LAYERS
from ..models.cli import MODEL_HELP, add_weight_arguments
from . import (BUDGET_FRACTIONS, HAYSTACKS, MODEL_DIR, NEEDLE_BUDGET_FRACTIONS, NEEDLE_CONTEXTS, NEEDLE_DEPTHS,
               NEEDLE_FULL_KEYS, NEEDLE_HAYSTACKS, NEEDLE_KEYS, PREFILL_STEP_SIZE, QUERY_CHUNK)
from .outputs import output_path, plot_path, read_text_file, write_outputs

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


def _policies(text: str):
    from .policies import parse_policies

    try:
        return parse_policies(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_jobs_argument(parser, unit: str) -> None:
    parser.add_argument("--jobs", type=_positive, default=1,
                        help=f"processes to share the {unit} among, each loading the model and using one BLAS "
                             "thread (on a CPU: one per core runs faster than one process with a threaded BLAS; "
                             "each holds a copy of the weights)")


def model_spec(model: str | None, args=None):
    """The ``workers.ModelSpec`` of ``model`` (the shipped model when None) with ``args``' GGUF weight options."""
    from .workers import ModelSpec

    return ModelSpec(str(model or MODEL_DIR), getattr(args, "dtype", None), getattr(args, "requantize", None))


def load(model: str | None, args=None):
    """``(model, tokenizer, config)`` through ``mlx_knorm.models.load``: the shipped model when ``model`` is None.

    ``args``: the parsed command line, for its GGUF weight options (``--dtype``, ``--requantize``).
    """
    return model_spec(model, args).load(return_config=True)


class Clock:
    """Wall and CPU time of a run, with the 1-minute load average at its start and end (a shared machine's)."""

    def __init__(self):
        self.start, self.cpu, self.load = time.perf_counter(), _cpu_seconds(), os.getloadavg()[0]

    def stop(self) -> dict:
        self.timing = {"seconds": round(time.perf_counter() - self.start, 1),
                       "cpu_seconds": round(_cpu_seconds() - self.cpu, 1),
                       "load_average_at_start": round(self.load, 2),
                       "load_average_at_end": round(os.getloadavg()[0], 2)}
        return self.timing

    def line(self) -> str:
        t = self.timing
        return (f"{t['seconds'] / 60:.1f} min ({t['cpu_seconds'] / 60:.1f} CPU min; 1-minute load average "
                f"{t['load_average_at_start']:.1f} at the start, {t['load_average_at_end']:.1f} at the end)")


def _cpu_seconds() -> float:
    """This process's CPU time and that of its children that have ended (``--jobs``' workers)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def _filters(args, model):
    """The query filters the qfilter policies read: --filters, or where
    ``mlx-knorm calibrate --model M`` writes them, checked against ``model``
    (``QueryFilters.check_model``); None without a qfilter policy."""
    if not any(p.score == "qfilter" for p in args.policies or ()):
        return None
    from ..scorers import QueryFilters, default_filters_path

    filters = QueryFilters.load(args.filters or default_filters_path(args.model or MODEL_DIR))
    filters.check_model(model)
    return filters


def eval_command(args) -> int:
    from . import data
    from .eval import evaluate, markdown_table, plot

    text = None
    if args.text and args.text != data.PYDOC_TOPICS:
        try:
            text = read_text_file(args.text, "--text")
        except ValueError as error:
            print(f"mlx-knorm eval: {error}", file=sys.stderr)
            return 2
    model, tokenizer, config = load(args.model, args)
    seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, config.get("max_position_embeddings") or DEFAULT_SEQ_LEN)
    if args.text == data.PYDOC_TOPICS:
        sequences = data.text_sequences(tokenizer, data.pydoc_topics(), seq_len, args.n_seqs)
        source = "pydoc_data.topics, sorted by topic"
    elif text is not None:
        sequences = data.text_sequences(tokenizer, text, seq_len, args.n_seqs)
        source = args.text
    else:
        sequences = data.document_sequences(tokenizer, data.heldout_texts(), seq_len, args.n_seqs)
        source = "held-out Python standard library files"
    policies = {} if args.policies is None else {"policies": args.policies}
    clock = Clock()
    results = evaluate(model, sequences, n_sink=args.n_sink, skip_layers=args.skip_layers,
                       fractions=args.budgets, seed=args.seed, query_chunk=args.query_chunk, progress=True,
                       jobs=args.jobs, model_spec=model_spec(args.model, args),
                       filters=_filters(args, model), **policies)
    name = args.model or "shipped byte-level model"
    print(markdown_table(results))
    print()
    timing = clock.stop()
    for note in results.notes:
        print(note)
    if (verdict := results.verdict()) is not None:
        print(verdict)
    print(clock.line())
    write_outputs(args, plot, results, name, timing, text=source, seed=args.seed)
    return 0


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def needle_grid(args) -> dict:
    """``run_grid``'s haystacks, policies and keys: the options given, else the default grid or ``--full-grid``'s."""
    from .policies import DEFAULT_POLICIES, NEEDLE_POLICIES

    full = args.full_grid
    return {"haystacks": args.haystacks or list(HAYSTACKS if full else NEEDLE_HAYSTACKS),
            "policies": args.policies or list(DEFAULT_POLICIES if full else NEEDLE_POLICIES),
            "keys": args.keys or (NEEDLE_FULL_KEYS if full else NEEDLE_KEYS)}


def needle_command(args) -> int:
    from .needle import markdown_tables, plot, run_grid

    grid_options = needle_grid(args)
    haystack_text = None
    if args.haystack is not None:
        try:
            haystack_text = read_text_file(args.haystack, "--haystack")
        except ValueError as error:
            print(f"mlx-knorm needle: {error}", file=sys.stderr)
            return 2
        if args.haystacks is None:
            grid_options["haystacks"] = ["prose"]
        elif "prose" not in grid_options["haystacks"]:
            print(f"mlx-knorm needle: --haystack {args.haystack} is the prose haystack's text, and --haystacks "
                  f"{','.join(grid_options['haystacks'])} has no prose", file=sys.stderr)
            return 2
    model, tokenizer, _ = load(args.model, args)
    clock = Clock()
    try:
        grid = run_grid(model, tokenizer, contexts=args.contexts, depths=args.depths, fractions=args.budgets,
                        n_sink=args.n_sink, prefill_step_size=args.prefill_step_size, seed=args.seed,
                        progress=True, jobs=args.jobs, model_spec=model_spec(args.model, args),
                        filters=_filters(args, model), haystack_text=haystack_text, **grid_options)
    except ValueError as error:
        print(f"mlx-knorm needle: {error}", file=sys.stderr)
        return 2
    timing = clock.stop()
    print(markdown_tables(grid))
    print(f"{len(grid.trials)} trials, {grid.prefill_tokens:,} prompt tokens read by the caches "
          f"({grid.replayed_tokens:,} of them replayed from the full cache's forward pass, which took "
          f"{grid.recorded_tokens:,}) in {clock.line()}")
    write_outputs(args, plot, grid, args.model, timing)
    return 0


def demo_command(args) -> int:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..cache import L2NormKVCache, make_knorm_cache

    model, tokenizer, _ = load(args.model, args)
    cache = make_knorm_cache(model, budget=args.budget, n_sink=args.n_sink, recent=args.recent,
                             skip_layers=args.skip_layers)
    mx.random.seed(args.seed)
    print(args.prompt, end="")
    for response in stream_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                                    sampler=make_sampler(temp=args.temp), prompt_cache=cache):
        print(response.text, end="", flush=True)
    compressed = [c for c in cache if isinstance(c, L2NormKVCache)]
    kept = sum(c.knorm_kept_bytes for c in compressed)
    full = sum(c.full_seq_bytes for c in compressed)
    first = compressed[0]
    print(f"\n\n--- {first.offset} tokens seen, {first.size()} kept per head (budget {args.budget}, "
          f"recent {first.recent}) in {len(compressed)} of {len(cache)} layers; "
          f"K+V at float16: {kept / 1024:.1f} KiB kept vs {full / 1024:.1f} KiB for a full cache, "
          f"{100 * (1 - kept / full):.1f}% saved")
    return 0


def calibrate_command(args) -> int:
    from ..scorers import default_filters_path
    from .calibrate import calibration_sequences, query_filters

    def refuse(why: str) -> int:
        print(f"mlx-knorm calibrate: error: {why}", file=sys.stderr)
        return 2

    why = local_model_problem(args.model)
    if why:
        return refuse(f"--model {args.model}: {why}")
    out = args.out or default_filters_path(args.model)
    if out.is_dir():
        return refuse(f"--out {out} is a folder; name the file to write")
    try:
        model, tokenizer, _ = load(args.model, args)
    except (OSError, ValueError, KeyError) as e:
        return refuse(f"--model {args.model}: cannot load it ({type(e).__name__}: {e})")
    try:
        sequences = calibration_sequences(tokenizer, args.n_seqs, args.seq_len)
    except ValueError as e:
        return refuse(f"--seq-len {args.seq_len} with --n-seqs {args.n_seqs}: the calibration text is too "
                      f"short ({e}); ask for fewer or shorter sequences")
    filters = query_filters(model, sequences)
    filters.metadata.update({"model": str(args.model), "n_seqs": args.n_seqs, "seq_len": args.seq_len,
                             "text": "Python standard library sources (training split)"})
    out = filters.save(out)
    print(f"query filters of {len(filters.filters)} layers ({args.n_seqs} x {args.seq_len} tokens) -> {out}")
    return 0


def local_model_problem(model: str) -> str | None:
    """Why ``model`` (as ``--model`` names it) cannot be a model, where that
    shows before loading: a path that does not exist, or a folder without
    an mlx-lm model's ``config.json`` and weights. None otherwise (a
    packaged short name, a Hugging Face repo, a model folder or GGUF file)."""
    from ..models.fetch import PACKAGED_MODELS

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return "the folder holds no model (no config.json)"
        if not any(path.glob("*.safetensors")):
            return "the folder holds no weights (no *.safetensors)"
        return None
    if path.exists() or model in PACKAGED_MODELS:
        return None
    # A Hugging Face repo is "name" or "owner/name"; a path names a folder.
    looks_local = path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1 or model.endswith(".gguf")
    return "no such file or folder" if looks_local else None


def register(commands) -> None:
    """Add the ``eval``, ``needle``, ``calibrate`` and ``demo`` subcommands to ``python -m mlx_knorm``."""
    ev = commands.add_parser(
        "eval", help="compare eviction policies on an mlx-lm model (the shipped byte-level one by default)",
        description="Teacher-forced, exact comparison of eviction policies at equal memory against the full "
                    "cache: perplexity and attention-mass recall with 95% bootstrap intervals over the "
                    "sequences, and the per-layer Spearman correlation of key norm with attention received.")
    ev.add_argument("--model", help=f"{MODEL_HELP} (default: the shipped byte-level model)")
    ev.add_argument("--text", help="UTF-8 text file to take the sequences from, or pydoc-topics: Python's "
                                   "reference documentation (pydoc_data.topics, sorted by topic) "
                                   "(default: held-out Python standard library files)")
    ev.add_argument("--seq-len", type=_positive,
                    help=f"tokens per sequence, a BOS token included where the tokenizer adds one (default: {DEFAULT_SEQ_LEN}, or the model's "
                         "max_position_embeddings if smaller)")
    ev.add_argument("--n-seqs", type=_positive, default=8, help="number of sequences")
    ev.add_argument("--budgets", type=_fractions, default=list(BUDGET_FRACTIONS),
                    help="cache budgets as fractions of --seq-len, comma-separated: KV rows per full-attention "
                         "layer on average, the same memory for every policy")
    ev.add_argument("--n-sink", type=_non_negative, default=DEFAULT_N_SINK,
                    help="protected first tokens, for every policy")
    ev.add_argument("--policies", type=_policies,
                    help="policies separated by spaces or semicolons, each SCORE[+recent=F][+skip=I,J][+bits=B] "
                         "with SCORE keep-low, keep-high, keydiff, vnorm, qfilter, window or random, F a share of the budget, I,J layers "
                         "kept whole, B the bits of quantized rows (group size 64; full+bits=B: mlx-lm's "
                         "QuantizedKVCache alone, whatever the budget); any set (the verdict line "
                         "compares keep-low and random where both run; default: those two, keep-high, "
                         "window, and keep-low with recent=1/4 and 1/2, each also with skip=0,1)")
    ev.add_argument("--skip-layers", type=_layers, default=[],
                    help="layers every policy leaves uncompressed, comma-separated (as make_knorm_cache's "
                         "skip_layers); budgets stay equal memory, so the other layers get fewer rows")
    ev.add_argument("--seed", type=int, default=0, help="seed of the random-eviction policy")
    ev.add_argument("--filters", type=Path,
                    help="the query filters of the qfilter policies (default: where `mlx-knorm calibrate "
                         "--model M` writes them)")
    ev.add_argument("--query-chunk", type=_positive, default=QUERY_CHUNK,
                    help="query rows per attention block (memory: heads x rows x seq-len floats)")
    _add_jobs_argument(ev, "windows")
    ev.add_argument("--plot", type=plot_path, help="write a plot (PNG) here")
    ev.add_argument("--json", type=output_path, help="write the numbers as JSON here")
    add_weight_arguments(ev)
    ev.set_defaults(func=eval_command)

    nd = commands.add_parser(
        "needle", help="needle retrieval through the real caches (SmolLM2 by default)",
        description="A 5-digit key at a chosen depth of a long prompt, asked for at the end, answered greedily "
                    "by mlx-lm's generate_step through each policy's real cache (make_knorm_cache, "
                    "RotatingKVCache, KVCache, random eviction), the prompt fed in chunks as mlx-lm feeds it. "
                    "Accuracy per context, depth, policy and budget with 95% Wilson intervals. The default "
                    "grid (passkey haystack, 3 contexts x 5 depths x 2 budgets, one key per cell, the full "
                    "cache, keep-low, the recent window and keep-low with a recent window of half the budget) "
                    "reads 186k prompt tokens: 12 minutes with --jobs 2 on SmolLM2-135M with float32 weights and OpenBLAS "
                    "on a 2-core x86 CPU. "
                    "--full-grid reads about 3.3M: hours on a CPU.")
    nd.add_argument("--model", default="smollm2", help=f"{MODEL_HELP} (default: smollm2)")
    nd.add_argument("--full-grid", action="store_true",
                    help=f"the full grid: both haystacks, the eval's nine policies, {NEEDLE_FULL_KEYS} "
                         "keys per cell (the options below, where given, still apply)")
    nd.add_argument("--haystacks", type=lambda t: t.split(","),
                    help="passkey (the classic filler) and/or prose (pydoc_data.topics), comma-separated "
                         f"(default: {','.join(NEEDLE_HAYSTACKS)}; --full-grid: {','.join(HAYSTACKS)})")
    nd.add_argument("--haystack", metavar="FILE",
                    help="a UTF-8 text file as the prose haystack's text, repeated where short (with it, "
                         "--haystacks defaults to prose)")
    nd.add_argument("--contexts", type=_numbers(int), default=list(NEEDLE_CONTEXTS),
                    help="prompt lengths in tokens, comma-separated")
    nd.add_argument("--depths", type=_numbers(float), default=list(NEEDLE_DEPTHS),
                    help="needle depths in [0, 1] (0: the start of the haystack), comma-separated")
    nd.add_argument("--budgets", type=_fractions, default=list(NEEDLE_BUDGET_FRACTIONS),
                    help="cache budgets as fractions of each context, comma-separated: KV rows per "
                         "full-attention layer on average, the same memory for every policy")
    nd.add_argument("--policies", type=_policies,
                    help="as for eval (default: keep-low, window and keep-low+recent=1/2; --full-grid: the "
                         "eval's nine); the full cache always runs")
    nd.add_argument("--keys", type=_positive,
                    help="keys per (context, depth): the same keys for every policy "
                         f"(default: {NEEDLE_KEYS}; --full-grid: {NEEDLE_FULL_KEYS})")
    nd.add_argument("--n-sink", type=_non_negative, default=DEFAULT_N_SINK,
                    help="protected first tokens, for every policy")
    nd.add_argument("--prefill-step-size", type=_positive, default=PREFILL_STEP_SIZE,
                    help="prompt tokens per model call (generate_step's prefill_step_size)")
    nd.add_argument("--seed", type=int, default=0, help="seed of the keys and of random eviction")
    nd.add_argument("--filters", type=Path,
                    help="the query filters of the qfilter policies (default: where `mlx-knorm calibrate "
                         "--model M` writes them)")
    _add_jobs_argument(nd, "policies and budgets")
    nd.add_argument("--plot", type=plot_path, help="write the heatmaps (PNG) here")
    nd.add_argument("--json", type=output_path, help="write every trial and the accuracies as JSON here")
    add_weight_arguments(nd)
    nd.set_defaults(func=needle_command)

    cal = commands.add_parser(
        "calibrate", help="measure a model's query filters for the qfilter scorer and write them to a file",
        description="Runs the model over the Python standard library's sources and writes, for each "
                    "full-attention layer, the principal direction of each KV head's queries (Q-Filters): "
                    "what the qfilter scorer projects keys on.")
    cal.add_argument("--model", default="smollm2", help=f"{MODEL_HELP} (default: smollm2)")
    cal.add_argument("--n-seqs", type=_positive, default=8, help="sequences of text to read (default 8)")
    cal.add_argument("--seq-len", type=_positive, default=512, help="tokens per sequence (default 512)")
    cal.add_argument("--out", type=Path,
                     help="the file to write (default: filters/<model>.safetensors in the cache folder, where "
                          "the commands' --scorer qfilter looks)")
    add_weight_arguments(cal)
    cal.set_defaults(func=calibrate_command)

    from .ruler_cli import register as register_ruler

    register_ruler(commands, fractions=_fractions, positive=_positive, non_negative=_non_negative,
                   policies=_policies, add_jobs=_add_jobs_argument)

    demo = commands.add_parser("demo", help="generate under make_knorm_cache (the shipped model by default)")
    demo.add_argument("--model", help=f"{MODEL_HELP} (default: the shipped byte-level model)")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=400)
    demo.add_argument("--budget", type=int, default=128)
    demo.add_argument("--n-sink", type=_non_negative, default=DEFAULT_N_SINK)
    demo.add_argument("--recent", type=int,
                      help="latest tokens always kept (default: make_knorm_cache's, "
                           f"{DEFAULT_RECENT_SHARE} of the budget)")
    demo.add_argument("--skip-layers", type=_layers, default=list(DEFAULT_SKIP_LAYERS),
                      help="layers left uncompressed, comma-separated (default: none)")
    demo.add_argument("--temp", type=float, default=0.8)
    demo.add_argument("--seed", type=int, default=0)
    add_weight_arguments(demo)
    demo.set_defaults(func=demo_command)
