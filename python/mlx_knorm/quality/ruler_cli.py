"""``python -m mlx_knorm ruler``: the command line of ``ruler.run``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..defaults import DEFAULT_N_SINK
from ..models.cli import MODEL_HELP, add_weight_arguments
from . import PREFILL_STEP_SIZE
from .outputs import output_path, plot_path, read_text_file, write_outputs


def ruler_command(args) -> int:
    from .cli import Clock, _filters, load, model_spec
    from .ruler import markdown_table, plot, run

    haystack_text = None
    if args.haystack is not None:
        from .ruler_tasks import ESSAY_TASKS

        if not set(args.tasks) & set(ESSAY_TASKS):
            print(f"mlx-knorm ruler: --haystack {args.haystack} is the essay haystacks' text, and --tasks "
                  f"{','.join(args.tasks)} has none (they are {', '.join(ESSAY_TASKS)})", file=sys.stderr)
            return 2
        try:
            haystack_text = read_text_file(args.haystack, "--haystack")
        except ValueError as error:
            print(f"mlx-knorm ruler: {error}", file=sys.stderr)
            return 2
    model, tokenizer, _ = load(args.model, args)
    clock = Clock()
    try:
        result = run(model, tokenizer, tasks=args.tasks, context=args.context, fractions=args.budgets,
                     policies=args.policies, samples=args.samples, seed=args.seed, n_sink=args.n_sink,
                     prefill_step_size=args.prefill_step_size, haystack_text=haystack_text,
                     max_tokens=args.max_tokens, filters=_filters(args, model), progress=True, jobs=args.jobs,
                     model_spec=model_spec(args.model, args))
    except ValueError as error:  # a task with no room at --context, a policy that cannot run on this model
        print(f"mlx-knorm ruler: {error}", file=sys.stderr)
        return 2
    timing = clock.stop()
    print(markdown_table(result))
    c = result.config
    print(f"{len(result.samples)} samples through {len(c['caches'])} caches each: "
          f"{c['prompt_tokens_read']:,} prompt tokens read ({c['replayed_tokens']:,} of them replayed from the full "
          f"cache's forward pass, which took {c['recorded_tokens']:,}) in {clock.line()}")
    write_outputs(args, plot, result, args.model, timing)
    return 0


def register(commands, *, fractions, positive, non_negative, policies, add_jobs) -> None:
    """Add ``ruler``; the argument types are the quality commands' own (``quality.cli``)."""
    from .ruler import RULER_BUDGET_FRACTIONS, RULER_CONTEXT, RULER_SAMPLES
    from .ruler_tasks import ALL_TASKS, TASKS

    rl = commands.add_parser(
        "ruler", help="RULER's synthetic tasks through the real caches (SmolLM2 by default)",
        description="RULER's synthetic tasks (needle in a haystack with number, word and UUID values, multi-key, "
                    "multi-value, multi-query, variable tracking, common and frequent words extraction; the QA "
                    "tasks need downloads and are left out), generated offline with fixed seeds, answered "
                    "greedily by mlx-lm's generate_step through the full cache and each policy's real cache, "
                    "the prompt fed in chunks as mlx-lm feeds it. Scores are RULER's string match (the share of "
                    "expected answers found), per task and averaged, with 95%% bootstrap intervals over the "
                    "samples and each policy's difference from the recent window, paired by sample.")
    rl.add_argument("--model", default="smollm2", help=f"{MODEL_HELP} (default: smollm2)")
    def task_list(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in ALL_TASKS]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown tasks {unknown}; known: {', '.join(ALL_TASKS)}")
        return names

    rl.add_argument("--tasks", type=task_list, default=list(TASKS),
                    help=f"comma-separated, of {', '.join(ALL_TASKS)} (default: RULER's {len(TASKS)} synthetic ones)")
    rl.add_argument("--context", type=positive, default=RULER_CONTEXT,
                    help=f"prompt tokens, the answer's budget included (default: {RULER_CONTEXT})")
    rl.add_argument("--budgets", type=fractions, default=list(RULER_BUDGET_FRACTIONS),
                    help="cache budgets as fractions of the context, comma-separated (default: kvpress's "
                         "compression ratios 25/50/75/87.5%%: 0.75,0.5,0.25,0.125)")
    rl.add_argument("--policies", type=policies,
                    help="as for eval, any set (default: window and keep-low, keydiff and vnorm each with the "
                         "default recent window); the full cache always runs")
    rl.add_argument("--samples", type=positive, default=RULER_SAMPLES,
                    help=f"samples per task, the same for every policy (default: {RULER_SAMPLES})")
    rl.add_argument("--haystack", metavar="FILE",
                    help="a UTF-8 text file for the essay haystacks (default: Python's reference documentation)")
    rl.add_argument("--max-tokens", type=positive,
                    help="answer tokens of every task (default: RULER's per task: 128 needle, 30 vt, 120 cwe, 50 fwe)")
    rl.add_argument("--n-sink", type=non_negative, default=DEFAULT_N_SINK,
                    help="protected first tokens, for every policy")
    rl.add_argument("--prefill-step-size", type=positive, default=PREFILL_STEP_SIZE,
                    help="prompt tokens per model call (generate_step's prefill_step_size)")
    rl.add_argument("--seed", type=int, default=0, help="seed of the samples and of random eviction")
    rl.add_argument("--filters", type=Path,
                    help="the query filters of the qfilter policies (default: where `mlx-knorm calibrate "
                         "--model M` writes them)")
    add_jobs(rl, "samples")
    rl.add_argument("--plot", type=plot_path, help="write the average against compression (PNG) here")
    rl.add_argument("--json", type=output_path,
                    help="write every sample, output and score, and the summary, as JSON here")
    add_weight_arguments(rl)
    rl.set_defaults(func=ruler_command)
