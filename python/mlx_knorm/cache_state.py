"""The checks every change of an ``L2NormKVCache`` goes through
(docs/spec.md §8): a whole state, as it is loaded (``check_state``), and a
block that ``update_and_fetch`` absorbs (``check_block``), from which the
step builds a state that passes ``check_state`` by construction. So what a
cache accepts is what ``save_prompt_cache`` writes and ``load_prompt_cache``
reads back, and a refused change raises, naming the argument or field,
before anything changes."""

from __future__ import annotations

import re
from typing import NamedTuple

import mlx.core as mx

from .backend import check_key_width
from .ops.evict_and_fill import check_layout
from .ops.key_norms import key_norms_unchecked
from .validation import INT32_MAX, check_config, check_floating, check_int, dtype_name

FIELDS = ("keys", "values", "norms", "positions", "offset", "budget", "n_sink", "recent", "keep", "layout")
META_FIELDS = FIELDS[5:]
STORAGE_DTYPES = (mx.float16, mx.bfloat16)


class CheckedState(NamedTuple):
    config: tuple[int, int, int, str]
    layout: str
    offset: int
    # keys, values, norms, positions [B, H, kept, ...], or None for an empty cache.
    rows: tuple[mx.array, mx.array, mx.array, mx.array] | None


class StateError(ValueError):
    """A state field that fails the load check. ``setting`` is the
    configuration field whose value the stored rows cannot satisfy, where
    one is to blame (a sink position missing: ``n_sink``)."""

    def __init__(self, field: str, message: str, setting: str | None = None):
        super().__init__(f"mlx_knorm: L2NormKVCache state field '{field}': {message}")
        self.field = field
        self.setting = setting


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
        raise StateError("offset", f"must be in [0, 2**31), got {offset}")
    arrays = dict(keys=keys, values=values, norms=norms, positions=positions)
    if all(a is None for a in arrays.values()):
        if offset != 0:
            raise StateError("keys", f"no rows are stored but offset is {offset}")
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
        raise StateError("norms", "differ from the norms of the stored keys (docs/spec.md §2)")
    return CheckedState(config, layout, offset, (keys, values, norms, positions))


def _check_shapes_and_dtypes(keys, values, norms, positions, kept: int) -> None:
    if keys.ndim != 4:
        raise StateError("keys", f"must be [B, H, kept, D_k], got shape {list(keys.shape)}")
    batch, heads, rows, _ = keys.shape
    if rows != kept:
        raise StateError(
            "keys", f"holds {rows} rows per head; offset and budget give {kept}", setting="budget"
        )
    if keys.dtype not in STORAGE_DTYPES:
        raise StateError("keys", f"must be float16 or bfloat16, got {dtype_name(keys.dtype)}")
    check_key_width(keys.shape[-1], "L2NormKVCache state field 'keys'")
    if values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
        raise StateError("values", f"shape {list(values.shape)} does not fit keys {list(keys.shape)}")
    if values.dtype != keys.dtype:
        raise StateError("values", f"dtype {dtype_name(values.dtype)} differs from keys {dtype_name(keys.dtype)}")
    for field, a, dtype in (("norms", norms, mx.float32), ("positions", positions, mx.int32)):
        if tuple(a.shape) != (batch, heads, rows):
            raise StateError(field, f"must be [B, H, kept] = {[batch, heads, rows]}, got {list(a.shape)}")
        if a.dtype != dtype:
            raise StateError(field, f"must be {dtype_name(dtype)}, got {dtype_name(a.dtype)}")


def _check_positions(positions: mx.array, offset: int, n_sink: int, recent: int) -> None:
    """Increasing, inside ``[0, offset)``, and holding every protected
    position: the sinks and the recent window are never evicted. Vacuous
    without rows or without heads (``B`` or ``H`` of 0)."""
    rows = positions.shape[-1]
    if positions.size == 0:
        return
    if not mx.all(positions[..., 1:] > positions[..., :-1]).item():
        raise StateError("positions", "must increase along each head's rows")
    if positions[..., 0].min().item() < 0 or positions[..., -1].max().item() >= offset:
        raise StateError("positions", f"must lie in [0, offset={offset})")
    sinks = min(n_sink, rows)
    window = min(recent, rows - sinks)
    for setting, held, protected, what in (
        ("n_sink", positions[..., :sinks], (0, sinks), "sink positions"),
        ("recent", positions[..., rows - window :], (offset - window, offset), "recent window"),
    ):
        if not mx.all(held == mx.arange(*protected, dtype=mx.int32)).item():
            raise StateError(
                "positions",
                f"must hold the {what} [{protected[0]}, {protected[1]})",
                setting=setting,
            )


def check_block(keys, values, stored: tuple[mx.array, mx.array] | None, offset: int) -> None:
    """A block for ``update_and_fetch``: ``keys [B, H, S, D_k]`` and
    ``values [B, H, S, D_v]``, floating, against the stored key and value
    buffers ``[B, H, C, D]`` (None before the first block). The same on the
    first call and every later one, and on every backend. Runs on every
    decode step of every layer, so each shape is read once."""
    for name, x in (("keys", keys), ("values", values)):
        check_floating(x, name)
    key_shape, value_shape = keys.shape, values.shape
    for name, shape in (("keys", key_shape), ("values", value_shape)):
        if len(shape) != 4:
            raise ValueError(
                f"mlx_knorm: L2NormKVCache.update_and_fetch: {name} must be [B, H, S, D] "
                f"(rank 4), got shape {list(shape)}"
            )
    if key_shape[:3] != value_shape[:3]:
        raise ValueError(
            "mlx_knorm: L2NormKVCache.update_and_fetch: keys and values must agree in "
            f"B, H and S: keys {list(key_shape)} vs values {list(value_shape)}"
        )
    if stored is None:
        # Later blocks keep this width, and a loaded state was checked for it.
        check_key_width(key_shape[3], "keys")
    else:
        stored_keys, stored_values = stored
        batch, heads, _, key_dim = stored_keys.shape
        value_dim = stored_values.shape[3]
        if key_shape[:2] != (batch, heads) or key_shape[3] != key_dim or value_shape[3] != value_dim:
            raise ValueError(
                f"mlx_knorm: L2NormKVCache holds [B, H, rows, D] = [{batch}, {heads}, rows, "
                f"{key_dim}] keys and [..., {value_dim}] values; got keys {list(key_shape)} "
                f"and values {list(value_shape)}"
            )
    if offset + key_shape[2] > INT32_MAX:
        raise ValueError(
            f"mlx_knorm: L2NormKVCache positions are int32: offset {offset} + "
            f"{key_shape[2]} new tokens must be < 2**31"
        )


def parse_meta_state(meta_state) -> tuple:
    """``(budget, n_sink, recent, keep, layout)`` from ``meta_state``: the
    integers as decimal strings (as ``L2NormKVCache.meta_state`` gives
    them) or ints; raises naming the field."""
    if not isinstance(meta_state, (tuple, list)) or len(meta_state) != len(META_FIELDS):
        count = len(meta_state) if isinstance(meta_state, (tuple, list)) else type(meta_state).__name__
        raise ValueError(
            f"mlx_knorm: L2NormKVCache meta_state must have the {len(META_FIELDS)} fields "
            f"({', '.join(META_FIELDS)}), got {count}"
        )
    numbers = []
    for field, value in zip(META_FIELDS[:3], meta_state):
        if isinstance(value, str):
            if not re.fullmatch(r"[+-]?[0-9]+", value):
                raise ValueError(
                    f"mlx_knorm: L2NormKVCache meta_state field '{field}' must be a decimal "
                    f"integer, got {value!r}"
                )
            value = int(value)
        numbers.append(check_int(value, f"meta_state field '{field}'"))
    return (*numbers, *meta_state[3:])
