"""Median time vs budget (decode) and vs S (prefill), one line per
implementation (needs matplotlib, the extra ``plot``)."""

from __future__ import annotations

from ..atomic import save_figure
from ..extras import install_hint
from .cases import IMPLEMENTATIONS


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(f"--plot needs matplotlib ({install_hint('plot')}): {err}")
    panels = [("decode", "budget", "decode (S = 1, full cache)"),
              ("prefill", "n_new", "prefill (empty cache)")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (kind, axis_key, title) in zip(axes, panels):
        cases = [r for r in report["cases"] if r["case"]["kind"] == kind]
        if kind == "prefill":
            # One budget per line set: the most common one gives the S sweep.
            budgets = [r["case"]["budget"] for r in cases]
            common = max(set(budgets), key=budgets.count) if budgets else None
            cases = [r for r in cases if r["case"]["budget"] == common]
            title += f", budget {common}"
        cases.sort(key=lambda r: r["case"][axis_key])
        xs = [r["case"][axis_key] for r in cases]
        for name in (*IMPLEMENTATIONS, "kernel in place", "memcpy"):
            ys = [
                {"memcpy": r["memcpy"], "kernel in place": r.get("in_place", {})}
                .get(name, r["timings"].get(name, {})).get("median_ms")
                for r in cases
            ]
            if xs and all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "memcpy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("budget" if kind == "decode" else "S (new tokens)")
        ax.set_ylabel("median ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"mlx-knorm {report['mlx_knorm_version']}, MLX {report['mlx_version']}, "
        f"{report['device']}, {report['machine']['cpu_model'] or report['machine']['processor']}"
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
