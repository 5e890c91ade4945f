"""Checks of a prompt-cache file before ``mlx-knorm generate`` answers from it.

mlx-lm's ``load_prompt_cache`` rebuilds each layer with ``from_state``; for an
``L2NormKVCache`` that checks every field (``cache_state.check_state``), so a
tampered layer raises naming the field. What no single layer can tell is
checked here: the metadata mlx-lm's ``generate`` reads, that all layers saw
the same tokens, and, once the model is loaded, that the file fits it (layer
count, each layer's cache kind, heads, key and value widths, dtype) and the
cache flags given on the command line. Every failure is a ``CommandError``
saying why, raised before anything is generated.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..cache import L2NormKVCache
from ..validation import dtype_name
from .session import CommandError

# File layer kinds accepted where the model's cache (under our factory) has a
# KVCache or an L2NormKVCache: the file keeps its own kind (mlx_lm.cache_prompt
# writes KVCache or, with --kv-bits, QuantizedKVCache layers).
_ATTENTION_KINDS = (KVCache, L2NormKVCache, QuantizedKVCache)


def refused(file_name: str, why: str) -> CommandError:
    return CommandError(f"refusing --prompt-cache-file {file_name}: {why}; nothing was generated")


def load_checked(load_prompt_cache, file_name: str):
    """mlx-lm's ``load_prompt_cache(file_name, return_metadata=True)``, checked
    as far as the file alone allows."""
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
    return cache, metadata


def _kind(c) -> str:
    return type(c).__name__


def _settings(c: L2NormKVCache) -> str:
    return (f"budget {c.budget}, n_sink {c.n_sink}, recent {c.recent}, keep {c.keep}, "
            f"layout {c.layout}")


def check_fits_model(file_name: str, cache: list, model, expected: list, given: dict) -> None:
    """``cache`` (loaded from ``file_name``) against ``expected``, a fresh cache
    of ``model`` built with the command line's settings, which this function
    runs one token through (unevaluated) to learn each layer's shapes.
    ``given``: the cache settings given on the command line; when there are
    any, the file's layers must be what they ask for."""
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


def _check_shapes(file_name: str, where: str, saved, fresh) -> None:
    arrays = [getattr(c, name, None) for c in (saved, fresh) for name in ("keys", "values")]
    if not all(isinstance(a, mx.array) and a.ndim == 4 for a in arrays):
        return  # empty, quantized (tuples of arrays) or not a KV cache
    saved_keys, saved_values, fresh_keys, fresh_values = arrays

    def shape(keys, values):
        return f"{keys.shape[0]} x {keys.shape[1]} heads, keys of {keys.shape[3]}, values of {values.shape[3]}"

    if (saved_keys.shape[:2], saved_keys.shape[3], saved_values.shape[3]) != (
        fresh_keys.shape[:2], fresh_keys.shape[3], fresh_values.shape[3]
    ):
        raise refused(file_name, f"{where} holds {shape(saved_keys, saved_values)}; the model gives "
                                 f"{shape(fresh_keys, fresh_values)}: it was saved for another model")
    if isinstance(saved, L2NormKVCache) and isinstance(fresh, L2NormKVCache) and saved_keys.dtype != fresh_keys.dtype:
        raise refused(file_name, f"{where} stores {dtype_name(saved_keys.dtype)} rows; this model's cache "
                                 f"stores {dtype_name(fresh_keys.dtype)}: it was saved for another model")


def _check_settings(file_name: str, where: str, saved, fresh, given: dict) -> None:
    flags = "the command line (" + ", ".join(f"--{f.replace('_', '-')}" for f in given) + ")"
    if type(saved) is not type(fresh):
        raise refused(file_name, f"{where} holds a {_kind(saved)} and {flags} asks for a {_kind(fresh)}; "
                                 "drop the cache flags to use the file as it is, or make it again with "
                                 "mlx-knorm cache-prompt and those flags")
    if isinstance(saved, L2NormKVCache):
        have, want = _settings(saved), _settings(fresh)
        if have != want:
            raise refused(file_name, f"{where} was made with {have} and {flags} asks for "
                                     f"{want}; a prompt cache keeps the settings it was made "
                                     "with: drop the cache flags, or make it again with mlx-knorm "
                                     "cache-prompt and those flags")
