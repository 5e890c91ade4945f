"""All-or-nothing changes of a cache (docs/spec.md §8, all or nothing): the one
mechanism every operation that changes an ``L2NormKVCache``, a
``QuantizedL2NormKVCache`` or a ``BatchL2NormKVCache`` runs under.

A cache's fields are only ever rebound, never changed in place: MLX
arrays are immutable, and the host lists (a batch's ranges) are rebuilt.
So the cache's ``__dict__``, copied shallowly before an operation, is the
whole cache as it was, and putting it back when the operation raises,
whatever raised (a field's check, a scorer that refuses, a user's callable,
the step's op), leaves the cache bit for bit what it was. The mask plan
shared by linked caches (``cache.MaskPlan``) is the one object a cache
changes in place; its planned block is put back too."""

from __future__ import annotations

import copy
import functools


# id(cache) -> the token of the operation changing it.
_CHANGING: dict[int, object] = {}


def all_or_nothing(method):
    """``method`` (of a cache, or a property's setter) changes the cache
    only if it returns; if it raises, the cache is restored as it was. An
    operation started while another is changing the same cache (a user's
    scorer calling back into it, another thread) raises ``RuntimeError``:
    the two would each build on the fields the other replaces."""

    @functools.wraps(method)
    def changed(self, *args, **kwargs):
        key, token = id(self), object()
        fields = dict(self.__dict__)
        plan = fields.get("_mask_plan")
        block = None if plan is None else plan.block
        try:
            if _CHANGING.setdefault(key, token) is not token:
                raise RuntimeError(
                    f"mlx_knorm: {type(self).__name__}.{method.__name__} called while another operation is "
                    "changing this cache (from a user's scorer, or another thread): a cache takes one change "
                    "at a time")
            return method(self, *args, **kwargs)
        except BaseException:
            # Stores only, no call between them: a signal's handler
            # (KeyboardInterrupt) runs after a call, never between these.
            self.__dict__ = fields
            if plan is not None:
                plan.block = block
            raise
        finally:
            # No call here either, so that no interrupt leaves the cache marked.
            if key in _CHANGING and _CHANGING[key] is token:
                del _CHANGING[key]

    return changed


def deep_copy_sharing_scorer(cache, memo):
    """A deep copy of ``cache`` whose scorer is the same object: a user's
    scorer (a function, a ``functools.partial``, any callable object) is
    code, copied by reference as ``copy.deepcopy`` copies a function, so
    that copies still batch with the caches they were copied from (which
    hold the same scorer)."""
    copied = type(cache).__new__(type(cache))
    memo[id(cache)] = copied
    for name, value in cache.__dict__.items():
        setattr(copied, name, value if name == "scorer" else copy.deepcopy(value, memo))
    return copied
