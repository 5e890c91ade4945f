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

from ..ops import key_norms, protected_topk_gather

POLICIES = ("keep-low", "keep-high", "window", "random")


def policy_scores(policy: str, keys: mx.array, key: mx.array) -> tuple[mx.array, str]:
    """``(scores [H, T] float32, keep)`` for ``keys [H, T, D]``; ``key`` seeds ``random``."""
    heads, length, _ = keys.shape
    if policy in ("keep-low", "keep-high"):
        # The cache stores float16 rows and takes norms from them.
        return key_norms(keys.astype(mx.float16)), policy.removeprefix("keep-")
    if policy == "window":
        position = mx.arange(length, dtype=mx.float32)
        return mx.broadcast_to(-position, (heads, length)), "low"
    if policy == "random":
        return mx.random.uniform(shape=(heads, length), key=key), "low"
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")


def kept_mask(scores: mx.array, budget: int, n_sink: int, keep: str) -> mx.array:
    """Boolean ``[H, T, T]``: may query ``t`` attend to key ``j`` under this cache.

    One selection call covers all ``H * T`` prefixes: row ``(h, t)`` holds the
    scores of the whole sequence with the future ``[t, T)`` set to NaN, which
    the selection ranks after every number, so it keeps exactly what it would
    keep from the prefix ``[0, t)``; the future is then masked out and the
    query's own key added.
    """
    heads, length = scores.shape
    rows = heads * length
    position = mx.arange(length)
    future = position[None, :] >= position[:, None]
    row_scores = mx.where(future[None], mx.array(float("nan")), scores[:, None, :]).reshape(rows, length)
    # Only the indices are needed: keys/values are one-column placeholders.
    placeholder = mx.zeros((rows, length, 1), mx.float16)
    empty = mx.zeros((rows, 0, 1), mx.float16)
    _, _, _, indices = protected_topk_gather(
        empty, empty, mx.zeros((rows, 0), mx.float32),
        placeholder, placeholder, row_scores, budget, n_sink, 0, keep,
    )
    kept = mx.put_along_axis(mx.zeros((rows, length), mx.bool_), indices.astype(mx.int32),
                             mx.array(True), axis=1)
    return (kept.reshape(heads, length, length) & ~future) | mx.eye(length, dtype=mx.bool_)
