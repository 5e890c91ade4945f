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
