"""Perplexity against KV bytes: every (policy, budget) of one or more
``mlx-knorm eval`` JSON files as a point, its perplexity over its own run's
full cache's (paired interval) against its KV bytes over the full float
cache's, one line per policy (docs/quality.md's plot).

    python -m mlx_knorm.quality.tradeoff --head-dim 64 --dtype float32 --plot docs/quality-tradeoff.png \\
        --report docs/results/quality-eval-smollm2.json window keep-low keep-low+recent=1/2 \\
        --report docs/results/quality-eval-smollm2-kv-bits-1k.json ...

``--against POLICY`` prints instead each point's perplexity over that
policy's at the same budget and on the same windows (paired interval), the
comparison docs/scorers.md's targets are stated in.

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

import numpy as np

from ..atomic import save_figure
from ..validation import FLOAT_DTYPES
from .policies import FULL, Policy, row_bytes
from .stats import perplexity_interval, resample_indices


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


def against(report: dict, baseline: str) -> list[dict]:
    """Each policy's perplexity over ``baseline``'s at every budget both were
    measured at, with the eval's paired interval: per-window NLL differences
    resampled by window, under the eval's own draw of windows."""
    nll = report["per_sequence"]["nll"]
    indices = resample_indices(report["n_seqs"], report["seed"])
    out = []
    for key, values in nll.items():
        name, _, budget = key.rpartition("@")
        base = nll.get(f"{baseline}@{budget}")
        if not name or name == baseline or base is None:
            continue
        gap = np.asarray(values, dtype=np.float64) - np.asarray(base, dtype=np.float64)
        out.append({"policy": name, "budget": int(budget), "baseline": baseline,
                    "ratio": float(np.exp(gap.mean())), "interval": perplexity_interval(gap, indices)})
    if not out:
        raise ValueError(f"--against: {baseline!r} shares no budget with another policy of the report")
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
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_knorm.quality.tradeoff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", nargs="+", action="append", required=True, metavar=("PATH", "POLICY"),
                        help="an mlx-knorm eval --json file, then the policies to take from it (names "
                             "as the eval writes them; none: every policy); repeat for more files")
    parser.add_argument("--head-dim", type=int, help="the model's KV head dimension (for the KV bytes)")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), help="the dtype the model's caches store "
                        "(for the KV bytes)")
    parser.add_argument("--against", metavar="POLICY",
                        help="print each policy's perplexity over this policy's at the same budget "
                             "(paired interval) instead of the KV bytes; no plot")
    parser.add_argument("--plot", metavar="PATH", help="write the plot (needs matplotlib)")
    parser.add_argument("--title", default="Perplexity against KV bytes")
    args = parser.parse_args(argv)
    if args.against:
        for path, *wanted in args.report:
            try:
                rows = against(json.loads(Path(path).read_text()), args.against)
            except ValueError as error:
                parser.error(f"{path}: {error}")
            for r in rows:
                if not wanted or r["policy"] in wanted:
                    low, high = r["interval"]
                    print(f"{r['policy']:<28} budget {r['budget']:>5}  perplexity / {r['baseline']}'s "
                          f"{r['ratio']:.3f} [{low:.3f}, {high:.3f}]")
        return 0
    if args.head_dim is None or args.dtype is None:
        parser.error("--head-dim and --dtype are needed for the KV bytes (or give --against)")
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
