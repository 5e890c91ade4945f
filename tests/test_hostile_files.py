"""Files and commands under hostile use: every file the package writes is
written whole or not at all (a write failed or killed part way leaves the
previous file readable), a filters file is written under the name given
and refused by a model it was not calibrated for, a prompt cache keeps
the filters it was made with, and calibrate and doctor refuse what they
cannot do with one line, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from mlx_knorm import atomic, doctor
from mlx_knorm.__main__ import main
from mlx_knorm.commands.session import CacheConfig
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.scorers import QueryFilters, model_attention_layers
from tiny_models import tiny_model


def unit_filters(model, layers=None, seed: int = 0) -> QueryFilters:
    """Unit filters of the shape of ``model``'s keys for ``layers`` (default:
    the layers calibrate measures), recording the model's layer count."""
    n_layers, attention = model_attention_layers(model)
    heads, dim = model.args.num_key_value_heads, model.args.hidden_size // model.args.num_attention_heads
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in attention if layers is None else layers:
        f = rng.standard_normal((heads, dim)).astype(np.float32)
        arrays[i] = f / np.linalg.norm(f, axis=1, keepdims=True)
    return QueryFilters(arrays, {"layers": n_layers if layers is None else max(layers) + 1})


def leftovers(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name)


# -- written whole or not at all ---------------------------------------------


def test_a_filters_file_is_written_under_the_name_given(tmp_path):
    filters = QueryFilters({0: np.eye(2, 8, dtype=np.float32)}, {"model": "m"})
    for name in ("filters", "filters.bin", "filters.safetensors"):
        assert filters.save(tmp_path / name) == tmp_path / name
        assert QueryFilters.load(tmp_path / name).metadata == {"model": "m"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["filters", "filters.bin", "filters.safetensors"]


def test_a_filters_write_that_fails_part_way_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "filters"
    QueryFilters({0: np.eye(2, 8, dtype=np.float32)}).save(path)
    before = path.read_bytes()
    real_save = mx.save_safetensors

    def disk_full(file, arrays, metadata=None):
        real_save(file, arrays, metadata)
        with open(file, "r+b") as f:  # half of it on disk, then the disk is full
            f.truncate(os.path.getsize(file) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        QueryFilters({0: np.ones((2, 8), np.float32), 1: np.ones((2, 8), np.float32)}).save(path)
    assert path.read_bytes() == before and leftovers(tmp_path) == []
    assert sorted(QueryFilters.load(path).filters) == [0]


def test_a_filters_write_killed_part_way_leaves_the_old_file(tmp_path):
    """A process killed (SIGKILL) with half the new file written: the old
    file reads back; only a hidden temporary file is left beside it."""
    path = tmp_path / "filters.safetensors"
    QueryFilters({0: np.eye(2, 8, dtype=np.float32)}).save(path)
    before = path.read_bytes()
    child = textwrap.dedent(f"""
        import os, signal
        import mlx.core as mx
        import numpy as np
        from mlx_knorm.scorers import QueryFilters
        real_save = mx.save_safetensors
        def killed(file, arrays, metadata=None):
            real_save(file, arrays, metadata)
            with open(file, "r+b") as f:
                f.truncate(os.path.getsize(file) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        mx.save_safetensors = killed
        QueryFilters({{i: np.ones((2, 8), np.float32) for i in range(4)}}).save({str(path)!r})
    """)
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()
    assert path.read_bytes() == before and sorted(QueryFilters.load(path).filters) == [0]
    assert all(name.startswith(".filters.safetensors.") for name in leftovers(tmp_path))


def test_text_files_are_replaced_whole_or_left_as_they_were(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    atomic.write_text(path, "old\n")
    assert path.read_text() == "old\n" and oct(path.stat().st_mode & 0o777) == oct(0o666 & ~atomic._UMASK)

    def fsync_fails(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="Input/output"):
        atomic.write_text(path, "new\n")
    assert path.read_text() == "old\n" and leftovers(tmp_path) == []
    monkeypatch.undo()
    with pytest.raises(IsADirectoryError):
        atomic.write_text(tmp_path, "x")
    path.chmod(0o600)
    atomic.write_text(path, "new\n")
    assert path.read_text() == "new\n" and leftovers(tmp_path) == []
    assert path.stat().st_mode & 0o777 == 0o600  # the mode of the file it replaced


def test_a_plot_that_fails_part_way_leaves_the_old_plot(tmp_path):
    """Every plot the commands draw goes through atomic.save_figure: a
    savefig that writes half a file and fails leaves the old plot."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    atomic.save_figure(fig, path, dpi=50)
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG")
    real_savefig = fig.savefig

    def disk_full(file, **kwargs):
        real_savefig(file, **kwargs)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        raise OSError(28, "No space left on device")

    fig.savefig = disk_full
    with pytest.raises(OSError, match="No space left"):
        atomic.save_figure(fig, path, dpi=80)
    plt.close(fig)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_a_doctor_report_that_fails_to_render_leaves_the_old_report(tmp_path, monkeypatch):
    cases = doctor.op_cases()[:2]
    monkeypatch.setattr(doctor, "op_cases", lambda: cases[:1])
    out = tmp_path / "report"
    assert main(["doctor", "--device", "cpu", "--out", str(out), "--no-timings", "--no-generation",
                 "--ops", "key_norms"]) == 0
    before = {s: out.with_suffix(s).read_text() for s in (".json", ".md")}
    monkeypatch.setattr(doctor, "op_cases", lambda: cases)  # a report that differs

    def broken(report):
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(doctor, "markdown", broken)
    with pytest.raises(RuntimeError, match="rendering failed"):
        doctor.run("cpu", out, timings=False, generation=False, progress=lambda _: None, ops=("key_norms",))
    assert {s: out.with_suffix(s).read_text() for s in (".json", ".md")} == before


def test_a_prompt_cache_save_that_fails_part_way_leaves_the_old_file(tmp_path, monkeypatch, capsys):
    import mlx_lm.cache_prompt

    from mlx_knorm.commands import cache_prompt

    path = tmp_path / "prompt.safetensors"
    argv = ["--model", str(MODEL_DIR), "--budget", "16", "--prompt", "def main():\n    return 1\n" * 3,
            "--prompt-cache-file", str(path)]
    assert cache_prompt.main(argv) == 0
    before = path.read_bytes()
    real_save = mlx_lm.cache_prompt.save_prompt_cache

    def disk_full(file_name, cache, metadata=None):
        real_save(file_name, cache, metadata)
        with open(file_name, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mlx_lm.cache_prompt, "save_prompt_cache", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cache_prompt.main([*argv[:-1], str(tmp_path / "prompt")])  # the name mlx-lm completes
    assert path.read_bytes() == before and leftovers(tmp_path) == []


# -- filters of another model ------------------------------------------------


def test_filters_of_a_deeper_model_are_refused_by_a_shallower_one():
    """Filters of a 30-layer model, every layer of the same heads and width
    as a 2-layer model's: the commands' caches refuse them, naming the
    layers; filters made for the model pass."""
    model = tiny_model("llama", layers=2)
    deep = unit_filters(model, layers=range(30))
    with pytest.raises(ValueError, match="of a model of 30 layers, this model has 2"):
        deep.check_model(model)
    deep.metadata.pop("layers")  # a file that does not record it: its layers tell
    with pytest.raises(ValueError, match="cover layers 0 to 29, this model's full-attention layers are 0, 1"):
        deep.check_model(model)
    with pytest.raises(ValueError, match="cover layers 0 to 29"):
        CacheConfig(budget=8, scorer="qfilter", filters=deep).make_cache(model)
    fitting = unit_filters(model)
    fitting.check_model(model)
    cache = CacheConfig(budget=8, scorer="qfilter", filters=fitting).make_cache(model)
    assert [c.scorer for c in cache] == ["qfilter", "qfilter"]
    with pytest.raises(ValueError, match="of a model of 2 layers, this model has 3"):
        fitting.check_model(tiny_model("llama", layers=3))
    wide = QueryFilters({**fitting.filters, 1: np.ones((2, 24), np.float32)})
    with pytest.raises(ValueError, match=r"query filters of layer 1 are \[2, 24\]"):
        wide.check_model(model)


def test_a_prompt_cache_keeps_the_filters_it_was_made_with(tmp_path, monkeypatch, capsys):
    from mlx_knorm.quality.cli import load

    monkeypatch.setenv("MLX_KNORM_CACHE", str(tmp_path / "cache"))
    model = load(None)[0]
    made_with, other = unit_filters(model, seed=0).save(tmp_path / "a"), unit_filters(model, seed=1).save(tmp_path / "b")
    prompt_cache = tmp_path / "prompt.safetensors"
    assert main(["cache-prompt", "--model", str(MODEL_DIR), "--budget", "16", "--scorer", "qfilter",
                 "--filters", str(made_with), "--prompt", "import os\n" * 8,
                 "--prompt-cache-file", str(prompt_cache)]) == 0
    capsys.readouterr()
    answer = ["generate", "--model", str(MODEL_DIR), "--prompt-cache-file", str(prompt_cache),
              "--prompt", "x", "--max-tokens", "2"]
    assert main([*answer, "--filters", str(other)]) == 1
    err = capsys.readouterr().err
    assert "refusing --prompt-cache-file" in err and "other query filters than --filters gives" in err
    assert main([*answer, "--filters", str(made_with)]) == 0
    assert main(answer) == 0


# -- calibrate and doctor refuse in one line ----------------------------------


@pytest.mark.parametrize("case", ["missing", "empty", "no weights", "seq-len"])
def test_calibrate_refuses_what_it_cannot_calibrate_in_one_line(case, tmp_path, monkeypatch, capsys):
    from mlx_knorm.quality import data

    files = data.split_files()[0][:3]  # a short text, so that the refusal comes fast
    monkeypatch.setattr(data, "split_files", lambda root=None: (files, []))
    model = {"missing": tmp_path / "no-such-model", "empty": tmp_path,
             "no weights": tmp_path, "seq-len": MODEL_DIR}[case]
    if case == "no weights":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    seq_len = "1000000" if case == "seq-len" else "32"
    out = tmp_path / "f.safetensors"
    assert main(["calibrate", "--model", str(model), "--n-seqs", "1", "--seq-len", seq_len, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    expected = {"missing": "no such file or folder", "empty": "no config.json", "no weights": "no weights",
                "seq-len": "--seq-len 1000000 with --n-seqs 1: the calibration text is too short"}[case]
    assert err.startswith("mlx-knorm calibrate: error:") and expected in err and "Traceback" not in err
    assert not out.exists()


def test_calibrate_writes_and_prints_the_file_named(tmp_path, capsys):
    out = tmp_path / "smollm2-filters"
    assert main(["calibrate", "--model", str(MODEL_DIR), "--n-seqs", "1", "--seq-len", "32", "--out", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"-> {out}")
    filters = QueryFilters.load(out)
    assert filters.metadata["layers"] == 4 and filters.metadata["model"] == str(MODEL_DIR)


@pytest.mark.parametrize("ops", [",", ""])
def test_doctor_refuses_to_check_no_op(ops, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["doctor", "--device", "cpu", "--ops", ops, "--no-generation", "--out", str(out)]) == 2
    assert "names no op" in capsys.readouterr().err and not out.with_suffix(".json").exists()
    with pytest.raises(ValueError, match="names no op"):
        doctor.run("cpu", out, generation=False, ops=())
