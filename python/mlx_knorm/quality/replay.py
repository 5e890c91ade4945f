"""The full cache's forward pass, replayed into a policy's cache for the chunks it has not yet evicted from.

Until a cache evicts, the model reads through it exactly what it reads
through mlx-lm's ``KVCache``: every earlier row, in order, under the
``"causal"`` mask. So its forward pass over such a chunk is the full
cache's, and the keys and values each layer hands its cache are the ones the
full cache was handed. ``Replay`` computes those once per chunk of a token
sequence (``FullCacheRecords``) and hands them to the policy's caches by
``update_and_fetch``, as the model would, without the model call: the needle
grid's policies at a budget of ``b`` rows share the ``b / step + 1`` first
chunks of the haystack and of every prompt whose needle comes early.

A chunk is replayed only where that is exact, checked, not assumed: every
layer's cache holds every earlier row (``size()``), is not quantized (mlx-lm
attends through a quantized cache by another path), answers the model's own
mask requests with ``"causal"``, and returns, bit for bit, the rows the full
cache returns. Otherwise the caches are left as they were and the model
runs. Only models whose own cache is a ``KVCache`` in every layer replay
(the llama and qwen families); for the others the model always runs.
"""

from __future__ import annotations

from collections import OrderedDict

import copy

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

# Recorded chunks a process keeps, least recently used dropped first (a
# dropped chunk is computed again if asked for).
RECORD_BYTES = 1 << 30


def copy_caches(caches: list) -> list:
    """Caches that continue from where ``caches`` are, without touching them.

    Each array attribute gets its own handle: mlx-lm's caches write new rows
    into their buffers by slice assignment, which rebinds the handle, so
    shared handles would carry one trial's rows into the next. (MLX writes a
    buffer in place only when nothing else holds it, so the copies never
    write into the snapshot's memory.)
    """
    def own(value):
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, (list, tuple)):
            # A quantized cache's rows are (packed, scales, biases).
            return type(value)(own(v) for v in value)
        return value

    copies = []
    for cache in caches:
        twin = copy.copy(cache)
        for name, value in vars(cache).items():
            setattr(twin, name, own(value))
        copies.append(twin)
    return copies


def _bits(a: mx.array) -> mx.array:
    """``a``'s bits as unsigned integers of its width, so that -0.0 and 0.0 (and NaNs) compare as bits."""
    return a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size])


def same_rows(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(_bits(a), _bits(b)).item()


def mask_requests(model) -> list[tuple[int, bool, int | None]] | None:
    """``(layer, return_array, window_size)`` of every mask the model asks its caches for, or None.

    Found as ``cache._array_mask_sources`` finds them: one 2-token forward
    pass, built and never evaluated, over a throwaway cache that records the
    requests. None when the model's own cache is not a ``KVCache`` in every
    layer.
    """
    probe = make_prompt_cache(model)
    if not probe or any(type(c) is not KVCache for c in probe):
        return None
    asked = []
    for index, cache in enumerate(probe):

        def make_mask(N, return_array=False, window_size=None, _index=index, _cache=cache):
            asked.append((_index, return_array, window_size))
            return KVCache.make_mask(_cache, N, return_array=return_array, window_size=window_size)

        cache.make_mask = make_mask
    model(mx.zeros((1, 2), mx.int32), cache=probe)
    return asked


class FullCacheRecords:
    """Per chunk of a token sequence: the ``(keys, values)`` each layer hands the full cache (``KVCache``).

    Keyed by the tokens up to the chunk's end, so that sequences sharing a
    prefix share its chunks. A chunk not yet recorded is computed from the
    recorded chunks before it: they are handed to fresh ``KVCache``s, then
    the model runs on the chunk.
    """

    def __init__(self, model, step: int, max_bytes: int = RECORD_BYTES):
        self.model, self.step, self.max_bytes = model, step, max_bytes
        self._chunks = OrderedDict()
        self._bytes = 0
        self.computed_tokens = 0  # tokens of the model's forward passes spent on records

    def chunk(self, tokens, index: int) -> list[tuple[mx.array, mx.array]]:
        key = tuple(tokens[: (index + 1) * self.step])
        if len(key) != (index + 1) * self.step:
            raise ValueError(f"chunk {index} of {self.step} tokens needs {(index + 1) * self.step} tokens, "
                             f"got {len(tokens)}")
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return self._chunks[key]
        earlier = [self.chunk(tokens, i) for i in range(index)]
        caches = make_prompt_cache(self.model)
        for rows in earlier:
            for cache, (k, v) in zip(caches, rows):
                cache.update_and_fetch(k, v)
        handed = []
        for cache in caches:
            fetch = cache.update_and_fetch

            def update_and_fetch(k, v, _fetch=fetch):
                handed.append((k, v))
                return _fetch(k, v)

            cache.update_and_fetch = update_and_fetch
        self.model(mx.array(key[index * self.step :])[None], cache=caches)
        mx.eval(handed)
        if len(handed) != len(caches):
            raise RuntimeError(f"the model handed {len(handed)} layers' rows to its {len(caches)} caches")
        self._chunks[key] = handed
        self._bytes += sum(k.nbytes + v.nbytes for k, v in handed)
        self.computed_tokens += self.step
        while self._bytes > self.max_bytes and len(self._chunks) > 1:
            _, dropped = self._chunks.popitem(last=False)
            self._bytes -= sum(k.nbytes + v.nbytes for k, v in dropped)
        return handed


class Replay:
    """Replays ``FullCacheRecords`` into a model's caches where exact (the module's docstring)."""

    def __init__(self, model, step: int, max_bytes: int = RECORD_BYTES):
        self.requests = mask_requests(model)
        self.records = FullCacheRecords(model, step, max_bytes) if self.requests is not None else None
        self.step = step
        self.replayed_tokens = 0

    def chunk(self, caches: list, tokens, index: int) -> bool:
        """Hand ``caches`` chunk ``index`` of ``tokens`` as the model would, if exact; whether it did.

        The list ``caches`` then holds the updated caches (copies: the
        objects it held are left as they were, as they are when it did not).
        """
        if self.records is None:
            return False
        seen = index * self.step
        for cache in caches:
            if hasattr(cache, "bits") or not hasattr(cache, "update_and_fetch") or cache.size() != seen:
                return False
        for layer, return_array, window_size in self.requests:
            if return_array or window_size is not None:
                return False
            mask = caches[layer].make_mask(self.step, return_array=False, window_size=None)
            if not (isinstance(mask, str) and mask == "causal"):
                return False
        handed = self.records.chunk(tokens, index)
        if len(handed) != len(caches):
            return False
        earlier = [self.records.chunk(tokens, i) for i in range(index)]
        updated = copy_caches(caches)
        for layer, (cache, (k, v)) in enumerate(zip(updated, handed)):
            keys, values = cache.update_and_fetch(k, v)
            full_keys = mx.concatenate([rows[layer][0] for rows in earlier] + [k], axis=2)
            full_values = mx.concatenate([rows[layer][1] for rows in earlier] + [v], axis=2)
            if not (same_rows(keys, full_keys) and same_rows(values, full_values)):
                return False
        caches[:] = updated
        mx.eval([c.state for c in caches])
        self.replayed_tokens += self.step
        return True
