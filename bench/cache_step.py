"""The cache-step sweep: one decode step of one layer's KV cache for mlx-lm's
KVCache and RotatingKVCache(max_size=budget, keep=4), the reference's
L2NormKVCache and ours (layout "slots" and "temporal"), at budgets 512,
2048 and 8192, B = 1 and 4, H = 8, D = 128, float16, with the slot layout's
evict_and_fill alone and the copy of K + V of the budget's size as the floor
(docs/benchmarks.md's cache-step table).

    python bench/cache_step.py --json bench/results/cache-step-cpu.json

``--quick`` is the suite of ``mlx-knorm bench --cache`` (budgets 512 and
2048, B = 1, fewer steps). How a step is timed and how to read the table:
bench/README.md and ``mlx_knorm.bench.cache_step``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import mlx.core as mx

from mlx_knorm.bench import cache_step, cli
from mlx_knorm.validation import FLOAT_DTYPES

BUDGETS = (512, 2048, 8192)
BATCHES = (1, 4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cache_step.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="budgets 512 and 2048, B = 1, fewer steps (under a minute)")
    parser.add_argument("--budget", type=int, nargs="+", help=f"budgets (default {BUDGETS})")
    parser.add_argument("--batch", type=int, nargs="+", help=f"batch sizes B (default {BATCHES})")
    parser.add_argument("--heads", type=int, default=cli.CACHE_HEADS, help="KV heads H")
    parser.add_argument("--dim", type=int, default=128, help="head dim D")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default="float16")
    parser.add_argument("--rounds", type=int, help="rounds, the first untimed")
    parser.add_argument("--steps", type=int, help="steps per round and cache")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (the first round is untimed), got {args.rounds}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if cli.native_missing("bench/cache_step.py"):
        return 1
    if args.quick:
        schedule, budgets, batches = cache_step.QUICK, cli.CACHE_BUDGETS, [cli.CACHE_BATCH]
    else:
        schedule, budgets, batches = cache_step.FULL, BUDGETS, BATCHES
    schedule = dataclasses.replace(schedule, rounds=args.rounds or schedule.rounds,
                                   steps=args.steps or schedule.steps)
    step_configs = cache_step.configs(args.budget or budgets, args.batch or batches,
                                      args.heads, args.dim, args.dtype)
    mx.set_default_device(mx.cpu)
    cli.report_cache_suite(step_configs, schedule, "cpu",
                           " ".join(["python bench/cache_step.py", *argv]), args.json,
                           not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
