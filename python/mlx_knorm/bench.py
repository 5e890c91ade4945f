"""Microbenchmarks: native kernel vs pure-MLX fallback vs the reference
package, against the memory floor, on decode and prefill steps.

Every case times ``knorm_update_batched`` end to end (Python wrapper,
validation, graph build and ``mx.eval``) on inputs evaluated beforehand, and
next to it a copy of the same output arrays on the same device in the same
run: the floor for an op whose outputs are fresh, immutable buffers. Before
any timing each case checks kernel == fallback bit for bit.

Decode cases also time the kernel in place: a stream of steps in which the
caller drops the previous state before evaluating the next (``state =
update(*state, ...)``), so the op takes over the state's buffers and moves
only the rows after the first evicted one. The bytes it moved are counted
from the returned indices.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from . import __version__, fallback
from .backend import backend_info, use_backend
from .knorm import knorm_update_batched
from .selfcheck import kernel_matches_fallback

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
IMPLEMENTATIONS = ("kernel", "fallback", "reference")
N_SINK = 4

# Speed targets of issue 5, checked per case in the table (never in tests).
DECODE_MIN_SPEEDUP_VS_REFERENCE = 20.0
DECODE_MAX_RATIO_TO_MEMCPY = 3.0
PREFILL_MIN_SPEEDUP_VS_REFERENCE = 50.0

# Timing stops adding repetitions once an implementation has used this much
# wall time (after at least MIN_REPS), so slow references do not dominate.
MIN_REPS = 3
IN_PLACE_MIN_STEPS = 200
SECONDS_PER_TIMING = {"quick": 1.5, "full": 8.0}


@dataclass(frozen=True)
class Case:
    """One step: ``n_prior`` cached rows plus ``n_new`` new rows per head."""

    kind: str  # "decode" (S = 1 from a full cache) or "prefill" (empty cache)
    n_rows: int
    dim: int
    budget: int
    n_prior: int
    n_new: int
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.kind} S={self.n_new} budget={self.budget}"

    @property
    def kept(self) -> int:
        return min(self.n_prior + self.n_new, self.budget)


def make_case(budget: int, n_new: int, n_rows: int, dim: int, dtype: str) -> Case:
    """S = 1 is a decode step from a full cache; S > 1 a prefill into an empty one."""
    if n_new == 1:
        return Case("decode", n_rows, dim, budget, budget, 1, dtype)
    return Case("prefill", n_rows, dim, budget, 0, n_new, dtype)


def default_suite(quick: bool, n_rows: int, dim: int, dtype: str) -> list[Case]:
    """The target cases; the full suite adds budget and S sweeps for the plot."""
    if quick:
        pairs = [(512, 1), (2048, 1), (512, 4096), (2048, 8192)]
    else:
        pairs = [(b, 1) for b in (256, 512, 1024, 2048, 4096)]
        pairs += [(512, s) for s in (1024, 2048, 4096, 8192)] + [(2048, 8192)]
    return [make_case(b, s, n_rows, dim, dtype) for b, s in pairs]


def custom_suite(budgets, sizes, n_rows: int, dim: int, dtype: str) -> list[Case]:
    return [make_case(b, s, n_rows, dim, dtype) for b in budgets for s in sizes]


def case_inputs(case: Case, seed: int = 0):
    """Evaluated ``(prior_keys, prior_values, prior_norms, new_keys, new_values)``."""
    dtype = DTYPES[case.dtype]
    shapes = [(case.n_rows, case.n_prior, case.dim)] * 2 + [(case.n_rows, case.n_new, case.dim)] * 2
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    prior_keys, prior_values, new_keys, new_values = (
        mx.random.normal(shape, key=k).astype(dtype) for shape, k in zip(shapes, keys)
    )
    prior_norms = fallback.key_norms(prior_keys)
    inputs = (prior_keys, prior_values, prior_norms, new_keys, new_values)
    mx.eval(inputs)
    return inputs


def reference_update():
    """The reference's ``knorm_update_batched``, or None when not installed."""
    try:
        from veloxquant_mlx.quantizers.knorm import knorm_update_batched as reference
    except ImportError:
        return None
    return reference


def step_arguments(case: Case, inputs):
    return (*inputs, case.budget, N_SINK, 0, "low")


def time_runs(run, reps: int, warmup: int, max_seconds: float) -> list[float]:
    """Seconds per call of ``run`` after ``warmup`` untimed calls.

    Every timing starts from an empty MLX buffer cache: MLX recycles a freed
    buffer only while its cache has room, so buffers left by an earlier
    timing would otherwise decide whether this one's outputs are reused or
    faulted in fresh from the OS, and the result would depend on the order
    of the cases.
    """
    mx.clear_cache()
    for _ in range(warmup):
        run()
    samples = []
    start = time.perf_counter()
    while len(samples) < reps:
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= MIN_REPS and time.perf_counter() - start > max_seconds:
            break
    return samples


def summary(samples: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "p25_ms": quartiles[0],
        "p75_ms": quartiles[2],
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "reps": len(ms),
        "samples_ms": ms,
    }


def output_copies(case: Case):
    """Arrays shaped like the op's outputs; copying them is the memcpy floor."""
    dtype = DTYPES[case.dtype]
    outputs = (
        mx.zeros((case.n_rows, case.kept, case.dim), dtype=dtype),
        mx.zeros((case.n_rows, case.kept, case.dim), dtype=dtype),
        mx.zeros((case.n_rows, case.kept), dtype=mx.float32),
        mx.zeros((case.n_rows, case.kept), dtype=mx.uint32),
    )
    mx.eval(outputs)
    return outputs


def moved_bytes(case: Case, indices: mx.array) -> int:
    """Bytes an in-place step rewrote: per head, every row from the first
    position whose row changed (keys, values and the norm)."""
    positions = mx.arange(indices.shape[1], dtype=mx.uint32)
    changed = indices != positions
    first = mx.where(changed.any(axis=1), mx.argmax(changed, axis=1), indices.shape[1])
    rows = (indices.shape[1] - first).sum().item()
    return int(rows) * (2 * case.dim * DTYPES[case.dtype].size + 4)


def time_in_place_decode(case: Case, inputs, reps: int, warmup: int, max_seconds: float):
    """Kernel decode steps on a donated state: (timing summary, mean bytes moved)."""
    steps = warmup + reps
    shape = (steps, case.n_rows, 1, case.dim)
    new_keys, new_values = (
        mx.random.normal(shape, key=k).astype(DTYPES[case.dtype])
        for k in mx.random.split(mx.random.key(1), 2)
    )
    mx.eval(new_keys, new_values)
    state = [tuple(mx.array(x) for x in inputs[:3])]
    mx.eval(state[0])
    moved = []

    def step():
        t = len(moved)
        prior = state.pop()
        with use_backend("kernel"):
            out = knorm_update_batched(
                *prior, new_keys[t], new_values[t], case.budget, N_SINK, 0, "low",
                return_indices=True,
            )
        del prior  # the last reference: the op may now reuse the buffers
        mx.eval(out)
        state.append(out[:3])
        moved.append(out[3])

    samples = time_runs(step, reps, warmup, max_seconds)
    counted = [moved_bytes(case, idx) for idx in moved[warmup:]]
    return summary(samples), sum(counted) / len(counted)


def call_overhead_us(case: Case, inputs, calls: int = 200) -> float:
    """Host time of one kernel call without evaluation: the Python wrapper,
    validation and graph construction, paid on every step."""
    args = step_arguments(case, inputs)
    with use_backend("kernel"):
        knorm_update_batched(*args)
        t0 = time.perf_counter()
        for _ in range(calls):
            knorm_update_batched(*args)
        return (time.perf_counter() - t0) / calls * 1e6


# The cases the targets are set for: (kind, budget, S).
TARGET_CASES = {("decode", 512, 1), ("decode", 2048, 1), ("prefill", 512, 4096), ("prefill", 2048, 8192)}


def case_targets(case: Case, result: dict) -> dict:
    """Each speed target set for this case, with its measured ratio and verdict."""
    targets = {}
    if (case.kind, case.budget, case.n_new) not in TARGET_CASES:
        return targets
    vs_reference = result.get("speedup_vs_reference")
    if case.kind == "decode":
        if vs_reference is not None:
            targets["speedup_vs_reference"] = {
                "measured": vs_reference,
                "target": f">= {DECODE_MIN_SPEEDUP_VS_REFERENCE:g}",
                "met": vs_reference >= DECODE_MIN_SPEEDUP_VS_REFERENCE,
            }
        targets["ratio_to_memcpy"] = {
            "measured": result["ratio_to_memcpy"],
            "target": f"<= {DECODE_MAX_RATIO_TO_MEMCPY:g}",
            "met": result["ratio_to_memcpy"] <= DECODE_MAX_RATIO_TO_MEMCPY,
        }
        in_place = result["in_place"]
        if in_place["speedup_vs_reference"] is not None:
            targets["in_place_speedup_vs_reference"] = {
                "measured": in_place["speedup_vs_reference"],
                "target": f">= {DECODE_MIN_SPEEDUP_VS_REFERENCE:g}",
                "met": in_place["speedup_vs_reference"] >= DECODE_MIN_SPEEDUP_VS_REFERENCE,
            }
        # The moonshot: a donated step beats one copy of the state.
        targets["in_place_ratio_to_memcpy"] = {
            "measured": in_place["ratio_to_memcpy"],
            "target": "< 1",
            "met": in_place["ratio_to_memcpy"] < 1.0,
        }
    elif vs_reference is not None:
        targets["speedup_vs_reference"] = {
            "measured": vs_reference,
            "target": f">= {PREFILL_MIN_SPEEDUP_VS_REFERENCE:g}",
            "met": vs_reference >= PREFILL_MIN_SPEEDUP_VS_REFERENCE,
        }
    return targets


class Progress:
    """tqdm when installed, else one line per step on stderr."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        self._enabled = enabled
        self._done = 0
        self._total = total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="timing", file=sys.stderr, leave=False)

    def step(self, description: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_description(description)
            self._bar.update()
        elif self._enabled:
            print(f"[{self._done}/{self._total}] {description}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_case(case: Case, implementations: dict, reps: int, warmup: int, max_seconds: float,
             progress: Progress) -> dict:
    inputs = case_inputs(case)
    args = step_arguments(case, inputs)
    result = {
        "case": asdict(case),
        "label": case.label,
        "bit_exact": kernel_matches_fallback(inputs, case.budget, N_SINK, 0, "low"),
    }

    timings = {}
    for name, (update, backend) in implementations.items():
        progress.step(f"{case.label}: {name}")

        def run(update=update, backend=backend):
            with use_backend(backend):
                mx.eval(update(*args))

        timings[name] = summary(time_runs(run, reps, warmup, max_seconds))

    if case.kind == "decode":
        progress.step(f"{case.label}: kernel in place")
        # A step is cheap and its cost depends on which row leaves: average
        # over a long stream of steps, not a handful.
        in_place, in_place_bytes = time_in_place_decode(
            case, inputs, max(reps, IN_PLACE_MIN_STEPS), warmup, max_seconds)

    progress.step(f"{case.label}: memcpy")
    copies = output_copies(case)
    memcpy = summary(time_runs(lambda: mx.eval([mx.array(x) for x in copies]), reps, warmup, max_seconds))

    output_bytes = sum(x.nbytes for x in copies)
    kernel_ms = timings["kernel"]["median_ms"]
    result.update(
        timings=timings,
        memcpy=memcpy,
        output_bytes=output_bytes,
        call_overhead_us=call_overhead_us(case, inputs),
        speedup_vs_fallback=timings["fallback"]["median_ms"] / kernel_ms,
        speedup_vs_reference=(
            timings["reference"]["median_ms"] / kernel_ms if "reference" in timings else None
        ),
        ratio_to_memcpy=kernel_ms / memcpy["median_ms"],
        # A copy reads and writes every output byte once.
        kernel_gbps=2 * output_bytes / (kernel_ms * 1e6),
        memcpy_gbps=2 * output_bytes / (memcpy["median_ms"] * 1e6),
    )
    if case.kind == "decode":
        reference_ms = timings["reference"]["median_ms"] if "reference" in timings else None
        result["in_place"] = {
            **in_place,
            "mean_bytes_moved": in_place_bytes,
            "state_bytes": output_bytes - copies[3].nbytes,
            "ratio_to_memcpy": in_place["median_ms"] / memcpy["median_ms"],
            "speedup_vs_reference": None if reference_ms is None else reference_ms / in_place["median_ms"],
        }
    result["targets"] = case_targets(case, result)
    return result


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
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


def run_suite(cases: list[Case], device: str, reps: int, quick: bool, show_progress: bool = True) -> dict:
    previous_device = mx.default_device()
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    implementations = {
        "kernel": (knorm_update_batched, "kernel"),
        "fallback": (knorm_update_batched, "fallback"),
    }
    reference = reference_update()
    if reference is not None:
        implementations["reference"] = (reference, "auto")
    warmup = 1 if quick else 3
    max_seconds = SECONDS_PER_TIMING["quick" if quick else "full"]
    # Per case: one timing per implementation, the memcpy floor, and for
    # decode the in-place kernel.
    timings = sum(len(implementations) + 1 + (c.kind == "decode") for c in cases)
    progress = Progress(timings, show_progress)
    try:
        results = [run_case(c, implementations, reps, warmup, max_seconds, progress) for c in cases]
    finally:
        progress.close()
        mx.set_default_device(previous_device)
    return {
        "mlx_knorm_version": __version__,
        "mlx_version": mx.__version__,
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["mlx-knorm", *sys.argv[1:]]),
        "machine": machine(),
        "backend": backend_info(),
        "reference_installed": reference is not None,
        "cases": results,
    }


def _ms(timing: dict) -> str:
    spread = (timing["p75_ms"] - timing["p25_ms"]) / 2
    return f"{timing['median_ms']:.3g} ± {spread:.2g}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.1f}x"


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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def in_place_table(report: dict) -> str:
    """Markdown table of the in-place (donated) decode steps."""
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
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def target_lines(report: dict) -> list[str]:
    lines = []
    for r in report["cases"]:
        for name, v in r["targets"].items():
            verdict = "met" if v["met"] else "MISSED"
            lines.append(f"{r['label']}: {name} {v['measured']:.2f} (target {v['target']}): {verdict}")
    return lines


def plot(report: dict, path: str) -> None:
    """Median time vs budget (decode) and vs S (prefill), one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(f"--plot needs matplotlib (pip install 'mlx-knorm[plot]'): {err}")
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
    fig.savefig(path, dpi=120)


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the four target cases with few repetitions (under a minute)")
    parser.add_argument("--n", type=int, default=32, help="rows N = B*H (default 32)")
    parser.add_argument("--d", type=int, default=128, help="head dim D (default 128)")
    parser.add_argument("--budget", type=int, nargs="+",
                        help="budgets; with --s, every budget x S pair replaces the built-in suite")
    parser.add_argument("--s", type=int, nargs="+",
                        help="new tokens per step: 1 is a decode step from a full cache, "
                             "more a prefill into an empty one")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--reps", type=int, help="timed repetitions per implementation "
                        "(default 7 with --quick, else 30; capped by time for slow ones)")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    parser.add_argument("--plot", metavar="PATH", help="time vs budget and vs S (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    if args.device == "gpu" and not mx.metal.is_available():
        print("mlx-knorm bench: --device gpu needs Metal; none is available here", file=sys.stderr)
        return 2
    if args.budget is None and args.s is None:
        cases = default_suite(args.quick, args.n, args.d, args.dtype)
    else:
        cases = custom_suite(args.budget or [512, 2048], args.s or [1], args.n, args.d, args.dtype)
    reps = args.reps or (7 if args.quick else 30)
    report = run_suite(cases, args.device, reps, args.quick, show_progress=not args.no_progress)
    m = report["machine"]
    print(f"mlx-knorm {report['mlx_knorm_version']} bench on {args.device}: "
          f"{m['cpu_model'] or m['processor']}, MLX {report['mlx_version']}, {report['date']}")
    if not report["reference_installed"]:
        print("reference (veloxquant-mlx) not installed: pip install 'mlx-knorm[bench]'")
    print(table(report))
    in_place = in_place_table(report)
    if in_place:
        print("\nDecode in place (the caller drops the previous state; the op reuses its buffers):")
        print(in_place)
    lines = target_lines(report)
    if lines:
        print("\nTargets (issue 5, this run):")
        print("\n".join("  " + line for line in lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0 if all(r["bit_exact"] for r in report["cases"]) else 1
