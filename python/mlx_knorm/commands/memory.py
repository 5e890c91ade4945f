"""The KV memory line the commands print next to mlx-lm's statistics.

For the layers' caches as they stand (a ``CacheList``'s members counted
each in its own kind):

- *held*: what the caches hold of this conversation: the rows they keep
  now, each as it is stored (an eviction cache's rows with their float32
  norm and int32 position; quantized rows as their packed words, scales and
  biases), and a recurrent layer's whole state;
- *allocated*: what their buffers take (``nbytes``): an eviction cache's
  ``budget + 1`` slots from its first block on, and its order tree; mlx-lm's
  caches grow in steps of 256 rows;
- *full cache*: what the model's own caches would hold of the same tokens
  with no eviction: every token's row in each layer eviction serves, stored
  as that layer stores them (without norms or positions); the other layers
  (windows, recurrent state, layers left uncompressed) as they are, since
  without eviction they are the same caches.

The line names which layers evict (the positions in the prompt cache: the
model's layer indices, KV-sharing layers having no cache of their own) and,
where the model has more than one kind of cache, each kind's figures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, RotatingKVCache

from ..cache import L2NormCacheBase, layer_caches

# mlx-lm's units: MB = 1e6 bytes, as its GB are 1e9.
MB = 1e6


@dataclass(frozen=True)
class CacheKind:
    """The caches of one kind and setting: which layers, and their bytes."""

    kind: str  # "eviction", "window", "chunked", "no eviction", "recurrent" or "other"
    setting: str  # "budget 512", "512", ... ("" where a kind has none)
    layers: tuple[int, ...]
    held: int
    allocated: int
    full: int

    @property
    def name(self) -> str:
        if self.kind == "eviction":
            return f"eviction ({self.setting})"
        return f"{self.kind} {self.setting}" if self.setting else self.kind


@dataclass(frozen=True)
class KVMemory:
    tokens: int  # the context: tokens seen by the caches
    kinds: tuple[CacheKind, ...]

    @property
    def held(self) -> int:
        return sum(k.held for k in self.kinds)

    @property
    def allocated(self) -> int:
        return sum(k.allocated for k in self.kinds)

    @property
    def full(self) -> int:
        return sum(k.full for k in self.kinds)


def _arrays(rows) -> list:
    return list(rows) if isinstance(rows, (tuple, list)) else [rows]


def _row_bytes(cache) -> tuple[int, int]:
    """``(B * H, bytes of one token's key and value row in one head)`` as the
    cache stores them (a quantized row: its packed words, scales and biases)."""
    arrays = _arrays(cache.keys) + _arrays(cache.values)
    batch, heads = arrays[0].shape[:2]
    return batch * heads, sum(a.shape[3] * a.itemsize for a in arrays)


def _has_rows(cache) -> bool:
    keys = getattr(cache, "keys", None)
    return keys is not None and all(isinstance(a, mx.array) and a.ndim == 4
                                    for a in _arrays(keys) + _arrays(cache.values))


def account(cache) -> tuple[str, str, int, int, int]:
    """One cache's ``(kind, setting, held, allocated, full)`` in bytes."""
    if isinstance(cache, L2NormCacheBase):
        setting = f"budget {cache.budget}" + (f", {cache.bits}-bit rows" if cache.quantized else "")
        if cache.keys is None:
            return "eviction", setting, 0, 0, 0
        heads, row = _row_bytes(cache)
        # Each kept row also carries its norm and its position.
        extra = cache.norms.itemsize + cache.slot_positions.itemsize
        return ("eviction", setting, cache.filled * heads * (row + extra), cache.nbytes,
                cache.offset * heads * row)
    if isinstance(cache, RotatingKVCache):
        kind, setting = "window", str(cache.max_size)
        rows = lambda: min(cache.offset, cache.keys.shape[2])
    elif isinstance(cache, ChunkedKVCache):
        kind, setting = "chunked", str(cache.chunk_size)
        rows = lambda: cache.offset - cache.start_position
    elif hasattr(cache, "offset") and hasattr(cache, "keys"):
        # KVCache, QuantizedKVCache: a layer left uncompressed.
        kind, setting = "no eviction", ""
        rows = lambda: cache.offset
    else:
        kind = "recurrent" if isinstance(cache, ArraysCache) else "other"
        try:
            size = cache.nbytes
        except NotImplementedError:  # mlx-lm's base class: a cache that does not say
            size = 0
        return kind, "", size, size, size
    if not _has_rows(cache):
        return kind, setting, 0, 0, 0
    heads, row = _row_bytes(cache)
    held = rows() * heads * row
    return kind, setting, held, cache.nbytes, held


def kv_memory(prompt_cache: list) -> KVMemory:
    """The caches' bytes by kind and setting: eviction first, the others in
    order of their first layer."""
    groups: dict[tuple[str, str], list] = {}
    tokens = 0
    for layer, entry in enumerate(prompt_cache):
        # A CacheList layer (attention beside recurrent state) counts as its members.
        for cache in layer_caches([entry]):
            kind, setting, held, allocated, full = account(cache)
            group = groups.setdefault((kind, setting), [[], 0, 0, 0])
            if layer not in group[0]:
                group[0].append(layer)
            group[1] += held
            group[2] += allocated
            group[3] += full
            offset = getattr(cache, "offset", 0)
            if isinstance(offset, int):
                tokens = max(tokens, offset)
    kinds = [CacheKind(kind, setting, tuple(layers), held, allocated, full)
             for (kind, setting), (layers, held, allocated, full) in groups.items()]
    # The eviction layers first, then the model's own kinds in layer order.
    return KVMemory(tokens, tuple(sorted(kinds, key=lambda k: k.kind != "eviction")))


def layer_ranges(layers) -> str:
    """``0-29`` or ``5,11,17`` or ``0-3,8``: layer indices as --skip-layers lists them."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def _figures(held: int, allocated: int, full: int | None) -> str:
    text = f"{held / MB:.3f} MB held, {allocated / MB:.3f} MB allocated"
    return text if full is None else f"{text}, {full / MB:.3f} MB for a full cache"


def _where(kind: CacheKind) -> str:
    """The eviction layers by index (which layers are ours); the others by count."""
    plural = "s" * (len(kind.layers) != 1)
    if kind.kind == "eviction":
        return f"in layer{plural} {layer_ranges(kind.layers)}"
    return f"in {len(kind.layers)} layer{plural}"


def kv_memory_line(prompt_cache: list) -> str:
    """``KV cache (4196 tokens): 0.562 MB held, 0.562 MB allocated, 4.719 MB
    for a full cache; eviction (budget 512) in layers 0-29``; with several
    kinds of cache, each kind's figures after its layers."""
    m = kv_memory(prompt_cache)
    line = f"KV cache ({m.tokens} tokens): {_figures(m.held, m.allocated, m.full)}"
    if len(m.kinds) == 1:
        [kind] = m.kinds
        return f"{line}; {kind.name} {_where(kind)}"
    parts = [f"{k.name} {_where(k)}: "
             + _figures(k.held, k.allocated, k.full if k.full != k.held else None) for k in m.kinds]
    return "; ".join([line, *parts])


KV_LINE = re.compile(r"KV cache \((\d+) tokens\): ([0-9.]+) MB held, ([0-9.]+) MB allocated, "
                     r"([0-9.]+) MB for a full cache; ([^\n]*)")


def parse_kv_memory_lines(text: str) -> list[dict]:
    """Every KV memory line in ``text``: its tokens, the held, allocated and
    full-cache MB as printed, and the rest of the line (the kinds of cache)."""
    return [{"tokens": int(tokens), "held_mb": float(held), "allocated_mb": float(allocated),
             "full_mb": float(full), "kinds": kinds}
            for tokens, held, allocated, full, kinds in KV_LINE.findall(text)]
