"""Shared test setup: device choice, hypothesis profiles, bitwise comparison."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The macOS workflow runs the suite with the GPU as default device.
if os.environ.get("MLX_KNORM_TEST_DEVICE") == "gpu":
    mx.set_default_device(mx.gpu)

# The suite's numbers do not depend on which BLAS this machine has: the fast CPU path is off (no
# re-execution of commands run as subprocesses, no hint, GGUF weights as stored, whatever LD_PRELOAD
# holds); tests/test_blas.py turns it on where it tests it.
os.environ.setdefault("MLX_KNORM_FAST_BLAS", "0")

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("MLX_KNORM_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("default")


def load_broken_kernels():
    """tests/cpp/broken_kernels.py as a module (a script, not a package)."""
    path = Path(__file__).resolve().parent / "cpp" / "broken_kernels.py"
    spec = importlib.util.spec_from_file_location("broken_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def emulator_built() -> bool:
    """The Metal emulator is built by default on non-Apple platforms."""
    from mlx_knorm import _native

    return _native.ext is not None and bool(_native.ext.has_metal_emulator)


# The native backends of this build, and with them the fallback: what the
# cross-checks run on.
NATIVE_BACKENDS = ["kernel"] + (["metal-emulator"] if emulator_built() else [])
ALL_BACKENDS = ["kernel", "fallback"] + NATIVE_BACKENDS[1:]

# The emulator runs every GPU thread as a real thread: fewer, smaller cases.
EMULATOR_SETTINGS = settings(max_examples=max(10, settings.default.max_examples // 4))
requires_emulator = pytest.mark.skipif(
    not emulator_built(), reason="the Metal emulator is not built (Apple builds run the real kernels)"
)


def assert_bitwise_equal(actual: mx.array, expected: mx.array, what: str = "") -> None:
    """Same dtype, same shape, same bytes (NaN payloads and signed zeros included)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.size:
        same = mx.array_equal(actual.reshape(-1).view(mx.uint8), expected.reshape(-1).view(mx.uint8)).item()
        assert same, f"{what}: values differ\nactual={actual}\nexpected={expected}"


def data_address(a: mx.array) -> int:
    """Where ``a``'s data lives, read through the buffer protocol without a
    copy; the numpy view is dropped at once, so ``a`` stays donatable."""
    return np.asarray(a).__array_interface__["data"][0]


@pytest.fixture
def cpu_default_device():
    """In-place updates are a property of the CPU kernel: run on the CPU even
    where the suite's default device is the GPU."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)
