"""The cache-step benchmark's report: the versions and machine, the targets
set for our cache, and the table."""

from __future__ import annotations

from importlib import metadata

import mlx.core as mx

from .. import __version__
from ..backend import backend_info
from ..extras import install_hint
from .report import faults_text, machine_text, markdown_table, verdict, verdict_text

# Targets for our cache's decode step that hold on a quiet machine, checked
# in the report (never in tests); its speed against the reference's cache is
# in the table, with no target.
SLOTS_MAX_RATIO_TO_ROTATING = 1.5
SLOTS_RATIO_BUDGETS = (512, 2048, 8192)
# No page faults per step in steady state: a buffer taken fresh from the OS
# on every step would fault at least once per step; a rare stray fault of the
# process (its other threads, the interpreter) is not the step's.
SLOTS_MAX_FAULTS_PER_STEP = 0.05
TEMPORAL_MAX_RATIO_TO_MEMCPY = 0.5


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def config_targets(result: dict) -> dict:
    """Each target set for this configuration, with its measured figure and verdict."""
    budget = result["config"]["budget"]
    caches = result["caches"]
    targets = {}
    slots = caches["slots"]
    if budget in SLOTS_RATIO_BUDGETS:
        targets["slots_ratio_to_rotating"] = verdict(
            slots["ratio_to_rotating"], slots["ratio_to_rotating"] <= SLOTS_MAX_RATIO_TO_ROTATING,
            f"<= {SLOTS_MAX_RATIO_TO_ROTATING:g}")
    targets["slots_faults_per_step"] = verdict(
        slots["faults_per_call"], slots["faults_per_call"] <= SLOTS_MAX_FAULTS_PER_STEP,
        f"<= {SLOTS_MAX_FAULTS_PER_STEP:g}")
    temporal = caches["temporal"]
    targets["temporal_ratio_to_memcpy"] = verdict(
        temporal["ratio_to_memcpy"], temporal["ratio_to_memcpy"] <= TEMPORAL_MAX_RATIO_TO_MEMCPY,
        f"<= {TEMPORAL_MAX_RATIO_TO_MEMCPY:g}")
    return targets


def cache_report(results: list[dict], schedule, device: str, command: str, host: dict,
                 date: str) -> dict:
    """The suite's figures with their targets, the command, the versions, and
    the machine and date as they were when the suite started."""
    for result in results:
        result["targets"] = config_targets(result)
    return {
        "benchmark": "cache_step",
        "mlx_knorm_version": __version__,
        "mlx_version": mx.__version__,
        "mlx_lm_version": package_version("mlx-lm"),
        "reference_version": package_version("veloxquant-mlx"),
        "device": device,
        "date": date,
        "command": command,
        "machine": host,
        "backend": backend_info(),
        "warm_process": True,
        "schedule": {"rounds": schedule.rounds, "steps": schedule.steps,
                     "max_seconds": schedule.max_seconds},
        "configs": results,
    }


def _ms(timing: dict) -> str:
    return f"{timing['median_ms']:.4g} [{timing['p25_ms']:.4g}, {timing['p75_ms']:.4g}]"


def cache_table(report: dict) -> str:
    """One row per configuration and cache, then the slot layout's op alone
    and the copy floor."""
    header = ["budget", "B", "cache", "ms/step [p25, p75]", "vs RotatingKVCache",
              "vs memcpy", "faults/step", "steps"]
    rows = []
    for r in report["configs"]:
        config = r["config"]
        lead = [str(config["budget"]), str(config["batch"])]
        for name, t in r["caches"].items():
            rows.append([*lead, name, _ms(t), f"{t['ratio_to_rotating']:.2f}x",
                         f"{t['ratio_to_memcpy']:.2f}x", faults_text(t['faults_per_call']), str(t["reps"])])
        op = r["evict_and_fill"]
        rows.append([*lead, "evict_and_fill (the slots step's op alone)", _ms(op),
                     f"{op['ratio_to_rotating']:.2f}x", f"{op['ratio_to_memcpy']:.2f}x",
                     faults_text(op["faults_per_call"]), str(op["reps"])])
        m = r["memcpy"]
        rows.append([*lead, f"memcpy of K+V ({r['kv_bytes'] / 2**20:.3g} MiB)", _ms(m), "-", "1x",
                     faults_text(m['faults_per_call']), str(m["reps"])])
    return markdown_table(header, rows)


def print_cache_report(report: dict) -> None:
    c = report["configs"][0]["config"] if report["configs"] else {}
    print(f"mlx-knorm {report['mlx_knorm_version']}: the cache's decode step on {report['device']}, "
          f"mlx-lm {report['mlx_lm_version']}, {report['date']}")
    print(f"Machine: {machine_text(report)}")
    print(f"One decode step per layer (update_and_fetch of one token + mx.eval of the attended "
          f"K/V and the stored state), H={c.get('heads')}, D={c.get('dim')}, {c.get('dtype')}. "
          "Timed in a warm process (MLX's buffer cache never cleared), the caches interleaved "
          "in rounds; medians over all timed steps; faults/step = minor page faults per step. "
          "evict_and_fill: the op of the slot layout's step alone, on donated buffers.")
    if report["reference_version"] is None:
        print(f"The reference (veloxquant-mlx) is not installed: {install_hint('bench')}")
    print(cache_table(report))
    print("\nTargets (each holds on a quiet machine):")
    for r in report["configs"]:
        for name, v in r["targets"].items():
            print(f"  - {r['label']}: {name} {v['measured']:.3g} (target {v['target']}): {verdict_text(v)}")
