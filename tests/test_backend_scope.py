"""Where a backend choice applies (use_backend is per thread and context), and
which stream the Metal emulator runs on."""

from __future__ import annotations

import contextvars
import threading

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from mlx_knorm import _native, backend

from conftest import assert_bitwise_equal, requires_emulator
from generators import protected_topk_gather_arrays


def in_thread(function, context: contextvars.Context | None = None):
    """``function()``'s result, run in a new thread (inside ``context`` if given)."""
    result = []
    target = (lambda: result.append(context.run(function))) if context else (lambda: result.append(function()))
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return result[0]


def test_a_plain_use_backend_call_applies_to_its_own_thread_only():
    default = mlx_knorm.current_backend()

    def choose_fallback():
        mlx_knorm.use_backend("fallback")
        return mlx_knorm.current_backend(), backend.resolve(mx.cpu)

    assert in_thread(choose_fallback) == ("fallback", "fallback")
    assert mlx_knorm.current_backend() == default

    with mlx_knorm.use_backend("fallback"):
        # A thread started now does not see this thread's choice ...
        assert in_thread(mlx_knorm.current_backend) == default
        # ... unless it runs in a copy of this thread's context.
        assert in_thread(mlx_knorm.current_backend, contextvars.copy_context()) == "fallback"


def test_the_environment_variable_reaches_every_thread(monkeypatch):
    monkeypatch.setenv("MLX_KNORM_BACKEND", "fallback")
    assert in_thread(mlx_knorm.current_backend) == "fallback"


def protected_topk_gather_inputs():
    arrays = protected_topk_gather_arrays(np.random.default_rng(1), 2, 0, 20, 8, dtypes=("float16", "float16"))
    return (*arrays, 12, 2, 0, "low")


@requires_emulator
def test_metal_emulator_runs_on_the_given_cpu_stream(monkeypatch):
    inputs = protected_topk_gather_inputs()
    keys = inputs[3]
    expected = mlx_knorm.key_norms(keys)
    expected_gather = mlx_knorm.protected_topk_gather(*inputs)
    streams = []
    for name in ("key_norms", "protected_topk_gather"):
        real = getattr(_native.ext, name)

        def spy(*args, _real=real, **kwargs):
            streams.append(kwargs["stream"])
            return _real(*args, **kwargs)

        monkeypatch.setattr(_native.ext, name, spy)
    own = mx.new_stream(mx.cpu)
    with mlx_knorm.use_backend("metal-emulator"):
        for stream in (None, mx.cpu, own):
            assert_bitwise_equal(mlx_knorm.key_norms(keys, stream=stream), expected)
            for ours, theirs in zip(mlx_knorm.protected_topk_gather(*inputs, stream=stream), expected_gather):
                assert_bitwise_equal(ours, theirs)
    # None runs on the CPU; a CPU stream or device given is used as given.
    assert streams == [mx.cpu, mx.cpu, mx.cpu, mx.cpu, own, own]


@requires_emulator
@pytest.mark.parametrize("stream", [mx.gpu, mx.Device(mx.gpu)], ids=["DeviceType", "Device"])
def test_metal_emulator_refuses_a_gpu_stream(stream):
    inputs = protected_topk_gather_inputs()
    with mlx_knorm.use_backend("metal-emulator"):
        with pytest.raises(ValueError, match="metal-emulator backend runs on the CPU; stream"):
            mlx_knorm.key_norms(inputs[3], stream=stream)
        with pytest.raises(ValueError, match="metal-emulator backend runs on the CPU; stream"):
            mlx_knorm.protected_topk_gather(*inputs, stream=stream)
