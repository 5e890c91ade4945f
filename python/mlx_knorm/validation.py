"""Argument checks shared by the ops, the state API and the cache
(docs/spec.md §6), run before any work on every backend.

The native ops check the same conditions again (their bindings are reachable
from Python); checking here first keeps the fallback's errors identical and
lets a failed call raise before anything is scheduled. Checks that concern
one op live in its module (``mlx_knorm.ops``).
"""

from __future__ import annotations

import numbers

import mlx.core as mx

# Key and value dtypes by name (docs/spec.md §5).
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
KEEP_CHOICES = ("low", "high")
# Rows of one head of a selection, and bytes of one key, value or payload
# row: below 2**31 (docs/spec.md §5), as csrc/common/validation.h says why.
MAX_HEAD_ROWS = 2**31 - 1
MAX_ROW_BYTES = 2**31 - 1
# Positions are int32, and so are MLX's shapes (docs/spec.md §5).
INT32_MAX = 2**31 - 1


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def check_array(x, name: str) -> None:
    if not isinstance(x, mx.array):
        raise TypeError(f"mlx_knorm: {name} must be an mlx.core.array, got {type(x).__name__}")


def check_floating(x: mx.array, name: str) -> None:
    check_array(x, name)
    if x.dtype not in FLOAT_DTYPES.values():
        raise TypeError(
            f"mlx_knorm: {name} must be float16, bfloat16 or float32, got {dtype_name(x.dtype)}"
        )


def check_float32(x: mx.array, name: str) -> None:
    if x.dtype != mx.float32:
        raise TypeError(f"mlx_knorm: {name} must be float32, got {dtype_name(x.dtype)}")


def check_int32(x: mx.array, name: str) -> None:
    """``x`` is int32 (the primitives' ``check_int32``)."""
    if x.dtype != mx.int32:
        raise TypeError(f"mlx_knorm: {name} must be int32, got {dtype_name(x.dtype)}")


def check_rank(x: mx.array, ndim: int, name: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"mlx_knorm: {name} must have rank {ndim}, got shape {list(x.shape)}")


def check_row_bytes(x: mx.array, name: str) -> None:
    """Rows of ``x`` (``[..., rows, W]``) of at most MAX_ROW_BYTES bytes."""
    row_bytes = x.shape[-1] * x.itemsize
    if row_bytes > MAX_ROW_BYTES:
        raise ValueError(
            f"mlx_knorm: {name} has rows of {row_bytes} bytes; rows must be < 2**31 bytes, "
            f"got shape {list(x.shape)}"
        )


def shape_mismatch(what: str, a_name: str, a: mx.array, b_name: str, b: mx.array) -> ValueError:
    return ValueError(
        f"mlx_knorm: {what}: {a_name} {list(a.shape)} vs {b_name} {list(b.shape)}"
    )


def check_same_dtype(a: mx.array, a_name: str, b: mx.array, b_name: str) -> None:
    """``a`` has ``b``'s dtype (the primitives' ``check_same_dtype``)."""
    if a.dtype != b.dtype:
        raise TypeError(
            f"mlx_knorm: {a_name} dtype {dtype_name(a.dtype)} must equal {b_name} dtype {dtype_name(b.dtype)}"
        )


def check_leading_axes(what: str, a_name: str, a: mx.array, b_name: str, b: mx.array, axes: int) -> None:
    """``a`` and ``b`` agree in their first ``axes`` axes (heads, then rows),
    else a shape mismatch naming both (the primitives' ``check_leading_axes``)."""
    if tuple(a.shape[:axes]) != tuple(b.shape[:axes]):
        raise shape_mismatch(what, a_name, a, b_name, b)


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
    if budget > INT32_MAX:
        raise ValueError(f"mlx_knorm: budget must be < 2**31, got {budget}")
    return budget, n_sink, recent, keep
