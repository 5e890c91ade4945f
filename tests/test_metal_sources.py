"""The Metal sources as the JIT path compiles them (no metallib): one string
per kernel, with the shared headers of metal/ inlined, since MLX compiles
the string with no include path and hands it to Metal as ASCII."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import load_broken_kernels
from mlx_knorm import _native

ROOT = Path(__file__).resolve().parents[1]
METAL_DIR = ROOT / "metal"
KERNELS = sorted(p.stem for p in METAL_DIR.glob("*.metal"))

pytestmark = pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")


@pytest.mark.parametrize("name", KERNELS)
def test_jit_source_inlines_the_shared_headers(name):
    """Each op's instantiations (<op>.metal) include its kernels (<op>.h),
    which include knorm_kernels.h, which includes knorm_defines.h."""
    source = _native.ext.metal_kernel_source(METAL_DIR, name)
    defines = (METAL_DIR / "knorm_defines.h").read_text()
    shared = (METAL_DIR / "knorm_kernels.h").read_text().replace('#include "knorm_defines.h"', defines, 1)
    kernels = (METAL_DIR / f"{name}.h").read_text().replace('#include "knorm_kernels.h"', shared, 1)
    instances = (METAL_DIR / f"{name}.metal").read_text()
    expected = instances.replace(f'#include "{name}.h"', kernels, 1)
    # Further kernel headers (evict_and_fill's order_tree.h) follow, their
    # include of the op's kernels already inlined: an empty line.
    for extra in re.findall(r'^#include "(\w+\.h)"$', expected, flags=re.M):
        text = (METAL_DIR / extra).read_text().replace(f'#include "{name}.h"', "", 1)
        expected = expected.replace(f'#include "{extra}"', text, 1)
    assert source == expected
    assert '#include "' not in source
    assert source.isascii()


def test_jit_source_inlines_a_header_once(tmp_path):
    """A header reached twice is inlined at its first include, as its guard
    would have it."""
    shutil.copy(METAL_DIR / "knorm_defines.h", tmp_path)
    (tmp_path / "extra.h").write_text('#include "knorm_defines.h"\nint extra;\n')
    (tmp_path / "k.metal").write_text('#include "knorm_defines.h"\n#include "extra.h"\nint k;\n')
    source = _native.ext.metal_kernel_source(tmp_path, "k")
    defines = (METAL_DIR / "knorm_defines.h").read_text()
    assert source == defines + "\n" + "\nint extra;\n\n" + "int k;\n"


def test_jit_source_needs_the_installed_headers(tmp_path):
    shutil.copy(METAL_DIR / "key_norms.metal", tmp_path)
    with pytest.raises(RuntimeError, match="key_norms.h"):
        _native.ext.metal_kernel_source(tmp_path, "key_norms")
    shutil.copy(METAL_DIR / "key_norms.h", tmp_path)
    with pytest.raises(RuntimeError, match="knorm_kernels.h"):
        _native.ext.metal_kernel_source(tmp_path, "key_norms")
    shutil.copy(METAL_DIR / "knorm_kernels.h", tmp_path)
    with pytest.raises(RuntimeError, match="knorm_defines.h"):
        _native.ext.metal_kernel_source(tmp_path, "key_norms")


def test_jit_source_must_reach_the_shared_defines(tmp_path):
    (tmp_path / "k.metal").write_text("int k;\n")
    with pytest.raises(RuntimeError, match="does not include knorm_defines.h"):
        _native.ext.metal_kernel_source(tmp_path, "k")


def test_build_installs_every_kernel_source_and_the_header():
    """CMake compiles the metallib from and installs for the JIT path the
    files of metal/ it lists; a file missing there fails only on a Mac."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for path in [*METAL_DIR.glob("*.metal"), *METAL_DIR.glob("*.h")]:
        assert "${PROJECT_SOURCE_DIR}/metal/" + path.name in cmake, path.name


BROKEN_KERNELS = load_broken_kernels()


@pytest.mark.parametrize("kernel", BROKEN_KERNELS.BROKEN_KERNELS, ids=lambda k: k.name)
def test_broken_kernel_edits_apply_to_the_sources(kernel):
    """.ci/sanitize's broken kernels are edits of metal/ that must each
    still apply exactly once, and change what they edit."""
    broken = BROKEN_KERNELS.broken_sources(kernel)
    for name, source in broken.items():
        assert source != (METAL_DIR / name).read_text()


def test_broken_kernel_edit_must_match_once(tmp_path):
    kernel = BROKEN_KERNELS.BROKEN_KERNELS[0]
    for name, _, _ in kernel.edits:
        (tmp_path / name).write_text("")
    with pytest.raises(ValueError, match="occurs 0 times"):
        BROKEN_KERNELS.broken_sources(kernel, tmp_path)
