"""The two public ops, dispatched to the native kernel or the fallback.

Each public op validates its arguments, then runs an unchecked twin; the
state API validates once and calls the twins directly, so a decode step pays
for its checks once.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from . import _native, fallback
from .backend import emulator_stream, resolve
from .validation import (
    check_block_args,
    check_config,
    check_key_norms_args,
    check_new_norms,
    dtype_name,
)


def _stream_scope(stream):
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


def key_norms(keys: mx.array, *, stream=None) -> mx.array:
    """float32 L2 norm of each row of ``keys [..., D]``, SPEC section 2 exactly."""
    check_key_norms_args(keys)
    return key_norms_unchecked(keys, stream)


def key_norms_unchecked(keys: mx.array, stream=None) -> mx.array:
    backend = resolve(stream, key_dim=keys.shape[-1])
    if backend == "fallback":
        with _stream_scope(stream):
            return fallback.key_norms(keys)
    if backend == "metal-emulator":
        return _native.ext.key_norms(keys, emulate_metal=True, stream=emulator_stream(stream))
    return _native.ext.key_norms(keys, stream=stream)


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
    """Protected top-k + temporal-order gather over ``prior ++ new`` (SPEC section 3).

    Returns ``(keys, values, norms, indices)``: ``[N, kept, D]`` twice,
    float32 ``[N, kept]`` and uint32 ``[N, kept]``, ``kept = min(n_prior + S,
    budget)``. ``new_keys``/``new_values`` must have the dtypes of
    ``prior_keys``/``prior_values``.
    """
    budget, n_sink, recent, keep = check_config(budget, n_sink, recent, keep)
    check_block_args(prior_keys, prior_values, prior_norms, new_keys, new_values)
    check_new_norms(new_norms, new_keys)
    for name, new, prior in (
        ("new_keys", new_keys, prior_keys),
        ("new_values", new_values, prior_values),
    ):
        if new.dtype != prior.dtype:
            raise TypeError(
                f"mlx_knorm: {name} dtype {dtype_name(new.dtype)} must equal "
                f"prior dtype {dtype_name(prior.dtype)}"
            )
    return protected_topk_gather_unchecked(
        prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms,
        budget, n_sink, recent, keep, stream,
    )


def protected_topk_gather_unchecked(
    prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms,
    budget, n_sink, recent, keep, stream=None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    args = (prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms,
            budget, n_sink, recent, keep)
    backend = resolve(stream)
    if backend == "fallback":
        with _stream_scope(stream):
            return fallback.protected_topk_gather(*args)
    if backend == "metal-emulator":
        return tuple(
            _native.ext.protected_topk_gather(*args, emulate_metal=True, stream=emulator_stream(stream))
        )
    return tuple(_native.ext.protected_topk_gather(*args, stream=stream))
