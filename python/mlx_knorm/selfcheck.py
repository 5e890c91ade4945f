"""Kernel-vs-fallback check on one step, run by ``mlx-knorm info`` and
before every benchmark case."""

from __future__ import annotations

import mlx.core as mx

from .backend import use_backend
from .state import knorm_update_batched


def kernel_matches_fallback(inputs, budget=512, n_sink=4, recent=0, keep="low", backend="kernel"):
    """True when ``backend`` and the fallback agree bit for bit on all four
    outputs of ``knorm_update_batched(*inputs, ...)``; ``inputs`` are
    ``(prior_keys, prior_values, prior_norms, new_keys, new_values)``."""
    results = []
    for name in (backend, "fallback"):
        with use_backend(name):
            out = knorm_update_batched(*inputs, budget, n_sink, recent, keep, return_indices=True)
            mx.eval(out)
            results.append(out)
    return all(
        a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a.view(mx.uint8), b.view(mx.uint8)).item()
        for a, b in zip(*results)
    )
