"""Which BLAS MLX's CPU matmuls call, and a fast one by default.

The ``mlx[cpu]`` wheel on Linux links the reference BLAS it bundles
(netlib's, unoptimized): a float32 matmul runs many times slower than with
OpenBLAS. The dynamic linker binds a symbol to a preloaded library before a
wheel's own, so with a system OpenBLAS in ``LD_PRELOAD`` every
``cblas_sgemm`` MLX calls is OpenBLAS's. ``reexec_with_fast_blas`` starts the
command again, once, with it preloaded; ``MLX_KNORM_FAST_BLAS`` steers it:
unset or ``1`` finds a library, a path preloads that library, ``0`` turns the
whole fast path off (no re-execution, no hint, and ``load``'s ``dtype="auto"``
keeps GGUF weights as stored).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

OPT_ENV = "MLX_KNORM_FAST_BLAS"
# Set in the re-executed process: it never re-executes again.
REEXEC_ENV = "MLX_KNORM_BLAS_REEXEC"
OFF_VALUES = ("0", "off", "no", "false")

# Where distributions put a threaded OpenBLAS (Debian/Ubuntu's libopenblas0-pthread first).
CANDIDATES = tuple(
    f"/usr/lib/{triple}-linux-gnu/{sub}libopenblas.so.0"
    for triple in ("x86_64", "aarch64") for sub in ("openblas-pthread/", "")
) + ("/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0")

INSTALL_HINT = (
    "mlx-knorm: MLX's CPU matmuls run on the slow reference BLAS bundled with mlx; a float32 model runs "
    "about 10-20x faster with OpenBLAS. Install it (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; "
    "Fedora: sudo dnf install openblas-threads) and the commands use it, or set {env}=/path/to/libopenblas.so.0; "
    "{env}=0 turns this off."
).format(env=OPT_ENV)

FAST_NAMES = ("OpenBLAS", "MKL", "BLIS", "Accelerate")
_hinted = False


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _library_of(address: int) -> str | None:
    """The file of the shared library that holds ``address`` (``dladdr``)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _sgemm_address(handle) -> int | None:
    try:
        return ctypes.cast(handle.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None


def blas_name(path: str) -> str:
    """What a BLAS library file is, by its name."""
    lower = path.lower()
    if "openblas" in lower:
        return "OpenBLAS"
    if "mkl" in lower:
        return "MKL"
    if "blis" in lower:
        return "BLIS"
    if "accelerate" in lower or "veclib" in lower:
        return "Accelerate"
    if "mlx_cpu.libs" in lower or "mlx/lib" in lower:
        return "reference BLAS (bundled with mlx)"
    return "reference BLAS"


def blas_in_use() -> dict:
    """``{"name", "path", "fast", "preloaded"}``: the library whose ``cblas_sgemm`` MLX's CPU matmuls call.

    A library in the process's global scope (the executable's, ``LD_PRELOAD``'s)
    binds first; otherwise libmlx's own dependency does.
    """
    if sys.platform == "darwin":
        return {"name": "Accelerate", "path": "Accelerate.framework", "fast": True, "preloaded": False}
    import mlx.core as mx  # noqa: F401  (loads libmlx and its BLAS)

    path, preloaded = None, False
    address = _sgemm_address(ctypes.CDLL(None))
    if address is not None:
        path, preloaded = _library_of(address), True
    else:
        libmlx = Path(mx.__file__).parent / "lib" / "libmlx.so"
        try:
            address = _sgemm_address(ctypes.CDLL(str(libmlx)))
        except OSError:
            address = None
        if address is not None:
            path = _library_of(address)
    if path is None:
        return {"name": "unknown", "path": None, "fast": False, "preloaded": preloaded}
    path = os.path.realpath(path)
    name = blas_name(path)
    return {"name": name, "path": path, "fast": name in FAST_NAMES, "preloaded": preloaded}


def blas_line() -> str:
    """One line for ``info`` and ``doctor``."""
    blas = blas_in_use()
    how = ", preloaded" if blas["preloaded"] else ""
    line = f"{blas['name']} ({blas['path']}{how})"
    if not blas["fast"] and sys.platform.startswith("linux"):
        line += f"; slow: install OpenBLAS (apt-get install libopenblas0-pthread) or set {OPT_ENV}"
    return line


def _exports_sgemm(path: str) -> bool:
    try:
        return _sgemm_address(ctypes.CDLL(path, mode=getattr(os, "RTLD_LOCAL", 0))) is not None
    except OSError:
        return False


def find_fast_blas() -> str | None:
    """An installed OpenBLAS that exports ``cblas_sgemm``, or None."""
    found = ctypes.util.find_library("openblas")
    for path in (*CANDIDATES, *((found,) if found else ())):
        if Path(path).exists() and _exports_sgemm(path):
            return path
    return None


def opted_out() -> bool:
    return os.environ.get(OPT_ENV, "").strip().lower() in OFF_VALUES


def hint_once() -> None:
    """Print ``INSTALL_HINT`` on stderr, once a process, unless opted out."""
    global _hinted
    if _hinted or opted_out():
        return
    _hinted = True
    print(INSTALL_HINT, file=sys.stderr)


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def named_library() -> str | None:
    """``MLX_KNORM_FAST_BLAS``'s library, or None where it names none (unset, ``1``, ``auto``, ...)."""
    chosen = os.environ.get(OPT_ENV, "").strip()
    if not chosen or chosen.lower() in ("1", "on", "yes", "true", "auto"):
        return None
    return chosen


def preload_target() -> str | None:
    """The library a re-execution would preload: ``MLX_KNORM_FAST_BLAS``'s, else an installed OpenBLAS.

    A named path is resolved (links followed): ``LD_PRELOAD`` splits its list at spaces and colons, so a
    path that still has one cannot be preloaded. A named library that cannot be preloaded is reported on
    stderr, once, and stands for the hint (whoever named it knows of the fast path).
    """
    global _hinted
    chosen = named_library()
    if chosen is None:
        return find_fast_blas()
    library = os.path.realpath(chosen) if os.sep in chosen else chosen  # a bare name: the linker's search
    if any(c.isspace() or c == ":" for c in library):
        problem = "has a space or colon, which LD_PRELOAD cannot hold (a link to it from a plain path can)"
    elif not _exports_sgemm(library):
        problem = "is not a shared library that exports cblas_sgemm"
    else:
        return library
    if not _hinted:
        print(f"mlx-knorm: {OPT_ENV}={chosen} {problem}; going on with the BLAS MLX has", file=sys.stderr)
    _hinted = True
    return None


def preload_plan() -> str | None:
    """The library to re-execute with, or None: not on Linux, not on the CPU device, opted out, already
    re-executed, MLX's BLAS already fast, or nothing to preload (then ``INSTALL_HINT`` is printed once, or
    the line on a named library that cannot be preloaded)."""
    if (not sys.platform.startswith("linux") or opted_out() or os.environ.get(REEXEC_ENV)
            or not _on_cpu() or blas_in_use()["fast"]):
        return None
    library = preload_target()
    if library is None:
        hint_once()
    return library


def reexec_with_fast_blas() -> None:
    """Run this process's command line again with a fast BLAS preloaded, where that helps; else return.

    Only on Linux, on the CPU device, when MLX's BLAS is slow, never when
    ``MLX_KNORM_FAST_BLAS=0``, never twice (the new process has
    ``MLX_KNORM_BLAS_REEXEC`` set) and never inside pytest's process
    (``preload_plan``). With no library to preload it prints ``INSTALL_HINT``
    once and returns.
    """
    if "_pytest" in sys.modules:
        return
    library = preload_plan()
    if library is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[REEXEC_ENV] = library
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as error:  # the command goes on with the BLAS it has
        print(f"mlx-knorm: could not start again with {library} preloaded: {error}", file=sys.stderr)
