"""Perplexity against KV bytes: every (policy, budget) of one or more
``mlx-knorm eval`` JSON files as a point, its perplexity over its own run's
full cache's (paired interval) against its KV bytes over the full float
cache's, one line per policy (docs/quality.md's plot).

    python -m mlx_knorm.quality.tradeoff --head-dim 64 --dtype float32 --plot docs/quality-tradeoff.png \\
        --report docs/results/quality-eval-smollm2.json window keep-low keep-low+recent=1/2 \\
        --report docs/results/quality-eval-smollm2-kv-bits-1k.json ...

The bytes are the rows a policy keeps per layer at the end of a window
(``cuts``) times the bytes of its row as its cache stores it
(``policies.row_bytes``: an eviction cache's row carries a norm and a
position, a quantized one its scales and biases; a recent window's row is
``RotatingKVCache``'s), over the window's rows at the model's dtype. The
eval's JSON does not record the model's head dimension or dtype, so they
are given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..validation import FLOAT_DTYPES
from .policies import FULL, Policy, row_bytes


def points(report: dict, head_dim: int, itemsize: int) -> list[dict]:
    """One point per cut of ``report`` (an eval JSON): the policy's name, its
    rows per compressed layer, its KV bytes over the full float cache's, and
    its perplexity ratio to the full cache's with the paired interval."""
    full_row = row_bytes(head_dim, itemsize, eviction=False)
    out = []
    for key, cut in report["cuts"].items():
        name, _, budget = key.rpartition("@")
        policy = Policy.parse(name)
        if policy.skip or key not in report["perplexity_ratio_to_full"]:
            continue  # skipped layers hold other row counts: no one row size
        evicting = policy.score not in ("window", FULL)
        row = row_bytes(head_dim, itemsize, policy.bits, eviction=evicting)
        rows = cut["rows_per_compressed_layer"]
        out.append({
            "policy": policy.name, "budget": int(budget), "rows": rows,
            "kv_bytes_ratio": rows * row / (report["seq_len"] * full_row),
            "perplexity_ratio": report["perplexity_ratio_to_full"][key],
            "interval": report["perplexity_ratio_to_full_ci"][key],
            "windows": f"{report['n_seqs']} windows of {report['seq_len']}",
        })
    return out


def plot(series: list[dict], path: str, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.2))
    # A line per policy and set of windows (the runs' full caches differ).
    by_policy: dict[str, list[dict]] = {}
    for point in series:
        by_policy.setdefault(f"{point['policy']} ({point['windows']})", []).append(point)
    for name, group in by_policy.items():
        group.sort(key=lambda p: p["kv_bytes_ratio"])
        x = [p["kv_bytes_ratio"] for p in group]
        y = [p["perplexity_ratio"] for p in group]
        err = [[p["perplexity_ratio"] - p["interval"][0] for p in group],
               [p["interval"][1] - p["perplexity_ratio"] for p in group]]
        ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=name)
    ax.axhline(1.0, color="k", ls="--", lw=0.8, label="full cache")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([0.02, 0.05, 0.1, 0.2, 0.5, 1])
    ax.set_yticks([1, 1.5, 2, 5, 10, 50])
    ax.set(xlabel="KV bytes / full float cache's", ylabel="perplexity / full cache's (95% interval)",
           title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_knorm.quality.tradeoff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", nargs="+", action="append", required=True, metavar=("PATH", "POLICY"),
                        help="an mlx-knorm eval --json file, then the policies to take from it (names "
                             "as the eval writes them; none: every policy); repeat for more files")
    parser.add_argument("--head-dim", type=int, required=True, help="the model's KV head dimension")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), required=True,
                        help="the dtype the model's caches store")
    parser.add_argument("--plot", metavar="PATH", help="write the plot (needs matplotlib)")
    parser.add_argument("--title", default="Perplexity against KV bytes")
    args = parser.parse_args(argv)
    series = []
    for path, *wanted in args.report:
        report = json.loads(Path(path).read_text())
        series += [p for p in points(report, args.head_dim, FLOAT_DTYPES[args.dtype].size)
                   if not wanted or p["policy"] in wanted]
    for p in series:
        low, high = p["interval"]
        print(f"{p['policy']:<28} {p['windows']:>12}  rows {p['rows']:>5}  KV bytes {p['kv_bytes_ratio']:.3f}  "
              f"perplexity {p['perplexity_ratio']:.2f} [{low:.2f}, {high:.2f}]")
    if args.plot:
        plot(series, args.plot, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
