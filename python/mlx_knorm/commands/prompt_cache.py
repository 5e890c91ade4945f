"""Checks of a prompt-cache file before ``mlx-knorm generate`` answers from it.

mlx-lm's ``load_prompt_cache`` rebuilds each layer with ``from_state``; for an
``L2NormKVCache`` that checks every field (``cache_state.check_state``), so a
tampered layer raises naming the field. What no single layer can tell is
checked here: the metadata mlx-lm's ``generate`` reads, that all layers saw
the same tokens, and, once the model is loaded, that the file fits it (layer
count, each layer's cache kind, heads, key and value widths, dtype) and the
cache flags given on the command line, with ``--kv-bits`` and
``--kv-group-size`` against a quantized file as mlx-lm checks its own. Every
failure is a ``CommandError`` saying why, raised before anything is
generated. The loaded eviction layers are linked again
(``link_prompt_cache``), as ``make_knorm_cache`` links the caches it makes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..cache import L2NormCacheBase, QuantizedL2NormKVCache, link_prompt_cache
from ..scorers import QueryFilters
from ..validation import dtype_name
from .session import CommandError

# File layer kinds accepted where the model's cache (under our factory) has a
# KVCache or an L2NormKVCache: the file keeps its own kind (mlx_lm.cache_prompt
# writes KVCache or, with --kv-bits, QuantizedKVCache layers; mlx-knorm
# cache-prompt L2NormKVCache or QuantizedL2NormKVCache ones).
_ATTENTION_KINDS = (KVCache, QuantizedKVCache, L2NormCacheBase)


def refused(file_name: str, why: str) -> CommandError:
    return CommandError(f"refusing --prompt-cache-file {file_name}: {why}; nothing was generated")


def load_checked(load_prompt_cache, file_name: str, kv_quantization=(None, None)):
    """mlx-lm's ``load_prompt_cache(file_name, return_metadata=True)``, checked
    as far as the file alone allows; ``kv_quantization``: the command line's
    ``(--kv-bits, --kv-group-size)``, which a quantized eviction file must
    match (mlx-lm checks its own ``QuantizedKVCache`` files so)."""
    try:
        cache, metadata = load_prompt_cache(file_name, return_metadata=True)
    except Exception as e:  # any way a file can fail to load is a refusal
        raise refused(file_name, f"{type(e).__name__}: {e}") from None
    if not isinstance(metadata.get("model"), str):
        raise refused(file_name, "its metadata has no 'model' (the model it was saved for)")
    try:
        tokenizer_config = json.loads(metadata.get("tokenizer_config", ""))
    except json.JSONDecodeError:
        tokenizer_config = None
    if not isinstance(tokenizer_config, dict):
        raise refused(file_name, "its metadata 'tokenizer_config' is not a JSON object")
    if not cache:
        raise refused(file_name, "it holds no layers")
    offsets = {c.offset for c in cache if hasattr(c, "offset")}
    if len(offsets) > 1:
        raise refused(file_name, f"its layers saw different numbers of tokens ({sorted(offsets)})")
    bits, group_size = kv_quantization
    for c in cache:
        if isinstance(c, QuantizedL2NormKVCache):
            for flag, asked, held in (("--kv-bits", bits, c.bits), ("--kv-group-size", group_size, c.group_size)):
                if asked is not None and asked != held:
                    raise refused(file_name, f"its layers are quantized with {flag} {held}, and the "
                                             f"command line asks for {asked}")
    link_prompt_cache(cache)
    return cache, metadata


def _kind(c) -> str:
    return type(c).__name__


def _settings(c: L2NormCacheBase) -> str:
    return (f"budget {c.budget}, n_sink {c.n_sink}, recent {c.recent}, keep {c.keep}, "
            f"layout {c.layout}, scorer {c.scorer}")


def check_fits_model(file_name: str, cache: list, model, expected: list, given: dict,
                     filters: QueryFilters | None = None) -> None:
    """``cache`` (loaded from ``file_name``) against ``expected``, a fresh cache
    of ``model`` built with the command line's settings, which this function
    runs one token through (unevaluated) to learn each layer's shapes.
    ``given``: the cache settings given on the command line; when there are
    any, the file's layers must be what they ask for. ``filters``: the
    query filters ``--filters`` names, when given, which every layer of the
    file that ranks by qfilter must hold."""
    if len(cache) != len(expected):
        raise refused(file_name, f"it holds {len(cache)} layers and the model has {len(expected)}: "
                                 "it was saved for another model")
    model(mx.zeros((1, 1), mx.int32), cache=expected)
    for index, (saved, fresh) in enumerate(zip(cache, expected)):
        where = f"layer {index}"
        if type(saved) is not type(fresh) and not (
            isinstance(fresh, _ATTENTION_KINDS) and isinstance(saved, _ATTENTION_KINDS)
        ):
            raise refused(file_name, f"{where} holds a {_kind(saved)} where the model has a "
                                     f"{_kind(fresh)}: it was saved for another model")
        _check_shapes(file_name, where, saved, fresh)
        if given:
            _check_settings(file_name, where, saved, fresh, given)
        if filters is not None:
            _check_filters(file_name, index, saved, filters)


def _rows(c):
    """``(B, H, D_k, D_v, dtype)`` of a KV layer's stored rows (quantized
    ones: their widths before quantization, their scales' dtype), or None
    (empty, or not a KV cache)."""
    if isinstance(c, L2NormCacheBase):
        dims = c._dims()
        return None if dims is None else (*dims, c._storage_dtype())
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if isinstance(c, QuantizedKVCache) and isinstance(keys, (tuple, list)):
        return (*keys[1].shape[:2], keys[1].shape[3] * c.group_size, values[1].shape[3] * c.group_size,
                keys[1].dtype)
    if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
        return (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
    return None


def _check_shapes(file_name: str, where: str, saved, fresh) -> None:
    saved_rows, fresh_rows = _rows(saved), _rows(fresh)
    if saved_rows is None or fresh_rows is None:
        return

    def shape(rows):
        return f"{rows[0]} x {rows[1]} heads, keys of {rows[2]}, values of {rows[3]}"

    if saved_rows[:4] != fresh_rows[:4]:
        raise refused(file_name, f"{where} holds {shape(saved_rows)}; the model gives "
                                 f"{shape(fresh_rows)}: it was saved for another model")
    if isinstance(saved, L2NormCacheBase) and isinstance(fresh, L2NormCacheBase) and saved_rows[4] != fresh_rows[4]:
        raise refused(file_name, f"{where} stores {dtype_name(saved_rows[4])} rows; this model's cache "
                                 f"stores {dtype_name(fresh_rows[4])}: it was saved for another model")


def _check_settings(file_name: str, where: str, saved, fresh, given: dict) -> None:
    flags = "the command line (" + ", ".join(f"--{f.replace('_', '-')}" for f in given) + ")"
    # A quantized eviction layer is the float one after --kv-bits.
    if not (isinstance(saved, L2NormCacheBase) and isinstance(fresh, L2NormCacheBase)) and type(saved) is not type(fresh):
        raise refused(file_name, f"{where} holds a {_kind(saved)} and {flags} asks for a {_kind(fresh)}; "
                                 "drop the cache flags to use the file as it is, or make it again with "
                                 "mlx-knorm cache-prompt and those flags")
    if isinstance(saved, L2NormCacheBase):
        have, want = _settings(saved), _settings(fresh)
        if have != want:
            raise refused(file_name, f"{where} was made with {have} and {flags} asks for "
                                     f"{want}; a prompt cache keeps the settings it was made "
                                     "with: drop the cache flags, or make it again with mlx-knorm "
                                     "cache-prompt and those flags")


def _check_filters(file_name: str, index: int, saved, filters: QueryFilters) -> None:
    """A qfilter layer of the file holds the filters ``--filters`` names (a
    prompt cache keeps the filters it was made with, as its settings)."""
    if not isinstance(saved, L2NormCacheBase) or saved.scorer != "qfilter":
        return
    held = saved._scorer_fields()[1]
    given = filters.filters.get(index)
    if given is None or tuple(given.shape) != tuple(held.shape) or not np.array_equal(np.array(held), given):
        raise refused(file_name, f"layer {index} was made with other query filters than --filters gives; a "
                                 "prompt cache keeps the filters it was made with: drop --filters, or make it "
                                 "again with mlx-knorm cache-prompt and those filters")
