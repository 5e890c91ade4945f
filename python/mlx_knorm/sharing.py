"""Layers that attend to another layer's cached rows (KV sharing).

Some mlx-lm models give their last layers no cache of their own: they
attend to the rows an earlier layer's cache holds, read through
``keys_and_values()`` (gemma3n, afm7) or handed on from that layer's
``update_and_fetch`` (gemma4), with the mask the model made for that
layer (docs/spec.md §8, KV sharing). An eviction cache returns exactly
the rows its own layer attended to, so the rows and the mask agree.

What the rows cannot tell is the position of the queries: afm7's
``KVReuseAttention`` rotates its queries by ``rows - L`` (``L`` new
tokens), which is their position only while the cache holds every token.
``share_positions(model)`` (called by ``make_knorm_cache``) gives such a
layer the position the eviction cache knows: each ``keys_and_values()`` of
an eviction cache notes the arrays it hands out and the position of the
last block's first token, and the layer, given those very arrays, rotates
its queries from there. Given any other arrays (mlx-lm's own caches) it
runs as mlx-lm wrote it.
"""

from __future__ import annotations

import threading
import weakref

import mlx.nn as nn
from mlx_lm.models import afm7

_last_read = threading.local()


def note_shared_read(keys, first_position) -> None:
    """Note that an eviction cache's ``keys_and_values()`` handed out
    ``keys`` (the array, or a quantized cache's packed array), whose last
    block starts at ``first_position`` (an int, or int32 ``[B]`` for a
    batch). Only the latest read of each thread is kept, by weak
    reference."""
    _last_read.value = (weakref.ref(keys), first_position)


def shared_read_position(keys):
    """The first position of the block whose rows ``keys`` are, when the
    latest ``keys_and_values()`` of an eviction cache on this thread handed
    out exactly this array; else None."""
    read = getattr(_last_read, "value", None)
    if read is None or read[0]() is not keys:
        return None
    return read[1]


class _FixedOffsetRope(nn.Module):
    """A RoPE module that rotates from ``offset`` whatever offset it is given."""

    def __init__(self, rope, offset) -> None:
        super().__init__()
        self._rope = rope
        self._offset = offset

    def __call__(self, x, offset=0):
        return self._rope(x, offset=self._offset)


class Afm7KVReuseAttention(afm7.KVReuseAttention):
    """afm7's ``KVReuseAttention`` whose queries take the position the
    eviction cache noted for the rows it is given (module docstring)."""

    def __call__(self, x, keys, values, mask=None):
        position = shared_read_position(keys[0] if isinstance(keys, tuple) else keys)
        if position is None:
            return super().__call__(x, keys, values, mask)
        rope = self.rope
        self.rope = _FixedOffsetRope(rope, position)
        try:
            return super().__call__(x, keys, values, mask)
        finally:
            self.rope = rope


# Attention classes that take their queries' position from the number of
# rows they are given -> the subclass that takes it from the cache.
POSITION_FROM_ROWS = {afm7.KVReuseAttention: Afm7KVReuseAttention}


def share_positions(model: nn.Module) -> int:
    """Make every layer of ``model`` that reads another layer's rows and
    takes its queries' position from their count take it from the eviction
    cache instead (module docstring); returns how many layers it changed
    (again: 0). The layers' weights and their behaviour with any other
    cache stay as they are."""
    changed = 0
    for _, module in model.named_modules():
        positioned = POSITION_FROM_ROWS.get(type(module))
        if positioned is not None:
            module.__class__ = positioned
            changed += 1
    return changed


__all__ = ["POSITION_FROM_ROWS", "note_shared_read", "share_positions", "shared_read_position"]
