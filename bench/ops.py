"""The op benchmark's sweeps: kernel vs fallback vs reference vs memcpy over
decode budgets 256-4096 and prefill lengths 1024-8192 (docs/benchmarks.md's plot).

    python bench/ops.py --json bench/results/ops-sweep-cpu.json \
        --plot bench/results/ops-sweep-cpu.png

Takes the options of ``mlx-knorm bench`` (``--budget``/``--s`` replace the
sweep); see bench/README.md for how to read the output.
"""

from __future__ import annotations

import argparse
import sys

from mlx_knorm.bench import cli

# (budget, S): decode steps from a full cache over the budget, prefill steps
# into an empty one over S; the four target cases are among them.
SWEEP = (
    [(budget, 1) for budget in (256, 512, 1024, 2048, 4096)]
    + [(512, s) for s in (1024, 2048, 4096, 8192)]
    + [(2048, 8192)]
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/ops.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if cli.native_missing("bench/ops.py"):
        return 1
    return cli.run(args, steps=SWEEP, command=" ".join(["python bench/ops.py", *argv]))


if __name__ == "__main__":
    sys.exit(main())
