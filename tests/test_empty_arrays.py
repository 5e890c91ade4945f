"""Calls where some arrays have no elements: empty priors, S = 0, D = 0.

MLX gives an array without elements no Metal buffer, so the launch plans
mark such arrays and eval_gpu binds a placeholder in their place
(common/launch_plan.h); the emulator refuses a plan that binds one as a
buffer (metal_emulator/run_plan.cpp), so on the ``metal-emulator`` backend
these cases check the plans, and with ``kernel`` on the GPU (the macOS
workflow, under Metal API validation) the real dispatch. Every native backend
must agree with the fallback bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from conftest import NATIVE_BACKENDS, assert_bitwise_equal
from generators import evict_and_fill_arrays, key_norms_arrays, protected_topk_gather_arrays


def on_backends(backend, op, *args, **kwargs):
    """``op`` on ``backend`` and on the fallback, evaluated."""
    results = []
    for name in (backend, "fallback"):
        with mlx_knorm.use_backend(name):
            out = op(*args, **kwargs)
            mx.eval(out)
            results.append(out if isinstance(out, (tuple, list)) else [out])
    return results


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("shape", [(2, 3, 0), (4, 0), (0, 8), (2, 0, 5)])
def test_key_norms(backend, shape):
    (keys,) = key_norms_arrays(np.random.default_rng(0), shape, palette="special", dtype="bfloat16")
    (native,), (fallback,) = on_backends(backend, mlx_knorm.key_norms, keys)
    assert_bitwise_equal(native, fallback, f"keys {shape}")


PROTECTED_TOPK_GATHER_CASES = {
    # name: (n_prior, n_new, key_dim, value_dim, budget)
    "empty prior": (0, 7, 3, 5, 4),
    "empty prior, all kept": (0, 3, 3, 5, 8),
    "S = 0": (9, 0, 3, 5, 4),
    "S = 0, all kept": (3, 0, 3, 5, 8),
    "no rows": (0, 0, 3, 5, 4),
    "D_k = 0": (9, 4, 0, 5, 6),
    "D_v = 0": (9, 4, 3, 0, 6),
    "D_k = D_v = 0, empty prior": (0, 9, 0, 0, 6),
    # More than 128 rows kept a head: the Metal plans split the row copies
    # over many threadgroups (an empty buffer is its input's, as if donated).
    "D_k = 0, kept past a block": (200, 4, 0, 5, 200),
    "D_v = 0, kept past a block": (200, 4, 3, 0, 200),
}


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("case", PROTECTED_TOPK_GATHER_CASES)
def test_protected_topk_gather(backend, case):
    n_prior, n_new, key_dim, value_dim, budget = PROTECTED_TOPK_GATHER_CASES[case]
    args = protected_topk_gather_arrays(np.random.default_rng(n_prior * 7 + n_new), 2, n_prior, n_new, key_dim,
                                        value_dim, key_palette="special", norm_palette="ties",
                                        dtypes=("float16", "float32"))
    native, fallback = on_backends(backend, mlx_knorm.protected_topk_gather, *args, budget, 1, 1, "low")
    for name, a, b in zip(("keys", "values", "norms", "indices"), native, fallback):
        assert_bitwise_equal(a, b, f"{case}: {name}")


EVICT_AND_FILL_CASES = {
    # name: (slots, filled, n_new, key_dim, value_dim, budget)
    "S = 0": (10, 10, 0, 4, 3, 6),
    "S = 0, nothing leaves": (10, 5, 0, 4, 3, 6),
    "empty cache": (6, 0, 4, 4, 3, 6),
    "no slots": (0, 0, 0, 4, 3, 6),
    "D_k = 0": (10, 10, 2, 0, 3, 6),
    "D_v = 0": (10, 10, 2, 4, 0, 6),
    "D_k = D_v = 0, S = 0": (10, 10, 0, 0, 0, 6),
    "D_v = 0, many leave past a block": (400, 400, 2, 4, 0, 200),
    "D_k = 0, one leaves past a block": (201, 201, 1, 0, 3, 200),
}


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("case", EVICT_AND_FILL_CASES)
def test_evict_and_fill(backend, case):
    slots, filled, n_new, key_dim, value_dim, budget = EVICT_AND_FILL_CASES[case]
    args = evict_and_fill_arrays(np.random.default_rng(slots * 5 + n_new), 2, slots, n_new, key_dim, value_dim,
                                 key_palette="special", norm_palette="ties", dtypes=("float16", "bfloat16"))
    kept = min(filled, budget)
    config = dict(filled=filled, offset=slots, capacity=kept + n_new, budget=budget,
                  n_sink=1, recent=1, keep="low")
    for layout in ("slots", "temporal"):
        native, fallback = on_backends(backend, mlx_knorm.evict_and_fill, *args, **config, layout=layout)
        for name, a, b in zip(("keys", "values", "norms", "positions"), native, fallback):
            assert_bitwise_equal(a, b, f"{case}, {layout}: {name}")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_no_heads_with_rows_past_a_block(backend):
    """N = 0 with more than 128 rows a head: no plan splits rows it does
    not have (nor asks for scratch memory for them)."""
    rng = np.random.default_rng(0)
    gather = [a[:0] for a in protected_topk_gather_arrays(rng, 1, 300, 4, 3, 5)]
    native, fallback = on_backends(backend, mlx_knorm.protected_topk_gather, *gather, 200, 1, 1, "low")
    for name, a, b in zip(("keys", "values", "norms", "indices"), native, fallback):
        assert_bitwise_equal(a, b, f"gather: {name}")
    args = [a[:0] for a in evict_and_fill_arrays(rng, 1, 400, 2, 4, 3)]
    for filled in (400, 201):
        config = dict(filled=filled, offset=400, capacity=202, budget=200, n_sink=1, recent=1, keep="low")
        for layout in ("slots", "temporal"):
            native, fallback = on_backends(backend, mlx_knorm.evict_and_fill, *args, **config, layout=layout)
            for name, a, b in zip(("keys", "values", "norms", "positions"), native, fallback):
                assert_bitwise_equal(a, b, f"filled {filled}, {layout}: {name}")
