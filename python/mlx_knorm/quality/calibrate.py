"""``mlx-knorm calibrate``: the ``qfilter`` scorer's query filters of a model.

The model reads text that ships with Python (the standard library's own
sources, the files a training split keeps: code and docstrings, disjoint
from the prose of ``pydoc_data.topics`` that the evals read); at each
full-attention layer (those ``make_knorm_cache`` compresses) the queries,
rotated as the model rotates them and grouped by the KV head they attend
through, give ``C = sum q q^T``. The filter of a KV head is the top
eigenvector of ``C``, the principal direction of its queries (Q-Filters,
Godey et al. 2025), signed so that the queries' mean projection on it is
positive. A key's projection on it then approximates, up to a positive
factor, the mean logit the queries give that key.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..scorers import QueryFilters, model_attention_layers
from . import data
from .eval import attention_routed
from .policies import attention_layers


class _QueryProbe(KVCache):
    """A full-attention layer's cache that hands the layer's queries over."""

    def __init__(self, layer: int, seen: list):
        super().__init__()
        self.layer = layer
        self.seen = seen


def _queries_through_probes():
    """mlx-lm's attention, recording each probe layer's queries first."""

    def route(original, queries, keys, values, cache, scale, mask, sinks):
        if isinstance(cache, _QueryProbe):
            cache.seen.append((cache.layer, queries, keys.shape[1]))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return attention_routed(route)


def calibration_sequences(tokenizer, n_seqs: int, seq_len: int) -> np.ndarray:
    """``[n_seqs, seq_len]`` token ids from the standard library's sources."""
    root = data.stdlib_root()
    texts = []
    for raw in data.read_bytes(data.split_files(root)[0], root):
        try:
            texts.append(raw.tobytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return data.document_sequences(tokenizer, texts, seq_len, n_seqs)


def query_filters(model, sequences: np.ndarray, n_sink: int = 4) -> QueryFilters:
    """The filters of ``model`` from its queries on ``sequences [n, T]``;
    their metadata records the model's layer count (``layers``), which
    ``QueryFilters.check_model`` compares."""
    layers = attention_layers(model, n_sink)
    n_layers, _ = model_attention_layers(model)
    moments: dict[int, np.ndarray] = {}
    sums: dict[int, np.ndarray] = {}
    for tokens in sequences:
        seen: list = []
        cache = make_prompt_cache(model)
        for i in layers:
            cache[i] = _QueryProbe(i, seen)
        with _queries_through_probes():
            mx.eval(model(mx.array(tokens)[None], cache=cache))
        for layer, queries, kv_heads in seen:
            q = np.array(queries[0].astype(mx.float32), dtype=np.float64)  # [H, T, D]
            heads, steps, dim = q.shape
            grouped = q.reshape(kv_heads, heads // kv_heads * steps, dim)
            moments[layer] = moments.get(layer, 0) + np.einsum("gnd,gne->gde", grouped, grouped)
            sums[layer] = sums.get(layer, 0) + grouped.sum(axis=1)
    missing = sorted(set(layers) - set(moments))
    if missing:
        raise ValueError(f"layers {missing} gave no queries (their attention does not go through "
                         "mlx-lm's scaled_dot_product_attention): qfilter cannot be calibrated for this model")
    filters = {}
    for layer in layers:
        _, vectors = np.linalg.eigh(moments[layer])  # ascending eigenvalues, per KV head
        top = vectors[..., -1]
        signs = np.where(np.einsum("gd,gd->g", top, sums[layer]) < 0, -1.0, 1.0)
        filters[layer] = (top * signs[:, None]).astype(np.float32)
    return QueryFilters(filters, {"layers": n_layers})
