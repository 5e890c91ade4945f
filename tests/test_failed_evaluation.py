"""A failure while the graph is evaluated (not built) leaves the cache
unchanged and usable (docs/spec.md §8 "A failed evaluation").

Two honest failures, each in a subprocess under a lowered address-space
limit, mid-stream: the Metal emulator cannot start a threadgroup's threads
(on a decode step that runs in place on donated buffers), and the CPU
kernel cannot allocate the larger buffers of a growing step. Evaluation
raises; the limit is lifted; evaluating the same arrays again gives what a
cache that never failed gives, and so does every later step, bit for bit;
decode steps run in place again. (The fallback has no failure to simulate:
MLX 0.32's own ops crash when an allocation fails.)

The subprocess bounds each case: a hang or a crash fails the test instead
of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import requires_emulator
from mlx_knorm import _native

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
    pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded"),
]

TIMEOUT_S = 300

# Runs the same blocks through a cache whose evaluation fails once (at
# FAIL_AT, under the limit) and a reference cache; prints one JSON line.
SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import mlx.core as mx, numpy as np
    import mlx_knorm
    from mlx_knorm.cache import L2NormKVCache

    backend, layout, fail_at, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    blocks = [int(n) for n in sys.argv[5].split(",")]
    mx.set_default_device(mx.cpu)
    if backend == "metal-emulator":
        # Threads started for each dispatch alone: a kept pool would have
        # them all from the steps before the limit.
        mlx_knorm._native.ext._emulator_debug(fresh_threads=True)

    def address(a):
        return np.asarray(a).__array_interface__["data"][0]

    def raw(arrays):
        return [bytes(np.array(a.reshape(-1).view(mx.uint8))) for a in arrays]

    report = {"raised": None, "same": [], "in_place_after": None}
    with mlx_knorm.use_backend(backend):
        cache, reference = (L2NormKVCache(budget=40, n_sink=2, recent=1, layout=layout) for _ in range(2))
        for step, rows in enumerate(blocks):
            kv = mx.random.normal((1, 4, rows, 64), key=mx.random.key(step)).astype(mx.float16)
            mx.eval(kv)
            want = reference.update_and_fetch(kv, kv)
            mx.eval(want)
            before = address(cache.keys) if cache.keys is not None else None
            got = cache.update_and_fetch(kv, kv)
            if step == fail_at:
                soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                with open("/proc/self/status") as status:
                    used = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (used + headroom, hard))
                try:
                    mx.eval(got)
                except RuntimeError as err:
                    report["raised"] = str(err)
                finally:
                    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            # After a failure: the same arrays, evaluated again, values first
            # (MLX then runs the step for the values output, a sibling whose
            # inputs the failed evaluation lent out).
            mx.eval(got[::-1])
            if step == fail_at + 2:
                # The step after the retried one runs in place again.
                report["in_place_after"] = address(cache.keys) == before
            same = raw(got) == raw(want) and raw(cache.state[:4]) == raw(reference.state[:4])
            report["same"].append(same and cache.state[4:] == reference.state[4:])
    print(json.dumps(report))
    """
)


def run_case(backend: str, layout: str, fail_at: int, headroom: int, blocks: list[int]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend, layout, str(fail_at), str(headroom), ",".join(map(str, blocks))],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Prefill 30, then decode to the budget of 40 and past it: the buffers hold
# 41 slots from the start, so every decode step runs in place.
DECODE = [30] + [1] * 16


@requires_emulator
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_emulator_threads_that_cannot_start_mid_decode(layout):
    """The step at 13 runs in place on donated buffers: the failed dispatch
    wrote nothing, so the retry reads the rows as they were (into fresh
    buffers: the failed outputs still share the donated ones), and the step
    after it runs in place again."""
    report = run_case("metal-emulator", layout, fail_at=13, headroom=64 << 20, blocks=DECODE)
    assert report["raised"] is not None and "metal emulator" in report["raised"], report
    assert "threads" in report["raised"], report
    assert report["same"] == [True] * len(DECODE), report
    assert report["in_place_after"] is True, report


@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_kernel_allocation_that_fails_mid_stream(layout):
    """A block of 3000 rows makes the step allocate larger buffers (1.5 MiB
    of keys) under a limit 1 MiB above what the process uses: the kernel's
    allocation raises instead of writing through a null pointer."""
    blocks = [30, 1, 1, 3000] + [1] * 6
    report = run_case("kernel", layout, fail_at=3, headroom=1 << 20, blocks=blocks)
    assert report["raised"] is not None and "cannot allocate" in report["raised"], report
    assert report["same"] == [True] * len(blocks), report
