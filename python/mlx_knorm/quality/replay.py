"""The full cache's forward pass, replayed into a policy's cache for the chunks it has not yet evicted from.

Until a cache evicts, the model reads through it exactly what it reads
through mlx-lm's ``KVCache``: every earlier row, in order, under the
``"causal"`` mask. So its forward pass over such a chunk is the full
cache's, and the keys and values each layer hands its cache are the ones the
full cache was handed. ``Replay`` computes those once per chunk of a token
sequence (``FullCacheRecords``) and hands them to the policy's caches by
``update_and_fetch``, as the model would, without the model call: the needle
grid's policies at a budget of ``b`` rows per layer share the first
``b // step + 1`` chunks of the haystack and of every prompt whose needle
comes early.

A chunk is replayed only where that is exact, checked, not assumed: every
layer's cache is at the chunk's start (``offset``) and holds every earlier
row (``size()``), is not quantized (mlx-lm attends through a quantized cache
by another path), answers the model's own mask requests with ``"causal"``,
and returns, bit for bit, the rows the full cache returns. Otherwise the
caches are left as they were (a linked cache's mask plan aside, which the
model's next ``make_mask`` sets again) and the model runs. Only models whose
own cache is a ``KVCache`` in every layer, each called once per forward
pass, replay (the llama and qwen families); for the others the model always
runs.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..cache import mask_requests as cache_mask_requests

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


def _record_updates(caches: list) -> list[list]:
    """Makes each cache of ``caches`` record the ``(keys, values)`` the model
    hands it; the records by the cache's index (a model calls its layers in
    any order)."""
    handed = [[] for _ in caches]
    for index, cache in enumerate(caches):
        fetch = cache.update_and_fetch

        def update_and_fetch(k, v, _fetch=fetch, _handed=handed[index]):
            _handed.append((k, v))
            return _fetch(k, v)

        cache.update_and_fetch = update_and_fetch
    return handed


def mask_requests(model) -> list[tuple[int, bool, int | None]] | None:
    """``(layer, return_array, window_size)`` of every mask the model asks its caches for, or None.

    Found as ``cache.mask_requests`` finds them: one 2-token forward pass,
    built and never evaluated, over a throwaway cache that records the
    requests. None when the model's own cache is not a ``KVCache`` in every
    layer, or when the pass does not hand each layer's cache its rows once.
    """
    probe = make_prompt_cache(model)
    if not probe or any(type(c) is not KVCache for c in probe):
        return None
    handed = _record_updates(probe)
    asked = cache_mask_requests(model, probe)
    return asked if all(len(h) == 1 for h in handed) else None


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
        return self.chunks(tokens, index)[index]

    def chunks(self, tokens, last: int) -> list[list[tuple[mx.array, mx.array]]]:
        """Chunks ``0 .. last`` of ``tokens``: those recorded as they are, the
        others computed in order, each with one forward pass over caches
        holding the chunks before it."""
        if len(tokens) < (last + 1) * self.step:
            raise ValueError(f"chunk {last} of {self.step} tokens needs {(last + 1) * self.step} tokens, "
                             f"got {len(tokens)}")
        out, caches = [], None
        for index in range(last + 1):
            key = tuple(tokens[: (index + 1) * self.step])
            rows = self._chunks.get(key)
            if rows is not None:
                self._chunks.move_to_end(key)
            else:
                if caches is None:
                    caches = make_prompt_cache(self.model)
                    for earlier in out:
                        _hand(caches, earlier)
                handed = _record_updates(caches)
                self.model(mx.array(key[index * self.step :])[None], cache=caches)
                if any(len(h) != 1 for h in handed):
                    raise ValueError("mlx_knorm: the model did not hand each layer's cache its rows once "
                                     "(mask_requests refuses such models)")
                rows = [h[0] for h in handed]
                mx.eval(rows)
                self._keep(key, rows)
                self.computed_tokens += self.step
                out.append(rows)
                continue
            if caches is not None:
                _hand(caches, rows)
            out.append(rows)
        return out

    def _keep(self, key: tuple, rows: list) -> None:
        self._chunks[key] = rows
        self._bytes += sum(k.nbytes + v.nbytes for k, v in rows)
        while self._bytes > self.max_bytes and len(self._chunks) > 1:
            _, dropped = self._chunks.popitem(last=False)
            self._bytes -= sum(k.nbytes + v.nbytes for k, v in dropped)


def _hand(caches: list, rows: list) -> None:
    """Hands each cache its layer's recorded rows, as the model would. Each
    call gets its own handles: a cache that keeps the array it is handed
    (``RotatingKVCache``'s first update) and later writes into it must not
    write into the records."""
    for cache, (k, v) in zip(caches, rows):
        cache.update_and_fetch(mx.array(k), mx.array(v))


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
            if (hasattr(cache, "bits") or not hasattr(cache, "update_and_fetch")
                    or getattr(cache, "offset", None) != seen or cache.size() != seen):
                return False
        for layer, return_array, window_size in self.requests:
            if return_array or window_size is not None:
                return False
            mask = caches[layer].make_mask(self.step, return_array=False, window_size=None)
            if not (isinstance(mask, str) and mask == "causal"):
                return False
        *earlier, handed = self.records.chunks(tokens, index)
        if len(handed) != len(caches):
            return False
        updated = copy_caches(caches)
        for layer, (cache, (k, v)) in enumerate(zip(updated, handed)):
            keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
            full_keys = mx.concatenate([rows[layer][0] for rows in earlier] + [k], axis=2)
            full_values = mx.concatenate([rows[layer][1] for rows in earlier] + [v], axis=2)
            if not (same_rows(keys, full_keys) and same_rows(values, full_values)):
                return False
        caches[:] = updated
        mx.eval([c.state for c in caches])
        self.replayed_tokens += self.step
        return True
