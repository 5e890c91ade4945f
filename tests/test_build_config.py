"""What only a Mac builds or runs, checked here: the CMake functions of
cmake/knorm_metal.cmake, run on their own through `cmake -P`, and as text
the Metal build's branches, eval_gpu's encoding and the macOS workflow."""

from __future__ import annotations

import shutil
import subprocess
import sys
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


def test_the_version_check_reads_the_version_find_package_sets(tmp_path):
    """MLX_VERSION, which CMakeLists.txt hands to knorm_require_metallib_mlx,
    is what find_package(MLX) sets from the installed MLX's package version
    file: the version of the MLX that Python imports."""
    import mlx.core as mx

    cmake_dir = subprocess.run([sys.executable, "-m", "mlx", "--cmake-dir"], capture_output=True,
                               text=True, check=True, timeout=60).stdout.strip()
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\nproject(probe LANGUAGES NONE)\n"
        'find_package(MLX CONFIG REQUIRED PATHS "${MLX_ROOT}" NO_DEFAULT_PATH)\n'
        'message(STATUS "MLX_VERSION=${MLX_VERSION}")\n')
    result = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build"), f"-DMLX_ROOT={cmake_dir}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"-- MLX_VERSION={mx.__version__}\n" in result.stdout


def test_the_jit_fallback_warning_is_the_failed_probe_branch():
    """The warning is what a failed probe leads to, not a STATUS line."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    probe = cmake.index('if(KNORM_METAL_PROBE_RESULT STREQUAL "0")')
    otherwise = cmake.index("else()", probe)
    end = cmake.index("endif()", otherwise)
    assert "mlx_build_metallib(" in cmake[probe:otherwise]
    assert cmake[otherwise:end].split() == [
        "else()", 'knorm_warn_metal_jit("${KNORM_METAL_PROBE_RESULT}"', '"${KNORM_METAL_PROBE_ERROR}")']


def test_gpu_dispatch_checks_pipelines_and_separates_dispatches():
    """eval_gpu's encoding (csrc/common/metal_dispatch.cpp), which only a Mac
    compiles: every pipeline of an evaluation goes through check_pipeline
    with its threadExecutionWidth before the command encoder is touched, and
    every dispatch after the first follows an explicit encoder barrier."""
    source = (ROOT / "csrc" / "common" / "metal_dispatch.cpp").read_text()
    body = source[source.index("const LaunchPlans& plans,"):]
    check = body.index("check_pipeline(plans[i], {kernels[i]->maxTotalThreadsPerThreadgroup(),")
    assert "kernels[i]->threadExecutionWidth()});" in body[check:check + 200]
    encoder = body.index("mx::metal::get_command_encoder(s)")
    assert check < encoder
    loop = body[encoder:]
    code = "\n".join(line.split("//")[0].strip() for line in loop.splitlines() if line.split("//")[0].strip())
    assert code.count("encoder.dispatch_threadgroups(") == 1
    assert ("if (plan.groups == 0) {\ncontinue;\n}\n"
            "if (encoded) {\nencoder.barrier();\n}\n"
            "encoder.set_compute_pipeline_state(kernels[i]);") in code
    assert code.index("encoder.barrier();") < code.index("encoder.dispatch_threadgroups(") < code.index("encoded = true;")


KERNEL_TEST_FILES = {"tests/test_key_norms.py", "tests/test_protected_topk_gather.py", "tests/test_evict_and_fill.py",
                     "tests/test_in_place.py", "tests/test_empty_arrays.py"}


def test_macos_workflow_runs_the_kernel_tests_with_shader_validation():
    """The macOS job runs the kernels' tests once more on the GPU with
    Metal shader validation on, and every file it names exists."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "macos.yml").read_text())
    steps = workflow["jobs"]["metal"]["steps"]
    validated = [s for s in steps if s.get("env", {}).get("MTL_SHADER_VALIDATION") == "1"]
    assert len(validated) == 1, validated
    step = validated[0]
    assert step["env"]["MLX_KNORM_TEST_DEVICE"] == "gpu"
    command = step["run"].split()
    assert command[:4] == ["python", "-m", "pytest", "-q"]
    assert set(command[4:]) == KERNEL_TEST_FILES
    assert all((ROOT / name).is_file() for name in KERNEL_TEST_FILES)
    build = next(i for i, s in enumerate(steps) if s.get("name") == "Build")
    assert steps.index(step) > build
