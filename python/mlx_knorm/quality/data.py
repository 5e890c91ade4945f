"""Byte-level corpus: the Python standard library's own ``.py`` sources.

Every machine with Python has them, so the corpus needs no download. The
held-out split is by file and by a hash of the file's path relative to the
stdlib root, so it does not depend on directory order or on which other files
exist.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np

HELDOUT_MODULUS = 20  # one file in 20 is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files, sorted; third-party packages excluded."""
    root = root or stdlib_root()
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        paths.append(rel)
    return sorted(paths)


def is_heldout(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % HELDOUT_MODULUS == 0


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """``(train, heldout)`` relative paths."""
    files = source_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read_bytes(rel_paths: list[str], root: Path | None = None) -> list[np.ndarray]:
    root = root or stdlib_root()
    return [np.frombuffer((root / p).read_bytes(), dtype=np.uint8) for p in rel_paths]


def concat(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(docs) if docs else np.zeros(0, dtype=np.uint8)


def random_windows(tokens: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` windows of ``length + 1`` bytes (inputs plus shifted targets) at random offsets."""
    starts = rng.integers(0, len(tokens) - length - 1, size=n)
    return np.stack([tokens[s : s + length + 1] for s in starts])


def heldout_sequences(length: int, count: int, root: Path | None = None) -> np.ndarray:
    """The first ``length`` bytes of ``count`` held-out files at least that long.

    Each sequence starts at the top of a file, as a prompt would, and the files
    are spread evenly over the sorted held-out list so that no single package
    dominates.
    """
    root = root or stdlib_root()
    _, heldout = split_files(root)
    docs = [d for d in read_bytes(heldout, root) if len(d) >= length]
    if len(docs) < count:
        raise ValueError(f"only {len(docs)} held-out files have >= {length} bytes, {count} requested")
    picks = np.linspace(0, len(docs) - 1, count).round().astype(int)
    return np.stack([docs[i][:length] for i in picks])


def unigram_cross_entropy(train: np.ndarray, heldout: np.ndarray) -> float:
    """Held-out cross-entropy (nats/byte) of the add-one smoothed training byte distribution."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())
