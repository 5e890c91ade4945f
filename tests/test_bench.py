"""The bench CLI end to end on a tiny suite: JSON structure and the bit-exact
flags. Never asserts timings (they belong to the benchmark's own table)."""

import json
import runpy
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_knorm
from mlx_knorm.__main__ import main
from mlx_knorm.bench.cases import TARGET_STEPS
from mlx_knorm.bench.timing import RAISED_CACHE_LIMIT
from mlx_knorm.quality import MODEL_DIR

pytestmark = pytest.mark.skipif(
    not mlx_knorm.native_available(), reason="native extension not loaded"
)
BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_program(name: str, argv: list[str], tmp_path):
    """A checkout's bench/<name> run with ``argv`` and --json: (its globals, the report)."""
    program = runpy.run_path(str(BENCH / name))
    path = tmp_path / "report.json"
    assert program["main"]([*argv, "--json", str(path)]) == 0
    return program, json.loads(path.read_text())


def test_bench_cli_writes_json_with_bit_exact_cases(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = main([
        "bench", "--quick", "--no-progress", "--n", "2", "--d", "8",
        "--budget", "16", "--s", "1", "40", "--reps", "3", "--json", str(path),
    ])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["mlx_version"] and report["device"] == "cpu"
    kinds = [c["case"]["kind"] for c in report["cases"]]
    assert kinds == ["decode", "prefill"]
    for case in report["cases"]:
        assert case["bit_exact"] is True
        assert case["output_bytes"] == 2 * 16 * (2 * 8 * 2 + 4 + 4)
        names = {"kernel", "fallback"} | ({"reference"} if report["reference_installed"] else set())
        assert set(case["timings"]) == names
        for timing in [*case["timings"].values(), case["memcpy"]]:
            assert timing["reps"] >= 3 and "samples_ms" not in timing
            assert timing["min_ms"] <= timing["p25_ms"] <= timing["median_ms"] <= timing["p75_ms"] <= timing["max_ms"]
        assert case["ratio_to_memcpy"] > 0 and case["call_overhead_us"] > 0
        assert all({"measured", "target", "met"} <= set(t) for t in case["targets"].values())
    decode, prefill = report["cases"]
    in_place = decode["in_place"]
    assert 0 <= in_place["mean_bytes_moved"] <= in_place["state_bytes"] == 2 * 16 * (2 * 8 * 2 + 4)
    raised = decode["raised_cache_limit"]
    assert raised["cache_limit_bytes"] == RAISED_CACHE_LIMIT
    assert set(raised) >= {"kernel", "memcpy", "default_cache_limit_bytes", "ratio_to_memcpy"}
    assert "in_place" not in prefill and "raised_cache_limit" not in prefill
    assert report["warm_process"] is True
    out = capsys.readouterr().out
    assert "| decode S=1 budget=16 |" in out and "| prefill S=40 budget=16 |" in out
    assert "raised to 256 MiB" in out


def test_bench_restores_the_cache_limit_it_raises(tmp_path):
    """The raised-limit row sets MLX's process-wide cache limit for its own
    timings only: the caller's limit is the one in force afterwards and the
    one the report names as the default."""
    limit = 48 << 20
    previous = mx.set_cache_limit(limit)
    try:
        path = tmp_path / "bench.json"
        assert main(["bench", "--quick", "--no-progress", "--n", "2", "--d", "8", "--budget", "16",
                     "--s", "1", "--reps", "3", "--json", str(path)]) == 0
        assert mx.set_cache_limit(limit) == limit
    finally:
        mx.set_cache_limit(previous)
    raised = json.loads(path.read_text())["cases"][0]["raised_cache_limit"]
    assert raised["default_cache_limit_bytes"] == limit


def test_default_command_is_the_quick_bench(monkeypatch):
    seen = {}

    def record_run(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr("mlx_knorm.bench.cli.run", record_run)
    assert main([]) == 0
    assert seen["args"].quick and seen["args"].budget is None


def test_sweep_program_runs_the_same_bench(tmp_path):
    """bench/ops.py (a checkout's sweep program) on a tiny grid."""
    program, report = run_program("ops.py", [
        "--quick", "--no-progress", "--n", "2", "--d", "8", "--budget", "16", "--s", "1",
        "--reps", "3",
    ], tmp_path)
    assert set(TARGET_STEPS) <= set(program["SWEEP"])
    assert report["command"].startswith("python bench/ops.py")
    assert [c["label"] for c in report["cases"]] == ["decode S=1 budget=16"]


def check_cache_report(report, configs):
    """The structure of a cache-step report over ``configs`` ([(budget, B), ...])."""
    assert report["benchmark"] == "cache_step" and report["warm_process"] is True
    assert report["mlx_version"] and report["machine"]["cpu_count"] and report["date"]
    names = {"KVCache", "RotatingKVCache", "slots", "temporal"}
    names |= {"reference"} if report["reference_version"] else set()
    assert [(r["config"]["budget"], r["config"]["batch"]) for r in report["configs"]] == configs
    for r in report["configs"]:
        c = r["config"]
        assert r["kv_bytes"] == 2 * c["batch"] * c["heads"] * c["budget"] * c["dim"] * 2
        assert set(r["caches"]) == names
        for timing in [*r["caches"].values(), r["evict_and_fill"], r["memcpy"]]:
            assert timing["reps"] >= 3 and "samples_ms" not in timing
            assert timing["min_ms"] <= timing["p25_ms"] <= timing["median_ms"] <= timing["p75_ms"] <= timing["max_ms"]
            assert timing["faults_per_call"] >= 0
        assert r["caches"]["RotatingKVCache"]["ratio_to_rotating"] == 1.0
        assert r["evict_and_fill"]["ratio_to_slots"] > 0
        assert {"slots_faults_per_step", "temporal_ratio_to_memcpy"} <= set(r["targets"])
        assert all({"measured", "target", "met"} <= set(t) for t in r["targets"].values())


def test_bench_cache_writes_json(tmp_path, capsys):
    path = tmp_path / "cache.json"
    rc = main(["bench", "--cache", "--no-progress", "--budget", "16", "--d", "8", "--reps", "4",
               "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    check_cache_report(report, [(16, 1)])
    assert report["command"].startswith("mlx-knorm") and report["configs"][0]["config"]["heads"] == 8
    out = capsys.readouterr().out
    assert "warm process" in out and "| 16 | 1 | slots |" in out and "| 16 | 1 | evict_and_fill" in out


def test_cache_step_program_runs_the_same_suite(tmp_path):
    """bench/cache_step.py (the full sweep) on a tiny grid, both batch sizes."""
    _, report = run_program("cache_step.py", [
        "--no-progress", "--budget", "16", "--batch", "1", "2", "--heads", "2", "--dim", "8",
        "--rounds", "2", "--steps", "3",
    ], tmp_path)
    assert report["command"].startswith("python bench/cache_step.py")
    check_cache_report(report, [(16, 1), (16, 2)])


@pytest.mark.parametrize("flag, value", [("--rounds", "1"), ("--rounds", "0"), ("--steps", "0")])
def test_cache_step_program_refuses_schedules_with_nothing_timed(flag, value, capsys):
    program = runpy.run_path(str(BENCH / "cache_step.py"))
    with pytest.raises(SystemExit) as exit_info:
        program["main"](["--budget", "16", flag, value])
    assert exit_info.value.code == 2
    assert f"{flag} must be >= " in capsys.readouterr().err


def test_order_tree_program_times_both_sides(tmp_path):
    """bench/order_tree.py on a tiny grid: both sides, both windows."""
    _, report = run_program("order_tree.py", ["--budget", "16", "--heads", "2", "--rounds", "2", "--steps", "2"],
                            tmp_path)
    assert report["benchmark"] == "order_tree"
    assert [(r["budget"], r["heads"], r["recent"]) for r in report["results"]] == [(16, 2, 0), (16, 2, 8)]
    for row in report["results"]:
        assert row["tree_ms"] > 0 and row["scan_ms"] > 0
        assert row["tree_over_scan"] == row["tree_ms"] / row["scan_ms"]


def check_decode_e2e(report, budgets):
    assert report["benchmark"] == "decode_e2e" and report["warm_process"] is True
    assert list(report["budgets"]) == [str(b) for b in budgets]
    names = {"KVCache", "RotatingKVCache", "slots", "temporal"}
    weights = report["model"]["weights_bytes"]
    for result in report["budgets"].values():
        caches = result["caches"]
        assert set(caches) == names | ({"reference"} if report["reference_version"] else set())
        for c in caches.values():
            assert c["reps"] == 2 and c["tokens_per_s"] > 0 and c["cpu_median_ms"] >= 0
            assert c["peak_memory_bytes"] >= max(c["prefill_peak_memory_bytes"], weights)
        assert caches["RotatingKVCache"]["peak_memory_ratio_to_rotating"] == 1.0
        assert caches["RotatingKVCache"]["cpu_ms_ratio_to_rotating"] == 1.0
        assert set(result["targets"]) == {
            f"{layout}_{what}" for layout in ("slots", "temporal")
            for what in ("tokens_per_s_ratio", "peak_memory_ratio")
        }
    # One KVCache (it keeps everything), listed under every budget.
    first, *rest = report["budgets"].values()
    assert all(r["caches"]["KVCache"]["median_ms"] == first["caches"]["KVCache"]["median_ms"] for r in rest)


def test_decode_e2e_program_on_a_tiny_prompt(tmp_path):
    """bench/decode_e2e.py end to end on one layer, a 40-token prompt and two budgets:
    JSON structure and the targets' fields, never the timings."""
    _, report = run_program("decode_e2e.py", [
        "--prompt", "40", "--tokens", "2", "--warmup", "1", "--round-tokens", "1", "--layers", "1",
        "--intermediate", "64", "--vocab", "64", "--budgets", "8,16",
    ], tmp_path)
    assert report["model"]["num_hidden_layers"] == 1 and report["prompt_tokens"] == 40
    check_decode_e2e(report, [8, 16])
    assert report["our_recent"] == {"8": 3, "16": 8}  # make_knorm_cache's default window at n_sink 4


def test_decode_e2e_program_with_kv_bits_times_quantized_caches(tmp_path):
    """--kv-bits: QuantizedKVCache and ours quantized as generate_step
    quantizes them, the ratios against QuantizedKVCache."""
    _, report = run_program("decode_e2e.py", [
        "--prompt", "40", "--tokens", "2", "--warmup", "1", "--round-tokens", "1", "--layers", "1",
        "--intermediate", "64", "--vocab", "64", "--budgets", "8,16", "--kv-bits", "4",
    ], tmp_path)
    assert report["kv_bits"] == 4 and report["baseline"] == "QuantizedKVCache"
    for result in report["budgets"].values():
        caches = result["caches"]
        assert set(caches) == {"QuantizedKVCache", "slots", "temporal"}
        assert caches["QuantizedKVCache"]["layer_cache_types"] == ["QuantizedKVCache"]
        assert caches["slots"]["layer_cache_types"] == caches["temporal"]["layer_cache_types"] \
            == ["QuantizedL2NormKVCache"]
        assert caches["QuantizedKVCache"]["tokens_per_s_ratio_to_quantized"] == 1.0
        assert set(result["targets"]) == {"slots_tokens_per_s_ratio", "temporal_tokens_per_s_ratio"}


def test_decode_e2e_program_on_a_real_model_decodes_real_text(tmp_path):
    _, report = run_program("decode_e2e.py", [
        "--model", str(MODEL_DIR), "--prompt", "40", "--tokens", "2", "--warmup", "1", "--round-tokens", "1",
        "--budgets", "16",
    ], tmp_path)
    assert report["model"]["name"] == str(MODEL_DIR) and report["model"]["num_hidden_layers"] == 4
    assert report["prompt_source"] == "pydoc_data.topics, sorted by topic"
    check_decode_e2e(report, [16])


def test_commands_program_counts_drafts_as_mlx_lm_proposes_them():
    drafted_tokens = runpy.run_path(str(BENCH / "commands.py"))["drafted_tokens"]
    # 3 drafts accepted, then the target's token; none accepted; 1 of the
    # last 2 (max_tokens 8 leaves 2 to propose), the target's token.
    assert drafted_tokens([True, True, True, False, False, True, False], 3) == 3 + 3 + 2
    # Stopped at max_tokens inside the accepted drafts: no target token.
    assert drafted_tokens([True, True], 3) == 2


def test_commands_program_compares_draft_models_and_kv_bits(tmp_path):
    from command_runs import WIDE_HEAD_DIM, write_tiny_llama

    small = ["--prompt", "48", "--tokens", "12", "--rounds", "1", "--budget", "16", "--log-dir", str(tmp_path)]
    _, report = run_program("commands.py", ["--compare", "draft", "--draft-bits", "2", *small], tmp_path)
    cases = report["draft"]["cases"]
    assert list(cases) == ["no draft", "self draft", "2-bit-rounded draft"]
    assert all(c["same_text_as_no_draft"] for c in cases.values())
    assert cases["self draft"]["acceptance_rate"] == 1.0 and cases["no draft"]["acceptance_rate"] == 0
    wide = write_tiny_llama(tmp_path / "wide", head_dim=WIDE_HEAD_DIM)
    _, report = run_program("commands.py", ["--compare", "kv-bits", "--model", str(wide), *small], tmp_path)
    kv = {name: c["kv_allocated_bytes"] for name, c in report["kv_bits"]["cases"].items()}
    # 4 layers x 4 heads x 17 slots: float16 rows of 64, or packed with a
    # float16 scale and bias; in the memory line's MB of 3 decimals.
    slots = 4 * 4 * 17
    for name, row in (("eviction float", 128), ("eviction 8-bit", 64 + 4), ("eviction 4-bit", 32 + 4)):
        assert kv[name] / 1e6 == pytest.approx(round(slots * (2 * row + 8) / 1e6, 3))
    assert kv["full 4-bit"] < kv["full 8-bit"] < kv["full float"]


def test_batch_decode_program_on_tiny_prompts(tmp_path):
    """bench/batch_decode.py end to end on one layer, prompts of 20 to 40
    tokens and budget 16: every kind at every batch size decodes and
    reports, and the batches' caches are the batch caches; never timings."""
    program, report = run_program("batch_decode.py", [
        "--prompt-min", "20", "--prompt-max", "40", "--budget", "16", "--rounds", "1",
        "--round-steps", "1", "--warmup", "1", "--layers", "1", "--intermediate", "64", "--vocab", "64",
    ], tmp_path)
    assert report["benchmark"] == "batch_decode" and report["warm_process"] is True
    assert sorted(report["prompt_tokens"]) == [20, 23, 26, 29, 31, 34, 37, 40]
    kinds = {"BatchKVCache", "BatchRotatingKVCache", "BatchL2NormKVCache"}
    assert set(report["batches"]) == {"1", "4", "8"}
    for batch, row in report["batches"].items():
        assert set(row) == kinds | ({"L2NormKVCache one at a time"} if batch != "1" else set())
        for c in row.values():
            assert c["sequences"] == int(batch) and c["reps"] == 1 and c["tokens_per_s"] > 0
        assert row["BatchRotatingKVCache"]["tokens_per_s_ratio_to_rotating"] == 1.0
    assert "B4_speedup_over_one_at_a_time" in report["targets"]
    model = program["build_model"](1, 64, 64)
    caches = program["single_caches"](model, 16)
    merged = [type(c[0].merge([c[0]])).__name__ for c in (make() for make in caches.values())]
    assert merged == ["BatchKVCache", "BatchRotatingKVCache", "BatchL2NormKVCache"]


def recorded_quick_report() -> dict:
    """bench/results/quick-cpu.json (a real run of the main job), its targets
    judged by this version's rules."""
    from mlx_knorm.bench.cases import Case
    from mlx_knorm.bench.report import case_targets

    report = json.loads((BENCH / "results" / "quick-cpu.json").read_text())
    for case in report["cases"]:
        case["targets"] = case_targets(Case(**case["case"]), case)
    return report


def test_the_main_job_reports_findings_and_only_the_live_targets(capsys):
    from mlx_knorm.bench.report import print_report

    report = recorded_quick_report()
    # Live targets on the target decode steps only; no speed-up over the
    # reference or the fallback is a target (those are findings).
    for case in report["cases"]:
        expected = {"ratio_to_memcpy", "in_place_ratio_to_memcpy"} if case["case"]["kind"] == "decode" else set()
        assert set(case["targets"]) == expected
    print_report(report)
    out = capsys.readouterr().out
    assert "MISSED" not in out and "does not hold" not in out
    assert "Machine: AMD EPYC, 2 cores, Linux" in out and "load average 6.1 at the start" in out
    assert "judge the targets on an idle machine" in out  # 6.1 on 2 cores: busy
    assert "bit for bit in 4 of 4 cases" in out
    assert "prefill: the kernel is 27x-32x the fallback's speed and 32x-39x the reference's" in out
    assert "1006 vs 8160 (decode S=1 budget=2048)" in out
    assert out.count(": holds") == 4


def test_a_live_target_missed_says_so_and_a_quiet_machine_is_not_called_busy(capsys):
    from mlx_knorm.bench.cases import Case
    from mlx_knorm.bench.report import case_targets, print_report

    report = recorded_quick_report()
    report["machine"]["load_average_1_5_15_min"] = [0.2, 0.3, 0.4]
    decode = report["cases"][0]
    decode["ratio_to_memcpy"] = 3.5
    decode["targets"] = case_targets(Case(**decode["case"]), decode)
    print_report(report)
    out = capsys.readouterr().out
    assert "decode S=1 budget=512: kernel / a copy of its outputs 3.5x (target <= 3): does not hold in this run" in out
    assert "load average 0.2 at the start" in out and "idle machine" not in out
