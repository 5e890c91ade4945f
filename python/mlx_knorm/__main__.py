"""Command line: ``python -m mlx_knorm [info | eval | demo]``."""

from __future__ import annotations

import argparse
import json
import sys

from .backend import backend_info, native_available
from .quality.cli import register as register_quality
from .selfcheck import decode_case, kernel_matches_fallback


def info(_args) -> int:
    print(json.dumps(backend_info(), indent=2))
    if not native_available():
        print("self-check skipped: the native extension is not loaded")
        return 1
    ok = kernel_matches_fallback(decode_case())
    print(f"self-check (decode, N=32, D=128, budget=512, float16): kernel == fallback bit for bit: {ok}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-knorm", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("info", help="backend info and a kernel-vs-fallback self-check (default)")
    register_quality(commands)
    args = parser.parse_args(argv)
    return getattr(args, "func", info)(args)


if __name__ == "__main__":
    sys.exit(main())
