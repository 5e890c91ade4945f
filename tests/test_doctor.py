"""mlx-knorm doctor: the report a user attaches to an issue, end to end on
this machine's devices (the CPU kernel and the emulator here; a Mac runs the
same code on the GPU)."""

from __future__ import annotations

import json

import mlx.core as mx

from conftest import NATIVE_BACKENDS
from mlx_knorm import current_backend, doctor
from mlx_knorm.__main__ import main


def test_doctor_checks_every_op_on_every_native_backend_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["doctor", "--device", "cpu", "--out", str(out), "--no-timings"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["ok"] and report["environment"]["device"] == "cpu"
    checks = report["checks"]
    for op in doctor.OPS:
        for backend in NATIVE_BACKENDS:
            rows = [r for r in checks if r["op"] == op and r["backend"] == backend]
            assert rows and all(r["bit_exact"] for r in rows), (op, backend)
            # Every case that donates its inputs is updated in place.
            assert all(r["in_place"] for r in rows if r["donated"]), (op, backend)
    assert {r["case"].split()[-1] for r in checks if r["op"] == "key_norms"} >= {"special", "subnormal", "ties"}
    generation = report["generation"]
    assert generation["equal_to_mlx_lm_within_budget"] and generation["bounded"]
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# mlx-knorm doctor: all good")
    assert "| evict_and_fill | kernel |" in markdown and markdown in capsys.readouterr().out


def test_doctor_reports_a_kernel_that_differs(tmp_path, monkeypatch, capsys):
    """A backend whose key norms differ in their last bit is a mismatch in
    every case of the report and a failing exit status."""
    key_norms = doctor.OPS["key_norms"]

    def last_bit_flipped(keys, *, stream=None):
        out = key_norms(keys, stream=stream)
        return out if current_backend() == "fallback" else (out.view(mx.uint32) ^ 1).view(mx.float32)

    monkeypatch.setitem(doctor.OPS, "key_norms", last_bit_flipped)
    out = tmp_path / "report"
    assert main(["doctor", "--device", "cpu", "--out", str(out), "--no-timings", "--no-generation",
                 "--ops", "key_norms"]) == 1
    report = json.loads(out.with_suffix(".json").read_text())
    assert not report["ok"]
    bad = [r for r in report["checks"] if not r["bit_exact"]]
    assert {r["op"] for r in bad} == {"key_norms"} and len(bad) == 48 * len(NATIVE_BACKENDS)
    assert "PROBLEMS FOUND" in out.with_suffix(".md").read_text()
    assert "MISMATCH key_norms" in capsys.readouterr().out


def test_doctor_refuses_an_op_it_does_not_have(capsys):
    assert main(["doctor", "--ops", "key_norms,sort"]) == 2
    assert "unknown ['sort']" in capsys.readouterr().err


def test_doctor_refuses_a_gpu_it_does_not_have(capsys):
    if mx.metal.is_available():
        return
    assert main(["doctor", "--device", "gpu"]) == 2
    assert "needs Metal" in capsys.readouterr().err
