"""``protected_topk_gather`` (docs/spec.md §3): the public op, its checks,
the dispatch to the native kernel, the Metal emulator or the fallback, and
the fallback."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..backend import resolve
from ..validation import (
    MAX_HEAD_ROWS,
    check_array,
    check_config,
    check_float32,
    check_floating,
    check_leading_axes,
    check_rank,
    check_row_bytes,
    check_same_dtype,
    shape_mismatch,
)
from .common import on_stream, run_native, shape_pinned, without_transforms
from .order_keys import score_order_key



class GatherInputs(NamedTuple):
    """The op's arrays: a prior state ``[N, n_prior, *]`` and a new block
    ``[N, S, *]`` of keys, values and float32 norms, in the op's order."""

    prior_keys: mx.array
    prior_values: mx.array
    prior_norms: mx.array
    new_keys: mx.array
    new_values: mx.array
    new_norms: mx.array


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
    *,
    stream=None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Protected top-k + temporal-order gather over ``prior ++ new`` (docs/spec.md §3).

    Returns ``(keys, values, norms, indices)``: ``[N, kept, D]`` twice,
    float32 ``[N, kept]`` and uint32 ``[N, kept]``, ``kept = min(n_prior + S,
    budget)``. ``new_keys``/``new_values`` must have the dtypes of
    ``prior_keys``/``prior_values``.
    """
    inputs = GatherInputs(prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms)
    config = check_gather(inputs, budget, n_sink, recent, keep)
    return _run(resolve(stream), inputs, config, stream)


def check_gather(inputs: GatherInputs, budget, n_sink, recent, keep) -> tuple[int, int, int, str]:
    """Every check of docs/spec.md §6 for one call; returns the configuration
    as converted."""
    config = check_config(budget, n_sink, recent, keep)
    check_block(*inputs[:5])
    check_new_norms(inputs.new_norms, inputs.new_keys)
    check_same_dtype(inputs.new_keys, "new_keys", inputs.prior_keys, "prior_keys")
    check_same_dtype(inputs.new_values, "new_values", inputs.prior_values, "prior_values")
    return config


def check_block(prior_keys, prior_values, prior_norms, new_keys, new_values) -> None:
    """Shapes and dtypes of one batched step: a prior state and a new block.
    Keys and values may differ in width (D_k != D_v), not in heads or rows."""
    named = [
        ("prior_keys", prior_keys, 3),
        ("prior_values", prior_values, 3),
        ("prior_norms", prior_norms, 2),
        ("new_keys", new_keys, 3),
        ("new_values", new_values, 3),
    ]
    for name, x, ndim in named:
        check_array(x, name)
        check_rank(x, ndim, name)
    for name, x, _ in named[:2] + named[3:]:
        check_floating(x, name)
    check_float32(prior_norms, "prior_norms")
    for keys_name, keys, values_name, values in (
        ("prior_keys", prior_keys, "prior_values", prior_values),
        ("new_keys", new_keys, "new_values", new_values),
    ):
        check_leading_axes("keys/values mismatch in N or rows", keys_name, keys, values_name, values, 2)
    if prior_keys.shape[0] != new_keys.shape[0] or prior_keys.shape[2] != new_keys.shape[2]:
        raise shape_mismatch("prior vs new mismatch in N or D", "prior_keys", prior_keys, "new_keys", new_keys)
    if prior_values.shape[2] != new_values.shape[2]:
        raise shape_mismatch(
            "prior vs new mismatch in N or D", "prior_values", prior_values, "new_values", new_values
        )
    if tuple(prior_norms.shape) != tuple(prior_keys.shape[:2]):
        raise shape_mismatch(
            "prior_norms must be [N, n_prior]", "prior_norms", prior_norms, "prior_keys", prior_keys
        )
    n_total = prior_keys.shape[1] + new_keys.shape[1]
    if n_total > MAX_HEAD_ROWS:
        raise ValueError(f"mlx_knorm: n_prior + S ({n_total}) must be < 2**31")
    check_row_bytes(prior_keys, "prior_keys")
    check_row_bytes(prior_values, "prior_values")


def check_new_norms(new_norms, new_keys: mx.array) -> None:
    """The norms a caller passes for a new block: float32 ``[N, S]``."""
    check_array(new_norms, "new_norms")
    check_rank(new_norms, 2, "new_norms")
    check_float32(new_norms, "new_norms")
    if tuple(new_norms.shape) != tuple(new_keys.shape[:2]):
        raise shape_mismatch("new_norms must be [N, S]", "new_norms", new_norms, "new_keys", new_keys)


def protected_topk_gather_unchecked(
    prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms,
    budget, n_sink, recent, keep, stream=None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``protected_topk_gather`` for callers that checked their arguments
    already (the state API): the native op checks again in C++, so only the
    fallback runs ``check_gather``, and every backend refuses the same calls
    (docs/spec.md §6)."""
    inputs = GatherInputs(prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms)
    config = budget, n_sink, recent, keep
    backend = resolve(stream)
    if backend == "fallback":
        config = check_gather(inputs, *config)
    return _run(backend, inputs, config, stream)


def _run(backend: str, inputs: GatherInputs, config, stream) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    if backend == "fallback":
        budget, n_sink, recent, keep = config
        with on_stream(stream):
            return fallback(*inputs, budget=budget, n_sink=n_sink, recent=recent, keep=keep)
    return tuple(run_native(backend, "protected_topk_gather", *inputs, *config, stream=stream))


@without_transforms("protected_topk_gather")
def fallback(
    prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms,
    *, budget: int, n_sink: int, recent: int, keep: str,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The pure-MLX op, bit-identical to the kernels. Rows are selected by
    unique (score, index) keys, so any correct partition algorithm picks
    exactly the rows the kernels pick."""
    keys = mx.concatenate([prior_keys, new_keys], axis=1)
    values = mx.concatenate([prior_values, new_values], axis=1)
    norms = mx.concatenate([shape_pinned(prior_norms), new_norms], axis=1)
    indices = selected_rows(norms, budget, n_sink, recent, keep)
    rows = indices[:, :, None]
    return (
        mx.take_along_axis(keys, rows, axis=1),
        mx.take_along_axis(values, rows, axis=1),
        mx.take_along_axis(norms, indices, axis=1),
        indices,
    )


def selected_rows(
    norms: mx.array, budget: int, n_sink: int, recent: int, keep: str
) -> mx.array:
    """uint32 [N, kept] indices into ``norms [N, n_total]`` that docs/spec.md
    §3 keeps, in temporal order."""
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
