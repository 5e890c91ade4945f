"""``evict_and_fill`` (docs/spec.md §4): the cache's step on its slot
buffers. The public op, its checks, the dispatch to the native kernel, the
Metal emulator or the fallback, and the fallback."""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import mlx.core as mx

from .. import _native
from ..backend import resolve
from ..validation import (
    INT32_MAX,
    check_array,
    check_config,
    check_float32,
    check_floating,
    check_int,
    check_int32,
    check_leading_axes,
    check_rank,
    check_row_bytes,
    check_same_dtype,
    shape_mismatch,
)
from .common import on_stream, run_native, shape_pinned, without_transforms
from .key_norms import fallback as key_norms_fallback
from .order_keys import PADDING_SCORE_KEY, position_order_key, score_order_key

LAYOUTS = ("slots", "temporal")
# Payload arrays (keys' and values' together) one call moves: the Metal
# kernel binds each at fixed buffer indices (kEvictMaxPayloads,
# metal/knorm_defines.h).
MAX_PAYLOADS = 6

# keys, values, new_keys, new_values: one array or a tuple of them.
Rows = Union[mx.array, tuple[mx.array, ...]]


def evict_and_fill(
    keys: Rows,
    values: Rows,
    norms: mx.array,
    positions: mx.array,
    new_keys: Rows,
    new_values: Rows,
    *,
    filled: int,
    offset: int,
    capacity: int,
    budget: int,
    n_sink: int,
    recent: int,
    keep: str,
    layout: str = "slots",
    new_norms: mx.array | None = None,
    valid: mx.array | None = None,
    tree: bool | mx.array = False,
    stream=None,
) -> tuple:
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
    ``kept = min(filled, budget)``. In place, buffer by buffer, when the
    buffers are donated and ``capacity == C`` (docs/spec.md §7). The heads
    may take several leading axes (``[B, H, C, D_k]``, as a model's cache
    holds them), the same in every array.

    Each of ``keys`` and ``values`` (with ``new_keys``, ``new_values``) may
    be a tuple of arrays ``[N, C, W]`` of any dtype, such as mlx-lm's
    quantized ``(packed, scales, biases)``: every array is a payload moved
    as raw bits, at most 6 in all, and the outputs come back in the same
    structure. ``new_norms`` (float32 ``[N, S]``) gives the new rows' norms;
    without it they are computed from ``new_keys`` (docs/spec.md §2), which
    must then be one floating array. ``valid`` (int32 ``[N, 2]``) gives each
    head's real positions ``[lo, hi)``: other rows are padding, ranked after
    every real row and never protected, so each sequence of a batch keeps
    what it would keep alone.

    ``tree=True``, or the tree the previous step returned (int32
    ``[N, 2, C + 1]``), adds the order tree (docs/spec.md §4 step 4) as a
    fifth output: a decode step given it finds the row to evict in
    ``O(log C)`` instead of ranking every row.
    """
    args = check_evict_and_fill(
        keys, values, norms, positions, new_keys, new_values,
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
        new_norms=new_norms, valid=valid, tree=tree,
    )
    return _run(resolve(stream, key_dim=args.norm_key_dim()), args, stream)


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"mlx_knorm: layout must be a str, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"mlx_knorm: layout must be 'slots' or 'temporal', got {layout!r}")
    return layout


class EvictAndFillArgs(NamedTuple):
    """One call's checked arguments: the payloads flat (the keys', then the values'),
    how they group back into ``keys`` and ``values`` (``None``: one array;
    else the tuple's length), the other arrays, and the configuration as
    converted."""

    payloads: list[mx.array]
    norms: mx.array
    positions: mx.array
    new_payloads: list[mx.array]
    new_norms: mx.array | None
    valid: mx.array | None
    key_tuple: int | None
    value_tuple: int | None
    config: dict
    # The given order tree, and whether the outputs include one.
    tree: mx.array | None = None
    order_tree: bool = False

    @property
    def n_keys(self) -> int:
        return 1 if self.key_tuple is None else self.key_tuple

    def norm_key_dim(self) -> int | None:
        """The width of the keys whose norms the op computes, for the
        backend's choice (``backend.resolve``); None when they are given."""
        return self.payloads[0].shape[-1] if self.new_norms is None else None

    def grouped(self, flat) -> tuple:
        """Flat outputs ``[*payloads, norms, positions]`` (and the tree) in
        the structure of the inputs."""
        flat = list(flat)
        tree = [flat.pop()] if self.order_tree else []
        *rows, norms, positions = flat
        keys, values = rows[: self.n_keys], rows[self.n_keys :]
        return (
            keys[0] if self.key_tuple is None else tuple(keys),
            values[0] if self.value_tuple is None else tuple(values),
            norms,
            positions,
            *tree,
        )


def _payload_group(x, name: str) -> tuple[list[mx.array], int | None, list[str]]:
    """``keys``, ``values``, ``new_keys`` or ``new_values``: its arrays, its
    tuple length (None for one array) and the arrays' names."""
    if isinstance(x, (tuple, list)):
        if not x:
            raise TypeError(
                f"mlx_knorm: {name} must be an mlx.core.array or a non-empty tuple of them, "
                "got an empty sequence"
            )
        names = [f"{name}[{i}]" for i in range(len(x))]
        for a, a_name in zip(x, names):
            check_array(a, a_name)
        return list(x), len(x), names
    check_array(x, name)
    return [x], None, [name]


def _check_structure(new_len, new_name: str, stored_len, stored_name: str) -> None:
    if new_len != stored_len:
        def describe(n):
            return "an array" if n is None else f"a tuple of {n} arrays"

        raise ValueError(
            f"mlx_knorm: {new_name} must have the structure of {stored_name}: "
            f"{stored_name} is {describe(stored_len)}, {new_name} {describe(new_len)}"
        )


def check_evict_and_fill(
    keys, values, norms, positions, new_keys, new_values,
    *, filled, offset, capacity, budget, n_sink, recent, keep, layout,
    new_norms=None, valid=None, tree=False,
) -> EvictAndFillArgs:
    """Every check of docs/spec.md §6 for one call, in the primitive's order
    (csrc/evict_and_fill/evict_and_fill.cpp); returns the arguments with
    the integer and string ones as converted, the form every later call
    uses."""
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    layout = check_layout(layout)
    filled = check_int(filled, "filled")
    offset = check_int(offset, "offset")
    capacity = check_int(capacity, "capacity")
    key_rows, key_tuple, key_names = _payload_group(keys, "keys")
    value_rows, value_tuple, value_names = _payload_group(values, "values")
    new_key_rows, new_key_tuple, new_key_names = _payload_group(new_keys, "new_keys")
    new_value_rows, new_value_tuple, new_value_names = _payload_group(new_values, "new_values")
    _check_structure(new_key_tuple, "new_keys", key_tuple, "keys")
    _check_structure(new_value_tuple, "new_values", value_tuple, "values")
    check_array(norms, "norms")
    check_array(positions, "positions")
    if new_norms is not None:
        check_array(new_norms, "new_norms")
    if valid is not None:
        check_array(valid, "valid")
    given_tree = _check_tree_argument(tree)
    rows = key_rows + value_rows
    new_rows = new_key_rows + new_value_rows
    names = key_names + value_names
    new_names = new_key_names + new_value_names
    if len(rows) > MAX_PAYLOADS:
        raise ValueError(
            f"mlx_knorm: keys and values take at most {MAX_PAYLOADS} payload arrays together, "
            f"got {len(rows)}"
        )
    first = rows[0]
    if first.ndim < 3:
        raise ValueError(
            f"mlx_knorm: {names[0]} must be [..., C, D_k] with at least one head axis, "
            f"got shape {list(first.shape)}"
        )
    heads = first.ndim - 2
    for x, name in zip(rows, names):
        check_rank(x, heads + 2, name)
    check_rank(norms, heads + 1, "norms")
    check_rank(positions, heads + 1, "positions")
    for x, name in zip(new_rows, new_names):
        check_rank(x, heads + 2, name)
    if new_norms is not None:
        check_rank(new_norms, heads + 1, "new_norms")
    if valid is not None:
        check_rank(valid, heads + 1, "valid")
    if new_norms is None:
        # The new rows' norms come from the keys (docs/spec.md §2).
        if key_tuple is not None:
            raise TypeError(
                "mlx_knorm: new_norms is required when keys is a tuple: the norms are computed "
                "from new_keys only when it is one float16, bfloat16 or float32 array"
            )
        check_floating(first, names[0])
        check_floating(new_rows[0], new_names[0])
    check_float32(norms, "norms")
    check_int32(positions, "positions")
    for new, stored, new_name, name in zip(new_rows, rows, new_names, names):
        check_same_dtype(new, new_name, stored, name)
    if new_norms is not None:
        check_float32(new_norms, "new_norms")
    if valid is not None:
        check_int32(valid, "valid")
    for x, name in zip(rows, names):
        check_row_bytes(x, name)
    for i in range(1, len(rows)):
        what = f"{names[0]}/{names[i]} mismatch in N or rows"
        check_leading_axes(what, names[0], first, names[i], rows[i], heads + 1)
        check_leading_axes(what, new_names[0], new_rows[0], new_names[i], new_rows[i], heads + 1)
    for stored, new, name, new_name in zip(rows, new_rows, names, new_names):
        if stored.shape[:heads] != new.shape[:heads] or stored.shape[-1] != new.shape[-1]:
            raise shape_mismatch("buffers vs new rows mismatch in N or D", name, stored, new_name, new)
    for name, x in (("norms", norms), ("positions", positions)):
        if tuple(x.shape) != tuple(first.shape[:-1]):
            raise shape_mismatch(f"{name} must be [N, C]", name, x, names[0], first)
    if new_norms is not None and tuple(new_norms.shape) != tuple(new_rows[0].shape[:-1]):
        raise shape_mismatch("new_norms must be [N, S]", "new_norms", new_norms, new_names[0], new_rows[0])
    if valid is not None and tuple(valid.shape) != (*first.shape[:heads], 2):
        raise shape_mismatch("valid must be [N, 2]", "valid", valid, names[0], first)
    if given_tree is not None:
        check_rank(given_tree, heads + 2, "tree")
        check_int32(given_tree, "tree")
        if tuple(given_tree.shape) != (*first.shape[:heads], 2, first.shape[-2] + 1):
            raise shape_mismatch("tree must be [N, 2, C + 1]", "tree", given_tree, names[0], first)
    slots = first.shape[-2]
    n_new = new_rows[0].shape[-2]
    if filled < 0:
        raise ValueError(f"mlx_knorm: filled must be >= 0, got {filled}")
    if filled > slots:
        raise ValueError(f"mlx_knorm: filled ({filled}) must be <= C, the buffers' slots ({slots})")
    if offset < 0:
        raise ValueError(f"mlx_knorm: offset must be >= 0, got {offset}")
    if offset + n_new > INT32_MAX:
        raise ValueError(f"mlx_knorm: offset + S ({offset + n_new}) must be < 2**31: positions are int32")
    needed = min(filled, budget) + n_new
    if capacity < needed:
        raise ValueError(f"mlx_knorm: capacity ({capacity}) must be >= kept + S ({needed})")
    if capacity > INT32_MAX:
        raise ValueError(f"mlx_knorm: capacity must be < 2**31, got {capacity}")
    config = dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    return EvictAndFillArgs(
        rows, norms, positions, new_rows, new_norms, valid, key_tuple, value_tuple, config,
        given_tree, given_tree is not None or tree is True,
    )


def _check_tree_argument(tree) -> mx.array | None:
    """``tree``: False, True or an array (checked with the other shapes);
    the array, or None."""
    if tree is True or tree is False:
        return None
    if not isinstance(tree, mx.array):
        raise TypeError(
            f"mlx_knorm: tree must be a bool or an mlx.core.array, got {type(tree).__name__}"
        )
    return tree


def evict_and_fill_unchecked(
    keys, values, norms, positions, new_keys, new_values,
    *, filled, offset, capacity, budget, n_sink, recent, keep, layout="slots",
    new_norms=None, valid=None, tree=False, stream=None, backend=None,
) -> tuple:
    """``evict_and_fill`` for callers that checked their arguments already
    (the cache): the native op checks every relation it relies on again in
    C++, so only the fallback runs ``check_evict_and_fill``, and every backend refuses
    the same calls (docs/spec.md §6). ``backend``: what ``backend.resolve``
    gave for ``stream`` and these keys, where the caller asked it already."""
    one_keys = type(keys) is mx.array
    if tree is not True and tree is not False and type(tree) is not mx.array:
        _check_tree_argument(tree)
    if backend is None:
        key_dim = keys.shape[-1] if new_norms is None and one_keys and keys.ndim else None
        backend = resolve(stream, key_dim=key_dim)
    if (backend == "kernel" and one_keys and type(values) is mx.array and type(norms) is mx.array
            and type(positions) is mx.array and type(new_keys) is mx.array
            and type(new_values) is mx.array and new_norms is None and valid is None):
        # The float cache's decode step, on every layer of every token: the
        # binding itself, positional arguments (it matches keywords by
        # name), the fewest Python operations.
        if type(tree) is mx.array:
            return tuple(_native.ext.evict_and_fill(
                keys, values, norms, positions, new_keys, new_values,
                filled, offset, capacity, budget, n_sink, recent, keep, layout,
                tree=tree, stream=stream,
            ))
        return tuple(_native.ext.evict_and_fill(
            keys, values, norms, positions, new_keys, new_values,
            filled, offset, capacity, budget, n_sink, recent, keep, layout,
            order_tree=tree is True, stream=stream,
        ))
    config = dict(
        filled=filled, offset=offset, capacity=capacity, budget=budget,
        n_sink=n_sink, recent=recent, keep=keep, layout=layout,
    )
    arrays = keys, values, norms, positions, new_keys, new_values
    if backend == "fallback":
        args = check_evict_and_fill(*arrays, **config, new_norms=new_norms, valid=valid, tree=tree)
        return _run(backend, args, stream)
    # The primitive checks every relation; what it cannot name is an
    # argument that is no array at all.
    for x, name in ((keys, "keys"), (values, "values"), (new_keys, "new_keys"), (new_values, "new_values")):
        _payload_group(x, name)
    for x, name in ((norms, "norms"), (positions, "positions"), (new_norms, "new_norms"), (valid, "valid")):
        if x is not None or name in ("norms", "positions"):
            check_array(x, name)
    _check_tree_argument(tree)
    return _run_native(backend, arrays, config, new_norms, valid, tree, stream)


def _run(backend: str, args: EvictAndFillArgs, stream) -> tuple:
    if backend == "fallback":
        arrays = [*args.payloads, args.norms, args.positions, *args.new_payloads]
        arrays += [x for x in (args.new_norms, args.valid) if x is not None]
        with on_stream(stream):
            flat = fallback(
                *arrays, payloads=len(args.payloads), norms_given=args.new_norms is not None,
                has_valid=args.valid is not None, order_tree=args.order_tree, **args.config,
            )
        return args.grouped(flat)
    keys = args.payloads[: args.n_keys]
    values = args.payloads[args.n_keys :]
    new_keys = args.new_payloads[: args.n_keys]
    new_values = args.new_payloads[args.n_keys :]
    arrays = (
        keys[0] if args.key_tuple is None else tuple(keys),
        values[0] if args.value_tuple is None else tuple(values),
        args.norms,
        args.positions,
        new_keys[0] if args.key_tuple is None else tuple(new_keys),
        new_values[0] if args.value_tuple is None else tuple(new_values),
    )
    tree = args.tree if args.tree is not None else args.order_tree
    return _run_native(backend, arrays, args.config, args.new_norms, args.valid, tree, stream)


def _run_native(backend: str, arrays, config: dict, new_norms, valid, tree, stream):
    """The extension's op on the structured arguments; its flat outputs in
    their structure."""
    given = {name: x for name, x in (("new_norms", new_norms), ("valid", valid)) if x is not None}
    if type(tree) is mx.array:
        given["tree"] = tree
    elif tree is True:
        given["order_tree"] = True
    flat = run_native(backend, "evict_and_fill", *arrays, **config, **given, stream=stream)
    out_tree = [flat.pop()] if tree is not False else []
    keys, values = arrays[0], arrays[1]
    n_keys = len(keys) if isinstance(keys, (tuple, list)) else 1
    rows = flat[:-2]
    return (
        tuple(rows[:n_keys]) if isinstance(keys, (tuple, list)) else rows[0],
        tuple(rows[n_keys:]) if isinstance(values, (tuple, list)) else rows[n_keys],
        flat[-2],
        flat[-1],
        *out_tree,
    )


def kept_slots(
    norms: mx.array, positions: mx.array,
    filled: int, offset: int, budget: int, n_sink: int, recent: int, keep: str,
    valid: mx.array | None = None,
) -> mx.array:
    """bool ``[N, filled]``: the slots of ``[0, filled)`` that docs/spec.md
    §4 step 1 keeps. ``valid``: int32 ``[N, 2]`` ranges, or None (every row
    real)."""
    n_rows = norms.shape[0]
    if filled <= budget:
        return mx.ones((n_rows, filled), dtype=mx.bool_)
    rank, _ = eviction_rank(
        norms[:, :filled], positions[:, :filled], offset, n_sink, recent, keep, valid
    )
    # The budget-th smallest rank; of the rows equal to it (equal positions)
    # the lowest slots are kept.
    threshold = mx.partition(rank, kth=budget - 1, axis=1)[:, budget - 1 : budget]
    below = rank < threshold
    at = rank == threshold
    room = budget - below.sum(axis=1, keepdims=True)
    return below | (at & (mx.cumsum(at.astype(mx.int32), axis=1) <= room))


def eviction_rank(
    norms: mx.array, positions: mx.array,
    offset: int, n_sink: int, recent: int, keep: str, valid: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """docs/spec.md §4 step 1 for rows ``[N, k]`` at ``offset``: each
    row's place in the rank as uint64 (later evicted first; equal ranks by
    slot), and whether it is a real row protected as one of the latest
    ``recent`` (the order tree's window)."""
    if valid is None:
        window = positions >= offset - recent
        protected = (positions < n_sink) | window
        real = None
    else:
        # Bounds past int32 (lo + n_sink, min(offset, hi) - recent) in int64.
        p = positions.astype(mx.int64)
        lo = valid[:, 0:1].astype(mx.int64)
        hi = valid[:, 1:2].astype(mx.int64)
        real = (p >= lo) & (p < hi)
        window = real & (p >= mx.minimum(hi, offset) - recent)
        protected = (p < lo + n_sink) | window
    scores = norms if keep == "low" else -norms
    # No score key is 0, so protected rows rank before every evictable row;
    # every score key is below the padding's.
    score_key = mx.where(protected, mx.array(0, mx.uint32), score_order_key(scores))
    if real is not None:
        score_key = mx.where(real, score_key, mx.array(PADDING_SCORE_KEY, mx.uint32))
    rank = (score_key.astype(mx.uint64) << 32) | position_order_key(positions).astype(mx.uint64)
    return rank, window


def build_order_tree(
    norms: mx.array, positions: mx.array, count: int,
    next_offset: int, n_sink: int, recent: int, keep: str, valid: mx.array | None,
) -> mx.array:
    """docs/spec.md §4 step 4: int32 ``[N, 2, n + 1]``, the order tree
    over the ``n`` slots of ``norms`` and ``positions`` ``[N, n]``, of
    which ``[0, count)`` are occupied, for the step at ``next_offset``."""
    n_heads, n = norms.shape
    rank, window = eviction_rank(norms, positions, next_offset, n_sink, recent, keep, valid)
    slot = mx.arange(n, dtype=mx.int32)
    occupied = mx.broadcast_to(slot < count, (n_heads, n))
    # Unoccupied slots compare by index alone: their keys are zeros.
    rank = mx.where(occupied, rank, mx.array(0, mx.uint64))
    window = window & occupied
    window_position = mx.where(window, positions, 0)

    def evicts_before(a, b):
        oa, ob = (mx.take_along_axis(occupied, x, axis=1) for x in (a, b))
        ra, rb = (mx.take_along_axis(rank, x, axis=1) for x in (a, b))
        return (oa & ~ob) | ((oa == ob) & ((ra > rb) | ((ra == rb) & (a > b))))

    def leaves_window_before(a, b):
        wa, wb = (mx.take_along_axis(window, x, axis=1) for x in (a, b))
        pa, pb = (mx.take_along_axis(window_position, x, axis=1) for x in (a, b))
        return (wa & ~wb) | ((wa == wb) & ((pa < pb) | ((pa == pb) & (a < b))))

    halves = []
    for beats, stamp in ((evicts_before, count), (leaves_window_before, next_offset)):
        nodes = _tournament(n, n_heads, beats)
        if n >= 2:
            winner = [nodes[:, :1]]
        elif n == 1:
            winner = [mx.zeros((n_heads, 1), mx.int32)]
        else:
            winner = []
        stamp = mx.full((n_heads, 1), stamp, dtype=mx.int32)
        halves.append(mx.concatenate([stamp, nodes, *winner], axis=1))
    return mx.stack(halves, axis=1)


def _tournament(n: int, n_heads: int, beats) -> mx.array:
    """int32 ``[N, n - 1]``: the winners of nodes ``1 .. n - 1`` of a
    tournament over ``n`` slots (node ``i``'s children ``2i``, ``2i + 1``;
    node ``n + s`` is slot ``s``), level by level from the deepest."""
    if n < 2:
        return mx.zeros((n_heads, 0), mx.int32)
    depth = (n - 1).bit_length() - 1
    levels = {}
    for level in range(depth, -1, -1):
        first = 1 << level
        end = min(first << 1, n)
        # The children, nodes [2 first, 2 end): the level below, then slots.
        child_first, child_end = 2 * first, 2 * end
        parts = []
        inner_end = min(child_end, n)
        if inner_end > child_first:
            parts.append(levels[level + 1][:, : inner_end - child_first])
        leaf_first = max(child_first, n)
        if child_end > leaf_first:
            leaves = mx.arange(leaf_first - n, child_end - n, dtype=mx.int32)
            parts.append(mx.broadcast_to(leaves, (n_heads, child_end - leaf_first)))
        children = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        a, b = children[:, 0::2], children[:, 1::2]
        levels[level] = mx.where(beats(a, b), a, b)
    return mx.concatenate([levels[level] for level in range(depth + 1)], axis=1)


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
    *arrays,
    payloads, norms_given, has_valid, order_tree=False,
    filled, offset, capacity, budget, n_sink, recent, keep, layout,
) -> tuple[mx.array, ...]:
    """The pure-MLX op, bit-identical to the kernels on slots
    ``[0, kept + S)``; later slots are zeros here. ``arrays`` in the
    primitive's order: the ``payloads`` buffers, norms, positions, the new
    payload rows, then new_norms and valid where given; returns the
    payloads, norms and positions, and with ``order_tree`` the tree (built:
    a given tree is the previous step's, the one this builds, so the
    fallback never reads it). Runs on one head axis."""
    m = payloads
    heads = arrays[m].shape[:-1]
    n_heads = math.prod(heads)
    rows = [x.reshape(n_heads, *x.shape[len(heads) :]) for x in arrays]
    stored, (norms, positions), new = rows[:m], rows[m : m + 2], rows[m + 2 : 2 * m + 2]
    extra = rows[2 * m + 2 :]
    new_norms = extra.pop(0) if norms_given else None
    valid = extra.pop(0) if has_valid else None
    out = _fallback_one_head_axis(
        stored, norms, positions, new, new_norms, valid,
        filled, offset, capacity, budget, n_sink, recent, keep, layout,
    )
    if order_tree:
        n_new = new[0].shape[1]
        out.append(build_order_tree(
            out[m], out[m + 1], min(filled, budget) + n_new, offset + n_new,
            n_sink, recent, keep, valid,
        ))
    return tuple(x.reshape(*heads, *x.shape[1:]) for x in out)


def _fallback_one_head_axis(
    stored, norms, positions, new, new_norms, valid,
    filled, offset, capacity, budget, n_sink, recent, keep, layout,
) -> list[mx.array]:
    kept = min(filled, budget)
    n_new = new[0].shape[1]
    n_heads = norms.shape[0]
    norms = shape_pinned(norms)
    keep_mask = kept_slots(norms, positions, filled, offset, budget, n_sink, recent, keep, valid)
    src = source_slots(keep_mask, kept, layout)

    def assemble(buffer, fresh):
        rows = mx.take_along_axis(buffer, src.reshape(*src.shape, *([1] * (buffer.ndim - 2))), axis=1)
        pad_shape = (buffer.shape[0], capacity - kept - n_new, *buffer.shape[2:])
        return mx.concatenate([rows, fresh, mx.zeros(pad_shape, buffer.dtype)], axis=1)

    new_positions = mx.broadcast_to(mx.arange(offset, offset + n_new, dtype=mx.int32), (n_heads, n_new))
    if new_norms is None:
        new_norms = key_norms_fallback(new[0])
    return [
        *(assemble(buffer, fresh) for buffer, fresh in zip(stored, new)),
        assemble(norms, new_norms),
        assemble(positions, new_positions),
    ]
