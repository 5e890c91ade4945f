"""Model loading for the commands, and the hook that gives a loaded model our caches.

mlx-lm's commands build every cache through ``make_prompt_cache(model, ...)``,
which returns ``model.make_cache()`` wherever the model has that method (and
ignores ``max_kv_size`` then). ``install_cache`` sets ``make_cache`` on the
model instance, so every cache mlx-lm builds for it (generation, chat turns,
prompt caching, each server request) comes from the factory we choose.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import mlx.nn as nn

# The attribute of an installed make_cache that holds the model's own one.
_OWN_MAKE_CACHE = "mlx_knorm_model_make_cache"
_NOT_INSTALLED = object()


def load_model(path_or_repo: str, *args, **kwargs):
    """Every model load of the commands goes through here: ``mlx_lm.load``'s
    arguments and return value (``(model, tokenizer)``, or with the config
    when ``return_config=True``), for GGUF files and packaged short names
    (``smollm2``) too (``mlx_knorm.models.load``)."""
    from ..models import load

    return load(path_or_repo, *args, **kwargs)


def model_cache(model: nn.Module) -> list:
    """The cache mlx-lm builds for ``model`` without us: its own ``make_cache()``,
    else a ``KVCache`` per layer."""
    own = own_make_cache(model)
    if own is not None:
        return list(own(model))
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in model.layers]


def own_make_cache(model: nn.Module) -> Callable[[nn.Module], list] | None:
    """The model's own ``make_cache`` as a function of the model (its class's,
    even once ``install_cache`` set one on the instance), or None."""
    installed = vars(model).get("make_cache")
    if installed is None:
        return getattr(type(model), "make_cache", None)
    own = getattr(installed, _OWN_MAKE_CACHE, _NOT_INSTALLED)
    return (lambda _model: installed()) if own is _NOT_INSTALLED else own


def install_cache(model: nn.Module, factory: Callable[[nn.Module], list]) -> None:
    """Make ``model.make_cache()`` return ``factory(model)``.

    The factory may itself ask the model for its cache (``make_knorm_cache``
    starts from ``model.make_cache()``): a call made while the factory runs,
    in the same thread, gets the model's own cache, so nothing recurses.
    Installing again replaces the factory and keeps the model's own method.
    """
    own = own_make_cache(model)
    building = threading.local()
    # The model holds make_cache; a strong reference back (the closure, or a
    # bound method of the model) would make a cycle that keeps the weights
    # alive until the garbage collector runs.
    model_ref = weakref.ref(model)

    def make_cache() -> list:
        model = model_ref()
        if getattr(building, "active", False):
            return model_cache(model)
        building.active = True
        try:
            return factory(model)
        finally:
            building.active = False

    setattr(make_cache, _OWN_MAKE_CACHE, own)
    # A plain function is stored as an instance attribute by nn.Module, not
    # as a child module or parameter, so weights and trees are untouched.
    model.make_cache = make_cache
