"""``evict_and_fill`` (docs/spec.md §4): the cache's step on its slot
buffers. The public op, its checks, the dispatch to the native kernel, the
Metal emulator or the fallback, and the fallback."""

from __future__ import annotations

import math

import mlx.core as mx

from ..backend import resolve
from ..validation import (
    INT32_MAX,
    check_array,
    check_config,
    check_float32,
    check_floating,
    check_int,
    check_rank,
    dtype_name,
    shape_mismatch,
)
from .common import on_stream, run_native, shape_pinned, without_transforms
from .key_norms import fallback as key_norms_fallback
from .protected_topk_gather import score_order_key

LAYOUTS = ("slots", "temporal")


def evict_and_fill(
    keys: mx.array,
    values: mx.array,
    norms: mx.array,
    positions: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    *,
    filled: int,
    offset: int,
    capacity: int,
    budget: int,
    n_sink: int,
    recent: int,
    keep: str,
    layout: str = "slots",
    stream=None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One step of the cache's buffers (docs/spec.md §4).

    ``keys [N, C, D_k]``, ``values [N, C, D_v]``, float32 ``norms [N, C]``
    and int32 ``positions [N, C]`` hold a row per slot, slots ``[0, filled)``
    occupied; ``new_keys [N, S, D_k]`` and ``new_values [N, S, D_v]`` (the
    buffers' dtypes) take positions ``offset, offset + 1, ...``. Per head,
    the ``filled`` rows are cut to the ``budget`` best (sinks and the recent
    window by position are protected), the kept rows are compacted into
    slots ``[0, kept)`` (``layout="slots"``: rows past ``kept`` fill the
    holes; ``"temporal"``: a stable compaction), and the new rows with their
    norms and positions follow. Returns ``(keys, values, norms, positions)``
    with ``capacity`` slots, of which ``[0, kept + S)`` are defined,
    ``kept = min(filled, budget)``. In place when the buffers are donated and
    ``capacity == C`` (docs/spec.md §7). The heads may take several leading
    axes (``[B, H, C, D_k]``, as a model's cache holds them), the same in
    every array.
    """
    arrays = keys, values, norms, positions, new_keys, new_values
    config = check_step(
        *arrays, filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    return _run(resolve(stream, key_dim=keys.shape[-1]), arrays, config, stream)


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"mlx_knorm: layout must be a str, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"mlx_knorm: layout must be 'slots' or 'temporal', got {layout!r}")
    return layout


def check_step(
    keys, values, norms, positions, new_keys, new_values,
    *, filled, offset, capacity, budget, n_sink, recent, keep, layout,
) -> dict:
    """Every check of docs/spec.md §6 for one step; returns the integer and
    string arguments as converted, the form every later call uses."""
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    layout = check_layout(layout)
    filled = check_int(filled, "filled")
    offset = check_int(offset, "offset")
    capacity = check_int(capacity, "capacity")
    check_array(keys, "keys")
    if keys.ndim < 3:
        raise ValueError(
            f"mlx_knorm: keys must be [..., C, D_k] with at least one head axis, "
            f"got shape {list(keys.shape)}"
        )
    heads = keys.ndim - 2
    named = [
        ("values", values, heads + 2),
        ("norms", norms, heads + 1),
        ("positions", positions, heads + 1),
        ("new_keys", new_keys, heads + 2),
        ("new_values", new_values, heads + 2),
    ]
    for name, x, ndim in named:
        check_array(x, name)
        check_rank(x, ndim, name)
    for name, x in (("keys", keys), ("values", values), ("new_keys", new_keys), ("new_values", new_values)):
        check_floating(x, name)
    check_float32(norms, "norms")
    if positions.dtype != mx.int32:
        raise TypeError(f"mlx_knorm: positions must be int32, got {dtype_name(positions.dtype)}")
    for name, new, stored, stored_name in (
        ("new_keys", new_keys, keys, "keys"),
        ("new_values", new_values, values, "values"),
    ):
        if new.dtype != stored.dtype:
            raise TypeError(
                f"mlx_knorm: {name} dtype {dtype_name(new.dtype)} must equal "
                f"{stored_name} dtype {dtype_name(stored.dtype)}"
            )
    for keys_name, k, values_name, v in (
        ("keys", keys, "values", values),
        ("new_keys", new_keys, "new_values", new_values),
    ):
        if k.shape[: heads + 1] != v.shape[: heads + 1]:
            raise shape_mismatch("keys/values mismatch in N or rows", keys_name, k, values_name, v)
    if keys.shape[:heads] != new_keys.shape[:heads] or keys.shape[-1] != new_keys.shape[-1]:
        raise shape_mismatch("buffers vs new rows mismatch in N or D", "keys", keys, "new_keys", new_keys)
    if values.shape[-1] != new_values.shape[-1]:
        raise shape_mismatch(
            "buffers vs new rows mismatch in N or D", "values", values, "new_values", new_values
        )
    for name, x in (("norms", norms), ("positions", positions)):
        if tuple(x.shape) != tuple(keys.shape[:-1]):
            raise shape_mismatch(f"{name} must be [N, C]", name, x, "keys", keys)
    slots = keys.shape[-2]
    steps = new_keys.shape[-2]
    if filled < 0:
        raise ValueError(f"mlx_knorm: filled must be >= 0, got {filled}")
    if filled > slots:
        raise ValueError(f"mlx_knorm: filled ({filled}) must be <= C, the buffers' slots ({slots})")
    if offset < 0:
        raise ValueError(f"mlx_knorm: offset must be >= 0, got {offset}")
    if offset + steps > INT32_MAX:
        raise ValueError(f"mlx_knorm: offset + S ({offset + steps}) must be < 2**31: positions are int32")
    needed = min(filled, budget) + steps
    if capacity < needed:
        raise ValueError(f"mlx_knorm: capacity ({capacity}) must be >= kept + S ({needed})")
    if capacity > INT32_MAX:
        raise ValueError(f"mlx_knorm: capacity must be < 2**31, got {capacity}")
    return dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )


def evict_and_fill_unchecked(
    keys, values, norms, positions, new_keys, new_values,
    *, filled, offset, capacity, budget, n_sink, recent, keep, layout="slots", stream=None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``evict_and_fill`` for callers that checked their arguments already
    (the cache): the native op checks every relation it relies on again in
    C++, so only the fallback runs ``check_step``, and every backend refuses
    the same calls (docs/spec.md §6)."""
    arrays = keys, values, norms, positions, new_keys, new_values
    config = dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    backend = resolve(stream, key_dim=keys.shape[-1])
    if backend == "fallback":
        config = check_step(*arrays, **config)
    return _run(backend, arrays, config, stream)


def _run(backend: str, arrays, config: dict, stream) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    if backend == "fallback":
        with on_stream(stream):
            return fallback(*arrays, **config)
    return tuple(run_native(backend, "evict_and_fill", *arrays, **config, stream=stream))


def position_order_key(positions: mx.array) -> mx.array:
    """int32 positions as uint32 in the same order (the sign bit flipped)."""
    return positions.view(mx.uint32) ^ 0x80000000


def kept_slots(
    norms: mx.array, positions: mx.array,
    filled: int, offset: int, budget: int, n_sink: int, recent: int, keep: str,
) -> mx.array:
    """bool ``[N, filled]``: the slots of ``[0, filled)`` that docs/spec.md
    §4 step 1 keeps."""
    n_rows = norms.shape[0]
    if filled <= budget:
        return mx.ones((n_rows, filled), dtype=mx.bool_)
    norms = norms[:, :filled]
    positions = positions[:, :filled]
    protected = (positions < n_sink) | (positions >= offset - recent)
    scores = norms if keep == "low" else -norms
    # No score key is 0, so protected rows rank before every evictable row.
    score_key = mx.where(protected, mx.array(0, mx.uint32), score_order_key(scores))
    rank = (score_key.astype(mx.uint64) << 32) | position_order_key(positions).astype(mx.uint64)
    # The budget-th smallest rank; of the rows equal to it (equal positions)
    # the lowest slots are kept.
    threshold = mx.partition(rank, kth=budget - 1, axis=1)[:, budget - 1 : budget]
    below = rank < threshold
    at = rank == threshold
    room = budget - below.sum(axis=1, keepdims=True)
    return below | (at & (mx.cumsum(at.astype(mx.int32), axis=1) <= room))


def source_slots(keep: mx.array, kept: int, layout: str) -> mx.array:
    """int32 ``[N, kept]``: the input slot whose row lands in each output
    slot (docs/spec.md §4 step 2)."""
    n_rows, filled = keep.shape
    slot = mx.arange(filled, dtype=mx.int32)
    if filled == kept:
        return mx.broadcast_to(slot, (n_rows, kept))
    if layout == "temporal":
        # The kept slots first, each group in slot order.
        return mx.argsort(mx.where(keep, slot, slot + filled), axis=1)[:, :kept].astype(mx.int32)
    movers = keep & (slot >= kept)
    mover_slots = mx.argsort(mx.where(movers, slot, slot + filled), axis=1).astype(mx.int32)
    hole = ~keep[:, :kept]
    hole_rank = mx.cumsum(hole.astype(mx.int32), axis=1) - 1
    moved_in = mx.take_along_axis(mover_slots, mx.maximum(hole_rank, 0), axis=1)
    return mx.where(hole, moved_in, slot[:kept])


@without_transforms("evict_and_fill")
def fallback(
    keys, values, norms, positions, new_keys, new_values,
    *, filled, offset, capacity, budget, n_sink, recent, keep, layout,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The pure-MLX step, bit-identical to the kernels on slots
    ``[0, kept + S)``; later slots are zeros here. Runs on one head axis."""
    heads = keys.shape[:-2]
    n_heads = math.prod(heads)
    arrays = keys, values, norms, positions, new_keys, new_values
    out = _fallback_one_head_axis(
        *(x.reshape(n_heads, *x.shape[len(heads) :]) for x in arrays),
        filled, offset, capacity, budget, n_sink, recent, keep, layout,
    )
    return tuple(x.reshape(*heads, *x.shape[1:]) for x in out)


def _fallback_one_head_axis(
    keys, values, norms, positions, new_keys, new_values,
    filled, offset, capacity, budget, n_sink, recent, keep, layout,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    kept = min(filled, budget)
    steps = new_keys.shape[1]
    norms = shape_pinned(norms)
    keep_mask = kept_slots(norms, positions, filled, offset, budget, n_sink, recent, keep)
    src = source_slots(keep_mask, kept, layout)

    def assemble(buffer, new):
        rows = mx.take_along_axis(buffer, src.reshape(*src.shape, *([1] * (buffer.ndim - 2))), axis=1)
        pad_shape = (buffer.shape[0], capacity - kept - steps, *buffer.shape[2:])
        return mx.concatenate([rows, new, mx.zeros(pad_shape, buffer.dtype)], axis=1)

    new_positions = mx.broadcast_to(
        mx.arange(offset, offset + steps, dtype=mx.int32), new_keys.shape[:2]
    )
    return (
        assemble(keys, new_keys),
        assemble(values, new_values),
        assemble(norms, key_norms_fallback(new_keys)),
        assemble(positions, new_positions),
    )
