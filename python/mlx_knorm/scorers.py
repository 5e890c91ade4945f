"""The scorers a cache ranks its rows by (docs/spec.md §2a), and the
query filters the ``qfilter`` scorer reads.

A scorer gives each new row one float32, fixed when the row arrives; the
cache keeps the lowest (``keep="low"``). The built-in ones run in
``row_scores``'s native kernels:

- ``knorm``: the key's L2 norm (Devoto et al. 2024), the default;
- ``keydiff``: the key's cosine similarity to the sum of the unit keys
  before it in its head (KeyDiff, Park et al. 2025, made causal), so the
  least redundant keys stay; the running sum is the cache's state;
- ``vnorm``: the key's norm over the value's (value-aware: a large value
  norm raises a row's weight in the output, as VATP and CriticalKV use);
- ``qfilter``: minus the key's projection on its head's filter, the
  principal direction of the model's queries there (Q-Filters, Godey et al.
  2025), which ``mlx-knorm calibrate`` measures and writes to a file.

A user's scorer is a callable ``scorer(keys, values, state) -> (scores,
state)``: ``keys``/``values`` ``[B, H, S, D]`` as the model gives them,
``scores`` ``[B, H, S]`` float32, ``state`` what the cache hands back on the
next call (None on the first; an array is batch-first, as the keys). It
runs in MLX ops on the model's stream; the selection ranks its scores as
any other's. docs/scorers.md has an example, which the tests run.
"""

from __future__ import annotations

import copy
import json
import re
import weakref
from pathlib import Path
from typing import Callable, Union

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

BUILTIN_SCORERS = ("knorm", "keydiff", "vnorm", "qfilter")
DEFAULT_SCORER = "knorm"
# What a scorer reads besides the keys (row_scores' arguments).
SCORER_USES_VALUES = frozenset({"vnorm"})
SCORER_STATEFUL = frozenset({"keydiff"})

Scorer = Union[str, Callable]

FILTERS_FORMAT = "mlx-knorm query filters 1"


def check_scorer(scorer) -> Scorer:
    """A built-in scorer's name or a callable; anything else raises naming ``scorer``."""
    if callable(scorer):
        return scorer
    if not isinstance(scorer, str) or scorer not in BUILTIN_SCORERS:
        raise ValueError(f"mlx_knorm: scorer must be one of {BUILTIN_SCORERS} or a callable "
                         f"scorer(keys, values, state) -> (scores, state), got {scorer!r}")
    return scorer


def scorer_label(scorer: Scorer) -> str:
    return scorer if isinstance(scorer, str) else getattr(scorer, "__name__", "custom")


def score_rows(scorer: Scorer, keys: mx.array, values: mx.array, state, *, offset: int = 0,
               valid: mx.array | None = None, filters: mx.array | None = None):
    """``(scores [B, H, S] float32, state)`` of new rows ``keys``/``values``
    ``[B, H, S, D]`` under ``scorer`` (not ``knorm``, whose norms the cache's
    step takes itself): keydiff's running sum (``state``, None at the start)
    moves on; qfilter reads ``filters [H, D]``; a callable is called as
    ``scorer(keys, values, state)``. ``offset`` and ``valid`` as
    ``row_scores`` takes them (a batch's padding rows)."""
    from .ops.row_scores import row_scores

    batch, heads, _, dim = keys.shape
    if callable(scorer):
        # Array objects of its own (no copy of the data): a callable that
        # updates them in place (``state += ...``) changes neither the
        # cache's fields, which a failed operation puts back and trim
        # rebuilds from, nor the rows the step stores.
        own = lambda a: copy.copy(a) if isinstance(a, mx.array) else a
        result = scorer(own(keys), own(values), tree_map(own, state))
        if not isinstance(result, tuple) or len(result) != 2:
            raise ValueError(f"mlx_knorm: scorer {scorer_label(scorer)} must return (scores, state), "
                             f"got {type(result).__name__}")
        scores, state = result
        if not isinstance(scores, mx.array) or scores.dtype != mx.float32 or scores.shape != keys.shape[:3]:
            got = f"{scores.dtype} {list(scores.shape)}" if isinstance(scores, mx.array) else type(scores).__name__
            raise ValueError(f"mlx_knorm: scorer {scorer_label(scorer)} must return float32 scores "
                             f"{list(keys.shape[:3])} for keys {list(keys.shape)}, got {got}")
        return scores, state
    if scorer == "keydiff":
        start = mx.zeros((batch, heads, dim), mx.float32) if state is None else state
        return row_scores(keys, None, start, scorer="keydiff", offset=offset, valid=valid)
    if scorer == "vnorm":
        return row_scores(keys, values, None, scorer="vnorm", offset=offset, valid=valid)[0], None
    if scorer == "qfilter":
        if filters is None or tuple(filters.shape) != (heads, dim):
            shape = None if filters is None else list(filters.shape)
            raise ValueError(f"mlx_knorm: the qfilter scorer's filters are {shape}, the keys [{heads}, {dim}] "
                             "per layer: calibrated for another model? Run `mlx-knorm calibrate`")
        filters = mx.broadcast_to(filters, (batch, heads, dim))
        return row_scores(keys, None, filters, scorer="qfilter", offset=offset, valid=valid)[0], None
    raise ValueError(f"mlx_knorm: score_rows: no scores for scorer {scorer!r}")


class QueryFilters:
    """The ``qfilter`` scorer's filters: for each full-attention layer of a
    model, one unit float32 vector per KV head, ``[H_kv, D]``, the principal
    direction of the model's (rotated) queries there, signed so that the
    queries' mean projection on it is positive: a key with a large
    projection draws more attention on average."""

    def __init__(self, filters: dict[int, np.ndarray], metadata: dict | None = None):
        self.filters = {int(layer): np.asarray(f, dtype=np.float32) for layer, f in filters.items()}
        self.metadata = dict(metadata or {})

    def __getstate__(self) -> dict:
        # The model found to fit (a weak reference) stays in this process.
        return {k: v for k, v in self.__dict__.items() if k != "_fitted_model"}

    def of_layer(self, index: int) -> mx.array:
        """Layer ``index``'s filters, ``[H_kv, D]``; a layer they lack raises."""
        if index not in self.filters:
            raise ValueError(f"mlx_knorm: the query filters have no layer {index} (they cover layers "
                             f"{sorted(self.filters)}): calibrated for another model? Run `mlx-knorm calibrate`")
        return mx.array(self.filters[index])

    def layer(self, index: int, heads: int, dim: int) -> mx.array:
        """Layer ``index``'s filters, ``[heads, dim]``; a mismatch raises naming the layer."""
        f = self.of_layer(index)
        if tuple(f.shape) != (heads, dim):
            raise ValueError(f"mlx_knorm: the query filters of layer {index} are {list(f.shape)}, the model's "
                             f"keys [{heads}, {dim}] per layer: calibrated for another model? "
                             "Run `mlx-knorm calibrate`")
        return f

    def save(self, path: str | Path) -> Path:
        """Write the filters to ``path``, that name exactly (whatever it ends
        with), atomically: a write that fails part way leaves the file
        there before as it was (``mlx_knorm.atomic``)."""
        from .atomic import atomic_path

        path = Path(path)
        arrays = {f"layer.{i}": mx.array(f) for i, f in sorted(self.filters.items())}
        metadata = {"format": FILTERS_FORMAT, "metadata": json.dumps(self.metadata)}
        # The temporary name ends in .safetensors, which mx.save_safetensors
        # would otherwise append.
        with atomic_path(path, suffix=".safetensors") as temporary:
            mx.save_safetensors(str(temporary), arrays, metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "QueryFilters":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"mlx_knorm: no query filters at {path}: run `mlx-knorm calibrate --model M "
                                    f"--out {path}` first")
        try:
            arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"mlx_knorm: {path} is not a query-filter file ({e}): run `mlx-knorm calibrate "
                             f"--model M --out {path}` again") from None
        if meta.get("format") != FILTERS_FORMAT:
            raise ValueError(f"mlx_knorm: {path} is not a query-filter file of this version "
                             f"(format {meta.get('format')!r}, expected {FILTERS_FORMAT!r})")
        filters = {}
        for name, array in arrays.items():
            prefix, _, index = name.partition(".")
            if prefix != "layer" or not index.isdigit() or array.ndim != 2 or array.dtype != mx.float32:
                raise ValueError(f"mlx_knorm: {path}: unexpected entry {name!r} {array.dtype} {array.shape}")
            filters[int(index)] = np.array(array)
        try:
            metadata = json.loads(meta.get("metadata", "{}"))
        except json.JSONDecodeError:
            metadata = None
        if not isinstance(metadata, dict):
            raise ValueError(f"mlx_knorm: {path}: its metadata is not a JSON object")
        return cls(filters, metadata)

    def check_model(self, model) -> None:
        """Refuse a model these filters were not calibrated for: they must
        cover exactly the layers ``make_knorm_cache`` compresses when none
        is skipped (those ``calibrate`` measures), of a model with the layer
        count the file records (``layers``, where it does), each ``[H_kv,
        D]`` as the model's keys. ``ValueError`` naming what differs; a
        model once found to fit is not checked again."""
        fitted = getattr(self, "_fitted_model", None)
        if fitted is not None and fitted() is model:
            return
        from .cache import _key_heads_and_widths

        layers, compressed = model_attention_layers(model)
        recorded = self.metadata.get("layers")
        made_for = f" (made for {self.metadata['model']})" if isinstance(self.metadata.get("model"), str) else ""
        if isinstance(recorded, int) and recorded != layers:
            raise ValueError(f"mlx_knorm: the query filters{made_for} are of a model of {recorded} layers, this "
                             f"model has {layers}: calibrated for another model? Run `mlx-knorm calibrate`")
        if set(self.filters) != set(compressed):
            raise ValueError(f"mlx_knorm: the query filters{made_for} cover layers {_ranges(self.filters)}, this "
                             f"model's full-attention layers are {_ranges(compressed)}: calibrated for another "
                             "model? Run `mlx-knorm calibrate`")
        # Each layer's heads and width, as make_knorm_cache checks them (not
        # through it: it may call this check).
        widths = _key_heads_and_widths(model)
        for index in compressed:
            if index in widths:
                self.layer(index, *widths[index])
        self._fitted_model = weakref.ref(model)


def model_attention_layers(model) -> tuple[int, tuple[int, ...]]:
    """``(layers, compressed)``: the model's layer count and the layers
    ``make_knorm_cache`` compresses when none is skipped (an
    ``L2NormKVCache`` of its own), which ``calibrate`` measures."""
    from .cache import L2NormKVCache, make_knorm_cache

    cache = make_knorm_cache(model, budget=2, n_sink=0, recent=0)
    return len(cache), tuple(i for i, c in enumerate(cache) if isinstance(c, L2NormKVCache))


def _ranges(layers) -> str:
    layers = sorted(layers)
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]} to {layers[-1]}"
    return ", ".join(map(str, layers))


def as_query_filters(filters) -> QueryFilters | None:
    """``filters`` given as a ``QueryFilters``, a path of a calibration file, or None."""
    if filters is None or isinstance(filters, QueryFilters):
        return filters
    if isinstance(filters, (str, Path)):
        return QueryFilters.load(filters)
    raise TypeError(f"mlx_knorm: filters must be a path to a `mlx-knorm calibrate` file or QueryFilters, "
                    f"got {type(filters).__name__}")


def default_filters_path(model) -> Path:
    """Where ``mlx-knorm calibrate`` writes, and the commands look for, the
    query filters of ``model`` (as given to ``--model``) by default: the
    cache folder's ``filters/<model>.safetensors``, a local path named by
    its resolved path."""
    from .models.fetch import cache_dir

    text = str(model)
    if Path(text).exists():
        # A local directory or file: its whole path, so that "." or two
        # folders of one name do not share a file.
        text = str(Path(text).resolve())
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text.rstrip("/")).strip("_.") or "model"
    return cache_dir() / "filters" / f"{name}.safetensors"
