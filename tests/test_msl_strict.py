"""The strict MSL check (tests/msl/check.py): metal/ and the JIT sources
pass it, and each deliberately broken source that Metal would reject
(tests/cpp/broken_kernels.py, those with an "msl" expectation) fails it
with its reason, the emulator being laxer than Metal for several."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_broken_kernels
from mlx_knorm import _native

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "msl"))
import check as msl_check  # noqa: E402

sys.path.pop(0)


BROKEN = load_broken_kernels()
MSL_BROKEN = [k for k in BROKEN.BROKEN_KERNELS if "msl" in k.expect]


def test_metal_sources_and_jit_sources_pass():
    findings = msl_check.check(jit=msl_check.jit_sources())
    assert findings == [], "\n".join(map(str, findings))


def test_the_check_runs_as_a_command():
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "msl" / "check.py")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    units = 2 * len(list((ROOT / "metal").glob("*.metal")))
    assert f"strict MSL check: {units} translation units x 2 modes, 0 findings" in run.stdout


def test_every_mode_and_reason_has_a_broken_source():
    """The issue's list of what the check must reject, each with a broken
    source here."""
    names = {k.name for k in MSL_BROKEN}
    assert {"half_parameter", "device_as_threadgroup_pointer", "program_scope_variable_outside_constant",
            "cxx17_constructs", "recursion", "unqualified_kernel_pointer",
            "thread_reference_through_generic_this"} <= names


@pytest.mark.parametrize("kernel", MSL_BROKEN, ids=lambda k: k.name)
def test_broken_source_fails_the_check(kernel):
    findings = msl_check.check(sources=BROKEN.broken_sources(kernel))
    text = "\n".join(map(str, findings))
    for expected in kernel.expect["msl"]:
        assert expected in text, f"{kernel.name}: {expected!r} not in\n{text}"
    if kernel.name == "thread_reference_through_generic_this":
        assert {f.mode for f in findings} == {"metal4.1"}, "MSL 3 compiles it"


def test_kernel_bodies_are_checked_for_every_instantiation():
    """clang checks a template's body once per instantiation: an error that
    only an instantiation shows is found, in each kernel template."""
    source = (ROOT / "metal" / "key_norms.h").read_text()
    broken = source.replace("  const uint row = group * kKeyNormsRowsPerGroup + simd_group;",
                            "  const uint row = group * kKeyNormsRowsPerGroup + simd_group;\n"
                            "  typename T::no_such_member unused;", 1)
    assert broken != source
    findings = msl_check.check(sources={"key_norms.h": broken})
    assert any("cannot be used prior to '::'" in f.message for f in findings), findings


def test_the_jit_source_of_a_broken_kernel_fails_the_check(tmp_path):
    """The text the extension hands Metal is checked too: the half parameter
    that shipped, through metal_kernel_source."""
    kernel = next(k for k in MSL_BROKEN if k.name == "half_parameter")
    for path in (ROOT / "metal").iterdir():
        (tmp_path / path.name).write_text(path.read_text())
    for name, text in BROKEN.broken_sources(kernel).items():
        (tmp_path / name).write_text(text)
    jit = {"evict_and_fill": _native.ext.metal_kernel_source(tmp_path, "evict_and_fill")}
    findings = msl_check.check(tmp_path, jit=jit, files=False)
    assert {f.unit for f in findings} == {"evict_and_fill (JIT)"}
    assert any("invalid parameter name: '_Float16' is a keyword" in f.message for f in findings)
