"""The quality commands' arguments and output files: a bad one stops the command before it loads a model
(exit 2, naming the argument); files are replaced atomically."""

import json

import pytest

from mlx_knorm.__main__ import main
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.atomic import save_figure
from mlx_knorm.quality.outputs import write_json

COMMANDS = {"ruler": ["--tasks", "vt", "--context", "700"], "needle": ["--contexts", "400"], "eval": []}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("option,name", [("--json", "a-file/out.json"), ("--plot", "a-file/sub/out.png"),
                                         ("--plot", "out.notaformat"), ("--json", "."), ("--json", "")])
def test_an_output_path_that_cannot_be_written_stops_the_command_first(command, option, name, tmp_path, capsys,
                                                                       monkeypatch):
    import mlx_knorm.quality.cli as quality_cli

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(quality_cli, "load", no_load)
    (tmp_path / "a-file").write_text("")  # a file where the output's folder would be
    path = {".": tmp_path, "": ""}.get(name, tmp_path / name)
    with pytest.raises(SystemExit) as stopped:
        main([command, "--model", str(MODEL_DIR), *COMMANDS[command], option, str(path)])
    assert stopped.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_write_json_replaces_the_file_whole_or_leaves_it(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_save_figure_writes_the_suffixs_format_and_leaves_no_temporary(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots()
    save_figure(fig, tmp_path / "a.png")
    save_figure(fig, tmp_path / "b.svg")
    save_figure(fig, tmp_path / "c")  # no suffix: PNG, as --plot takes it
    plt.close(fig)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "c").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "b.svg").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.svg", "c"]


@pytest.mark.parametrize("command", ["ruler", "needle", "eval", "demo"])
def test_a_negative_n_sink_is_refused_by_name(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([command, "--model", str(MODEL_DIR), "--n-sink", "-1"])
    assert stopped.value.code == 2
    assert "argument --n-sink: must be >= 0" in capsys.readouterr().err


def test_ruler_run_refuses_a_negative_n_sink_by_name():
    from mlx_knorm.models.loader import load
    from mlx_knorm.quality.ruler import run

    model, tokenizer = load(str(MODEL_DIR))
    with pytest.raises(ValueError, match="n_sink must be a non-negative int"):
        run(model, tokenizer, tasks=["vt"], context=512, n_sink=-1)


@pytest.mark.parametrize("command,option", [("eval", "--text"), ("needle", "--haystack"), ("ruler", "--haystack")])
@pytest.mark.parametrize("content", [None, b"\xff\xfe not utf-8", b"", b" \n\t\n"])
def test_a_text_file_that_cannot_be_used_stops_before_the_model_loads(command, option, content, tmp_path, capsys,
                                                                      monkeypatch):
    import mlx_knorm.quality.cli as quality_cli

    monkeypatch.setattr(quality_cli, "load", lambda *a, **k: pytest.fail("the model was loaded first"))
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    assert main([command, option, str(path)]) == 2
    assert f"{option} {path}" in capsys.readouterr().err


def test_an_output_in_a_folder_yet_to_be_made_is_taken_and_written(tmp_path):
    from mlx_knorm.quality.outputs import output_path

    path = output_path(str(tmp_path / "new" / "deeper" / "out.json"))
    write_json(path, [1])
    assert json.loads((tmp_path / "new" / "deeper" / "out.json").read_text()) == [1]


def test_needle_refuses_a_haystack_file_it_would_not_read(tmp_path, capsys, monkeypatch):
    import mlx_knorm.quality.cli as quality_cli

    monkeypatch.setattr(quality_cli, "load", lambda *a, **k: pytest.fail("the model was loaded first"))
    path = tmp_path / "text.txt"
    path.write_text("Some prose of my own. " * 20)
    assert main(["needle", "--haystack", str(path), "--haystacks", "passkey"]) == 2
    assert "--haystacks passkey has no prose" in capsys.readouterr().err


def test_ruler_refuses_a_haystack_file_no_task_reads(tmp_path, capsys, monkeypatch):
    import mlx_knorm.quality.cli as quality_cli

    monkeypatch.setattr(quality_cli, "load", lambda *a, **k: pytest.fail("the model was loaded first"))
    path = tmp_path / "text.txt"
    path.write_text("Some prose of my own. " * 20)
    assert main(["ruler", "--haystack", str(path), "--tasks", "vt,niah_single_1"]) == 2
    assert "--tasks vt,niah_single_1 has none" in capsys.readouterr().err
