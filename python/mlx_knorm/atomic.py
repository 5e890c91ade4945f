"""Files written whole or not at all.

Every file the package writes for a user (query filters, prompt-cache
files from ``cache-prompt``, doctor's reports, the results and plots of
``eval``, ``needle``, ``ruler``, ``evolution``, ``tradeoff`` and the
benchmarks, the training's weights and records) goes through
``atomic_path``, and ``convert``'s model folder through ``atomic_folder``:
the writer fills a temporary file (folder) beside the target, which is
flushed to disk and then renamed onto the target in one step
(``os.replace``). A write that fails part way (a full disk, an exception,
a killed process) leaves the previous file as it was; the failed write's
temporary is removed where the process lives to do so (a killed one leaves
a hidden ``.NAME.*.partial*`` beside the target, never the target half-written).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

# The process's umask, read once (reading it means setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer to fill; on a clean
    exit it is flushed to disk and renamed to ``path``, on an exception it
    is removed and ``path`` is left as it was. ``suffix`` ends the
    temporary name (``mx.save_safetensors`` appends ``.safetensors`` to a
    name without it)."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder, not a file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".partial{suffix}")
    os.close(fd)
    temporary = Path(name)
    try:
        # mkstemp's file is the owner's alone; the written file keeps the
        # mode of the one it replaces, else gets what open() would give it.
        os.chmod(temporary, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_UMASK)
        yield temporary
        _flush(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    _flush_folder(target.parent)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside ``path`` (which must be missing or empty)
    for a writer to fill; on a clean exit it is renamed onto ``path``, on
    an exception removed, ``path`` left as it was."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
    try:
        os.chmod(staging, 0o777 & ~_UMASK)
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                _flush(file)
        os.replace(staging, target)  # onto a missing or empty folder only
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _flush_folder(target.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """``data`` to ``path``, atomically."""
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` to ``path`` as UTF-8, atomically."""
    return write_bytes(path, text.encode("utf-8"))


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """A matplotlib figure to ``path``, atomically (its format from the suffix; without one, matplotlib's
    default, ``savefig.format``, as ``fig.savefig(path)`` takes it: the temporary name's suffix is not it)."""
    if not Path(path).suffix and "format" not in savefig_kwargs:
        import matplotlib

        savefig_kwargs["format"] = matplotlib.rcParams["savefig.format"]
    with atomic_path(path, suffix=Path(path).suffix) as temporary:
        fig.savefig(temporary, **savefig_kwargs)
    return Path(path)


def _flush(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _flush_folder(folder: Path) -> None:
    """The rename itself to disk, where the system lets a folder be synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["atomic_folder", "atomic_path", "save_figure", "write_bytes", "write_text"]
