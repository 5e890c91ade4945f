"""The KV memory line the commands print next to mlx-lm's statistics.

``kept``: the bytes every layer's cache holds now (``nbytes``: for an
``L2NormKVCache`` its key, value, norm and position buffers, spare slot
included, quantized rows as their packed words, scales and biases; for
mlx-lm's caches their buffers). ``full``: what the layers would hold had
every token seen been kept, each layer's rows as that layer stores them (a
layer whose state does not grow with the context, such as a recurrent one,
counts its ``nbytes`` in both).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_lm.models.cache import RotatingKVCache

from ..cache import L2NormCacheBase, layer_caches


@dataclass(frozen=True)
class KVMemory:
    kept_bytes: int
    full_bytes: int
    tokens: int  # the context: tokens seen by the cache
    budget: int | None  # rows kept per head by the eviction layers; None without any
    window: int | None  # the largest RotatingKVCache's rows, if any


def _full_bytes(cache) -> int:
    arrays = [getattr(cache, "keys", None), getattr(cache, "values", None)]
    # Quantized caches hold (packed, scales, biases) for each.
    arrays = [a for x in arrays for a in (x if isinstance(x, (tuple, list)) else [x])]
    if arrays and all(isinstance(a, mx.array) and a.ndim == 4 for a in arrays):
        batch, heads = arrays[0].shape[:2]
        row = sum(a.shape[3] * a.itemsize for a in arrays)
        return cache.offset * batch * heads * row
    return cache.nbytes


def kv_memory(prompt_cache: list) -> KVMemory:
    # A CacheList layer (attention beside recurrent state) counts as its members.
    caches = layer_caches(prompt_cache)
    budgets = {c.budget for c in caches if isinstance(c, L2NormCacheBase)}
    return KVMemory(
        kept_bytes=sum(c.nbytes for c in caches),
        full_bytes=sum(_full_bytes(c) for c in caches),
        tokens=max((getattr(c, "offset", 0) for c in caches), default=0),
        budget=max(budgets) if budgets else None,
        window=max((c.max_size for c in caches if isinstance(c, RotatingKVCache)), default=None),
    )


def kv_memory_line(prompt_cache: list) -> str:
    """``KV cache: 0.562 MB kept, 4.719 MB for a full cache (4196 tokens, budget 512)``,
    in mlx-lm's units (MB = 1e6 bytes, as its GB are 1e9)."""
    m = kv_memory(prompt_cache)
    if m.budget is not None:
        budget = f"budget {m.budget}"
    else:
        budget = "no eviction" if m.window is None else f"window {m.window}"
    return (f"KV cache: {m.kept_bytes / 1e6:.3f} MB kept, {m.full_bytes / 1e6:.3f} MB "
            f"for a full cache ({m.tokens} tokens, {budget})")
