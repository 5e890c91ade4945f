"""``python -m mlx_knorm.quality.tradeoff`` (docs/quality.md's plot) on the
recorded eval runs: each point's KV bytes are its rows as its cache stores
them, over the full float cache's."""

import json
from pathlib import Path

import pytest

from mlx_knorm.quality.tradeoff import main, points

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def by_key(path: str) -> dict:
    report = json.loads((RESULTS / path).read_text())
    # SmolLM2-135M: head dim 64, float32.
    return {(p["policy"], p["rows"]): p for p in points(report, head_dim=64, itemsize=4)}


def test_kv_bytes_count_norms_positions_scales_and_biases():
    eval8 = by_key("quality-eval-smollm2.json")
    # 128 of 1024 rows: a window's rows as they are (1/8); an eviction row adds
    # 8 bytes to 512 (0.127); skipped layers hold other row counts (no point).
    assert eval8[("window", 128)]["kv_bytes_ratio"] == 128 / 1024
    assert eval8[("keep-low+recent=1/2", 128)]["kv_bytes_ratio"] == 128 * 520 / (1024 * 512)
    assert eval8[("keep-low+recent=1/2", 128)]["perplexity_ratio"] == pytest.approx(1.3585, abs=1e-4)
    assert not any("skip" in policy for policy, _ in eval8)
    bits = by_key("quality-eval-smollm2-kv-bits-1k.json")
    # 8 bits: 64 bytes packed and a float32 scale and bias per 64 values, keys and values, + 8.
    assert bits[("keep-low+recent=1/2+bits=8", 128)]["kv_bytes_ratio"] == 128 * (2 * 72 + 8) / (1024 * 512)
    assert bits[("full+bits=4", 1024)]["kv_bytes_ratio"] == 2 * 40 / 512


def test_the_command_prints_the_points_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "tradeoff.png"
    assert main(["--head-dim", "64", "--dtype", "float32", "--plot", str(plot),
                 "--report", str(RESULTS / "quality-eval-smollm2.json"), "window", "keep-low+recent=1/2",
                 "--report", str(RESULTS / "quality-eval-smollm2-kv-bits-1k-equal-bytes.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 + 8  # two policies at three budgets; every cut of the second file
    assert "keep-low+recent=1/2+bits=8   4 windows of 1024  rows   437  KV bytes 0.127  perplexity 1.04" in "\n".join(lines)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_against_a_policy_is_the_paired_ratio_at_each_budget(capsys):
    """The scorer targets compare with the recent window on the same windows:
    the ratio is exp of the mean per-window NLL gap, its interval resampled
    by window, and a baseline measured at no shared budget is refused."""
    import math

    import numpy as np

    from mlx_knorm.quality.tradeoff import against

    report = json.loads((RESULTS / "quality-eval-gemma3-scorers.json").read_text())
    rows = {(r["policy"], r["budget"]): r for r in against(report, "window")}
    nll = report["per_sequence"]["nll"]
    gap = np.array(nll["qfilter+recent=1/2@256"]) - np.array(nll["window@256"])
    row = rows[("qfilter+recent=1/2", 256)]
    assert row["ratio"] == pytest.approx(math.exp(gap.mean()))
    assert row["interval"][0] < row["ratio"] < row["interval"][1] < 1.0  # better than the window here
    assert ("window", 256) not in rows and ("full", 256) not in rows
    # The same ratio the eval reports through the full cache, up to rounding.
    to_full = report["perplexity_ratio_to_full"]
    assert row["ratio"] == pytest.approx(to_full["qfilter+recent=1/2@256"] / to_full["window@256"])
    with pytest.raises(ValueError, match="--against: 'full\\+bits=8'"):
        against(report, "full+bits=8")
    assert main(["--against", "window", "--report", str(RESULTS / "quality-eval-gemma3-scorers.json"),
                 "qfilter+recent=1/2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("perplexity / window's" in line for line in lines)


def test_bytes_need_the_head_dim_and_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["--report", str(RESULTS / "quality-eval-smollm2.json")])
    assert "--head-dim and --dtype" in capsys.readouterr().err
