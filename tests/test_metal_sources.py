"""The Metal sources as the JIT path compiles them (no metallib): one string
per kernel, with metal/knorm_defines.h inlined, since MLX compiles the string
with no include path and hands it to Metal as ASCII."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_knorm import _native

ROOT = Path(__file__).resolve().parents[1]
METAL_DIR = ROOT / "metal"
KERNELS = sorted(p.stem for p in METAL_DIR.glob("*.metal"))

pytestmark = pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")


@pytest.mark.parametrize("name", KERNELS)
def test_jit_source_inlines_the_shared_header(name):
    source = _native.ext.metal_kernel_source(METAL_DIR, name)
    header = (METAL_DIR / "knorm_defines.h").read_text()
    kernel = (METAL_DIR / f"{name}.metal").read_text()
    assert source == kernel.replace('#include "knorm_defines.h"', header, 1)
    assert '#include "' not in source
    assert source.isascii()


def test_jit_source_needs_the_installed_header(tmp_path):
    shutil.copy(METAL_DIR / "key_norms.metal", tmp_path)
    with pytest.raises(RuntimeError, match="knorm_defines.h"):
        _native.ext.metal_kernel_source(tmp_path, "key_norms")


def test_build_installs_every_kernel_source_and_the_header():
    """CMake compiles the metallib from and installs for the JIT path the
    files of metal/ it lists; a kernel missing there fails only on a Mac."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for path in [*METAL_DIR.glob("*.metal"), METAL_DIR / "knorm_defines.h"]:
        assert "${PROJECT_SOURCE_DIR}/metal/" + path.name in cmake, path.name
