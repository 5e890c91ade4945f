"""Argument checks of SPEC section 4, run before any work on every backend.

The native ops check the same conditions again (their bindings are reachable
from Python); checking here first keeps the fallback's errors identical and
lets a failed call raise before anything is scheduled.
"""

from __future__ import annotations

import operator

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
    """``value`` as a Python int. Python and NumPy integers pass; floats and
    bools posing as counts raise, so ``budget=512.0`` fails loudly instead of
    truncating."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"mlx_knorm: {name} must be an int, got {type(value).__name__}")


def check_config(budget: int, n_sink: int, recent: int, keep: str) -> None:
    """The eviction configuration shared by every call and by init_knorm_state."""
    check_int(budget, "budget")
    check_int(n_sink, "n_sink")
    check_int(recent, "recent")
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


def check_key_norms_args(keys: mx.array) -> None:
    check_floating(keys, "keys")
    if keys.ndim < 1:
        raise ValueError("mlx_knorm: keys must have at least one axis [..., D], got a scalar")


def _mismatch(what: str, a_name: str, a: mx.array, b_name: str, b: mx.array) -> ValueError:
    return ValueError(
        f"mlx_knorm: {what}: {a_name} {list(a.shape)} vs {b_name} {list(b.shape)}"
    )


def check_gather_args(
    prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms=None
) -> None:
    """Shapes and dtypes of one batched step; new_norms is optional because
    the state API computes it from new_keys."""
    named = [
        ("prior_keys", prior_keys, 3),
        ("prior_values", prior_values, 3),
        ("prior_norms", prior_norms, 2),
        ("new_keys", new_keys, 3),
        ("new_values", new_values, 3),
    ]
    if new_norms is not None:
        named.append(("new_norms", new_norms, 2))
    for name, x, ndim in named:
        check_array(x, name)
        check_rank(x, ndim, name)
    for name, x, _ in named[:2] + named[3:5]:
        check_floating(x, name)
    for name, x, _ in named:
        if name.endswith("norms") and x.dtype != mx.float32:
            raise TypeError(f"mlx_knorm: {name} must be float32, got {dtype_name(x.dtype)}")
    if prior_keys.shape != prior_values.shape:
        raise _mismatch("keys/values shape mismatch", "prior_keys", prior_keys, "prior_values", prior_values)
    if new_keys.shape != new_values.shape:
        raise _mismatch("keys/values shape mismatch", "new_keys", new_keys, "new_values", new_values)
    if prior_keys.shape[0] != new_keys.shape[0] or prior_keys.shape[2] != new_keys.shape[2]:
        raise _mismatch("prior vs new mismatch in N or D", "prior_keys", prior_keys, "new_keys", new_keys)
    if tuple(prior_norms.shape) != tuple(prior_keys.shape[:2]):
        raise _mismatch("prior_norms must be [N, n_prior]", "prior_norms", prior_norms, "prior_keys", prior_keys)
    if new_norms is not None and tuple(new_norms.shape) != tuple(new_keys.shape[:2]):
        raise _mismatch("new_norms must be [N, S]", "new_norms", new_norms, "new_keys", new_keys)
    if prior_keys.shape[1] + new_keys.shape[1] > 2**32 - 1:
        raise ValueError("mlx_knorm: n_prior + S must fit in uint32 row indices")
