"""A forked child of a process whose large CPU calls started the row workers
(csrc/common/parallel.h), or whose emulated kernels started the emulator's
threads (csrc/metal_emulator/thread_pool.h), exits, and makes such calls of
its own.

The child inherits the pools but none of their threads: waiting for them (a
call that hands them work, or joining them at exit) would hang. Each case
runs in a subprocess bounded by a timeout, so a hang fails the test instead
of stalling the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import requires_emulator
from mlx_knorm import _native

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
    pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded"),
]

CHILD_TIMEOUT_S = 60

# 4096 rows of 2048 float32 keys: 32 MiB, four times parallel_for's 8 MiB per
# thread, so the rows are split over the workers on any machine of 2+ cores.
SCRIPT = textwrap.dedent(
    f"""
    import os, sys, time
    import mlx.core as mx
    import mlx_knorm

    mx.set_default_device(mx.cpu)
    backend = sys.argv[2]
    # Large enough to start the row workers; the emulator's threads start
    # on any size.
    shape = (4096, 2048) if backend == "kernel" else (8, 64)
    keys = mx.random.normal(shape, key=mx.random.key(0))
    with mlx_knorm.use_backend(backend):
        mx.eval(mlx_knorm.key_norms(keys))

    pid = os.fork()
    if pid == 0:
        code = 0
        if sys.argv[1] == "call":
            # MLX's default CPU stream runs on a thread the child lacks too.
            with mx.stream(mx.new_stream(mx.cpu)):
                with mlx_knorm.use_backend(backend):
                    got = mlx_knorm.key_norms(keys * 2)
                with mlx_knorm.use_backend("fallback"):
                    want = mlx_knorm.key_norms(keys * 2)
                code = 0 if mx.array_equal(got, want).item() else 3
        # A normal exit: the interpreter finalises and static destructors run.
        sys.exit(code)

    deadline = time.monotonic() + {CHILD_TIMEOUT_S}
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit code", os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child hung")
    """
)


@pytest.mark.parametrize("backend", [
    # With one core there are no row workers to lose.
    pytest.param("kernel", marks=pytest.mark.skipif((os.cpu_count() or 1) < 2,
                                                    reason="the row workers need two cores")),
    pytest.param("metal-emulator", marks=requires_emulator),
])
@pytest.mark.parametrize("child", ["exit", "call"])
def test_forked_child_exits_and_calls(child, backend):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, child, backend],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S + 60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "child exit code 0", result.stdout + result.stderr
