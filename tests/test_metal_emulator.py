"""Edge cases of the Metal kernels run through the emulator of the Metal
execution model; the property-based cross-checks against the fallback live
beside the kernel's own (test_key_norms.py, test_protected_topk_gather.py).

The gather kernel compacts rows in chunks of 256 (its threadgroup size) and
the norm kernel runs one 32-lane SIMD group per row, four rows per
threadgroup: the cases below cross those boundaries.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import assert_bitwise_equal, requires_emulator
from generators import fill, fill_norms
from mlx_knorm import _native

pytestmark = requires_emulator


def native_and_emulated(op, *args):
    ext = _native.ext
    return getattr(ext, op)(*args, stream=mx.cpu), getattr(ext, op)(*args, emulate_metal=True, stream=mx.cpu)


def gather_args(n_prior, n_new, budget, n_sink, recent, palette, keep="low", dim=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        fill(rng, (2, n_prior, dim), "special", "float16"),
        fill(rng, (2, n_prior, dim), "normal", "float32"),
        fill_norms(rng, (2, n_prior), palette),
        fill(rng, (2, n_new, dim), "special", "float16"),
        fill(rng, (2, n_new, dim), "normal", "float32"),
        fill_norms(rng, (2, n_new), palette),
        budget, n_sink, recent, keep,
    )


@pytest.mark.parametrize(
    "n_prior,n_new,budget,n_sink,recent",
    [
        (0, 0, 4, 1, 1),        # nothing at all
        (0, 7, 4, 1, 1),        # empty prior
        (9, 0, 4, 1, 1),        # S = 0
        (600, 40, 639, 0, 0),   # evicts one row of many chunks
        (700, 0, 300, 5, 17),   # threshold deep inside the middle
        (513, 0, 2, 1, 0),      # keeps a single middle row
        (255, 2, 256, 0, 0),    # the evicted row on a chunk boundary
    ],
)
@pytest.mark.parametrize("palette", ["ties", "special", "zeros"])
@pytest.mark.parametrize("keep", ["low", "high"])
def test_gather_edges(n_prior, n_new, budget, n_sink, recent, palette, keep):
    args = gather_args(n_prior, n_new, budget, n_sink, recent, palette, keep, seed=n_prior * 31 + budget)
    for name, a, b in zip(("keys", "values", "norms", "indices"), *native_and_emulated("protected_topk_gather", *args)):
        assert_bitwise_equal(b, a, name)


def test_all_equal_scores_keep_earliest():
    n_prior, budget = 300, 40
    args = (
        mx.zeros((1, n_prior, 4)), mx.zeros((1, n_prior, 4)), mx.ones((1, n_prior)),
        mx.zeros((1, 0, 4)), mx.zeros((1, 0, 4)), mx.zeros((1, 0)), budget, 2, 3, "high",
    )
    _, emulated = native_and_emulated("protected_topk_gather", *args)
    expected = list(range(2 + budget - 5)) + list(range(n_prior - 3, n_prior))
    assert emulated[3][0].tolist() == expected


@pytest.mark.parametrize("dim", [0, 1, 31, 32, 33, 512])
def test_key_norms_simd_boundaries(dim):
    keys = fill(np.random.default_rng(dim), (2, 3, 5, dim), "special", "bfloat16")
    native, emulated = native_and_emulated("key_norms", keys)
    assert_bitwise_equal(emulated, native, f"D={dim}")


def test_key_norms_rejects_dim_past_kernel_limit():
    with pytest.raises(ValueError, match="D <= 512"):
        _native.ext.key_norms(mx.zeros((1, 513)), emulate_metal=True, stream=mx.cpu)
