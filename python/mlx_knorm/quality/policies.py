"""Eviction policies: what each keeps, as attention masks (the teacher-forced eval) and as caches (the needle task).

A policy is a score, a recent window and the layers it leaves uncompressed:

- ``keep-low`` / ``keep-high``: the lowest (the paper's rule) or highest key
  norm; ``keydiff``, ``vnorm``, ``qfilter``: the lowest score of those
  scorers (docs/spec.md §2a, ``mlx_knorm.scorers``; ``qfilter`` reads the
  model's query filters, ``mlx-knorm calibrate``); ``window``: sinks + the
  latest tokens (StreamingLLM, mlx-lm's ``RotatingKVCache``); ``random``: a
  fixed random number per token;
- ``+recent=F``: the latest ``F`` of the cache's budget are also protected
  (the reference's ``recent``), e.g. ``keep-low+recent=1/4``;
- ``+skip=I,J``: layers ``I, J`` keep every token (``skip_layers``), e.g.
  ``keep-low+recent=1/4+skip=0,1``;
- ``+bits=B``: every attention layer's rows in MLX's affine quantization at
  ``B`` bits, group size ``DEFAULT_KV_GROUP_SIZE`` (mlx-lm's ``kv_bits``: the
  eviction cache's ``to_quantized``, ``KVCache``'s for skipped layers), the
  scores taken before quantization; ``full+bits=B`` evicts nothing
  (mlx-lm's ``QuantizedKVCache`` alone, whatever the budget).

Every policy protects the first ``n_sink`` tokens. Policies are compared at
equal memory: a budget is the KV rows held per full-attention layer, on
average over those layers, once the whole context has been seen, so a
policy that leaves layers uncompressed gives the others fewer rows
(``Policy.layer_budget``). Equal memory counts rows, not bytes: a
quantized policy at a budget holds fewer bytes than a float one
(``row_bytes``); to compare at equal bytes, give it the larger budget
those bytes buy.

Masks follow ``mlx_knorm.cache.L2NormKVCache`` decoding one token at a time:
query ``t`` attends to the rows kept from ``[0, t)`` plus itself, and the
kept set of ``[0, t)`` is the protected top-k of that whole prefix
(docs/spec.md §3). The kept set does not depend on how the stream was split,
with or without a recent window: a row once evicted is outranked by
``budget - n_sink - recent`` rows that can only be replaced by better ones,
while the rows that can compete with it only grow in number. So one
selection per prefix gives the streaming result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache, create_attention_mask, make_prompt_cache

from .. import key_norms, protected_topk_gather, row_scores
from ..cache import L2NormKVCache, make_knorm_cache
from ..defaults import DEFAULT_KV_GROUP_SIZE, DEFAULT_RECENT_SHARE, share_of

SCORES = ("keep-low", "keep-high", "window", "random", "full", "keydiff", "vnorm", "qfilter")
SCORE_LABELS = {
    "keep-low": "keep-low (paper)",
    "keep-high": "keep-high (ablation)",
    "window": "sinks + recent window",
    "random": "random",
    "full": "no eviction",
    "keydiff": "keydiff (causal)",
    "vnorm": "key norm / value norm",
    "qfilter": "query filter",
}
# Policies whose cache is make_knorm_cache's, and the scorer and keep rule
# each gives it.
CACHE_SCORERS = {"keep-low": ("knorm", "low"), "keep-high": ("knorm", "high"), "keydiff": ("keydiff", "low"),
                 "vnorm": ("vnorm", "low"), "qfilter": ("qfilter", "low")}
# mx.quantize's affine bit widths; every quantized policy takes DEFAULT_KV_GROUP_SIZE.
KV_BITS = (2, 3, 4, 5, 6, 8)
FULL = "full"  # the full cache, in tables and the needle grid


@dataclass(frozen=True)
class Policy:
    """One eviction policy: ``score`` in SCORES, a recent window (a share of the budget), skipped layers."""

    score: str
    recent: Fraction = Fraction(0)
    skip: tuple[int, ...] = ()
    bits: int | None = None

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"policy score must be one of {SCORES}, got {self.score!r}")
        if self.bits is not None and self.bits not in KV_BITS:
            raise ValueError(f"policy bits must be one of {KV_BITS}, got {self.bits!r}")
        if self.score == "full" and (self.bits is None or self.recent or self.skip):
            raise ValueError("the full policy is the quantized full cache: it takes +bits and no +recent or +skip "
                             "(the float full cache always runs)")
        if self.bits is not None and self.score in ("window", "random"):
            raise ValueError(f"the {self.score} policy has no quantized cache (mlx-lm's RotatingKVCache "
                             "cannot be quantized); +bits goes with a scorer's policy or full")
        if not 0 <= self.recent < 1:
            raise ValueError(f"policy recent must be a share of the budget in [0, 1), got {self.recent}")
        if self.score == "window" and self.recent:
            raise ValueError("the window policy is a recent window already: it takes no +recent")
        if any(not isinstance(i, int) or i < 0 for i in self.skip) or len(set(self.skip)) != len(self.skip):
            raise ValueError(f"policy skip must be distinct layer indices >= 0, got {self.skip}")

    @classmethod
    def parse(cls, text: str) -> "Policy":
        """``SCORE[+recent=F][+skip=I,J,...][+bits=B]``; F a fraction (``1/4``) or a decimal (``0.25``)."""
        score, *options = text.strip().split("+")
        recent, skip, bits = Fraction(0), (), None
        for option in options:
            key, _, value = option.partition("=")
            try:
                if key == "recent":
                    recent = Fraction(value)
                elif key == "skip":
                    skip = tuple(sorted(int(v) for v in value.split(",")))
                elif key == "bits":
                    bits = int(value)
                else:
                    raise ValueError
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"policy {text!r}: expected SCORE[+recent=F][+skip=I,J][+bits=B], "
                                 f"with SCORE one of {SCORES}") from None
        return cls(score, recent, skip, bits)

    @property
    def name(self) -> str:
        parts = [self.score]
        if self.recent:
            parts.append(f"recent={self.recent}")
        if self.skip:
            parts.append("skip=" + ",".join(map(str, self.skip)))
        if self.bits:
            parts.append(f"bits={self.bits}")
        return "+".join(parts)

    @property
    def label(self) -> str:
        parts = [SCORE_LABELS[self.score]]
        if self.recent:
            parts.append(f"recent {self.recent} of budget")
        if self.skip:
            parts.append("layers " + ",".join(map(str, self.skip)) + " full")
        if self.bits:
            parts.append(f"{self.bits}-bit rows")
        return ", ".join(parts)

    def layer_budget(self, budget: int, context: int, attention_layers, n_sink: int) -> int | None:
        """Rows per compressed layer that hold ``budget`` rows per attention layer on average.

        At ``context`` tokens the skipped attention layers hold ``context``
        rows each; the compressed ones share what is left. None when that
        leaves no room for the sinks, the recent window and one evictable row.
        The full policy keeps all ``context`` rows whatever the budget.
        """
        if self.score == "full":
            return context
        skipped = len(set(self.skip) & set(attention_layers))
        compressed = len(attention_layers) - skipped
        if compressed < 1:
            return None
        rows = (budget * len(attention_layers) - skipped * context) // compressed
        if rows < 1 or n_sink + self.recent_rows(rows) >= rows:
            return None
        return rows

    def recent_rows(self, layer_budget: int) -> int:
        return share_of(self.recent, layer_budget)


def row_bytes(head_dim: int, itemsize: int, bits: int | None = None, eviction: bool = True) -> int:
    """Bytes of one stored token in one KV head of one layer, keys and values of width ``head_dim``:
    ``itemsize``-byte floats, or with ``bits`` the packed words plus a scale and a bias of
    ``itemsize`` bytes per ``DEFAULT_KV_GROUP_SIZE`` elements (``mx.quantize``); an eviction cache
    adds its float32 norm and int32 position."""
    if bits is None:
        row = head_dim * itemsize
    else:
        row = head_dim * bits // 8 + 2 * itemsize * head_dim // DEFAULT_KV_GROUP_SIZE
    return 2 * row + (8 if eviction else 0)


def parse_policies(text: str) -> list[Policy]:
    """Policies separated by spaces or semicolons (a skip list uses commas)."""
    names = [n for n in re.split(r"[;\s]+", text) if n]
    if not names:
        raise ValueError("no policy given")
    return [Policy.parse(n) for n in names]


# The evaluation's default set: the pure policies, then keep-low with a recent
# window of a quarter and a half of the budget, each also with layers 0 and 1
# uncompressed (the paper's choice), all at equal memory.
DEFAULT_POLICIES = tuple(Policy.parse(name) for name in (
    "keep-low", "keep-high", "window", "random",
    "keep-low+recent=1/4", "keep-low+recent=1/2",
    "keep-low+skip=0,1", "keep-low+recent=1/4+skip=0,1", "keep-low+recent=1/2+skip=0,1",
))


# The needle task's default set, small enough for a CPU: the paper's rule,
# the recent window (StreamingLLM) and the hybrid make_knorm_cache defaults to.
NEEDLE_POLICIES = (Policy("keep-low"), Policy("window"), Policy("keep-low", DEFAULT_RECENT_SHARE))

def derived_key(*entropy: int) -> mx.array:
    """An MLX random key determined by the integers given (a seed, then indices), independent of any count."""
    return mx.random.key(int(np.random.SeedSequence(list(entropy)).generate_state(1)[0]))


def stored_dtype(keys: mx.array, values: mx.array) -> mx.Dtype:
    """The dtype ``L2NormKVCache`` stores these rows in; it takes norms from the stored rows.

    Asked of the cache itself, with one row, so that the eval follows the
    cache's rule whatever it is.
    """
    cache = L2NormKVCache(budget=1, n_sink=0, recent=0)
    cache.update_and_fetch(keys[None, :1, :1], values[None, :1, :1])
    return cache.keys.dtype


def policy_scores(score: str, keys: mx.array, values: mx.array, key: mx.array,
                  draws: int | None = None, filters: mx.array | None = None) -> tuple[mx.array, str]:
    """``(scores [H, T] float32, keep)`` for ``keys [H, T, Dk]``; ``key`` seeds ``random``.

    ``random`` draws ``[H, draws]`` numbers (default ``T``) and keeps the
    first ``T``, so passes over prefixes of one sequence agree. A scorer's
    scores are those of the rows as the cache stores them; ``filters [H,
    Dk]``: the layer's query filters, for ``qfilter``.
    """
    heads, length, _ = keys.shape
    if score in CACHE_SCORERS:
        scorer, keep = CACHE_SCORERS[score]
        dtype = stored_dtype(keys, values)
        if scorer == "knorm":
            return key_norms(keys.astype(dtype)), keep
        if scorer == "qfilter" and filters is None:
            raise ValueError("the qfilter policy needs the model's query filters (mlx-knorm calibrate)")
        state = {"keydiff": mx.zeros((heads, keys.shape[-1]), mx.float32), "qfilter": filters}.get(scorer)
        stored_values = values.astype(dtype) if scorer == "vnorm" else None
        return row_scores(keys.astype(dtype), stored_values, state, scorer=scorer)[0], keep
    if score == "window":
        position = mx.arange(length, dtype=mx.float32)
        return mx.broadcast_to(-position, (heads, length)), "low"
    if score == "random":
        return mx.random.uniform(shape=(heads, max(draws or 0, length)), key=key)[:, :length], "low"
    raise ValueError(f"policy score must be one of {SCORES}, got {score!r}")


def quantized_rows(rows: mx.array, bits: int) -> mx.array:
    """``rows`` as a quantized cache holds them, dequantized: ``mx.dequantize(mx.quantize(rows))``."""
    packed = mx.quantize(rows, group_size=DEFAULT_KV_GROUP_SIZE, bits=bits)
    return mx.dequantize(*packed, group_size=DEFAULT_KV_GROUP_SIZE, bits=bits).astype(rows.dtype)


def kept_mask(scores: mx.array, budget: int, n_sink: int, keep: str,
              first: int = 0, stop: int | None = None, recent: int = 0) -> mx.array:
    """Boolean ``[H, stop - first, stop]``: may query ``t`` in ``[first, stop)`` attend to key ``j``.

    One selection call covers the ``H * (stop - first)`` prefixes: row
    ``(h, t)`` holds the scores of keys ``[0, stop)`` with the future
    ``[t, stop)`` set to NaN, which the selection ranks after every number,
    so it keeps exactly what it would keep from the prefix ``[0, t)``; the
    future is then masked out and the query's own key added. The recent
    window ``[t - recent, t)`` of each prefix gets the best score there is
    (``-inf`` for keep-low, ``+inf`` for keep-high), which keeps it as the
    cache's protection does (``n_sink + recent < budget``).
    """
    heads, length = scores.shape
    stop = length if stop is None else stop
    queries = mx.arange(first, stop)[:, None]
    positions = mx.arange(stop)[None, :]
    future = positions >= queries
    row_scores = mx.where(future[None], mx.array(float("nan")), scores[:, None, :stop])
    if recent:
        best = mx.array(-mx.inf if keep == "low" else mx.inf, mx.float32)
        row_scores = mx.where(((positions >= queries - recent) & ~future)[None], best, row_scores)
    rows = heads * (stop - first)
    row_scores = row_scores.reshape(rows, stop)
    # Only the indices are needed: keys/values are one-column placeholders.
    placeholder = mx.zeros((rows, stop, 1), mx.float16)
    empty = mx.zeros((rows, 0, 1), mx.float16)
    _, _, _, indices = protected_topk_gather(
        empty, empty, mx.zeros((rows, 0), mx.float32),
        placeholder, placeholder, row_scores, budget, n_sink, 0, keep,
    )
    kept = mx.put_along_axis(mx.zeros((rows, stop), mx.bool_), indices.astype(mx.int32),
                             mx.array(True), axis=1)
    return (kept.reshape(heads, stop - first, stop) & ~future) | (positions == queries)


class RandomEvictionCache(_BaseCache):
    """An mlx-lm KV cache that keeps the ``n_sink`` first tokens, the ``recent`` latest, and a random subset of the rest.

    The baseline for eviction with no information: each token of each head
    draws a fixed uniform score when it arrives, and the ``budget`` rows kept
    are the sinks plus the lowest scores (``protected_topk_gather``), so each
    non-sink token is equally likely to survive. Eviction is deferred as in
    ``L2NormKVCache``: a step attends to every kept row plus its new rows,
    and only what is stored for the next step is cut to the budget. Rows are
    stored in the model's dtype, in temporal order.
    """

    def __init__(self, budget: int, n_sink: int, key: mx.array, recent: int = 0):
        self.budget, self.n_sink, self.recent, self._key = budget, n_sink, recent, key
        self.keys = self.values = self.scores = None
        self.offset = 0

    def size(self) -> int:
        return 0 if self.keys is None else min(self.keys.shape[2], self.budget)

    def reseed(self, key: mx.array) -> None:
        """Draw the scores of the tokens still to come from ``key``."""
        self._key = key

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        batch, heads, steps, _ = keys.shape
        self._key, draw = mx.random.split(self._key)
        scores = mx.random.uniform(shape=(batch, heads, steps), key=draw)
        if self.keys is None:
            self.keys, self.values, self.scores = keys, values, scores
        else:
            if self.keys.shape[2] > self.budget:
                self._evict()
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
            self.scores = mx.concatenate([self.scores, scores], axis=2)
        self.offset += steps
        return self.keys, self.values

    def _evict(self) -> None:
        batch, heads, rows, _ = self.keys.shape

        def heads_first(x):
            return x.reshape(batch * heads, rows, *x.shape[3:])

        empty_k = mx.zeros((batch * heads, 0, self.keys.shape[3]), self.keys.dtype)
        empty_v = mx.zeros((batch * heads, 0, self.values.shape[3]), self.values.dtype)
        keys, values, scores, _ = protected_topk_gather(
            heads_first(self.keys), heads_first(self.values), heads_first(self.scores),
            empty_k, empty_v, mx.zeros((batch * heads, 0), mx.float32),
            self.budget, self.n_sink, self.recent, "low")
        self.keys = keys.reshape(batch, heads, self.budget, -1)
        self.values = values.reshape(batch, heads, self.budget, -1)
        self.scores = scores.reshape(batch, heads, self.budget)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # Kept rows all precede the new ones, as in L2NormKVCache.make_mask.
        return create_attention_mask(N, offset=self.size(), return_array=return_array, window_size=window_size)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes + self.scores.nbytes


def attention_layers(model, n_sink: int = 4) -> tuple[int, ...]:
    """The layers ``make_knorm_cache`` compresses when nothing is skipped: the ones a policy acts on."""
    return tuple(i for i, c in enumerate(make_knorm_cache(model, budget=n_sink + 1, n_sink=n_sink, recent=0))
                 if isinstance(c, L2NormKVCache))


def policy_cache(model, policy: Policy | None, budget: int, context: int, n_sink: int = 4,
                 seed: int = 0, layout: str | None = None, filters=None) -> list:
    """The prompt cache that runs ``policy`` at ``budget`` rows per attention layer for a ``context``-token prompt.

    ``None`` is the full cache (``KVCache`` in every attention layer).
    keep-low/keep-high: ``make_knorm_cache`` with the policy's budget per
    layer, recent window and ``skip_layers``; window: mlx-lm's
    ``RotatingKVCache(max_size=budget + 1, keep=n_sink)``, which shows each
    query the same ``budget`` earlier rows as the other caches; random:
    ``RandomEvictionCache``; keydiff, vnorm, qfilter: ``make_knorm_cache``
    with that scorer (qfilter with ``filters``, the model's query filters).
    Layers the model gives another cache
    (sliding-window, recurrent) keep it. With ``bits``, every cache that
    can is converted by its ``to_quantized`` (mlx-lm's ``kv_bits``):
    ``QuantizedL2NormKVCache``, and ``QuantizedKVCache`` for the full policy
    and skipped layers.
    """
    caches = _float_policy_cache(model, policy, budget, context, n_sink, seed, layout, filters)
    if policy is None or policy.bits is None:
        return caches
    return [c.to_quantized(group_size=DEFAULT_KV_GROUP_SIZE, bits=policy.bits)
            if isinstance(c, (KVCache, L2NormKVCache)) else c for c in caches]


def _float_policy_cache(model, policy, budget, context, n_sink, seed, layout, filters) -> list:
    layers = attention_layers(model, n_sink)
    if policy is None or policy.score == "full":
        return make_prompt_cache(model)
    if policy.score == "window" and policy.skip:
        # mlx-lm builds one mask from layer 0's cache; a skipped (KVCache)
        # layer 0 would hand the rotating layers a causal mask, not a window.
        raise ValueError("the window policy (RotatingKVCache) cannot skip layers: the model's shared "
                         "attention mask would not fit its layers")
    rows = policy.layer_budget(budget, context, layers, n_sink)
    if rows is None:
        raise ValueError(f"policy {policy.name} has no room at budget {budget} for a {context}-token context")
    extra = {} if layout is None else {"layout": layout}
    recent = policy.recent_rows(rows)
    scorer, keep = CACHE_SCORERS.get(policy.score, ("knorm", "low"))
    caches = make_knorm_cache(model, budget=rows, n_sink=n_sink, recent=recent, keep=keep, skip_layers=policy.skip,
                              scorer=scorer, filters=filters if scorer == "qfilter" else None, **extra)
    if policy.score in CACHE_SCORERS:
        return caches
    return [(RotatingKVCache(max_size=rows + 1, keep=n_sink) if policy.score == "window"
             else RandomEvictionCache(rows, n_sink, derived_key(seed, i), recent))
            if isinstance(c, L2NormKVCache) else c
            for i, c in enumerate(caches)]
