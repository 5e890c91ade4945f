"""What both ops share: running on the chosen backend, and the shape pin of
their fallbacks."""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import _native
from ..backend import emulator_stream


def on_stream(stream):
    """Where a fallback runs: the caller's stream, or MLX's default."""
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


def run_native(backend: str, name: str, *args, stream=None):
    """The extension's op ``name`` on ``backend`` (from
    ``mlx_knorm.backend.resolve``): the native kernel on ``stream``, or with
    ``"metal-emulator"`` the Metal kernel run by the emulator on a CPU stream
    (a GPU ``stream`` is refused)."""
    op = getattr(_native.ext, name)
    if backend == "metal-emulator":
        return op(*args, emulate_metal=True, stream=emulator_stream(stream))
    return op(*args, stream=stream)


def shape_pinned(x: mx.array) -> mx.array:
    """``x`` as a dense view that ``mx.compile(shapeless=True)`` refuses to trace.

    The fallbacks compute their selection (and the norm's padding) from the
    input shapes in Python, so a graph traced for one shape would give wrong
    results when replayed for another (docs/spec.md §6). MLX cannot infer the
    output shape of ``as_strided``, so a shapeless compilation raises instead
    ("AsStrided cannot infer output shapes"); eagerly and under ordinary
    ``mx.compile`` it is a view.
    """
    return mx.as_strided(x, x.shape)
