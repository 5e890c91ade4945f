"""``row_scores`` (docs/spec.md §2a): the public op, its checks, the dispatch
to the native kernel, the Metal emulator or the fallback, and the fallback."""

from __future__ import annotations

import mlx.core as mx

from ..backend import resolve
from ..validation import (INT32_MAX, check_array, check_float32, check_floating, check_int, check_int32,
                          check_same_dtype, shape_mismatch)
from .common import on_stream, run_native, shape_pinned, without_transforms
from .key_norms import fallback as key_norms_fallback

SCORERS = ("knorm", "vnorm", "qfilter", "keydiff")
# What each scorer reads besides the keys: the values (vnorm), a float32
# vector per head (qfilter's filter, keydiff's running sum of unit keys).
USES_VALUES = frozenset({"vnorm"})
USES_STATE = frozenset({"qfilter", "keydiff"})

_SMALLEST_NORMAL = 2.0**-126
_CANONICAL_NAN_BITS = 0x7FC00000


def row_scores(keys: mx.array, values: mx.array | None = None, state: mx.array | None = None, *,
               scorer: str, offset: int = 0, valid: mx.array | None = None, stream=None):
    """float32 scores of the rows of ``keys [..., S, D]`` (the leading axes
    the heads), docs/spec.md §2a exactly: ``(scores [..., S], state)``.

    ``scorer``: ``"knorm"`` (the key's norm), ``"vnorm"`` (the key's norm
    over the value's; ``values [..., S, D_v]``), ``"qfilter"`` (minus the
    key's projection on ``state [..., D]``, its head's filter) or
    ``"keydiff"`` (the key's cosine similarity to ``state`` plus the unit
    keys of its head's earlier rows; the returned state is the sum after the
    block). Lower scores are kept first. With ``valid [..., 2]`` int32, a row
    whose position ``offset + j`` lies outside its head's ``[lo, hi)`` is
    padding: score ``+0``, and keydiff's sum skips it. The returned state is
    None for knorm and vnorm, ``state`` itself for qfilter.
    """
    check_row_scores(keys, values, state, scorer, offset, valid)
    width = max(keys.shape[-1], 0 if values is None else values.shape[-1])
    return _run(resolve(stream, key_dim=width), keys, values, state, scorer, offset, valid, stream)


def check_row_scores(keys, values, state, scorer, offset, valid) -> None:
    if scorer not in SCORERS:
        raise ValueError(f"mlx_knorm: scorer must be one of {SCORERS}, got {scorer!r}")
    check_floating(keys, "keys")
    if keys.ndim < 2:
        raise ValueError(f"mlx_knorm: keys must be [..., S, D], got {keys.ndim} axes")
    lead = keys.shape[:-2]
    for name, given, needed in (("values", values, scorer in USES_VALUES),
                                ("state", state, scorer in USES_STATE)):
        if (given is not None) != needed:
            raise ValueError(f"mlx_knorm: the {scorer} scorer " + ("needs " if needed else "takes no ") + name)
    if values is not None:
        check_array(values, "values")
        check_same_dtype(values, "values", keys, "keys")
        if values.shape[:-1] != keys.shape[:-1]:
            raise shape_mismatch("values must be [..., S, D_v] with the keys' heads and rows",
                                 "values", values, "keys", keys)
    if state is not None:
        check_float32(state, "state")
        if state.shape != (*lead, keys.shape[-1]):
            raise shape_mismatch("state must be [..., D] per head of keys", "state", state, "keys", keys)
    if valid is not None:
        check_int32(valid, "valid")
        if valid.shape != (*lead, 2):
            raise shape_mismatch("valid must be [..., 2] per head of keys", "valid", valid, "keys", keys)
    offset = check_int(offset, "offset")
    if offset < 0 or offset + keys.shape[-2] > INT32_MAX:
        raise ValueError(f"mlx_knorm: offset ({offset}) must be >= 0 with offset + S < 2**31")


def _run(backend, keys, values, state, scorer, offset, valid, stream):
    if backend == "fallback":
        with on_stream(stream):
            arrays = [keys] + [a for a in (values, state, valid) if a is not None]
            out = fallback(*arrays, scorer=scorer, offset=offset, has_valid=valid is not None)
    else:
        out = run_native(backend, "row_scores", keys, values, state, scorer=scorer, offset=offset, valid=valid,
                         stream=stream)
    scores = out[0]
    if scorer == "keydiff":
        return scores, out[1]
    return scores, state


def _flushed(x: mx.array) -> mx.array:
    """docs/spec.md §2a: below the smallest normal float, +0 (NaN passes)."""
    return mx.where(mx.abs(x) < _SMALLEST_NORMAL, mx.array(0.0, mx.float32), x)


def _canonical(x: mx.array) -> mx.array:
    nan = mx.array(_CANONICAL_NAN_BITS, mx.uint32).view(mx.float32)
    return mx.where(mx.isnan(x), nan, x)


def _pinned_sum(terms: mx.array) -> mx.array:
    """The pinned sum of the last axis: padding to a power of two, halving
    adds, each flushed (never ``mx.sum``, whose order differs by device)."""
    dim = terms.shape[-1]
    width = 1
    while width < dim:
        width *= 2
    if width > dim:
        terms = mx.concatenate([terms, mx.zeros((*terms.shape[:-1], width - dim), mx.float32)], axis=-1)
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = _flushed(terms[..., :half] + terms[..., half:])
    return terms[..., 0]


def _dot(x: mx.array, y: mx.array) -> mx.array:
    return _pinned_sum(_flushed(x * y))


def _real(offset: int, rows: int, valid: mx.array | None) -> mx.array | None:
    """bool ``[..., S]``: the rows whose positions lie in their head's range."""
    if valid is None:
        return None
    positions = mx.arange(offset, offset + rows, dtype=mx.int32)
    return (positions >= valid[..., :1]) & (positions < valid[..., 1:])


@without_transforms("row_scores")
def fallback(keys, *arrays, scorer: str, offset: int, has_valid: bool):
    """The pure-MLX scores, bit-identical to the kernels: docs/spec.md §2a
    literally, in its pinned order; keydiff row by row (all heads at once)."""
    arrays = list(arrays)
    valid = arrays.pop() if has_valid else None
    values = arrays.pop(0) if scorer in USES_VALUES else None
    state = arrays.pop(0) if scorer in USES_STATE else None
    keys = shape_pinned(keys)
    rows = keys.shape[-2]
    real = _real(offset, rows, valid)
    zero = mx.array(0.0, mx.float32)
    if scorer == "keydiff":
        return _keydiff(keys, state, real)
    if scorer == "knorm":
        scores = key_norms_fallback(keys)
    elif scorer == "vnorm":
        scores = _canonical(_flushed(key_norms_fallback(keys) / key_norms_fallback(shape_pinned(values))))
    else:
        scores = _canonical(_flushed(-_dot(keys.astype(mx.float32), state[..., None, :])))
    return [scores if real is None else mx.where(real, scores, zero)]


def _keydiff(keys: mx.array, state: mx.array, real: mx.array | None) -> list:
    zero = mx.array(0.0, mx.float32)
    nan = mx.array(_CANONICAL_NAN_BITS, mx.uint32).view(mx.float32)
    total = state
    scores = []
    for j in range(keys.shape[-2]):
        k = keys[..., j, :].astype(mx.float32)
        norm = key_norms_fallback(k)
        finite = ~(mx.isnan(norm) | mx.isinf(norm))
        denominator = _flushed(norm * key_norms_fallback(total))
        projection = _dot(k, total)
        safe = mx.where(denominator == 0, mx.array(1.0, mx.float32), denominator)
        score = mx.where(denominator == 0, zero, _canonical(_flushed(projection / safe)))
        score = mx.where(finite, score, nan)
        joins = finite & (norm != 0)
        if real is not None:
            score = mx.where(real[..., j], score, zero)
            joins = joins & real[..., j]
        safe_norm = mx.where(joins, norm, mx.array(1.0, mx.float32))[..., None]
        total = mx.where(joins[..., None], _flushed(total + _flushed(k / safe_norm)), total)
        scores.append(score)
    if not scores:
        return [mx.zeros((*keys.shape[:-1],), mx.float32), total]
    return [mx.stack(scores, axis=-1), total]
