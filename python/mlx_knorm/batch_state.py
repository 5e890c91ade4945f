"""The check a ``BatchL2NormKVCache`` state goes through as it is set
(docs/spec.md §8, batches): its fields against each other
(``check_batch_fields``), then, on the cache holding them, what every step
leaves in the occupied slots (``slot_flaws``); the batch cache then loads
each sequence as a single cache would (``extract``)."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .cache_state import STATE_SCORERS, StateError, check_scorer_fields, decimal_int
from .ops.evict_and_fill import check_layout
from .ops.key_norms import key_norms_unchecked
from .validation import INT32_MAX, check_config

# The state's integer fields, ints or decimal strings.
_STATE_INTS = ("timeline", "filled", "budget", "n_sink", "recent")


class BatchFields(NamedTuple):
    budget: int
    n_sink: int
    recent: int
    keep: str
    layout: str
    scorer: str
    scorer_array: mx.array | None
    # keys, values, norms, positions, or four Nones.
    arrays: tuple
    # (lo, hi) of each sequence.
    pairs: list
    # Real rows of each sequence.
    counts: list
    timeline: int
    filled: int


def _checked_scorer_array(scorer: str, array, batch: int, rows) -> mx.array | None:
    """A batch state's ``scorer_state``: the single cache's rules
    (``cache_state``), and keydiff's running sum ``[B, H, D_k]`` over the
    batch and the stored keys' heads and width."""
    try:
        _, array = check_scorer_fields((scorer, array))
    except StateError as e:
        raise ValueError(f"mlx_knorm: BatchL2NormKVCache state field '{e.field}': {e.detail}") from None
    if scorer == "keydiff" and array is not None:
        keys = rows[0]
        want = (batch, *((keys.shape[1], keys.shape[3]) if keys is not None else array.shape[1:]))
        if array.ndim != 3 or tuple(array.shape) != want or not mx.all(mx.isfinite(array)).item():
            raise ValueError("mlx_knorm: BatchL2NormKVCache state field 'scorer_state': keydiff's running sum "
                             f"must be finite float32 {list(want)}, got {list(array.shape)}")
    if scorer == "qfilter" and rows[0] is not None and tuple(array.shape) != (rows[0].shape[1], rows[0].shape[3]):
        raise ValueError("mlx_knorm: BatchL2NormKVCache state field 'scorer_state': qfilter's filters are "
                         f"{list(array.shape)}, the keys' heads and width "
                         f"[{rows[0].shape[1]}, {rows[0].shape[3]}]")
    return array


def check_batch_fields(v) -> BatchFields:
    """The fields of a batch state (``BatchL2NormKVCache.state``), checked
    against each other; raises naming the field."""
    v = tuple(v)
    if len(v) not in (13, 15):
        raise ValueError(f"mlx_knorm: BatchL2NormKVCache state must have 13 fields, and two more (scorer, "
                         f"scorer_state) for a scorer other than knorm, got {len(v)}")
    scorer, scorer_array = v[13:] if len(v) == 15 else ("knorm", None)
    if len(v) == 15 and scorer not in STATE_SCORERS:
        raise ValueError(f"mlx_knorm: BatchL2NormKVCache state field 'scorer' must be one of {STATE_SCORERS}, "
                         f"got {scorer!r}")
    keys, values, norms, positions, ranges, real, timeline, filled, *config = v[:13]
    timeline, filled, budget, n_sink, recent = (
        decimal_int(x, f"BatchL2NormKVCache state field '{name}'")
        for x, name in zip((timeline, filled, *config[:3]), _STATE_INTS))
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, config[3])
    layout = check_layout(config[4])
    if not isinstance(ranges, mx.array) or ranges.dtype != mx.int32 or ranges.ndim != 2 or ranges.shape[1] != 2:
        raise ValueError("mlx_knorm: BatchL2NormKVCache state field 'ranges' must be int32 [B, 2]")
    batch = ranges.shape[0]
    if not isinstance(real, mx.array) or real.dtype != mx.int32 or tuple(real.shape) != (batch,):
        raise ValueError(f"mlx_knorm: BatchL2NormKVCache state field 'real_rows' must be int32 [{batch}]")
    arrays = (keys, values, norms, positions)
    if any(a is None for a in arrays):
        if any(a is not None for a in arrays) or filled:
            raise ValueError("mlx_knorm: BatchL2NormKVCache state: keys, values, norms and positions "
                             "are all arrays or all None (then filled is 0)")
    else:
        for name, a in zip(("keys", "values", "norms", "positions"), arrays):
            if not isinstance(a, mx.array):
                raise TypeError(f"mlx_knorm: BatchL2NormKVCache state field '{name}' must be an "
                                f"mlx.core.array, got {type(a).__name__}")
        for name, a, ndim in zip(("keys", "values", "norms", "positions"), arrays, (4, 4, 3, 3)):
            if a.ndim != ndim or a.shape[0] != batch \
                    or a.shape[1:3] != norms.shape[1:3]:
                raise ValueError(
                    f"mlx_knorm: BatchL2NormKVCache state field '{name}' must be [{batch}, H, C, ...] "
                    "like the norms"
                )
        if norms.dtype != mx.float32 or positions.dtype != mx.int32 or keys.dtype != values.dtype:
            raise ValueError("mlx_knorm: BatchL2NormKVCache state: norms float32, positions int32, "
                             "keys and values of one dtype")
        if not 0 <= filled <= norms.shape[2]:
            raise ValueError(f"mlx_knorm: BatchL2NormKVCache state field 'filled' {filled} "
                             f"must be in [0, {norms.shape[2]}]")
    counts = real.tolist()
    if any(not 0 <= r <= filled for r in counts) or not 0 <= timeline <= INT32_MAX:
        raise ValueError("mlx_knorm: BatchL2NormKVCache state fields 'real_rows' must be in "
                         "[0, filled] and 'timeline' in [0, 2**31)")
    pairs = ranges.tolist()
    if any(not 0 <= lo <= hi for lo, hi in pairs):
        raise ValueError("mlx_knorm: BatchL2NormKVCache state field 'ranges' must hold "
                         f"0 <= lo <= hi for every sequence, got {pairs}")
    if len(v) == 15:
        scorer_array = _checked_scorer_array(scorer, scorer_array, batch, arrays)
    if scorer == "keydiff" and scorer_array is not None:
        # A sequence's sum starts at +0 and only its tokens move it.
        empty = [b for b, (lo, hi) in enumerate(pairs) if min(timeline, hi) <= lo]
        moved = empty and mx.any(scorer_array[mx.array(empty, dtype=mx.int32)].view(mx.uint32) != 0).item()
        if moved:
            raise ValueError("mlx_knorm: BatchL2NormKVCache state field 'scorer_state': keydiff's running sum "
                             f"of a sequence with no token is +0, but sequences {empty} have none and a sum "
                             "that is not")
    return BatchFields(budget, n_sink, recent, keep, layout, scorer, scorer_array, arrays, pairs, counts,
                       timeline, filled)


def slot_flaws(cache) -> list:
    """What every step leaves in the occupied slots of ``cache`` (a
    ``BatchL2NormKVCache`` holding the fields to check; docs/spec.md §8,
    batches), as a loaded state must hold it: each row's norm is §2 of its
    key (padding rows' too: the pending eviction ranks them), and, outside
    a right-padded prefill, each sequence's padding rows fill its front
    slots at increasing positions from their slots up, below its first
    position (so the lowest positions are the lowest slots), its real rows
    the others, so that the mask hides exactly the padding. Per sequence,
    what it breaks (naming the field) or None."""
    batch, filled = cache.batch_size, cache.filled
    if cache.keys is None or not filled or not batch:
        return [None] * batch
    if cache.scorer == "knorm":
        stored = key_norms_unchecked(cache.keys[:, :, :filled]).view(mx.uint32)
        wrong_norms = (stored != cache.norms[:, :, :filled].view(mx.uint32)).reshape(batch, -1).any(axis=1)
    else:
        # Another scorer's scores: what extract()'s load check holds of
        # each sequence's real rows.
        wrong_norms = mx.zeros((batch,), mx.bool_)
    if cache._padded():
        wrong_positions = mx.zeros((batch,), mx.bool_)
    else:
        positions = cache.slot_positions[:, :, :filled]
        slot = mx.arange(filled, dtype=mx.int32)
        front = mx.array([filled - real for real in cache._real], dtype=mx.int32)[:, None, None]
        lo = mx.array(cache._lo, dtype=mx.int32)[:, None, None]
        # A step writes padding at the timeline's positions: past its slot
        # once a left padding longer than the blocks so far was evicted.
        increasing = mx.concatenate([mx.ones((*positions.shape[:2], 1), mx.bool_),
                                     positions[..., 1:] > positions[..., :-1]], axis=2)
        held = mx.where(slot < front, increasing & (positions >= slot) & (positions < lo),
                        (positions >= lo) & (positions < cache.timeline))
        wrong_positions = (~held).reshape(batch, -1).any(axis=1)
    flaws = []
    for real, lo, norms, positions in zip(cache._real, cache._lo, wrong_norms.tolist(), wrong_positions.tolist()):
        if norms:
            flaws.append(f"field 'norms': the rows of slots [0, {filled}) must hold the norms of their "
                         "keys (docs/spec.md §2)")
        elif positions:
            flaws.append(
                f"field 'positions': its {filled - real} padding rows must fill the first slots at "
                f"increasing positions from their slots up (below its first position {lo}), its {real} "
                f"real rows the others, at positions in [{lo}, {cache.timeline})")
        else:
            flaws.append(None)
    return flaws
