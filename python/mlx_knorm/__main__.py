"""Command line: ``python -m mlx_knorm [bench | info | doctor | eval | needle | demo | convert | fetch | generate | chat | cache-prompt | server]``.

With no command it runs the quick benchmark suite. ``generate``, ``chat``,
``cache-prompt`` and ``server`` are mlx-lm's commands with eviction caches
(``mlx_knorm.commands``): they parse their own arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from .backend import backend_info, native_available
from .bench import cli as bench_cli
from .bench.cases import case_inputs, make_case
from .blas import blas_in_use, blas_line, reexec_with_fast_blas
from .commands import LM_COMMANDS, command_help
from .commands import run as run_lm_command
from .doctor import register as register_doctor
from .models.cli import register as register_models
from .quality.cli import register as register_quality
from .selfcheck import kernel_matches_fallback


# The commands that run matmuls on MLX's BLAS: run from the command line on a CPU, they re-execute with a
# fast one preloaded (mlx_knorm.blas).
MODEL_COMMANDS = (*LM_COMMANDS, "eval", "needle", "ruler", "calibrate", "demo", "info", "doctor")


def info(_args) -> int:
    print(json.dumps({**backend_info(), "blas": blas_in_use()}, indent=2))
    print(f"BLAS of MLX's CPU matmuls: {blas_line()}")
    if not native_available():
        print("self-check skipped: the native extension is not loaded")
        return 1
    ok = kernel_matches_fallback(case_inputs(make_case(512, 1, 32, 128, "float16")), budget=512)
    print(f"self-check (decode, N=32, D=128, budget=512, float16): kernel == fallback bit for bit: {ok}")
    return 0 if ok else 1


def run_bench(args) -> int:
    if bench_cli.native_missing("mlx-knorm bench"):
        return 1
    return bench_cli.run(args)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if argv and argv[0] in MODEL_COMMANDS:
            reexec_with_fast_blas()
    argv = list(argv)
    if argv and argv[0] in LM_COMMANDS:
        return run_lm_command(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="mlx-knorm", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    for name in LM_COMMANDS:
        commands.add_parser(name, help=command_help(name), add_help=False)
    bench_parser = commands.add_parser(
        "bench", help="kernel vs fallback vs reference vs memcpy (the default, with --quick)")
    bench_cli.add_arguments(bench_parser)
    bench_parser.set_defaults(func=run_bench)
    commands.add_parser(
        "info", help="backend info and a kernel-vs-fallback self-check").set_defaults(func=info)
    register_doctor(commands)
    register_quality(commands)
    register_models(commands)
    args = parser.parse_args(argv)
    if args.command is None:
        return run_bench(bench_parser.parse_args(["--quick"]))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
