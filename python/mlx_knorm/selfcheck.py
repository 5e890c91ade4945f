"""Kernel-vs-fallback check on one decode case, run by ``python -m mlx_knorm``."""

from __future__ import annotations

import mlx.core as mx

from . import fallback
from .backend import use_backend
from .knorm import knorm_update_batched


def decode_case(n_rows=32, dim=128, budget=512, dtype=mx.float16, seed=0):
    """A full cache of ``budget`` rows per head plus one new token."""
    keys_prior, values_prior, keys_new, values_new = (
        mx.random.normal(shape, key=k).astype(dtype)
        for shape, k in zip(
            [(n_rows, budget, dim)] * 2 + [(n_rows, 1, dim)] * 2,
            mx.random.split(mx.random.key(seed), 4),
        )
    )
    return keys_prior, values_prior, fallback.key_norms(keys_prior), keys_new, values_new


def kernel_matches_fallback(case, budget=512, n_sink=4, recent=0, keep="low", backend="kernel"):
    """True when ``backend`` and the fallback agree bit for bit on all four outputs."""
    results = []
    for name in (backend, "fallback"):
        with use_backend(name):
            out = knorm_update_batched(*case, budget, n_sink, recent, keep, return_indices=True)
            mx.eval(out)
            results.append(out)
    return all(
        a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a.view(mx.uint8), b.view(mx.uint8)).item()
        for a, b in zip(*results)
    )
