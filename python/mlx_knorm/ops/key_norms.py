"""``key_norms`` (docs/spec.md §2): the public op, its checks, the dispatch to
the native kernel, the Metal emulator or the fallback, and the fallback."""

from __future__ import annotations

import mlx.core as mx

from ..backend import resolve
from ..validation import check_floating
from .common import on_stream, run_native, shape_pinned, without_transforms

_SMALLEST_NORMAL = 2.0**-126
_CANONICAL_NAN_BITS = 0x7FC00000


def key_norms(keys: mx.array, *, stream=None) -> mx.array:
    """float32 L2 norm of each row of ``keys [..., D]``, docs/spec.md §2 exactly."""
    check_keys(keys)
    return _run(resolve(stream, key_dim=keys.shape[-1]), keys, stream)


def check_keys(keys) -> None:
    check_floating(keys, "keys")
    if keys.ndim < 1:
        raise ValueError("mlx_knorm: keys must have at least one axis [..., D], got a scalar")


def key_norms_unchecked(keys: mx.array, stream=None) -> mx.array:
    """``key_norms`` for callers that checked ``keys`` already (the state API,
    the cache): the native op checks again in C++, so only the fallback runs
    the Python checks, and every backend refuses the same calls."""
    backend = resolve(stream, key_dim=keys.shape[-1])
    if backend == "fallback":
        check_keys(keys)
    return _run(backend, keys, stream)


def _run(backend: str, keys: mx.array, stream) -> mx.array:
    if backend == "fallback":
        with on_stream(stream):
            return fallback(keys)
    return run_native(backend, "key_norms", keys, stream=stream)


@without_transforms("key_norms")
def fallback(keys: mx.array) -> mx.array:
    """The pure-MLX norm, bit-identical to the kernels: docs/spec.md §2
    literally, in the pinned halving order (never ``mx.sum``, whose order
    differs between devices)."""
    x = shape_pinned(keys).astype(mx.float32)
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
    # Built on the call's stream: an array built lazily at import belongs to
    # the stream that was default then (in a forked child, one whose thread
    # is gone).
    canonical_nan = mx.array(_CANONICAL_NAN_BITS, mx.uint32).view(mx.float32)
    return mx.where(mx.isnan(norms), canonical_nan, norms)
