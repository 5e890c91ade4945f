"""The speed targets, the report's tables and the machine description."""

from __future__ import annotations

import datetime
import os
import platform

from .cases import TARGET_STEPS, Case

# Speed targets, checked per case in the table (never in tests).
DECODE_MIN_SPEEDUP_VS_REFERENCE = 20.0
DECODE_MAX_RATIO_TO_MEMCPY = 3.0
PREFILL_MIN_SPEEDUP_VS_REFERENCE = 50.0


def verdict(measured: float, met: bool, target: str) -> dict:
    """One target's entry in a report: the measured figure, the target, met or not."""
    return {"measured": measured, "target": target, "met": met}


def case_targets(case: Case, result: dict) -> dict:
    """Each speed target set for this case, with its measured ratio and verdict."""
    targets = {}
    if (case.budget, case.n_new) not in TARGET_STEPS:
        return targets
    vs_reference = result.get("speedup_vs_reference")
    if case.kind == "decode":
        if vs_reference is not None:
            targets["speedup_vs_reference"] = verdict(
                vs_reference, vs_reference >= DECODE_MIN_SPEEDUP_VS_REFERENCE,
                f">= {DECODE_MIN_SPEEDUP_VS_REFERENCE:g}")
        targets["ratio_to_memcpy"] = verdict(
            result["ratio_to_memcpy"], result["ratio_to_memcpy"] <= DECODE_MAX_RATIO_TO_MEMCPY,
            f"<= {DECODE_MAX_RATIO_TO_MEMCPY:g}")
        in_place = result["in_place"]
        if in_place["speedup_vs_reference"] is not None:
            targets["in_place_speedup_vs_reference"] = verdict(
                in_place["speedup_vs_reference"],
                in_place["speedup_vs_reference"] >= DECODE_MIN_SPEEDUP_VS_REFERENCE,
                f">= {DECODE_MIN_SPEEDUP_VS_REFERENCE:g}")
        # A donated step beats one copy of the state.
        targets["in_place_ratio_to_memcpy"] = verdict(
            in_place["ratio_to_memcpy"], in_place["ratio_to_memcpy"] < 1.0, "< 1")
    elif vs_reference is not None:
        targets["speedup_vs_reference"] = verdict(
            vs_reference, vs_reference >= PREFILL_MIN_SPEEDUP_VS_REFERENCE,
            f">= {PREFILL_MIN_SPEEDUP_VS_REFERENCE:g}")
    return targets


def now() -> str:
    """The UTC date and time, as the reports record it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    """The machine, with its load when the suite started: on a shared
    machine other work slows some timings more than others."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def faults_text(faults: float) -> str:
    """Page faults per call: whole numbers from 10 up, else two digits."""
    return f"{faults:.0f}" if faults >= 10 else f"{faults:.2g}"


def _ms(timing: dict) -> str:
    """Median ± half the interquartile range, and minor page faults per call."""
    spread = (timing["p75_ms"] - timing["p25_ms"]) / 2
    return f"{timing['median_ms']:.3g} ± {spread:.2g} ({faults_text(timing['faults_per_call'])} pf)"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.1f}x"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table(report: dict) -> str:
    """Markdown table of the medians (± half the interquartile range) and ratios."""
    header = [
        "case", "N", "D", "dtype", "bit-exact", "kernel ms", "fallback ms", "reference ms",
        "memcpy ms", "kernel/memcpy", "vs fallback", "vs reference", "kernel GB/s",
        "call µs", "targets",
    ]
    rows = []
    for r in report["cases"]:
        case, t = r["case"], r["timings"]
        verdicts = [v["met"] for v in r["targets"].values()]
        rows.append([
            r["label"], str(case["n_rows"]), str(case["dim"]), case["dtype"],
            "yes" if r["bit_exact"] else "NO",
            _ms(t["kernel"]), _ms(t["fallback"]),
            _ms(t["reference"]) if "reference" in t else "-",
            _ms(r["memcpy"]), _ratio(r["ratio_to_memcpy"]), _ratio(r["speedup_vs_fallback"]),
            _ratio(r["speedup_vs_reference"]), f"{r['kernel_gbps']:.1f}",
            f"{r['call_overhead_us']:.0f}",
            "-" if not verdicts else ("met" if all(verdicts) else "MISSED"),
        ])
    return markdown_table(header, rows)


def in_place_table(report: dict) -> str:
    """Markdown table of the in-place (donated) decode steps; empty without any."""
    header = ["case", "in-place ms", "memcpy ms", "in-place/memcpy", "vs reference",
              "mean bytes moved", "share of state"]
    rows = []
    for r in report["cases"]:
        if "in_place" not in r:
            continue
        p = r["in_place"]
        rows.append([
            r["label"], _ms(p), _ms(r["memcpy"]), _ratio(p["ratio_to_memcpy"]),
            _ratio(p["speedup_vs_reference"]), f"{p['mean_bytes_moved'] / 2**20:.2f} MiB",
            f"{p['mean_bytes_moved'] / p['state_bytes']:.0%}",
        ])
    return markdown_table(header, rows) if rows else ""


def cache_limit_table(report: dict) -> str:
    """Markdown table of the fresh-output decode under MLX's default buffer-cache
    limit and a raised one; empty without decode cases."""
    rows = []
    for r in report["cases"]:
        if "raised_cache_limit" not in r:
            continue
        raised = r["raised_cache_limit"]
        for limit, kernel, memcpy, ratio in (
            (f"default ({raised['default_cache_limit_bytes'] >> 20} MiB)", r["timings"]["kernel"],
             r["memcpy"], r["ratio_to_memcpy"]),
            (f"raised to {raised['cache_limit_bytes'] >> 20} MiB", raised["kernel"],
             raised["memcpy"], raised["ratio_to_memcpy"]),
        ):
            rows.append([r["label"], limit, _ms(kernel), _ms(memcpy), _ratio(ratio)])
    header = ["case", "MLX cache limit", "kernel ms", "memcpy ms", "kernel/memcpy"]
    return markdown_table(header, rows) if rows else ""


def target_lines(report: dict) -> list[str]:
    lines = []
    for r in report["cases"]:
        for name, v in r["targets"].items():
            verdict = "met" if v["met"] else "MISSED"
            lines.append(f"{r['label']}: {name} {v['measured']:.2f} (target {v['target']}): {verdict}")
    return lines


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"mlx-knorm {report['mlx_knorm_version']} bench on {report['device']}: "
          f"{m['cpu_model'] or m['processor']}, MLX {report['mlx_version']}, {report['date']}")
    print("Timed in a warm process (MLX's buffer cache never cleared); medians ± half the "
          "interquartile range in ms, (N pf) = minor page faults per call.")
    if not report["reference_installed"]:
        print("reference (veloxquant-mlx) not installed: pip install 'mlx-knorm[bench]'")
    print(table(report))
    in_place = in_place_table(report)
    if in_place:
        print("\nDecode in place (the caller drops the previous state; the op reuses its buffers):")
        print(in_place)
    limits = cache_limit_table(report)
    if limits:
        print("\nDecode with fresh outputs, MLX's default buffer-cache limit and a raised one "
              "(set for these timings only):")
        print(limits)
    lines = target_lines(report)
    if lines:
        print("\nTargets (this run):")
        print("\n".join("  " + line for line in lines))
