"""Pure-MLX implementation of both ops, bit-identical to the native kernels.

Built from MLX ops only, so it runs on any device MLX supports. It follows
SPEC sections 2 and 3 literally: the norm is reduced in the pinned halving
order (never ``mx.sum``, whose order differs between devices), and the
selection ranks unique (score, index) keys, so any correct partition
algorithm picks exactly the rows the kernels pick.
"""

from __future__ import annotations

import mlx.core as mx

_SIGN = 0x80000000
_NAN_KEY = 0xFFFFFFFF
_SMALLEST_NORMAL = 2.0**-126
_CANONICAL_NAN = mx.array(0x7FC00000, mx.uint32).view(mx.float32)


def _shape_pinned(x: mx.array) -> mx.array:
    """``x`` as a dense view that ``mx.compile(shapeless=True)`` refuses to trace.

    These functions compute their selection from the input shapes in Python,
    so a graph traced for one shape would give wrong results when replayed
    for another. MLX cannot infer the output shape of ``as_strided``, so a
    shapeless compilation raises instead ("AsStrided cannot infer output
    shapes"); eagerly and under ordinary ``mx.compile`` it is a view.
    """
    return mx.as_strided(x, x.shape)


def key_norms(keys: mx.array) -> mx.array:
    """float32 L2 norm of each row of ``keys [..., D]`` (SPEC section 2)."""
    x = _shape_pinned(keys).astype(mx.float32)
    squares = x * x
    # Squares below the smallest normal float are +0 on every backend
    # (NaN compares false and stays).
    squares = mx.where(squares < _SMALLEST_NORMAL, mx.array(0.0, mx.float32), squares)
    dim = squares.shape[-1]
    width = 1
    while width < dim:
        width *= 2
    if width > dim:
        pad = mx.zeros((*squares.shape[:-1], width - dim), dtype=mx.float32)
        squares = mx.concatenate([squares, pad], axis=-1)
    while squares.shape[-1] > 1:
        half = squares.shape[-1] // 2
        squares = squares[..., :half] + squares[..., half:]
    norms = mx.sqrt(squares[..., 0])
    return mx.where(mx.isnan(norms), _CANONICAL_NAN, norms)


def score_order_key(score: mx.array) -> mx.array:
    """Order-preserving uint32 image of float32 scores: -0 and +0 together,
    every NaN after +inf."""
    bits = score.view(mx.uint32)
    bits = mx.where((bits & 0x7FFFFFFF) == 0, mx.array(0, mx.uint32), bits)
    key = mx.where(bits >= _SIGN, ~bits, bits | _SIGN)
    return mx.where(mx.isnan(score), mx.array(_NAN_KEY, mx.uint32), key)


def selected_rows(
    norms: mx.array, budget: int, n_sink: int, recent: int, keep: str
) -> mx.array:
    """uint32 [N, kept] indices into ``norms [N, n_total]`` that SPEC section 3
    keeps, in temporal order."""
    n_rows, n_total = norms.shape
    if n_total <= budget:
        return mx.broadcast_to(mx.arange(n_total, dtype=mx.uint32), (n_rows, n_total))
    sinks = min(n_sink, n_total)
    tail = min(recent, n_total - sinks)
    mid_end = n_total - tail
    mid_keep = budget - sinks - tail
    scores = norms[:, sinks:mid_end]
    if keep == "high":
        scores = -scores
    positions = mx.arange(sinks, mid_end, dtype=mx.uint64)
    rank = (score_order_key(scores).astype(mx.uint64) << 32) | positions
    chosen = mx.argpartition(rank, kth=mid_keep - 1, axis=1)[:, :mid_keep]
    middle = mx.sort(chosen.astype(mx.uint32), axis=1) + sinks

    def protected(start: int, stop: int) -> mx.array:
        return mx.broadcast_to(mx.arange(start, stop, dtype=mx.uint32), (n_rows, stop - start))

    return mx.concatenate([protected(0, sinks), middle, protected(mid_end, n_total)], axis=1)


def protected_topk_gather(
    prior_keys: mx.array,
    prior_values: mx.array,
    prior_norms: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    new_norms: mx.array,
    budget: int,
    n_sink: int,
    recent: int,
    keep: str,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(keys, values, norms, indices) kept by SPEC section 3."""
    keys = mx.concatenate([prior_keys, new_keys], axis=1)
    values = mx.concatenate([prior_values, new_values], axis=1)
    norms = mx.concatenate([_shape_pinned(prior_norms), new_norms], axis=1)
    indices = selected_rows(norms, budget, n_sink, recent, keep)
    rows = indices[:, :, None]
    return (
        mx.take_along_axis(keys, rows, axis=1),
        mx.take_along_axis(values, rows, axis=1),
        mx.take_along_axis(norms, indices, axis=1),
        indices,
    )
