"""Kept sets of each eviction policy, as attention masks for a teacher-forced pass.

All policies go through the package's own selection (``protected_topk_gather``)
with a per-token score: the key norm (keep-low, keep-high), ``-position``
(sinks + recent window, i.e. StreamingLLM / mlx-lm's ``RotatingKVCache``), or
a fixed random number (random eviction).

Semantics are those of ``mlx_knorm.cache.L2NormKVCache`` decoding one token
at a time: query ``t`` attends to the ``budget`` rows kept from ``[0, t)``
plus itself, and the kept set of ``[0, t)`` is the protected top-``budget``
of that whole prefix (docs/spec.md §3; with ``recent = 0`` the selection is
path independent, so one call per prefix gives the streaming result).
"""

from __future__ import annotations

import mlx.core as mx

from .. import key_norms, protected_topk_gather
from ..cache import L2NormKVCache

POLICIES = ("keep-low", "keep-high", "window", "random")
POLICY_LABELS = {
    "keep-low": "keep-low (paper)",
    "keep-high": "keep-high (ablation)",
    "window": "sinks + recent window",
    "random": "random",
}


def stored_dtype(keys: mx.array, values: mx.array) -> mx.Dtype:
    """The dtype ``L2NormKVCache`` stores these rows in; it takes norms from the stored rows.

    Asked of the cache itself, with one row, so that the eval follows the
    cache's rule whatever it is.
    """
    cache = L2NormKVCache(budget=1, n_sink=0)
    cache.update_and_fetch(keys[None, :1, :1], values[None, :1, :1])
    return cache.keys.dtype


def policy_scores(policy: str, keys: mx.array, values: mx.array, key: mx.array) -> tuple[mx.array, str]:
    """``(scores [H, T] float32, keep)`` for ``keys [H, T, Dk]``; ``key`` seeds ``random``."""
    heads, length, _ = keys.shape
    if policy in ("keep-low", "keep-high"):
        return key_norms(keys.astype(stored_dtype(keys, values))), policy.removeprefix("keep-")
    if policy == "window":
        position = mx.arange(length, dtype=mx.float32)
        return mx.broadcast_to(-position, (heads, length)), "low"
    if policy == "random":
        return mx.random.uniform(shape=(heads, length), key=key), "low"
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def kept_mask(scores: mx.array, budget: int, n_sink: int, keep: str,
              first: int = 0, stop: int | None = None) -> mx.array:
    """Boolean ``[H, stop - first, stop]``: may query ``t`` in ``[first, stop)`` attend to key ``j``.

    One selection call covers the ``H * (stop - first)`` prefixes: row
    ``(h, t)`` holds the scores of keys ``[0, stop)`` with the future
    ``[t, stop)`` set to NaN, which the selection ranks after every number,
    so it keeps exactly what it would keep from the prefix ``[0, t)``; the
    future is then masked out and the query's own key added.
    """
    heads, length = scores.shape
    stop = length if stop is None else stop
    queries = mx.arange(first, stop)[:, None]
    positions = mx.arange(stop)[None, :]
    future = positions >= queries
    rows = heads * (stop - first)
    row_scores = mx.where(future[None], mx.array(float("nan")), scores[:, None, :stop]).reshape(rows, stop)
    # Only the indices are needed: keys/values are one-column placeholders.
    placeholder = mx.zeros((rows, stop, 1), mx.float16)
    empty = mx.zeros((rows, 0, 1), mx.float16)
    _, _, _, indices = protected_topk_gather(
        empty, empty, mx.zeros((rows, 0), mx.float32),
        placeholder, placeholder, row_scores, budget, n_sink, 0, keep,
    )
    kept = mx.put_along_axis(mx.zeros((rows, stop), mx.bool_), indices.astype(mx.int32),
                             mx.array(True), axis=1)
    return (kept.reshape(heads, stop - first, stop) & ~future) | (positions == queries)
