"""Compare eviction policies on an mlx-lm model, teacher-forced and exact.

Each sequence of ``T`` tokens is run once with the full cache, which gives
the attention maps and keys, and once per (policy, budget) with that policy's
kept sets applied as attention masks, layer by layer (a layer's kept set
depends on its keys, which depend on the eviction below it), which is what
the cache does when decoding token by token. The model runs its own forward
pass; only the attention of its full-attention layers (the layers
``make_knorm_cache`` would give an ``L2NormKVCache`` without ``skip_layers``)
is computed here, in blocks of query rows, so that memory holds one block of
``[heads, rows, T]`` scores at a time.

Policies are compared at equal memory (``policies.Policy.layer_budget``): a
budget is the KV rows per full-attention layer, on average over those layers,
at the end of the sequence; a policy that leaves layers uncompressed gives
the others fewer rows. A query at position ``t <= rows`` (the policy's
per-layer budget) sees every earlier token, so every position up to
``rows`` has the full cache's activations: each masked pass starts from a
cache filled by one full-attention pass over that prefix, shared by the
policies with that prefix, and runs only the rest.

A quantized policy (``+bits=B``) attends, in every full-attention layer,
to its rows as the quantized cache holds them (``mx.dequantize`` of
``mx.quantize``, group size 64), its kept set scored on the float keys as
the cache scores them; its passes share no full-attention prefix. Its
recall is the float policy's at the same rows (the kept sets are the
same); ``full+bits=B`` keeps every row (recall 1), once for all budgets.

Metrics, all on the continuation, the last ``T / 2`` positions, one value per
sequence (``stats`` turns them into bootstrap intervals over sequences):

- perplexity of the continuation under each cache;
- attention-mass recall: the share of the full cache's attention that falls
  on the keys a policy keeps (kept sets taken from the full pass's keys),
  averaged over the full-attention layers (a layer a policy leaves
  uncompressed keeps all of it), heads and queries;
- per full-attention layer, the Spearman correlation between a key's norm
  and the attention it receives (mean over continuation queries and the
  query heads of its group), over the context keys ``[n_sink, T / 2)``,
  averaged over KV heads and sequences. The paper predicts it is negative.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import KVCache
from tqdm import tqdm

from ..atomic import save_figure
from ..cache import L2NormKVCache, make_knorm_cache
from ..scorers import as_query_filters
from . import BUDGET_FRACTIONS, QUERY_CHUNK
from .policies import (DEFAULT_POLICIES, FULL, Policy, attention_layers, derived_key, kept_mask, policy_scores,
                       quantized_rows, stored_dtype)
from .stats import bootstrap_interval, perplexity_interval, resample_indices
from .workers import ModelSpec, check_jobs, map_tasks


@dataclass(frozen=True)
class Cut:
    """One policy at one budget: the rows and recent window of each compressed layer."""

    policy: Policy
    budget: int  # rows per attention layer, on average (the memory)
    rows: int  # rows per compressed layer
    recent: int
    compressed: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        return self.policy.name, self.budget


def _as_policy(policy) -> Policy:
    return policy if isinstance(policy, Policy) else Policy.parse(policy)


def _with_skipped(policy: Policy, skip_layers) -> Policy:
    """``policy`` leaving ``skip_layers`` uncompressed too (the full policy compresses none)."""
    if policy.score == "full":
        return policy
    return Policy(policy.score, policy.recent, tuple(sorted(set(policy.skip) | set(skip_layers))), policy.bits)


def plan_cuts(model, policies, budgets, length: int, n_sink: int, skip_layers=(),
              strict: bool = True) -> tuple[tuple[int, ...], list, list[str], list[str]]:
    """``(attention layers, cuts, notes, names)``: each policy at each budget where it fits.

    Each policy's ``skip_layers`` (its own plus the command's) goes through
    ``make_knorm_cache``, which validates them for this model. A policy the
    model cannot run (its skipped layers are all there is, or the model
    refuses ``skip_layers``) raises, or with ``strict=False`` is left out
    with a note; so is, silently, a policy at a budget whose memory its
    skipped layers exceed (tables show it as missing). ``names``: the
    policies planned, with the command's ``skip_layers`` in their names.
    """
    attention = attention_layers(model, n_sink)
    cuts, notes, names = [], [], []
    for policy in policies:
        policy = _with_skipped(policy, skip_layers)
        compressed = tuple(i for i in attention if i not in policy.skip)
        planned = []
        try:
            if not compressed:
                raise ValueError(f"skip_layers {policy.skip} leaves no full-attention layer to compress "
                                 f"(full-attention layers: {attention})")
            for budget in budgets:
                rows = policy.layer_budget(budget, length, attention, n_sink)
                if rows is None:
                    continue
                recent = policy.recent_rows(rows)
                make_knorm_cache(model, budget=rows, n_sink=n_sink, recent=recent, skip_layers=policy.skip)
                planned.append(Cut(policy, budget, rows, recent, compressed))
        except ValueError as error:
            if strict:
                raise
            notes.append(f"{policy.name} left out: {error}")
            continue
        cuts += planned
        names.append(policy.name)
    return attention, cuts, notes, names


class _LayerProbe(KVCache):
    """One full-attention layer's cache in a teacher-forced pass: hands its attention to the pass."""

    def __init__(self, layer: int, attend):
        super().__init__()
        self.layer = layer
        self.attend = attend


@contextmanager
def attention_routed(route):
    """mlx-lm's ``scaled_dot_product_attention`` is ``route(original,
    queries, keys, values, cache, scale, mask, sinks)`` while the block runs.

    mlx-lm's model modules import the function from ``mlx_lm.models.base`` by
    name, so it is replaced in every loaded model module.
    """
    original = mlx_lm_base.scaled_dot_product_attention

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        return route(original, queries, keys, values, cache, scale, mask, sinks)

    modules = [module for name, module in list(sys.modules.items())
               if name.startswith("mlx_lm.models.")
               and getattr(module, "scaled_dot_product_attention", None) is original]
    for module in modules:
        module.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        for module in modules:
            module.scaled_dot_product_attention = original


def _attention_through_probes():
    """Route mlx-lm's attention to the probes while the block runs; layers
    whose cache is not a probe (sliding-window, recurrent) run the original."""

    def route(original, queries, keys, values, cache, scale, mask, sinks):
        if not isinstance(cache, _LayerProbe):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            raise ValueError("the eval does not support models with attention sinks (sinks=...)")
        # The model's mask is the causal mask of a fresh cache; the pass builds its own.
        return cache.attend(cache.layer, queries, keys, values, scale)

    return attention_routed(route)


def causal(first: int, stop: int) -> mx.array:
    """Boolean ``[1, stop - first, stop]``: query ``t`` in ``[first, stop)`` sees keys ``[0, t]``."""
    return (mx.arange(stop)[None, :] <= mx.arange(first, stop)[:, None])[None]


def masked_softmax(scores: mx.array, allowed: mx.array) -> mx.array:
    """float32 softmax over the last axis of ``scores`` where ``allowed`` (broadcast), 0 elsewhere.

    The mask is an additive bias built at the mask's own (unbroadcast) shape,
    and ``exp(x)`` is ``2 ** (x * log2(e))``: on MLX's x86 CPU backend ``exp``
    runs about 3x slower than ``power``, and this softmax (within 4e-7
    relative of ``mx.softmax``) is the larger part of the eval's time.
    """
    bias = mx.where(allowed, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    shifted = scores + bias
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    weights = mx.power(mx.array(2.0, mx.float32), shifted * math.log2(math.e))
    return weights / weights.sum(axis=-1, keepdims=True)


def chunked_attention(queries, keys, values, scale, allowed, observe=None, chunk: int = QUERY_CHUNK):
    """Masked GQA attention of ``[1, H, S, D]`` queries at positions ``[T - S, T)`` over ``[1, Hkv, T, D]`` keys.

    ``chunk`` query rows at a time. ``allowed(first, stop)`` gives the
    boolean ``[Hkv or 1, stop - first, stop]`` mask of the queries at
    positions ``[first, stop)``; ``observe(first, stop, probs [Hkv, group,
    rows, stop])`` may return arrays to evaluate with the block. Scores and
    softmax are float32. Each block is evaluated before the next is built,
    so peak memory is one block's scores, not ``[H, S, T]``.
    """
    batch, heads, steps, _ = queries.shape
    if batch != 1:
        raise ValueError(f"the eval runs one sequence at a time, got batch {batch}")
    kv_heads, length = keys.shape[1], keys.shape[2]
    offset = length - steps
    q = (queries[0].astype(mx.float32) * scale).reshape(kv_heads, heads // kv_heads, steps, -1)
    k = keys[0].astype(mx.float32)[:, None]
    v = values[0].astype(mx.float32)[:, None]
    blocks = []
    for row in range(0, steps, chunk):
        first, stop = offset + row, offset + min(row + chunk, steps)
        scores = q[:, :, row : row + chunk] @ k[:, :, :stop].swapaxes(-1, -2)
        probs = masked_softmax(scores, allowed(first, stop)[:, None])
        observed = observe(first, stop, probs) if observe else []
        block = probs @ v[:, :, :stop]
        mx.eval(block, *observed)
        blocks.append(block)
    out = mx.concatenate(blocks, axis=2).reshape(1, heads, steps, -1)
    return out.astype(queries.dtype)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass
class Results:
    seq_len: int
    n_seqs: int
    n_sink: int
    budgets: list[int]
    attention_layers: tuple[int, ...]
    cuts: list = field(default_factory=list)
    # (policy name, budget) -> per-sequence values; (FULL, None) for the full cache.
    nll: dict = field(default_factory=dict)
    # (policy name, budget) -> per sequence, per attention layer.
    recall: dict = field(default_factory=dict)
    # per sequence, per attention layer
    spearman: list = field(default_factory=list)
    seed: int = 0
    notes: list = field(default_factory=list)  # policies left out, and why
    planned: list = field(default_factory=list)  # policy names, those with no room at any budget included
    skip_layers: tuple[int, ...] = ()  # left uncompressed by every policy

    def policies(self) -> list[str]:
        return self.planned or list(dict.fromkeys(cut.policy.name for cut in self.cuts))

    def cut(self, policy: str, budget: int) -> Cut | None:
        return next((c for c in self.cuts if c.key == (policy, budget)), None)

    def _indices(self) -> np.ndarray:
        # One draw of windows for every figure, so intervals are paired.
        return resample_indices(self.n_seqs, self.seed)

    def perplexity(self, policy, budget=None) -> float:
        return math.exp(float(np.mean(self.nll[(policy, budget)])))

    def perplexity_ci(self, policy, budget=None) -> tuple[float, float]:
        return perplexity_interval(self.nll[(policy, budget)], self._indices())

    def perplexity_ratio(self, policy, budget) -> float:
        """Perplexity under the policy over the full cache's, on the same sequences."""
        return self.perplexity(policy, budget) / self.perplexity(FULL)

    def perplexity_ratio_ci(self, policy, budget) -> tuple[float, float]:
        """Paired interval of that ratio: per-sequence NLL differences, resampled by sequence."""
        gap = np.array(self.nll[(policy, budget)]) - np.array(self.nll[(FULL, None)])
        return perplexity_interval(gap, self._indices())

    def mean_recall(self, policy, budget=None) -> float:
        return float(np.mean(self.recall[(policy, budget)]))

    def recall_ci(self, policy, budget=None) -> tuple[float, float]:
        return bootstrap_interval(self.recall[(policy, budget)], np.mean, self._indices())

    def layer_recall(self, policy, budget) -> dict[int, float]:
        means = np.mean(np.array(self.recall[(policy, budget)]), axis=0)
        return dict(zip(self.attention_layers, means.tolist()))

    def layer_spearman(self) -> dict[int, float]:
        return dict(zip(self.attention_layers, np.mean(np.array(self.spearman), axis=0).tolist()))

    def plain(self, score: str) -> str:
        """The name of the policy ``score`` with no recent window and no layers skipped but every policy's."""
        return Policy(score, skip=self.skip_layers).name

    def verdict(self) -> str | None:
        """keep-low against random eviction at the smallest budget; None when either did not run there."""
        budget = min(self.budgets)
        low_name, random_name = self.plain("keep-low"), self.plain("random")
        if (low_name, budget) not in self.recall or (random_name, budget) not in self.recall:
            return None
        low, rand = self.mean_recall(low_name, budget), self.mean_recall(random_name, budget)
        line = (f"keep=low keeps more attention mass than random on this model at "
                f"{budget / self.seq_len:.0%} (budget {budget} of {self.seq_len}): "
                f"{'yes' if low > rand else 'no'}, recall {low:.3f} vs {rand:.3f} ({low - rand:+.3f})")
        if (low_name, budget) in self.nll:
            line += (f"; perplexity {self.perplexity(low_name, budget):.3f} vs "
                     f"{self.perplexity(random_name, budget):.3f} (full cache {self.perplexity(FULL):.3f})")
        return line

    def report(self) -> dict:
        def named(cut_key):
            return f"{cut_key[0]}@{cut_key[1]}"

        measured = [c.key for c in self.cuts if c.key in self.nll]
        return {
            "seq_len": self.seq_len, "n_seqs": self.n_seqs, "n_sink": self.n_sink,
            "budgets": self.budgets, "attention_layers": list(self.attention_layers),
            "skip_layers": list(self.skip_layers),
            "policies": {c.policy.name: {"label": c.policy.label, "recent": str(c.policy.recent),
                                         "skip_layers": list(c.policy.skip),
                                         "compressed_layers": list(c.compressed)} for c in self.cuts},
            "cuts": {named(c.key): {"rows_per_compressed_layer": c.rows, "recent_rows": c.recent}
                     for c in self.cuts},
            "interval": "95% percentile bootstrap over sequences (10,000 resamples, paired across figures)",
            "full_perplexity": self.perplexity(FULL),
            "full_perplexity_ci": self.perplexity_ci(FULL),
            "perplexity": {named(k): self.perplexity(*k) for k in measured},
            "perplexity_ci": {named(k): self.perplexity_ci(*k) for k in measured},
            "perplexity_ratio_to_full": {named(k): self.perplexity_ratio(*k) for k in measured},
            "perplexity_ratio_to_full_ci": {named(k): self.perplexity_ratio_ci(*k) for k in measured},
            "recall": {named(c.key): self.mean_recall(*c.key) for c in self.cuts},
            "recall_ci": {named(c.key): self.recall_ci(*c.key) for c in self.cuts},
            "layer_recall": {named(c.key): self.layer_recall(*c.key) for c in self.cuts},
            "layer_spearman": self.layer_spearman(),
            "per_sequence": {
                "nll": {named(k) if k[1] else FULL: v for k, v in self.nll.items()},
                "recall": {named(k): np.mean(np.array(v), axis=1).tolist()
                           for k, v in self.recall.items() if k[1]},
            },
            "notes": self.notes,
            "verdict": self.verdict(),
        }


class _Evaluator:
    """Runs the passes of one sequence and records their numbers in ``results``."""

    def __init__(self, model, results: Results, seed: int, query_chunk: int, bar, filters=None):
        self.model, self.results = model, results
        self.query_chunk, self.bar = query_chunk, bar
        self.attention = results.attention_layers
        self.seed = seed
        self.filters = filters

    def caches(self) -> list:
        return make_knorm_cache(self.model, budget=self.results.n_sink + 1, n_sink=self.results.n_sink, recent=0)

    def scores(self, sequence: int, layer: int, score: str, keys, values):
        # One random-eviction key per (sequence, layer), shared by the recall and perplexity passes.
        filters = None
        if score == "qfilter":
            filters = self.filters.layer(layer, keys.shape[1], keys.shape[-1])
        return policy_scores(score, keys[0], values[0], derived_key(self.seed, sequence, layer),
                             self.results.seq_len, filters)

    def run(self, tokens: mx.array, attend, state=None, caches=None) -> tuple[mx.array, list]:
        """``(logits [S, vocab], caches)`` of the model on ``tokens [S]`` with ``attend`` in its attention layers.

        The tokens continue ``caches`` (those of an earlier call) or fresh
        caches set to ``state``; nothing is evaluated but the attention, so
        logits that nobody evaluates cost nothing.
        """
        attended = []

        def record(layer, *args):
            attended.append(layer)
            out = self.attends[layer](layer, *args)
            self.bar.update()
            return out

        if caches is None:
            caches = [_LayerProbe(i, record) if isinstance(c, L2NormKVCache) else c
                      for i, c in enumerate(self.caches())]
            for cache, saved in zip(caches, state or []):
                cache.state = saved
        for cache in caches:
            if isinstance(cache, _LayerProbe):
                cache.attend = record
        self.attends = {layer: attend for layer in self.attention}
        with _attention_through_probes():
            logits = self.model(tokens[None], cache=caches)[0]
        if sorted(attended) != list(self.attention):
            raise ValueError(
                f"{type(self.model).__module__} computes attention in layers "
                f"{sorted(set(self.attention) - set(attended))} without "
                "mlx_lm.models.base.scaled_dot_product_attention; the eval cannot observe it")
        return logits, caches

    def full_attention(self, layer, queries, keys, values, scale):
        return chunked_attention(queries, keys, values, scale, causal, chunk=self.query_chunk)

    def record_nll(self, key, logits: mx.array, tokens: mx.array) -> None:
        """NLL of the continuation ``tokens[T/2:]``; ``logits`` are those of the last ``len(logits)`` positions."""
        start = len(tokens) // 2
        first = len(tokens) - len(logits)
        nll = nn.losses.cross_entropy(logits[start - 1 - first : -1].astype(mx.float32), tokens[start:],
                                      reduction="mean")
        self.results.nll.setdefault(key, []).append(nll.item())

    def full_pass(self, sequence: int, tokens: mx.array, cuts) -> None:
        length = len(tokens)
        start, n_sink = length // 2, self.results.n_sink
        recall = {key: [] for key in [(FULL, None), *(c.key for c in cuts)]}
        rho = []

        def attend(layer, queries, keys, values, scale):
            active = [c for c in cuts if layer in c.compressed and c.policy.score != "full"]
            scores = {s: self.scores(sequence, layer, s, keys, values) for s in {c.policy.score for c in active}}
            # Per-row attention mass (a float32 sum over one row's keys), added up
            # in float64 once the layer is done: one float32 sum over every row
            # drifts by ~1e-5.
            mass = {key: [] for key in [(FULL, None), *(c.key for c in active)]}
            received = mx.zeros((keys.shape[1], start), mx.float32)

            def observe(first, stop, probs):
                nonlocal received
                if stop <= start:
                    return []
                rows = probs[:, :, max(first, start) - first :]
                received = received + rows[..., :start].sum(axis=(1, 2))
                mass[(FULL, None)].append(rows.sum(axis=-1))
                for cut in active:
                    score, keep = scores[cut.policy.score]
                    kept = kept_mask(score, cut.rows, n_sink, keep, max(first, start), stop, cut.recent)
                    mass[cut.key].append((rows * kept[:, None]).sum(axis=-1))
                return [received] + [partials[-1] for partials in mass.values() if partials]

            out = chunked_attention(queries, keys, values, scale, causal, observe, self.query_chunk)
            norms, _ = policy_scores("keep-low", keys[0, :, :start], values[0, :, :start], None)
            per_head = [spearman(n[n_sink:], r[n_sink:]) for n, r in zip(np.array(norms), np.array(received))]
            rho.append(float(np.mean(per_head)))
            rows_seen = queries.shape[1] * (length - start)
            full = sum(np.array(rows).sum(dtype=np.float64) for rows in mass[(FULL, None)]) / rows_seen
            for key in recall:
                # A layer a policy leaves uncompressed keeps every key: the full cache's mass.
                kept = mass.get(key)
                recall[key].append(full if kept is None else
                                   sum(np.array(rows).sum(dtype=np.float64) for rows in kept) / rows_seen)
            return out

        self.record_nll((FULL, None), self.run(tokens, attend)[0], tokens)
        self.results.spearman.append(rho)
        for key, values in recall.items():
            self.results.recall.setdefault(key, []).append(values)

    def masked_logits(self, sequence: int, tokens: mx.array, cut: Cut | None, prefix: int = 0,
                      state=None, scored: int | None = None) -> mx.array:
        """Logits of positions ``[scored, T)`` under ``cut``; the full cache for ``cut=None``.

        ``state``: the caches after a full-attention pass over ``tokens[:prefix]``
        (``prefix <= cut.rows + 1``: until then nothing is evicted).
        ``scored`` (default ``prefix``): the positions before it run in a
        call of their own whose logits are never computed.
        """
        def attend(layer, queries, keys, values, scale):
            allowed = causal
            if cut is not None and layer in cut.compressed and cut.policy.score != "full":
                # Scored on the float keys, as the quantized cache scores them.
                scores, keep = self.scores(sequence, layer, cut.policy.score, keys, values)

                def allowed(first, stop):
                    return kept_mask(scores, cut.rows, self.results.n_sink, keep, first, stop, cut.recent)

            if cut is not None and cut.policy.bits:
                keys, values = (quantized_rows(a.astype(stored_dtype(keys[0], values[0])), cut.policy.bits)
                                for a in (keys, values))
            return chunked_attention(queries, keys, values, scale, allowed, chunk=self.query_chunk)

        scored = prefix if scored is None else scored
        caches = None
        if scored > prefix:
            _, caches = self.run(tokens[prefix:scored], attend, state)
        return self.run(tokens[scored:], attend, state, caches)[0]

    def masked_passes(self, sequence: int, tokens: mx.array, cuts) -> None:
        """Every cut's perplexity; cuts whose first ``rows + 1`` positions see everything share that prefix."""
        last = len(tokens) // 2 - 1  # the first position whose logits are scored
        by_prefix, full = {}, {}
        for cut in cuts:
            if cut.policy.score == "full":
                full.setdefault(cut.policy.name, []).append(cut)
            else:
                # A quantized policy's rows differ from the first token on.
                by_prefix.setdefault(0 if cut.policy.bits else min(cut.rows + 1, last), []).append(cut)
        for group in full.values():
            logits = self.masked_logits(sequence, tokens, group[0], scored=last)
            for cut in group:
                self.record_nll(cut.key, logits, tokens)
        for prefix, group in sorted(by_prefix.items()):
            state = None
            if prefix:
                _, caches = self.run(tokens[:prefix], self.full_attention)
                state = [c.state for c in caches]
                mx.eval(state)
            for cut in group:
                logits = self.masked_logits(sequence, tokens, cut, prefix, state, scored=last)
                self.record_nll(cut.key, logits, tokens)


def _check_args(query_chunk) -> None:
    if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")


def teacher_forced_logits(model, tokens, policy=None, budget: int | None = None,
                          n_sink: int = 4, skip_layers=(), seed: int = 0,
                          query_chunk: int = QUERY_CHUNK) -> mx.array:
    """Logits ``[T, vocab]`` of ``model`` on ``tokens [T]`` under ``policy`` (a ``Policy`` or its name).

    ``budget`` is the cache's own (rows per compressed layer, as
    ``make_knorm_cache`` takes it), with the policy's recent window a share
    of it; ``skip_layers`` add to the policy's. The masks and the
    random-eviction key for ``seed`` are those ``evaluate`` scores the first
    sequence with. ``policy=None`` is the full cache.
    """
    _check_args(query_chunk)
    tokens = mx.array(tokens, dtype=mx.int32)
    attention = attention_layers(model, n_sink)
    results = Results(len(tokens), 1, n_sink, [], attention)
    cut = None
    if policy is not None:
        policy = _as_policy(policy)
        policy = _with_skipped(policy, skip_layers)
        budget = len(tokens) if budget is None or policy.score == "full" else budget
        recent = policy.recent_rows(budget)
        make_knorm_cache(model, budget=budget, n_sink=n_sink, recent=recent, skip_layers=policy.skip)
        cut = Cut(policy, budget, budget, recent, tuple(i for i in attention if i not in policy.skip))
    with tqdm(disable=True) as bar:
        return _Evaluator(model, results, seed, query_chunk, bar).masked_logits(0, tokens, cut)


def evaluate(model, sequences: np.ndarray, n_sink: int = 4, skip_layers=(), fractions=BUDGET_FRACTIONS,
             seed: int = 0, policies=None, perplexity: bool = True, query_chunk: int = QUERY_CHUNK,
             progress: bool = False, jobs: int = 1, model_spec: ModelSpec | None = None,
             filters=None) -> Results:
    """Run every policy at every budget on ``sequences [n, T]`` (token ids).

    Budgets are ``round(fraction * T)`` rows per attention layer, on average
    (equal memory); ``skip_layers`` are left uncompressed by every policy,
    on top of each policy's own. ``policies`` are ``Policy`` objects or
    their names, any set of them (where plain ``keep-low`` and ``random``
    both run, ``Results.verdict`` compares them); by default ``policies.DEFAULT_POLICIES``, less
    those the model cannot run (noted in ``Results.notes``). A policy with
    no room at a budget (skipped layers taking more than the budget's
    memory) is left out there.
    ``perplexity=False`` skips the masked passes: recall, Spearman and the
    full cache's perplexity only.
    ``jobs > 1`` shares the sequences among that many processes
    (``workers.map_tasks``), each loading ``model_spec`` (the model
    ``model`` is); the numbers are those of ``jobs=1``.
    ``filters``: the model's query filters (``mlx_knorm.scorers.QueryFilters``
    or the path of a ``mlx-knorm calibrate`` file), which ``qfilter``
    policies need.
    """
    sequences = np.asarray(sequences)
    if sequences.ndim != 2 or sequences.shape[0] < 1 or sequences.shape[1] < 4:
        raise ValueError(f"sequences must be [n >= 1, T >= 4] token ids, got shape {sequences.shape}")
    _check_args(query_chunk)
    check_jobs(jobs, model_spec)
    strict = policies is not None
    try:
        policies = [_as_policy(p) for p in (DEFAULT_POLICIES if policies is None else policies)]
    except ValueError as error:
        raise ValueError(f"policies: {error}") from None
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"policies must be distinct, got {names}")
    filters = as_query_filters(filters)
    if filters is None and any(p.score == "qfilter" for p in policies):
        raise ValueError("the qfilter policies need the model's query filters (filters=, or the eval's "
                         "--filters): run `mlx-knorm calibrate --model M` first")
    for fraction in fractions:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fractions must lie in (0, 1], got {fraction!r}")
    n_seqs, length = sequences.shape
    budgets = [int(round(f * length)) for f in fractions]
    # The command's own skip_layers must work whatever the policies.
    plan_cuts(model, [Policy("keep-low")], [length], length, n_sink, skip_layers)
    attention, cuts, notes, planned = plan_cuts(model, policies, budgets, length, n_sink, skip_layers, strict)
    for score in ("keep-low", "random"):
        if Policy(score).name not in names:  # the verdict's policies, where asked for
            continue
        name = Policy(score, skip=tuple(sorted(set(skip_layers)))).name
        missing = [b for b in budgets if not any(c.key == (name, b) for c in cuts)]
        if missing:
            raise ValueError(f"budgets {missing} leave {name} no room: skip_layers {sorted(set(skip_layers))} "
                             f"keep {length} rows each, more than those budgets' memory over the "
                             f"{len(attention)} full-attention layers")
    results = Results(length, n_seqs, n_sink, budgets, attention, cuts, seed=seed,
                      skip_layers=tuple(sorted(set(skip_layers))), notes=notes, planned=planned)
    last = length // 2 - 1
    # One pass per full policy, whatever the budget.
    passed = [c for c in cuts if c.policy.score != "full"] + list(
        {c.policy.name: c for c in cuts if c.policy.score == "full"}.values())
    starts = [0 if c.policy.bits else min(c.rows + 1, last) for c in passed]
    # Model calls per sequence: the full pass; per cut one or two (before and from the scored positions),
    # and one per distinct prefix.
    passes = 1 + ((sum(1 + (p < last) for p in starts) + len(set(starts) - {0})) if perplexity else 0)
    bar = tqdm(total=n_seqs * passes * len(attention), desc="eval", unit="layer", disable=not progress)
    window = functools.partial(_evaluate_window, dataclasses.replace(results, n_seqs=1), seed, query_chunk,
                               perplexity, filters)
    parts = map_tasks(window, list(enumerate(sequences)), jobs=jobs, bar=bar, model=model, model_spec=model_spec)
    bar.close()
    for part in parts:
        for key, values in part.nll.items():
            results.nll.setdefault(key, []).extend(values)
        for key, values in part.recall.items():
            results.recall.setdefault(key, []).extend(values)
        results.spearman += part.spearman
    return results


def _evaluate_window(setup: Results, seed: int, query_chunk: int, perplexity: bool, filters, model, _tokenizer,
                     task, bar) -> Results:
    """The numbers of window ``task = (index, token ids)``, in a ``Results`` of one sequence like ``setup``."""
    sequence, row = task
    part = dataclasses.replace(setup, nll={}, recall={}, spearman=[])
    evaluator = _Evaluator(model, part, seed, query_chunk, bar, filters)
    tokens = mx.array(row, dtype=mx.int32)
    evaluator.full_pass(sequence, tokens, part.cuts)
    if perplexity:
        evaluator.masked_passes(sequence, tokens, part.cuts)
    return part


def _interval(value: float, ci: tuple[float, float], digits: int) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def markdown_table(results: Results) -> str:
    """Perplexity and recall per policy and budget, each with its 95% bootstrap interval over sequences."""
    budgets = results.budgets
    with_ppl = any(c.key in results.nll for c in results.cuts)
    header = ([f"ppl @ {b}" for b in budgets] if with_ppl else []) + [f"recall @ {b}" for b in budgets]
    lines = ["| policy | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    full_ppl = _interval(results.perplexity(FULL), results.perplexity_ci(FULL), 2)
    lines.append("| full cache | " + " | ".join(([full_ppl] * len(budgets) if with_ppl else [])
                                              + ["1.000"] * len(budgets)) + " |")
    for policy in results.policies():
        cells = []
        for metric in (["ppl"] if with_ppl else []) + ["recall"]:
            for budget in budgets:
                cut = results.cut(policy, budget)
                if cut is None:
                    cells.append("—")
                elif metric == "ppl":
                    cells.append(_interval(results.perplexity(*cut.key), results.perplexity_ci(*cut.key), 2))
                else:
                    cells.append(_interval(results.mean_recall(*cut.key), results.recall_ci(*cut.key), 3))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    rho = results.layer_spearman()
    lines += ["", "| layer | " + " | ".join(str(i) for i in rho) + " |", "|---|" + "---|" * len(rho),
              "| Spearman(key norm, attention received) | " + " | ".join(f"{r:+.3f}" for r in rho.values()) + " |"]
    return "\n".join(lines)


def plot(results: Results, path: str, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ppl = any(c.key in results.nll for c in results.cuts)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for policy in results.policies():
        cuts = [c for c in (results.cut(policy, b) for b in results.budgets) if c is not None]
        if not cuts:
            continue
        fractions = [c.budget / results.seq_len for c in cuts]
        for ax, value, interval in ([(axes[0], results.perplexity, results.perplexity_ci)] if with_ppl else []) \
                + [(axes[1], results.mean_recall, results.recall_ci)]:
            centre = np.array([value(*c.key) for c in cuts])
            bounds = np.array([interval(*c.key) for c in cuts]).T
            ax.errorbar(fractions, centre, yerr=np.abs(bounds - centre), fmt="o-", capsize=3, label=policy)
    axes[0].axhline(results.perplexity(FULL), color="k", ls="--", label="full cache")
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].tick_params(axis="y", which="minor", labelsize=7)
    axes[1].axhline(1.0, color="k", ls="--", label="full cache")
    axes[0].set(xlabel="budget / sequence length (equal memory)", ylabel="continuation perplexity (tokens)",
                title="Perplexity (lower is better)")
    axes[1].set(xlabel="budget / sequence length (equal memory)", ylabel="attention-mass recall",
                title="Attention-mass recall (higher is better)")
    rho = results.layer_spearman()
    axes[2].bar(range(len(rho)), list(rho.values()), color="tab:purple")
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_xticks(range(len(rho)), [str(i) for i in rho], fontsize=7 if len(rho) > 12 else None)
    axes[2].set(xlabel="layer", ylabel="Spearman rho", title="key norm vs attention received")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: {results.n_seqs} sequences of {results.seq_len} tokens; metrics on the last half; "
                 "95% bootstrap intervals over sequences")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
