"""``mlx-knorm bench``: the target cases (or any budget x S grid) timed side
by side, printed as tables, optionally written as JSON and plotted;
``--cache``: the quick cache-step suite instead."""

from __future__ import annotations

import dataclasses
import json
import sys

import mlx.core as mx

from ..atomic import write_text
from ..backend import native_available
from ..validation import FLOAT_DTYPES
from . import cache_step
from .cache_report import cache_report, print_cache_report
from .cases import TARGET_STEPS, suite
from .plot import plot
from .report import machine, now, print_report
from .timing import run_suite


# The quick cache-step suite of ``--cache``: B = 1, H = 8.
CACHE_BUDGETS = (512, 2048)
CACHE_BATCH = 1
CACHE_HEADS = 8


def add_arguments(parser) -> None:
    parser.add_argument("--cache", action="store_true",
                        help="the quick cache-step suite instead: one decode step of mlx-lm's "
                             "KVCache, RotatingKVCache, the reference's cache and ours "
                             f"(B={CACHE_BATCH}, H={CACHE_HEADS}; honours --budget --d --dtype "
                             "--device --reps (steps per round) --json --no-progress)")
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions, about a second per timing (under a minute)")
    parser.add_argument("--n", type=int, default=32, help="rows N = B*H (default 32)")
    parser.add_argument("--d", type=int, default=128, help="head dim D (default 128)")
    parser.add_argument("--budget", type=int, nargs="+",
                        help="budgets; with --s, every budget x S pair replaces the built-in cases")
    parser.add_argument("--s", type=int, nargs="+",
                        help="new tokens per step: 1 is a decode step from a full cache, "
                             "more a prefill into an empty one")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default="float16")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--reps", type=int, help="timed repetitions per implementation "
                        "(default 7 with --quick, else 30; capped by time for slow ones)")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    parser.add_argument("--plot", metavar="PATH", help="time vs budget and vs S (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def native_missing(program: str) -> bool:
    """True, after saying so on stderr, when the native extension is not loaded."""
    if native_available():
        return False
    print(f"{program}: the native extension is not loaded; see `mlx-knorm info`", file=sys.stderr)
    return True


def write_json(report: dict, path: str | None) -> None:
    if path:
        write_text(path, json.dumps(report, indent=2))


def run_program(program: str, args, run, print_report) -> int:
    """A bench/ program's last steps: refuse without the extension, run,
    print the report, write it as JSON to ``args.json``; the exit status."""
    if native_missing(program):
        return 1
    report = run(args)
    print_report(report)
    write_json(report, args.json)
    return 0


def report_cache_suite(step_configs, schedule, device: str, command: str,
                       json_path: str | None, show_progress: bool) -> dict:
    """Runs the cache-step configurations, prints the report, writes the JSON."""
    host, date = machine(), now()
    results = cache_step.run_cache_suite(step_configs, schedule, show_progress)
    report = cache_report(results, schedule, device, command, host, date)
    print_cache_report(report)
    write_json(report, json_path)
    return report


def run_cache(args, command: str) -> int:
    """The quick cache-step suite (bench/cache_step.py runs the full sweep)."""
    step_configs = cache_step.configs(args.budget or CACHE_BUDGETS, [CACHE_BATCH], CACHE_HEADS,
                                      args.d, args.dtype)
    schedule = cache_step.QUICK
    if args.reps is not None:
        schedule = dataclasses.replace(schedule, steps=args.reps)
    report_cache_suite(step_configs, schedule, args.device, command, args.json,
                       not args.no_progress)
    return 0


def run(args, steps=TARGET_STEPS, command: str | None = None) -> int:
    """Runs the (budget, S) ``steps`` unless ``--budget``/``--s`` name others;
    0 when every case was bit-exact. ``command`` is recorded in the JSON
    (default: this process's ``mlx-knorm`` command line)."""
    if args.device == "gpu" and not mx.metal.is_available():
        print("mlx-knorm bench: --device gpu needs Metal; none is available here", file=sys.stderr)
        return 2
    command = command or " ".join(["mlx-knorm", *sys.argv[1:]])
    previous_device = mx.default_device()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    try:
        if args.cache:
            return run_cache(args, command)
        return run_ops(args, steps, command)
    finally:
        mx.set_default_device(previous_device)


def run_ops(args, steps, command: str) -> int:
    if args.budget is not None or args.s is not None:
        steps = [(b, s) for b in args.budget or [512, 2048] for s in args.s or [1]]
    cases = suite(steps, args.n, args.d, args.dtype)
    reps = args.reps or (7 if args.quick else 30)
    report = run_suite(cases, args.device, reps, args.quick, command,
                       show_progress=not args.no_progress)
    print_report(report)
    write_json(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return 0 if all(r["bit_exact"] for r in report["cases"]) else 1
