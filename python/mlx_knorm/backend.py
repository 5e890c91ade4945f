"""Which implementation runs each op: the native kernels or the fallback.

``"auto"`` (the default) uses the native kernel where one exists for the
stream's device and the pure-MLX fallback elsewhere; ``"kernel"`` insists on
the native kernel; ``"fallback"`` always uses the fallback;
``"metal-emulator"`` runs the Metal kernels through the CPU emulator of the
Metal execution model (slow; for testing), on the CPU: on ``stream`` when that
is a CPU stream or device, on the CPU's default stream when it is None, and a
GPU ``stream`` raises ``ValueError``. ``MLX_KNORM_BACKEND`` sets the default
for the whole process; ``use_backend`` overrides it for one thread or context.
"""

from __future__ import annotations

import contextvars
import functools
import os

import mlx.core as mx

from . import _native

BACKENDS = ("auto", "kernel", "fallback", "metal-emulator")

_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mlx_knorm_backend", default=None
)


def _check_name(name, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"mlx_knorm: {source} must be one of {BACKENDS}, got {name!r}")
    return name


ENVIRONMENT_VARIABLE = "MLX_KNORM_BACKEND"

# The variable's key in CPython's os.environ mapping (None elsewhere).
try:
    _ENVIRONMENT_KEY = os.environ.encodekey(ENVIRONMENT_VARIABLE)
except AttributeError:
    _ENVIRONMENT_KEY = None


def _environment_choice() -> str | None:
    """``MLX_KNORM_BACKEND`` as ``os.environ`` holds it now, or None. Read
    from CPython's mapping behind ``os.environ`` where there is one:
    ``os.environ.get`` raises and catches two KeyErrors when the variable is
    unset, half of what resolving the backend costs on every cache step."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if _ENVIRONMENT_KEY is None or type(data) is not dict:
        return environ.get(ENVIRONMENT_VARIABLE)
    value = data.get(_ENVIRONMENT_KEY)
    return None if value is None else environ.decodevalue(value)


def current_backend() -> str:
    """The backend chosen now: by ``use_backend``, else ``MLX_KNORM_BACKEND``, else auto."""
    name = _choice.get()
    if name is not None:
        return name
    name = _environment_choice()
    return "auto" if name is None else _check_name(name, ENVIRONMENT_VARIABLE)


class use_backend:
    """Choose the backend; a plain call sets it, ``with`` restores the previous one.

    >>> with mlx_knorm.use_backend("fallback"):
    ...     ...

    The choice lives in a ``contextvars.ContextVar``, so it applies to the
    calling thread (and to asyncio tasks and ``contextvars.copy_context()``
    copies made from it afterwards) only. Other threads, including threads
    started later, keep ``MLX_KNORM_BACKEND`` (read on every call) or
    ``"auto"``: call ``use_backend`` in each thread, or set
    ``MLX_KNORM_BACKEND`` for the whole process.
    """

    def __init__(self, name: str):
        _check_name(name, "backend name")
        if name != "fallback" and name != "auto":
            _require_extension(name)
        self._token = _choice.set(name)

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc) -> None:
        _choice.reset(self._token)


def native_available() -> bool:
    """True when the compiled extension loaded and matches the running MLX."""
    return _native.ext is not None


def _require_extension(name: str) -> None:
    if _native.ext is None:
        raise RuntimeError(
            f"mlx_knorm: backend {name!r} needs the native extension, which is "
            f"unavailable: {_native.load_error}"
        )


@functools.cache
def _gpu_kernels() -> bool:
    """Metal kernels built and a Metal device present: fixed for the process,
    and asked on every call, so answered once."""
    ext = _native.ext
    return ext is not None and bool(ext.has_metal_kernels) and mx.metal.is_available()


def _kernel_devices() -> dict[str, bool]:
    return {"cpu": _native.ext is not None, "gpu": _gpu_kernels()}


def _device_of(stream) -> mx.Device:
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Stream):
        return stream.device
    if isinstance(stream, mx.Device):
        return stream
    if isinstance(stream, mx.DeviceType):
        return mx.Device(stream)
    raise TypeError(
        "mlx_knorm: stream must be an mlx.core.Stream, Device, DeviceType or None, "
        f"got {type(stream).__name__}"
    )


def emulator_stream(stream):
    """Where the Metal emulator runs: ``stream`` if it is on the CPU, the CPU's
    default stream for None. The emulator is CPU code, so a GPU stream raises
    instead of being ignored."""
    if stream is None:
        return mx.cpu
    if _device_of(stream).type != mx.DeviceType.cpu:
        raise ValueError(
            "mlx_knorm: the metal-emulator backend runs on the CPU; stream must be "
            f"None or a CPU stream or device, got {stream}"
        )
    return stream


def resolve(stream, key_dim: int | None = None) -> str:
    """The implementation that runs on ``stream``: kernel, fallback or metal-emulator.

    ``key_dim``: the D of a key-norm call; the Metal kernel holds at most
    ``metal_key_norms_max_dim`` squares per row, so ``auto`` sends larger
    rows on the GPU to the fallback (``kernel`` lets the op raise).
    """
    device = _device_of(stream)
    name = current_backend()
    if name == "fallback":
        return "fallback"
    if name == "metal-emulator":
        _require_extension(name)
        return name
    on_gpu = device.type == mx.DeviceType.gpu
    has_kernel = _gpu_kernels() if on_gpu else _native.ext is not None
    if name == "kernel":
        _require_extension(name)
        if not has_kernel:
            raise RuntimeError(f"mlx_knorm: no native kernel for device {device} in this build")
        return "kernel"
    fits = not (on_gpu and key_dim is not None and key_dim > _native.ext.metal_key_norms_max_dim)
    return "kernel" if has_kernel and fits else "fallback"


def check_key_width(key_dim: int, name: str, stream=None) -> None:
    """Keys that the backend chosen for ``stream`` can take: the Metal
    key-norm kernel (on a GPU, or through the emulator) holds at most
    ``metal_key_norms_max_dim`` squares per row. The ops raise the same
    in C++ under their argument names; callers that pass rows on under
    another name (the cache's ``keys`` become the step's ``new_keys``) check
    here first, under theirs."""
    backend = resolve(stream, key_dim=key_dim)
    on_metal = backend == "metal-emulator" or (
        backend == "kernel" and _device_of(stream).type == mx.DeviceType.gpu
    )
    limit = _native.ext.metal_key_norms_max_dim if on_metal else None
    if limit is not None and key_dim > limit:
        raise ValueError(
            f"mlx_knorm: {name}: the Metal key-norm kernel supports D <= {limit}, "
            f"got D = {key_dim}"
        )


def _metal_kernel_library() -> dict | None:
    """Where the Metal kernels come from, in builds that have them: the
    prebuilt ``mlx_knorm.metallib`` or the ``.metal`` sources compiled at
    first use (``"jit"``)."""
    ext = _native.ext
    if ext is None or not ext.has_metal_kernels:
        return None
    kind, path = ext.metal_kernel_library()
    return {"kind": kind, "path": str(path)}


def backend_info() -> dict:
    """What is loaded and what runs where."""
    ext = _native.ext
    return {
        "backend": current_backend(),
        "extension_loaded": ext is not None,
        "extension_error": _native.load_error,
        "mlx_version_running": mx.__version__,
        "mlx_version_built": None if ext is None else ext.built_mlx_version,
        "default_device": str(mx.default_device()),
        "kernels": {
            **_kernel_devices(),
            "metal-emulator": ext is not None and bool(ext.has_metal_emulator),
        },
        "metal_kernel_library": _metal_kernel_library(),
    }
