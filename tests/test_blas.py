"""The fast CPU path: which BLAS MLX calls, the once-only re-execution with one preloaded, the hint,
and ``load``'s float32 default on a CPU with a fast BLAS. Nothing here depends on this machine having
OpenBLAS: the library preloaded in the re-execution tests is the reference BLAS mlx bundles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as Q

from mlx_knorm import blas
from mlx_knorm.models import load, loader
from mlx_knorm.models.gguf_file import open_gguf

from tiny_gguf import write_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and mlx's bundled BLAS")


def _bundled_blas() -> str:
    """The library whose cblas_sgemm libmlx binds without a preload (mlx's own reference BLAS here)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.REEXEC_ENV)}
    out = subprocess.run([sys.executable, "-c", "from mlx_knorm.blas import blas_in_use; "
                          "import json; print(json.dumps(blas_in_use()))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["path"]


def _info(setting: str | None, **extra):
    """``python -m mlx_knorm info`` as a user runs it, with ``MLX_KNORM_FAST_BLAS=setting``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.REEXEC_ENV, blas.OPT_ENV)}
    if setting is not None:
        env[blas.OPT_ENV] = setting
    env.update(extra)
    result = subprocess.run([sys.executable, "-m", "mlx_knorm", "info"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    return json.loads(text[: text.index("\n}\n") + 2])["blas"], result.stderr


def test_blas_in_use_names_the_library_libmlx_calls():
    info = blas.blas_in_use()
    assert info["path"] and os.path.exists(info["path"])
    assert set(info) == {"name", "path", "fast", "preloaded"}
    if not os.environ.get("LD_PRELOAD"):
        assert info["preloaded"] is False
    assert info["fast"] == (info["name"] in blas.FAST_NAMES)


@pytest.mark.parametrize("path,name", [
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", "OpenBLAS"),
    ("/usr/lib64/libopenblasp.so.0", "OpenBLAS"),
    ("/opt/intel/mkl/lib/libmkl_rt.so", "MKL"),
    ("/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0", "reference BLAS (bundled with mlx)"),
    ("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", "reference BLAS"),
])
def test_blas_name(path, name):
    assert blas.blas_name(path) == name


def test_command_reexecutes_once_with_the_named_library_preloaded():
    bundled = _bundled_blas()
    info, err = _info(bundled)
    # The reference library is not a fast one: a second re-execution would loop; REEXEC_ENV stops it.
    assert info["preloaded"] is True and info["path"] == os.path.realpath(bundled)
    assert blas.INSTALL_HINT not in err


def test_no_reexecution_when_opted_out_or_already_reexecuted():
    bundled = _bundled_blas()
    for info, err in (_info("0"), _info(bundled, **{blas.REEXEC_ENV: bundled})):
        assert info["preloaded"] is False
        assert blas.INSTALL_HINT not in err


def test_a_named_library_that_is_not_one_is_reported_and_the_command_goes_on(tmp_path):
    info, err = _info(str(tmp_path / "missing.so"))
    assert info["preloaded"] is False
    assert "is not a shared library that exports cblas_sgemm" in err


def test_no_library_to_preload_prints_the_hint_once(monkeypatch, capsys):
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.delenv(blas.OPT_ENV, raising=False)
    blas.hint_once()
    blas.hint_once()
    assert capsys.readouterr().err == blas.INSTALL_HINT + "\n"
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.setenv(blas.OPT_ENV, "0")
    blas.hint_once()
    assert capsys.readouterr().err == ""


def test_the_plan_preloads_an_installed_openblas_or_hints_once(monkeypatch, capsys):
    slow = {"name": "reference BLAS", "path": "x", "fast": False, "preloaded": False}
    monkeypatch.setattr(blas, "blas_in_use", lambda: slow)
    monkeypatch.delenv(blas.OPT_ENV, raising=False)
    monkeypatch.delenv(blas.REEXEC_ENV, raising=False)
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.setattr(blas, "find_fast_blas", lambda: "/usr/lib/libopenblas.so.0")
    assert blas.preload_plan() == "/usr/lib/libopenblas.so.0"
    monkeypatch.setattr(blas, "find_fast_blas", lambda: None)
    assert blas.preload_plan() is None and blas.preload_plan() is None
    assert capsys.readouterr().err == blas.INSTALL_HINT + "\n"  # once
    for setting in ({blas.OPT_ENV: "0"}, {blas.REEXEC_ENV: "/usr/lib/libopenblas.so.0"}):
        with monkeypatch.context() as m:
            for key, value in setting.items():
                m.setenv(key, value)
            m.setattr(blas, "find_fast_blas", lambda: "/usr/lib/libopenblas.so.0")
            assert blas.preload_plan() is None
    monkeypatch.setattr(blas, "blas_in_use", lambda: {**slow, "fast": True})
    monkeypatch.setattr(blas, "find_fast_blas", lambda: "/usr/lib/libopenblas.so.0")
    assert blas.preload_plan() is None
    monkeypatch.setattr(blas, "blas_in_use", lambda: slow)
    monkeypatch.setattr(blas, "_on_cpu", lambda: False)  # a GPU keeps its path
    assert blas.preload_plan() is None


def test_never_reexecutes_pytests_own_process(monkeypatch):
    monkeypatch.setenv(blas.OPT_ENV, _bundled_blas())
    monkeypatch.delenv(blas.REEXEC_ENV, raising=False)
    monkeypatch.setattr(blas, "blas_in_use", lambda: {"fast": False})
    blas.reexec_with_fast_blas()  # returns: an exec would end this test run


def _fast(monkeypatch, fast: bool, memory: int | None = 1 << 40):
    monkeypatch.delenv(blas.OPT_ENV, raising=False)
    monkeypatch.setattr(blas, "blas_in_use", lambda: {"name": "OpenBLAS" if fast else "reference BLAS",
                                                      "path": "x", "fast": fast, "preloaded": fast})
    monkeypatch.setattr(loader, "available_memory", lambda: memory)
    monkeypatch.setattr(blas, "_hinted", False)


def _up_proj(model):
    return model.model.layers[0].mlp.up_proj


def test_load_takes_float32_weights_on_a_cpu_with_a_fast_blas(tmp_path, monkeypatch):
    tiny = write_model(tmp_path / "tiny.gguf", "llama", Q.Q8_0)
    _fast(monkeypatch, True)
    model, _ = load(tiny.path)
    assert _up_proj(model).weight.dtype == mx.float32 and not hasattr(_up_proj(model), "scales")
    stored, _ = load(tiny.path, dtype="stored")
    assert hasattr(_up_proj(stored), "scales")
    assert hasattr(_up_proj(load(tiny.path, dtype=None)[0]), "scales")
    monkeypatch.setenv(blas.OPT_ENV, "0")  # the whole fast path off
    assert hasattr(_up_proj(load(tiny.path)[0]), "scales")


def test_load_keeps_weights_as_stored_on_a_slow_blas_or_short_memory(tmp_path, monkeypatch, capsys):
    tiny = write_model(tmp_path / "tiny.gguf", "llama", Q.Q8_0)
    monkeypatch.delenv(blas.OPT_ENV, raising=False)
    _fast(monkeypatch, False)
    assert hasattr(_up_proj(load(tiny.path)[0]), "scales")
    assert blas.INSTALL_HINT in capsys.readouterr().err
    _fast(monkeypatch, True, memory=2 * loader.float32_bytes(open_gguf(tiny.path)) - 1)
    assert hasattr(_up_proj(load(tiny.path)[0]), "scales")
    _fast(monkeypatch, True, memory=None)
    assert hasattr(_up_proj(load(tiny.path)[0]), "scales")
    _fast(monkeypatch, True)
    with mx.stream(mx.cpu):
        assert hasattr(_up_proj(load(tiny.path, requantize=(4, 64))[0]), "scales")


def test_a_float_dtype_is_refused_for_an_mlx_lm_directory(tmp_path):
    with pytest.raises(ValueError, match="GGUF files only"):
        load(tmp_path, dtype="float32")


def test_doctor_says_which_blas_mlx_uses():
    from mlx_knorm import doctor

    environment = doctor.environment(mx.cpu)
    assert environment["blas"] == blas.blas_in_use()
    text = doctor.markdown({"environment": environment, "checks": [], "ok": True})
    assert f"- BLAS of MLX's CPU matmuls: {blas.blas_line()}\n" in text


def test_load_makes_an_mlx_lm_models_weights_float32_on_a_cpu_with_a_fast_blas(tmp_path, monkeypatch, capsys):
    from mlx_knorm.models import convert

    tiny = write_model(tmp_path / "tiny.gguf", "llama", Q.Q8_0)
    out = convert(tiny.path, tmp_path / "mlx")  # 8-bit affine layers, as stored
    tokens = mx.array([[3, 17, 42, 5, 9]])
    _fast(monkeypatch, False)
    stored, _ = load(out)
    assert hasattr(_up_proj(stored), "scales")
    _fast(monkeypatch, True)
    model, _ = load(out)
    assert not hasattr(_up_proj(model), "scales") and _up_proj(model).weight.dtype == mx.float32
    assert "weights made float32 for the CPU's BLAS" in capsys.readouterr().err
    # The dequantized weights compute what the quantized layers compute, up to the rounding of the
    # stored model's float16 scales and activations.
    assert mx.allclose(model(tokens), stored(tokens), atol=1e-2, rtol=1e-2).item()
    assert hasattr(_up_proj(load(out, dtype="stored")[0]), "scales")
    assert hasattr(_up_proj(load(out, lazy=True)[0]), "scales")
    _fast(monkeypatch, True, memory=loader.model_float32_bytes(stored))  # more than half of it
    assert hasattr(_up_proj(load(out)[0]), "scales")


def _slow_cpu(monkeypatch, setting: str) -> None:
    monkeypatch.setattr(blas, "blas_in_use", lambda: {"name": "reference BLAS", "path": "/x", "fast": False,
                                                      "preloaded": False})
    monkeypatch.setattr(blas, "_on_cpu", lambda: True)
    monkeypatch.setattr(blas, "_hinted", False)
    monkeypatch.delenv(blas.REEXEC_ENV, raising=False)
    monkeypatch.setenv(blas.OPT_ENV, setting)


def test_a_named_path_is_resolved_so_ld_preload_can_hold_it(tmp_path, monkeypatch, capsys):
    # LD_PRELOAD splits at spaces and colons: a link in a directory with a space is preloaded by its target.
    bundled = os.path.realpath(_bundled_blas())
    spaced = tmp_path / "my libs"
    spaced.mkdir()
    (spaced / "libblas.so").symlink_to(bundled)
    _slow_cpu(monkeypatch, str(spaced / "libblas.so"))
    assert blas.preload_plan() == bundled
    assert capsys.readouterr().err == ""


def test_a_named_library_that_cannot_be_preloaded_says_so_once_and_no_hint(tmp_path, monkeypatch, capsys):
    import shutil

    spaced = tmp_path / "my libs"
    spaced.mkdir()
    shutil.copy(_bundled_blas(), spaced / "libblas.so")
    for setting, problem in ((str(spaced / "libblas.so"), "space or colon"),
                             (str(tmp_path / "missing.so"), "not a shared library")):
        _slow_cpu(monkeypatch, setting)
        assert blas.preload_plan() is None
        blas.hint_once()  # as load's dtype='auto' calls it later in the process
        err = capsys.readouterr().err
        assert err.count(blas.OPT_ENV + "=" + setting) == 1 and problem in err
        assert blas.INSTALL_HINT not in err


@pytest.mark.parametrize("dtype", ["AUTO", 123, "float32"])
def test_load_names_a_dtype_an_mlx_lm_model_cannot_take(dtype):
    from mlx_knorm.quality import MODEL_DIR

    with pytest.raises(ValueError, match=f"dtype must be 'auto', 'stored' or None for an mlx-lm model, got {dtype!r}"):
        load(str(MODEL_DIR), dtype=dtype)
    with pytest.raises(ValueError, match="requantize applies to GGUF files only"):
        load(str(MODEL_DIR), requantize=(4, 64))


def _worker_weights_are_float32(model, _tokenizer, _task, _bar) -> bool:
    return loader.all_float32(model)


def test_workers_take_the_weights_their_parent_took(tmp_path, monkeypatch):
    # A worker's own dtype='auto' could come out otherwise (another memory reading; here its BLAS is the
    # reference one): it follows the parent's, so every process of a --jobs run has the same weights.
    from tqdm import tqdm

    from mlx_knorm.quality.workers import ModelSpec, map_tasks

    tiny = write_model(tmp_path / "tiny.gguf", "llama", Q.Q8_0)
    _fast(monkeypatch, True)
    model, tokenizer = load(tiny.path)
    assert loader.all_float32(model)
    with tqdm(disable=True) as bar:
        out = map_tasks(_worker_weights_are_float32, [0, 1], jobs=2, bar=bar, model=model, tokenizer=tokenizer,
                        model_spec=ModelSpec(tiny.path, "auto"))
    assert out == [True, True]
