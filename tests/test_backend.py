"""Backend choice, reporting, and behaviour without the extension."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_knorm
from mlx_knorm import _native, backend


def test_context_manager_restores_and_plain_call_sets():
    assert mlx_knorm.current_backend() == "auto"
    with mlx_knorm.use_backend("fallback"):
        assert mlx_knorm.current_backend() == "fallback"
        with mlx_knorm.use_backend("kernel"):
            assert mlx_knorm.current_backend() == "kernel"
        assert mlx_knorm.current_backend() == "fallback"
    assert mlx_knorm.current_backend() == "auto"
    token = mlx_knorm.use_backend("fallback")
    try:
        assert mlx_knorm.current_backend() == "fallback"
    finally:
        token.__exit__(None, None, None)
    assert mlx_knorm.current_backend() == "auto"


def test_unknown_backend_names_raise():
    with pytest.raises(ValueError, match="backend name must be one of"):
        mlx_knorm.use_backend("cuda")


def test_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv("MLX_KNORM_BACKEND", "fallback")
    assert mlx_knorm.current_backend() == "fallback"
    assert backend.resolve(None) == "fallback"
    monkeypatch.setenv("MLX_KNORM_BACKEND", "fast")
    with pytest.raises(ValueError, match="MLX_KNORM_BACKEND must be one of"):
        mlx_knorm.key_norms(mx.ones((2, 2)))


def test_environment_is_read_on_every_call(monkeypatch):
    # Set, changed and removed after the first read; and through a plain
    # mapping put in place of os.environ, which the fast read steps around.
    monkeypatch.delenv("MLX_KNORM_BACKEND", raising=False)
    assert mlx_knorm.current_backend() == "auto"
    monkeypatch.setenv("MLX_KNORM_BACKEND", "fallback")
    assert mlx_knorm.current_backend() == "fallback"
    monkeypatch.setenv("MLX_KNORM_BACKEND", "auto")
    assert mlx_knorm.current_backend() == "auto"
    monkeypatch.delenv("MLX_KNORM_BACKEND")
    assert mlx_knorm.current_backend() == "auto"
    monkeypatch.setattr(os, "environ", {"MLX_KNORM_BACKEND": "fallback"})
    assert mlx_knorm.current_backend() == "fallback"
    assert backend.resolve(mx.cpu) == "fallback"
    os.environ["MLX_KNORM_BACKEND"] = "fast"
    with pytest.raises(ValueError, match="MLX_KNORM_BACKEND must be one of"):
        mlx_knorm.current_backend()
    del os.environ["MLX_KNORM_BACKEND"]
    assert mlx_knorm.current_backend() == "auto"


def test_auto_uses_the_cpu_kernel_when_loaded():
    assert mlx_knorm.native_available() is (_native.ext is not None)
    expected = "kernel" if mlx_knorm.native_available() else "fallback"
    assert backend.resolve(mx.cpu) == expected
    assert backend.resolve(mx.default_stream(mx.cpu)) == expected


def test_backend_info_reports_versions_and_devices():
    info = mlx_knorm.backend_info()
    assert info["mlx_version_running"] == mx.__version__
    assert info["extension_loaded"] == mlx_knorm.native_available()
    if info["extension_loaded"]:
        assert info["mlx_version_built"] == mx.__version__ and info["extension_error"] is None
    assert set(info["kernels"]) == {"cpu", "gpu", "metal-emulator"}
    library = info["metal_kernel_library"]
    if info["extension_loaded"] and _native.ext.has_metal_kernels:
        assert library["kind"] in ("metallib", "jit")
        name = "mlx_knorm.metallib" if library["kind"] == "metallib" else "metal"
        assert Path(library["path"]).name == name and Path(library["path"]).exists()
    else:
        assert library is None
    json.dumps(info)


def test_kernel_without_extension_raises_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(_native, "ext", None)
    monkeypatch.setattr(_native, "load_error", "simulated")
    assert backend.resolve(mx.cpu) == "fallback"
    with pytest.raises(RuntimeError, match="needs the native extension.*simulated"):
        mlx_knorm.use_backend("kernel")
    assert mlx_knorm.key_norms(mx.array([[3.0, 4.0]])).tolist() == [5.0]


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_without_extension_warns_once_and_works():
    code = (
        "import sys; sys.modules['mlx_knorm._ext'] = None\n"
        "import mlx.core as mx, mlx_knorm\n"
        "assert not mlx_knorm.native_available()\n"
        "print(mlx_knorm.backend_info()['extension_error'])\n"
        "print(mlx_knorm.key_norms(mx.array([[3.0, 4.0]])).tolist())\n"
        "try:\n    mlx_knorm.use_backend('kernel')\nexcept RuntimeError as e:\n    print('RuntimeError', e)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("native kernels unavailable") == 1
    assert "extension not importable" in result.stdout
    assert "[5.0]" in result.stdout and "RuntimeError" in result.stdout


@pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")
def test_extension_built_for_another_mlx_is_refused():
    code = (
        "import mlx.core as mx; mx.__version__ = '0.0.1'\n"
        "import mlx_knorm\n"
        "print(mlx_knorm.native_available(), mlx_knorm.backend_info()['extension_error'])\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert f"False extension built against MLX {mx.__version__}, running MLX 0.0.1" in result.stdout
