"""What the ops share: running on the chosen backend, and what their
fallbacks share with the primitives: the shape pin and no transforms."""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import _native
from ..backend import emulator_stream


def on_stream(stream):
    """Where a fallback runs: the caller's stream, or MLX's default."""
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


def run_native(backend: str, name: str, *args, stream=None, **kwargs):
    """The extension's op ``name`` on ``backend`` (from
    ``mlx_knorm.backend.resolve``): the native kernel on ``stream``, or with
    ``"metal-emulator"`` the Metal kernel run by the emulator on a CPU stream
    (a GPU ``stream`` is refused)."""
    op = getattr(_native.ext, name)
    if backend == "metal-emulator":
        return op(*args, **kwargs, emulate_metal=True, stream=emulator_stream(stream))
    return op(*args, **kwargs, stream=stream)


def shape_pinned(x: mx.array) -> mx.array:
    """``x`` as a dense view that ``mx.compile(shapeless=True)`` refuses to trace.

    The fallbacks compute their selection (and the norm's padding) from the
    input shapes in Python, so a graph traced for one shape would give wrong
    results when replayed for another (docs/spec.md §6). MLX cannot infer the
    output shape of ``as_strided``, so a shapeless compilation raises instead
    ("AsStrided cannot infer output shapes"); eagerly and under ordinary
    ``mx.compile`` it is a view. ``as_strided`` takes row-contiguous arrays
    only (a slice of a larger buffer, evaluated, raises when evaluated), so
    ``x`` is made contiguous first: a copy only where it is not, as the
    primitives copy such inputs.
    """
    return mx.as_strided(mx.contiguous(x), x.shape)


def without_transforms(op_name: str):
    """Decorator: the fallback of ``op_name`` as an ``mx.custom_function``
    whose ``vjp``, ``jvp`` and ``vmap`` raise ``ValueError``, as MLX raises
    for the primitives, which define none (docs/spec.md §6). Without it the
    fallback's MLX ops would differentiate, and the answer to ``mx.grad``
    would depend on the backend. Arrays are passed positionally (the
    function's traced inputs), the configuration by keyword."""

    def refuse(transform: str):
        def raise_for(*_, **__):
            raise ValueError(
                f"mlx_knorm: {op_name} defines no {transform} (docs/spec.md §6), "
                "on any backend"
            )

        return raise_for

    def wrap(fn):
        custom = mx.custom_function(fn)
        for transform in ("vjp", "jvp", "vmap"):
            getattr(custom, transform)(refuse(transform))
        return custom

    return wrap
