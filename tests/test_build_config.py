"""The CMake functions of cmake/knorm_metal.cmake that the Metal build
runs only on a Mac, run here on their own through `cmake -P`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "cmake" / "knorm_metal.cmake"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "check.cmake"
    script.write_text(f'include("{MODULE.as_posix()}")\n{body}\n')
    return subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("version", ["0.32.3", "0.31.2", "0.9.0", ""])
def test_metallib_build_refuses_an_older_mlx(tmp_path, version):
    result = run_script(tmp_path, f'knorm_require_metallib_mlx("{version}")')
    assert result.returncode != 0
    assert "older than 0.32.4" in result.stderr
    assert "DEPLOYMENT_TARGET" in result.stderr


@pytest.mark.parametrize("version", ["0.32.4", "0.32.10", "0.33.0", "1.0.0"])
def test_metallib_build_takes_mlx_from_the_version_with_every_argument(tmp_path, version):
    result = run_script(tmp_path, f'knorm_require_metallib_mlx("{version}")')
    assert result.returncode == 0, result.stderr


def test_the_version_check_guards_the_metallib_build():
    """CMakeLists.txt checks MLX's version right before it calls
    mlx_build_metallib with DEPLOYMENT_TARGET, which MLX's own
    extension.cmake of the pinned version takes."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    check = cmake.index('knorm_require_metallib_mlx("${MLX_VERSION}")')
    build = cmake.index("mlx_build_metallib(", check)
    assert "DEPLOYMENT_TARGET" in cmake[build:cmake.index(")", build)]
    import mlx.core

    extension = Path(mlx.core.__file__).parent / "share" / "cmake" / "MLX" / "extension.cmake"
    if extension.exists():
        assert "DEPLOYMENT_TARGET" in extension.read_text()


def test_metal_probe_includes_the_standard_library(tmp_path):
    """The probe compiles what every kernel source starts with."""
    result = run_script(tmp_path, 'message(STATUS "${KNORM_METAL_PROBE_SOURCE}")')
    assert result.returncode == 0, result.stderr
    source = result.stdout
    assert source.lstrip("- ").startswith("#include <metal_stdlib>\n")
    assert "bfloat" in source and "kernel void knorm_probe" in source


def test_jit_fallback_warns(tmp_path):
    """Building without the metallib is a CMake warning, with the probe's
    result and the compiler's first line."""
    result = run_script(tmp_path, 'knorm_warn_metal_jit("1" "error: no Metal toolchain\\nmore")')
    assert result.returncode == 0, result.stderr
    assert "CMake Warning" in result.stderr
    assert "1: error: no Metal toolchain" in result.stderr
    assert "more" not in result.stderr
    assert "compile at first use" in result.stderr
