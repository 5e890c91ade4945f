"""Loads the compiled extension, or records why it could not be loaded.

``import mlx_knorm`` must work without the extension (a source checkout, or a
build against another MLX), so a failure here is recorded and reported once,
and the ``auto`` backend then uses the pure-MLX fallback.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

ext = None
load_error: str | None = None

try:
    from . import _ext as ext  # type: ignore[attr-defined, no-redef]
except ImportError as err:  # missing or unloadable shared object
    load_error = f"extension not importable: {err}"
else:
    if ext.built_mlx_version != mx.__version__:
        load_error = (
            f"extension built against MLX {ext.built_mlx_version}, "
            f"running MLX {mx.__version__}"
        )
        ext = None

if load_error is not None:
    warnings.warn(
        f"mlx_knorm: native kernels unavailable ({load_error}); "
        "using the pure-MLX fallback",
        RuntimeWarning,
        stacklevel=2,
    )
