"""Install hints name the extra's packages from this installation's metadata
(mlx-knorm is not on PyPI, so ``pip install 'mlx-knorm[lm]'`` installs nothing)."""

from pathlib import Path

import pytest

from mlx_knorm.extras import extra_requirements, install_hint

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("extra", ["lm", "bench", "plot", "gguf"])
def test_an_extra_s_requirements_are_pyproject_s(extra):
    tomllib = pytest.importorskip("tomllib")
    requirement = pytest.importorskip("packaging.requirements").Requirement
    listed = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"][extra]
    # Metadata writes a specifier's clauses in its own order.
    assert ({(r.name, r.specifier) for r in map(requirement, extra_requirements(extra))}
            == {(r.name, r.specifier) for r in map(requirement, listed)})


def test_the_hint_names_packages_pip_can_find_and_the_extra_for_a_clone():
    hint = install_hint("lm")
    assert hint.startswith("pip install 'mlx-lm") and "pip install '.[lm]'" in hint
    assert "mlx-knorm[" not in hint
    # An extra that includes another extra: that extra's packages, not mlx-knorm[...].
    quality = install_hint("quality")
    assert "'gguf" in quality and "mlx-knorm[" not in quality
    assert install_hint("no-such-extra") == "pip install '.[no-such-extra]'"


def test_a_command_without_mlx_lm_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    from mlx_knorm import commands

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlx_lm" else real_find_spec(name, *a))
    assert commands.run("generate", ["--model", "x"]) == 1
    err = capsys.readouterr().err
    assert "mlx-lm is not installed: pip install 'mlx-lm" in err and "mlx-knorm[lm]" not in err
