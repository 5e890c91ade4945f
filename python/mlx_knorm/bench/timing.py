"""How a case is timed, and a suite run.

Timings run in a warm process: other MLX work runs first (``warm_up``) and
MLX's buffer cache is never cleared, so an op's fresh outputs come from
buffers MLX recycles whenever its cache holds them, as in an application.
Minor page faults per call (``ru_minflt``) are reported next to each
timing: a buffer that is not recycled is faulted in from the OS page by
page.

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

import contextlib
import resource
import statistics
import time
from dataclasses import asdict

import mlx.core as mx

from .. import __version__
from ..backend import backend_info, use_backend
from ..selfcheck import kernel_matches_fallback
from ..state import knorm_update_batched
from ..validation import FLOAT_DTYPES
from .cases import N_SINK, Case, case_inputs, output_copies, random_arrays, reference_update, step_arguments
from .progress import Progress
from .report import case_targets, machine, now

# Timing stops adding repetitions once an implementation has used this much
# wall time (after at least MIN_REPS), so slow references do not dominate.
MIN_REPS = 3
IN_PLACE_MIN_STEPS = 200
SECONDS_PER_TIMING = {"quick": 1.5, "full": 8.0}
# The raised MLX buffer-cache limit of the labelled fresh-output decode row.
RAISED_CACHE_LIMIT = 256 << 20


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def warm_up() -> None:
    """Other MLX work before any timing, so a suite never times a cold process."""
    a = mx.random.normal((1024, 1024))
    mx.eval([(a @ a).sum() for _ in range(4)])


@contextlib.contextmanager
def cache_limit(limit: int):
    """MLX's buffer-cache limit set to ``limit`` inside (yields the previous
    one), the previous one restored after."""
    previous = mx.set_cache_limit(limit)
    try:
        yield previous
    finally:
        mx.set_cache_limit(previous)


def time_runs(run, reps: int, warmup: int, max_seconds: float) -> tuple[list[float], int]:
    """Seconds per call of ``run`` after ``warmup`` untimed calls, and the
    minor page faults of the timed calls."""
    for _ in range(warmup):
        run()
    samples = []
    faults = minor_faults()
    start = time.perf_counter()
    while len(samples) < reps:
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= MIN_REPS and time.perf_counter() - start > max_seconds:
            break
    return samples, minor_faults() - faults


def summary(samples: list[float], faults: int) -> dict:
    """Median, quartiles and extremes in ms, the count, and minor page faults
    per call: what a report records of a timing (not every sample)."""
    ms = sorted(s * 1e3 for s in samples)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "p25_ms": quartiles[0],
        "p75_ms": quartiles[2],
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "reps": len(ms),
        "faults_per_call": faults / len(ms),
    }


def moved_bytes(case: Case, indices: mx.array) -> int:
    """Bytes an in-place step rewrote: per head, every row from the first
    position whose row changed (keys, values and the norm)."""
    positions = mx.arange(indices.shape[1], dtype=mx.uint32)
    changed = indices != positions
    first = mx.where(changed.any(axis=1), mx.argmax(changed, axis=1), indices.shape[1])
    rows = (indices.shape[1] - first).sum().item()
    return int(rows) * (2 * case.dim * FLOAT_DTYPES[case.dtype].size + 4)


def time_in_place_decode(case: Case, inputs, reps: int, warmup: int, max_seconds: float):
    """Kernel decode steps on a donated state: (timing summary, mean bytes moved)."""
    steps = warmup + reps
    shape = (steps, case.n_rows, 1, case.dim)
    new_keys, new_values = random_arrays([shape, shape], FLOAT_DTYPES[case.dtype], seed=1)
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

    samples, faults = time_runs(step, reps, warmup, max_seconds)
    counted = [moved_bytes(case, idx) for idx in moved[warmup:]]
    return summary(samples, faults), sum(counted) / len(counted)


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


def run_case(case: Case, implementations: dict, reps: int, warmup: int, max_seconds: float,
             progress: Progress) -> dict:
    inputs = case_inputs(case)
    args = step_arguments(case, inputs)
    result = {
        "case": asdict(case),
        "label": case.label,
        "bit_exact": kernel_matches_fallback(inputs, case.budget, N_SINK, 0, "low"),
    }

    def timed(run):
        return summary(*time_runs(run, reps, warmup, max_seconds))

    def runner(update, backend):
        def run():
            with use_backend(backend):
                mx.eval(update(*args))

        return run

    timings = {}
    for name, (update, backend) in implementations.items():
        progress.step(f"{case.label}: {name}")
        timings[name] = timed(runner(update, backend))

    if case.kind == "decode":
        progress.step(f"{case.label}: kernel in place")
        # A step is cheap and its cost depends on which row leaves: average
        # over a long stream of steps, not a handful.
        in_place, in_place_bytes = time_in_place_decode(
            case, inputs, max(reps, IN_PLACE_MIN_STEPS), warmup, max_seconds)

    progress.step(f"{case.label}: memcpy")
    copies = output_copies(case)

    def copy():
        mx.eval([mx.array(x) for x in copies])

    memcpy = timed(copy)
    if case.kind == "decode":
        # The fresh-output step again with room in MLX's buffer cache for its
        # outputs: set for these two timings only, then restored.
        progress.step(f"{case.label}: kernel and memcpy, cache limit {RAISED_CACHE_LIMIT >> 20} MiB")
        with cache_limit(RAISED_CACHE_LIMIT) as default_limit:
            raised = {"kernel": timed(runner(*implementations["kernel"])), "memcpy": timed(copy)}
        result["raised_cache_limit"] = {
            **raised,
            "cache_limit_bytes": RAISED_CACHE_LIMIT,
            "default_cache_limit_bytes": default_limit,
            "ratio_to_memcpy": raised["kernel"]["median_ms"] / raised["memcpy"]["median_ms"],
        }

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


def run_suite(cases: list[Case], device: str, reps: int, quick: bool, command: str,
              show_progress: bool = True) -> dict:
    """Every case on the default device (named ``device`` in the report): the
    report's figures, with the command, the versions and the machine they
    were measured with."""
    host, date = machine(), now()
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
    # decode the in-place kernel and the raised cache limit.
    timings = sum(len(implementations) + 1 + 2 * (c.kind == "decode") for c in cases)
    progress = Progress(timings, show_progress)
    try:
        warm_up()
        results = [run_case(c, implementations, reps, warmup, max_seconds, progress) for c in cases]
    finally:
        progress.close()
    return {
        "mlx_knorm_version": __version__,
        "mlx_version": mx.__version__,
        "device": device,
        "date": date,
        "command": command,
        "machine": host,
        "backend": backend_info(),
        "reference_installed": reference is not None,
        "warm_process": True,
        "cases": results,
    }
