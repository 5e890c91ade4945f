"""Argument checks of SPEC section 4, run before any work on every backend.

The native ops check the same conditions again (their bindings are reachable
from Python); checking here first keeps the fallback's errors identical and
lets a failed call raise before anything is scheduled.
"""

from __future__ import annotations

import numbers

import mlx.core as mx

FLOATING = (mx.float16, mx.bfloat16, mx.float32)
KEEP_CHOICES = ("low", "high")


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def check_array(x, name: str) -> None:
    if not isinstance(x, mx.array):
        raise TypeError(f"mlx_knorm: {name} must be an mlx.core.array, got {type(x).__name__}")


def check_floating(x: mx.array, name: str) -> None:
    check_array(x, name)
    if x.dtype not in FLOATING:
        raise TypeError(
            f"mlx_knorm: {name} must be float16, bfloat16 or float32, got {dtype_name(x.dtype)}"
        )


def check_rank(x: mx.array, ndim: int, name: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"mlx_knorm: {name} must have rank {ndim}, got shape {list(x.shape)}")


def check_int(value, name: str) -> int:
    """``value`` as a Python int, the form every later check and call uses.

    Python and NumPy integers pass (NumPy's fixed-width integers would wrap
    in later arithmetic, so they are converted here); floats, bools, arrays
    and None raise, so ``budget=512.0`` fails loudly instead of truncating.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"mlx_knorm: {name} must be an int, got {type(value).__name__}")


def check_config(budget, n_sink, recent, keep) -> tuple[int, int, int, str]:
    """The eviction configuration shared by every call, the state API and the
    cache, returned as Python ints: callers use the returned values only."""
    budget = check_int(budget, "budget")
    n_sink = check_int(n_sink, "n_sink")
    recent = check_int(recent, "recent")
    if not isinstance(keep, str):
        raise TypeError(f"mlx_knorm: keep must be a str, got {type(keep).__name__}")
    if keep not in KEEP_CHOICES:
        raise ValueError(f"mlx_knorm: keep must be 'low' or 'high', got {keep!r}")
    if budget < 1:
        raise ValueError(f"mlx_knorm: budget must be >= 1, got {budget}")
    if n_sink < 0:
        raise ValueError(f"mlx_knorm: n_sink must be >= 0, got {n_sink}")
    if recent < 0:
        raise ValueError(f"mlx_knorm: recent must be >= 0, got {recent}")
    if n_sink + recent >= budget:
        raise ValueError(
            f"mlx_knorm: n_sink ({n_sink}) + recent ({recent}) must be < budget ({budget}): "
            "no evictable positions remain"
        )
    if budget > 2**31 - 1:
        raise ValueError(f"mlx_knorm: budget must be < 2**31, got {budget}")
    return budget, n_sink, recent, keep


def check_key_norms_args(keys: mx.array) -> None:
    check_floating(keys, "keys")
    if keys.ndim < 1:
        raise ValueError("mlx_knorm: keys must have at least one axis [..., D], got a scalar")


def _mismatch(what: str, a_name: str, a: mx.array, b_name: str, b: mx.array) -> ValueError:
    return ValueError(
        f"mlx_knorm: {what}: {a_name} {list(a.shape)} vs {b_name} {list(b.shape)}"
    )


def check_block_args(prior_keys, prior_values, prior_norms, new_keys, new_values) -> None:
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
    check_norms_dtype(prior_norms, "prior_norms")
    for keys_name, keys, values_name, values in (
        ("prior_keys", prior_keys, "prior_values", prior_values),
        ("new_keys", new_keys, "new_values", new_values),
    ):
        if keys.shape[:2] != values.shape[:2]:
            raise _mismatch("keys/values mismatch in N or rows", keys_name, keys, values_name, values)
    if prior_keys.shape[0] != new_keys.shape[0] or prior_keys.shape[2] != new_keys.shape[2]:
        raise _mismatch("prior vs new mismatch in N or D", "prior_keys", prior_keys, "new_keys", new_keys)
    if prior_values.shape[2] != new_values.shape[2]:
        raise _mismatch(
            "prior vs new mismatch in N or D", "prior_values", prior_values, "new_values", new_values
        )
    if tuple(prior_norms.shape) != tuple(prior_keys.shape[:2]):
        raise _mismatch("prior_norms must be [N, n_prior]", "prior_norms", prior_norms, "prior_keys", prior_keys)
    if prior_keys.shape[1] + new_keys.shape[1] > 2**32 - 1:
        raise ValueError("mlx_knorm: n_prior + S must fit in uint32 row indices")


def check_norms_dtype(norms, name: str) -> None:
    if norms.dtype != mx.float32:
        raise TypeError(f"mlx_knorm: {name} must be float32, got {dtype_name(norms.dtype)}")


def check_new_norms(new_norms, new_keys: mx.array) -> None:
    """The norms a caller passes for a new block: float32 ``[N, S]``."""
    check_array(new_norms, "new_norms")
    check_rank(new_norms, 2, "new_norms")
    check_norms_dtype(new_norms, "new_norms")
    if tuple(new_norms.shape) != tuple(new_keys.shape[:2]):
        raise _mismatch("new_norms must be [N, S]", "new_norms", new_norms, "new_keys", new_keys)
