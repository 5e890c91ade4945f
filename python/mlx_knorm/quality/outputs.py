"""The quality commands' output files: checked when the command line is read (a run can take hours; a path
it cannot write must not cost them) and written through ``mlx_knorm.atomic`` (whole or not at all)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..atomic import write_text


def output_path(text: str) -> str:
    """An argparse type: a file path that is not a folder, whose folder exists or can be made
    (``atomic_path`` makes it): the nearest existing one is a folder this process can write in."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file to write")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {str(folder)!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {str(folder)!r}")
    return str(path)


def plot_path(text: str) -> str:
    """``output_path`` whose suffix, if any, is a format matplotlib writes (none: PNG)."""
    path = output_path(text)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'mlx-knorm[quality]'") from None
    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    suffix = Path(path).suffix[1:].lower()
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(f"{text}: matplotlib cannot write {suffix!r} files; "
                                         f"use one of {', '.join(formats)}")
    return path


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path``, given as ``option``; ``ValueError`` naming both where it cannot be read,
    is not UTF-8 or has no words."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{option} {path}: {error}") from None
    if not text.split():
        raise ValueError(f"{option} {path}: the file has no words")
    return text


def write_json(path: str | Path, report) -> None:
    """``report`` as indented JSON at ``path``, atomically (serialized in full before the file is touched)."""
    write_text(path, json.dumps(report, indent=2) + "\n")


def write_outputs(args, plot, result, model: str, timing: dict, **fields) -> None:
    """A quality command's ``--plot`` (``plot(result, path, title=...)``)
    and ``--json`` (``result.report()`` with the model, ``fields`` and the
    run's timing), each where asked for."""
    if args.plot:
        plot(result, args.plot, title=Path(model).name)
        print(f"plot: {args.plot}")
    if args.json:
        write_json(args.json, {"model": model, **fields, **result.report(), "timing": timing})
