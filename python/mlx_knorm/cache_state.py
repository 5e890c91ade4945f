"""Checks of a saved ``L2NormKVCache`` state before it is loaded
(docs/spec.md §8): every field against the others and the configuration, so
that a tampered or mismatched prompt-cache file raises here, naming the
field, instead of at the next step or inside RoPE."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .ops.evict_and_fill import check_layout
from .ops.key_norms import key_norms_unchecked
from .validation import INT32_MAX, check_config, check_int, dtype_name

FIELDS = ("keys", "values", "norms", "positions", "offset", "budget", "n_sink", "recent", "keep", "layout")
STORAGE_DTYPES = (mx.float16, mx.bfloat16)


class CheckedState(NamedTuple):
    config: tuple[int, int, int, str]
    layout: str
    offset: int
    # keys, values, norms, positions [B, H, kept, ...], or None for an empty cache.
    rows: tuple[mx.array, mx.array, mx.array, mx.array] | None


def _error(field: str, message: str) -> ValueError:
    return ValueError(f"mlx_knorm: L2NormKVCache state field '{field}': {message}")


def check_state(state) -> CheckedState:
    """The state as ``L2NormKVCache.state`` writes it, checked; raises
    ``ValueError``/``TypeError`` naming the field that is wrong."""
    if not isinstance(state, (tuple, list)) or len(state) != len(FIELDS):
        count = len(state) if isinstance(state, (tuple, list)) else type(state).__name__
        raise ValueError(
            f"mlx_knorm: L2NormKVCache state must have the {len(FIELDS)} fields "
            f"({', '.join(FIELDS)}), got {count}"
        )
    keys, values, norms, positions, offset, budget, n_sink, recent, keep, layout = state
    config = check_config(budget, n_sink, recent, keep)
    budget, n_sink, recent, _ = config
    layout = check_layout(layout)
    offset = check_int(offset, "offset")
    if not 0 <= offset <= INT32_MAX:
        raise _error("offset", f"must be in [0, 2**31), got {offset}")
    arrays = dict(keys=keys, values=values, norms=norms, positions=positions)
    if all(a is None for a in arrays.values()):
        if offset != 0:
            raise _error("keys", f"no rows are stored but offset is {offset}")
        return CheckedState(config, layout, offset, None)
    for field, a in arrays.items():
        if not isinstance(a, mx.array):
            raise TypeError(
                f"mlx_knorm: L2NormKVCache state field '{field}' must be an mlx.core.array, "
                f"got {type(a).__name__}"
            )
    _check_shapes_and_dtypes(keys, values, norms, positions, min(offset, budget))
    _check_positions(positions, offset, n_sink, recent)
    stored = key_norms_unchecked(keys)
    if not mx.array_equal(stored.view(mx.uint32), norms.view(mx.uint32)).item():
        raise _error("norms", "differ from the norms of the stored keys (docs/spec.md §2)")
    return CheckedState(config, layout, offset, (keys, values, norms, positions))


def _check_shapes_and_dtypes(keys, values, norms, positions, kept: int) -> None:
    if keys.ndim != 4:
        raise _error("keys", f"must be [B, H, kept, D_k], got shape {list(keys.shape)}")
    batch, heads, rows, _ = keys.shape
    if rows != kept:
        raise _error("keys", f"holds {rows} rows per head; offset and budget give {kept}")
    if keys.dtype not in STORAGE_DTYPES:
        raise _error("keys", f"must be float16 or bfloat16, got {dtype_name(keys.dtype)}")
    if values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
        raise _error("values", f"shape {list(values.shape)} does not fit keys {list(keys.shape)}")
    if values.dtype != keys.dtype:
        raise _error("values", f"dtype {dtype_name(values.dtype)} differs from keys {dtype_name(keys.dtype)}")
    for field, a, dtype in (("norms", norms, mx.float32), ("positions", positions, mx.int32)):
        if tuple(a.shape) != (batch, heads, rows):
            raise _error(field, f"must be [B, H, kept] = {[batch, heads, rows]}, got {list(a.shape)}")
        if a.dtype != dtype:
            raise _error(field, f"must be {dtype_name(dtype)}, got {dtype_name(a.dtype)}")


def _check_positions(positions: mx.array, offset: int, n_sink: int, recent: int) -> None:
    """Increasing, inside ``[0, offset)``, and holding every protected
    position: the sinks and the recent window are never evicted."""
    rows = positions.shape[-1]
    if rows == 0:
        return
    if not mx.all(positions[..., 1:] > positions[..., :-1]).item():
        raise _error("positions", "must increase along each head's rows")
    if positions[..., 0].min().item() < 0 or positions[..., -1].max().item() >= offset:
        raise _error("positions", f"must lie in [0, offset={offset})")
    sinks = min(n_sink, rows)
    window = min(recent, rows - sinks)
    protected = mx.concatenate(
        [mx.arange(sinks, dtype=mx.int32), mx.arange(offset - window, offset, dtype=mx.int32)]
    )
    held = mx.concatenate([positions[..., :sinks], positions[..., rows - window :]], axis=-1)
    if not mx.all(held == protected).item():
        raise _error(
            "positions",
            f"must hold the sink positions [0, {sinks}) and the recent window "
            f"[{offset - window}, {offset})",
        )
