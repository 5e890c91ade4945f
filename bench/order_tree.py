"""The order tree against ranking every row: one decode step of
``evict_and_fill`` (slot layout, donated buffers, a full state of budget + 1
rows, keep-low, n_sink 4) given the previous step's order tree, next to the
same step without one, at budgets 1024 to 8192, N = 8 and 32 heads, D = 128
float16, without a recent window and with one of half the budget. The two
alternate in interleaved rounds in one warm process; medians over the timed
steps of every round; minor page faults per step. ``defaults.uses_order_tree``
(which configurations the caches keep the tree for) follows this table.

    python bench/order_tree.py --json bench/results/order-tree-cpu.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from mlx_knorm import __version__
from mlx_knorm.atomic import write_text
from mlx_knorm.bench.report import machine, markdown_table, now
from mlx_knorm.bench.timing import warm_up
from mlx_knorm.defaults import ORDER_TREE_MIN_BUDGET, ORDER_TREE_MIN_BUDGET_WITH_WINDOW
from mlx_knorm.ops.evict_and_fill import evict_and_fill_unchecked
from mlx_knorm.ops.key_norms import key_norms

BUDGETS = (1024, 2048, 4096, 8192)
HEADS = (8, 32)
N_SINK = 4
DIM = 128


class Decode:
    """A full slot-layout state stepped one row at a time, with its order
    tree (given each step) or without one."""

    def __init__(self, heads: int, budget: int, recent: int, with_tree: bool, seed: int):
        rng = np.random.default_rng(seed)
        self.budget, self.recent, self.slots = budget, recent, budget + 1
        keys = mx.array(rng.standard_normal((heads, self.slots, DIM)).astype(np.float16))
        # The keys' own norms: new rows then compete with the stored ones, and
        # the row evicted lies at a random slot, as in a real stream.
        norms = key_norms(keys)
        positions = mx.array(np.stack([rng.permutation(self.slots) for _ in range(heads)]).astype(np.int32))
        self.state = [keys, mx.array(keys), norms, positions]
        self.tree = with_tree
        self.offset = self.slots
        mx.eval(self.state)
        self.step(mx.zeros((heads, 1, DIM), mx.float16))  # builds the tree

    def step(self, token: mx.array) -> None:
        inputs, tree = self.state, self.tree
        self.state = None
        out = evict_and_fill_unchecked(
            *inputs, token, token, filled=self.slots, offset=self.offset, capacity=self.slots,
            budget=self.budget, n_sink=N_SINK, recent=self.recent, keep="low", tree=tree,
        )
        del inputs, tree  # the op's inputs are then donated
        self.state = list(out[:4])
        if self.tree is not False:
            self.tree = out[4]
        del out
        mx.eval(self.state, *([] if self.tree is False else [self.tree]))
        self.offset += 1


def run(budgets, heads, rounds: int, steps: int) -> list[dict]:
    warm_up()
    rng = np.random.default_rng(0)
    results = []
    for budget in budgets:
        for n in heads:
            for recent in (0, budget // 2):
                sides = {"tree": Decode(n, budget, recent, True, 1), "scan": Decode(n, budget, recent, False, 1)}
                tokens = [mx.array(rng.standard_normal((n, 1, DIM)).astype(np.float16)) for _ in range(steps)]
                mx.eval(tokens)
                times = {k: [] for k in sides}
                faults = {k: 0 for k in sides}
                for r in range(rounds):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for name in order:
                        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                        for token in tokens:
                            t0 = time.perf_counter()
                            sides[name].step(token)
                            if r > 0:
                                times[name].append(time.perf_counter() - t0)
                        if r > 0:
                            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
                timed = (rounds - 1) * steps
                row = {"budget": budget, "heads": n, "recent": recent}
                for name in sides:
                    row[f"{name}_ms"] = statistics.median(times[name]) * 1e3
                    row[f"{name}_faults_per_step"] = faults[name] / timed
                row["tree_over_scan"] = row["tree_ms"] / row["scan_ms"]
                results.append(row)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/order_tree.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, nargs="+", help=f"budgets (default {BUDGETS})")
    parser.add_argument("--heads", type=int, nargs="+", help=f"heads N (default {HEADS})")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, the first untimed")
    parser.add_argument("--steps", type=int, default=40, help="steps per round and side")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be >= 2 (the first is untimed) and --steps >= 1")
    mx.set_default_device(mx.cpu)
    rows = run(args.budget or BUDGETS, args.heads or HEADS, args.rounds, args.steps)
    print(markdown_table(
        ["budget", "N", "recent", "with the tree ms", "ranking every row ms", "tree / ranking", "faults/step"],
        [[str(r["budget"]), str(r["heads"]), str(r["recent"]), f"{r['tree_ms']:.4f}", f"{r['scan_ms']:.4f}",
          f"{r['tree_over_scan']:.2f}x", f"{r['tree_faults_per_step']:.2f} / {r['scan_faults_per_step']:.2f}"]
         for r in rows]))
    print(f"The caches keep the tree on the CPU from budget {ORDER_TREE_MIN_BUDGET} on without a recent window, "
          f"from {ORDER_TREE_MIN_BUDGET_WITH_WINDOW} on with one.")
    if args.json:
        report = {"benchmark": "order_tree", "version": __version__, "date": now(), "machine": machine(),
                  "command": " ".join(["python bench/order_tree.py", *(argv or sys.argv[1:])]),
                  "rounds": args.rounds, "steps": args.steps, "results": rows}
        write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
