"""The op benchmark's targets, findings and tables, and the machine description."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

from ..extras import install_hint
from .cases import N_SINK, TARGET_STEPS, Case

# Targets that hold on a quiet machine, checked per case of TARGET_STEPS
# (never in tests): a decode step with fresh outputs within this many times a
# copy of those outputs, and an in-place decode step under one copy of the
# state it updates. The ratios to the reference and the fallback are reported
# as findings, with no target.
DECODE_MAX_RATIO_TO_MEMCPY = 3.0
IN_PLACE_MAX_RATIO_TO_MEMCPY = 1.0
TARGET_NAMES = {
    "ratio_to_memcpy": "kernel / a copy of its outputs",
    "in_place_ratio_to_memcpy": "in place / a copy of the state",
}

# What a target's verdict prints: a miss on a busy machine says so.
HOLDS, DOES_NOT_HOLD = "holds", "does not hold in this run"


def verdict(measured: float, met: bool, target: str) -> dict:
    """One target's entry in a report: the measured figure, the target, met or not."""
    return {"measured": measured, "target": target, "met": met}


def verdict_text(v: dict) -> str:
    return HOLDS if v["met"] else DOES_NOT_HOLD


def case_targets(case: Case, result: dict) -> dict:
    """Each target set for this case, with its measured ratio and verdict."""
    if case.kind != "decode" or (case.budget, case.n_new) not in TARGET_STEPS:
        return {}
    in_place = result["in_place"]["ratio_to_memcpy"]
    return {
        "ratio_to_memcpy": verdict(
            result["ratio_to_memcpy"], result["ratio_to_memcpy"] <= DECODE_MAX_RATIO_TO_MEMCPY,
            f"<= {DECODE_MAX_RATIO_TO_MEMCPY:g}"),
        "in_place_ratio_to_memcpy": verdict(
            in_place, in_place < IN_PLACE_MAX_RATIO_TO_MEMCPY, f"< {IN_PLACE_MAX_RATIO_TO_MEMCPY:g}"),
    }


def now() -> str:
    """The UTC date and time, as the reports record it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    """The machine, with its load when the suite started: other work on the
    cores slows some timings more than others."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
    }


def _cpu_model() -> str | None:
    """The CPU's name: /proc/cpuinfo's model name on Linux, the brand string on macOS."""
    if platform.system() == "Darwin":
        try:
            brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                   text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        return brand or None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def busy(m: dict) -> bool:
    """Whether other work kept more than half the cores busy when the suite
    started (the 1-minute load average)."""
    load = m.get("load_average_1_5_15_min")
    return bool(load and m.get("cpu_count") and load[0] > m["cpu_count"] / 2)


def machine_text(report: dict) -> str:
    """``AMD EPYC, 2 cores, Linux-6.18-x86_64, MLX 0.32.4, Python 3.11.7; load
    average 0.3 at the start`` (and, on a busy machine, what that means)."""
    m = report["machine"]
    text = (f"{m['cpu_model'] or m['processor']}, {m['cpu_count']} cores, {m['platform']}, "
            f"MLX {report['mlx_version']}, Python {m['python']}")
    load = m.get("load_average_1_5_15_min")
    if load:
        text += f"; load average {load[0]:.1f} at the start"
    if busy(m):
        text += (" (other work shared the cores: timings vary more than usual; judge the "
                 "targets on an idle machine)")
    return text


def faults_text(faults: float) -> str:
    """Page faults per call: whole numbers from 10 up, else two digits."""
    return f"{faults:.0f}" if faults >= 10 else f"{faults:.2g}"


def _ms(timing: dict) -> str:
    """Median ± half the interquartile range, and minor page faults per call."""
    spread = (timing["p75_ms"] - timing["p25_ms"]) / 2
    return f"{timing['median_ms']:.3g} ± {spread:.2g} ({faults_text(timing['faults_per_call'])} pf)"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table(report: dict) -> str:
    """Markdown table of the medians (± half the interquartile range, page
    faults per call) and the kernel's ratios to the others."""
    header = ["case", "bit-exact", "kernel ms", "fallback ms", "reference ms", "memcpy ms",
              "kernel / memcpy", "kernel vs fallback", "kernel vs reference", "call µs"]
    rows = []
    for r in report["cases"]:
        t = r["timings"]
        rows.append([
            r["label"], "yes" if r["bit_exact"] else "NO",
            _ms(t["kernel"]), _ms(t["fallback"]),
            _ms(t["reference"]) if "reference" in t else "-",
            _ms(r["memcpy"]), _ratio(r["ratio_to_memcpy"]), _ratio(r["speedup_vs_fallback"]),
            _ratio(r["speedup_vs_reference"]), f"{r['call_overhead_us']:.0f}",
        ])
    return markdown_table(header, rows)


def in_place_table(report: dict) -> str:
    """Markdown table of the in-place (donated) decode steps; empty without any."""
    header = ["case", "in-place ms", "memcpy of the state ms", "in-place / memcpy", "vs reference",
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
    header = ["case", "MLX cache limit", "kernel ms", "memcpy ms", "kernel / memcpy"]
    return markdown_table(header, rows) if rows else ""


def _span(values: list[float]) -> str:
    """``7.7x`` or ``6.9x-7.7x``: the range of the kernel's ratios."""
    low, high = _ratio(min(values)), _ratio(max(values))
    return low if low == high else f"{low}-{high}"


def findings(report: dict) -> list[str]:
    """What this run measured, as statements: bit-exactness, the kernel's
    speed against the fallback and the reference, its page faults."""
    cases = report["cases"]
    exact = [r["label"] for r in cases if r["bit_exact"]]
    wrong = [r["label"] for r in cases if not r["bit_exact"]]
    lines = [f"the kernel's outputs equal the fallback's bit for bit in {len(exact)} of {len(cases)} cases"
             + (f"; NOT in {', '.join(wrong)}: please report this with `mlx-knorm doctor`" if wrong else "")]
    for kind, how in (("decode", "decode with fresh outputs"), ("prefill", "prefill")):
        of_kind = [r for r in cases if r["case"]["kind"] == kind]
        if not of_kind:
            continue
        speed = f"{how}: the kernel is {_span([r['speedup_vs_fallback'] for r in of_kind])} the fallback's speed"
        against = [r["speedup_vs_reference"] for r in of_kind if r["speedup_vs_reference"] is not None]
        if against:
            speed += f" and {_span(against)} the reference's"
        lines.append(speed)
    in_place = [r["in_place"]["speedup_vs_reference"] for r in cases
                if r.get("in_place", {}).get("speedup_vs_reference") is not None]
    if in_place:
        lines.append(f"decode in place: {_span(in_place)} the reference's speed")
    faults = ", ".join(
        f"{faults_text(r['timings']['kernel']['faults_per_call'])} vs "
        f"{faults_text(r['memcpy']['faults_per_call'])} ({r['label']})" for r in cases)
    lines.append(f"page faults per call, the kernel vs a copy of the same outputs: {faults}; "
                 "an output that MLX's buffer cache cannot hold comes fresh from the OS, page by page")
    return lines


def target_lines(report: dict) -> list[str]:
    lines = []
    for r in report["cases"]:
        for name, v in r["targets"].items():
            lines.append(f"{r['label']}: {TARGET_NAMES[name]} {_ratio(v['measured'])} "
                         f"(target {v['target']}): {verdict_text(v)}")
    return lines



def print_report(report: dict) -> None:
    print(f"mlx-knorm {report['mlx_knorm_version']}: knorm_update_batched on {report['device']}, "
          f"{report['date']}")
    print(f"Machine: {machine_text(report)}")
    case = report["cases"][0]["case"] if report["cases"] else None
    if case:
        print(f"N = {case['n_rows']} heads, D = {case['dim']}, {case['dtype']}, n_sink {N_SINK}. ", end="")
    print("A warm process (MLX's buffer cache never cleared); medians ± half the interquartile "
          "range in ms; (N pf) = minor page faults per call.")
    if not report["reference_installed"]:
        print(f"The reference (veloxquant-mlx) is not installed: {install_hint('bench')}")
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
    print("\nWhat this run measured:")
    print("\n".join("  - " + line for line in findings(report)))
    lines = target_lines(report)
    if lines:
        print("\nTargets (each holds on a quiet machine):")
        print("\n".join("  - " + line for line in lines))
