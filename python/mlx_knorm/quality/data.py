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


def heldout_windows(count: int, length: int, seed: int, root: Path | None = None) -> np.ndarray:
    """The fixed held-out windows a training run with ``seed`` reports its loss on.

    Drawn from their own generator, so the number is comparable across
    checkpoints and across runs with different step counts.
    """
    heldout = concat(read_bytes(split_files(root)[1], root))
    return random_windows(heldout, count, length, np.random.default_rng(seed + 1))


def heldout_texts(root: Path | None = None) -> list[str]:
    """The held-out files that are UTF-8 text (a tokenizer takes text), in sorted order."""
    texts = []
    for raw in read_bytes(split_files(root)[1], root):
        try:
            texts.append(raw.tobytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_start(tokenizer) -> list[int]:
    """The ids ``tokenizer.encode`` puts before any text: its BOS token if it adds one, else nothing."""
    plain = _encode(tokenizer, "a")
    encoded = list(tokenizer.encode("a"))
    extra = len(encoded) - len(plain)
    return encoded[:extra] if extra > 0 and encoded[extra:] == plain else []


def _with_bos(tokenizer, length: int) -> tuple[list[int], int]:
    """A sequence starts as the tokenizer starts a text: with a BOS token where ``encode`` adds one.

    (SmolLM2's tokenizer has a BOS token, ``<|im_start|>``, which opens a
    chat turn; its ``encode`` adds nothing, so its windows start with text.)
    """
    prefix = text_start(tokenizer)
    return prefix, length - len(prefix)


# Characters a token spans at most in a leading encoding that is taken whole;
# beyond the last few tokens, a cut does not change the ids before it.
_CHARS_PER_TOKEN = 16
_CUT_MARGIN = 32


def _leading_ids(tokenizer, text: str, count: int) -> list[int]:
    """At least ``count`` ids from the top of ``text`` as encoding all of it
    gives them (or all its ids, if fewer): a leading slice is encoded first,
    long enough that a tokenizer's merges across the cut reach only ids
    past the ones kept, so that a long document costs a short encoding."""
    head = text[: _CHARS_PER_TOKEN * (count + _CUT_MARGIN)]
    if len(head) < len(text):
        ids = _encode(tokenizer, head)
        if len(ids) >= count + _CUT_MARGIN:
            return ids[:count]
    return _encode(tokenizer, text)


def document_sequences(tokenizer, documents: list[str], length: int, count: int) -> np.ndarray:
    """``[count, length]`` token ids: the first tokens of ``count`` documents long enough.

    Each sequence starts at the top of a document, as a prompt would, and the
    documents are spread evenly over the list so that no single package
    dominates.
    """
    prefix, body = _with_bos(tokenizer, length)
    encoded = [ids for ids in (_leading_ids(tokenizer, d, body) for d in documents) if len(ids) >= body]
    if len(encoded) < count:
        raise ValueError(f"only {len(encoded)} documents have >= {body} tokens, n_seqs={count} requested")
    picks = np.linspace(0, len(encoded) - 1, count).round().astype(int)
    return np.array([prefix + encoded[i][:body] for i in picks], dtype=np.int64)


def text_sequences(tokenizer, text: str, length: int, count: int) -> np.ndarray:
    """``[count, length]`` token ids: disjoint windows spread evenly over one text."""
    prefix, body = _with_bos(tokenizer, length)
    ids = _encode(tokenizer, text)
    if len(ids) < count * body:
        raise ValueError(f"the text has {len(ids)} tokens; n_seqs={count} windows of {body} "
                         f"need {count * body}")
    starts = np.linspace(0, len(ids) - body, count).round().astype(int)
    return np.array([prefix + ids[s : s + body] for s in starts], dtype=np.int64)


PYDOC_TOPICS = "pydoc-topics"


def pydoc_topics() -> str:
    """Python's reference documentation as ``help()`` shows it (``pydoc_data.topics``), topics in sorted order.

    Real English prose with some code, on every machine with Python.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def unigram_cross_entropy(train: np.ndarray, heldout: np.ndarray) -> float:
    """Held-out cross-entropy (nats/byte) of the add-one smoothed training byte distribution."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def bigram_cross_entropy(train: np.ndarray, heldout: np.ndarray) -> float:
    """Held-out cross-entropy (nats/byte) of the add-one smoothed training bigram table.

    Scores every held-out byte after the first given the byte before it.
    """
    pairs = train[:-1].astype(np.int64) * 256 + train[1:]
    counts = np.bincount(pairs, minlength=256 * 256).reshape(256, 256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    return float(-logp[heldout[:-1], heldout[1:]].mean())
