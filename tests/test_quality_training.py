"""The training script and the checkpoint evolution, on a run of a few tiny steps."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_knorm.quality import evolution, train

TINY = ["--dim", "16", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "32",
        "--batch", "2", "--seq-len", "48", "--eval-windows", "4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    argv = [*TINY, "--steps", "6", "--checkpoints", "0.1,0.5,1.0",
            "--checkpoint-dir", str(root / "checkpoints"), "--out", str(root / "model")]
    assert train.main(argv) == 0
    return root


def test_training_writes_a_loadable_model_and_checkpoints(run):
    report = json.loads((run / "model" / "TRAINING.json").read_text())
    assert report["steps"] == 6 and report["tokens_seen"] == 6 * 2 * 48
    assert [c["step"] for c in report["checkpoints"]] == [1, 3, 6]
    assert report["bigram_heldout_loss"] < report["unigram_heldout_loss"]
    assert report["checkpoints"][-1]["heldout_loss"] == report["heldout_loss"]
    model, tokenizer = load(str(run / "checkpoints" / "step-00003"))
    assert tokenizer.encode("ab\n") == [97, 98, 10]
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 256)


def test_evolution_reproduces_the_training_numbers(run, tmp_path):
    out = tmp_path / "evolution.json"
    checkpoints = sorted(str(p) for p in (run / "checkpoints").iterdir())
    assert evolution.main([*checkpoints, "--init", "--n-seqs", "2", "--eval-windows", "4",
                           "--json", str(out), "--plot", str(tmp_path / "evolution.png")]) == 0
    rows = json.loads(out.read_text())["checkpoints"]
    assert [row["step"] for row in rows] == [0, 1, 3, 6]
    recorded = json.loads((run / "model" / "TRAINING.json").read_text())["checkpoints"]
    for row, record in zip(rows[1:], recorded):
        assert row["heldout_loss"] == pytest.approx(record["heldout_loss"], abs=2e-4)
    # The schedule's first step has learning rate 0, so step 1 is the rebuilt step-0 model.
    assert rows[0]["heldout_loss"] == rows[1]["heldout_loss"]
    assert rows[0]["layer_spearman"] == rows[1]["layer_spearman"]
    assert all(0.0 < row["keep_low_recall"] < 1.0 and 0.0 < row["random_recall"] < 1.0 for row in rows)


def test_measure_times_eager_and_compiled_steps(capsys):
    assert train.main([*TINY, "--measure", "2x32,1x64", "--measure-steps", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["seq_len"], r["compiled"]) for r in rows] == [
        (2, 32, False), (2, 32, True), (1, 64, False), (1, 64, True)]
    assert all(r["tokens_per_second"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        train.main(["--measure", "2by32"])
