"""The strict MSL check (tests/msl/check.py): metal/ and the JIT sources
pass it, and each deliberately broken source that Metal would reject
(tests/cpp/broken_kernels.py, those with an "msl" expectation, and the
mutation suite of tests/msl/mutants.py) fails it with its reason, the
emulator being laxer than Metal for several; each legal change of the
mutation suite passes it."""

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
import mutants  # noqa: E402

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


def test_the_check_runs_without_the_extension():
    """From a source tree where mlx_knorm cannot be imported: one line says
    the JIT sources are not checked, and the .metal files are."""
    path = ROOT / "tests" / "msl" / "check.py"
    # As `python tests/msl/check.py` runs it (its folder first on the path).
    script = (f"import runpy, sys; sys.modules['mlx_knorm'] = None; sys.argv = ['check.py']; "
              f"sys.path.insert(0, {str(path.parent)!r}); runpy.run_path({str(path)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("strict MSL check: JIT sources not checked (the JIT sources need mlx_knorm's "
                               "extension:"), run.stdout
    units = len(list((ROOT / "metal").glob("*.metal")))
    assert lines[1:] == [f"strict MSL check: {units} translation units x 2 modes, 0 findings"], run.stdout


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


def test_the_mutation_suite_covers_each_rule():
    """At least 25 MSL-illegal mutants of the real sources, each named with
    its rule, among them every class the check models."""
    names = [m.name for m in mutants.MUTANTS] + [k.name for k in MSL_BROKEN]
    assert len(names) == len(set(names)) >= 25
    assert all(m.rule and m.expect for m in mutants.MUTANTS)
    rules = " ".join(m.rule for m in mutants.MUTANTS)
    for rule in ("no double", "no long double", "no long long", "conversion to bfloat", "buffer indices are 0-30",
                 "one buffer index", "[[thread_index_in_simdgroup]]", "[[threads_per_simdgroup]]", "one width",
                 "threadgroup barrier in thread-dependent", "no virtual", "no exceptions", "no new or delete",
                 "no thread_local", "read-only", "is initialized", "standard library", "Metal 4.1"):
        assert rule in rules, rule


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_mutant_fails_the_check(mutant):
    findings = msl_check.check(sources=BROKEN.broken_sources(mutant))
    text = "\n".join(map(str, findings))
    for expected in mutant.expect:
        assert expected in text, f"{mutant.name} ({mutant.rule}): {expected!r} not in\n{text}"


@pytest.mark.parametrize("control", mutants.CONTROLS, ids=lambda c: c.name)
def test_legal_change_passes_the_check(control):
    findings = msl_check.check(sources=BROKEN.broken_sources(control))
    assert findings == [], f"{control.name} ({control.why}):\n" + "\n".join(map(str, findings))
