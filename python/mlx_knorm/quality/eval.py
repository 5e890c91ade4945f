"""Compare eviction policies on an mlx-lm model, teacher-forced and exact.

Each sequence of ``T`` tokens is run once with the full cache, which gives
the attention maps and keys, and once per (policy, budget) with that policy's
kept sets applied as attention masks, layer by layer (a layer's kept set
depends on its keys, which depend on the eviction below it), which is what
the cache does when decoding token by token. The model runs its own forward
pass; only the attention of its full-attention layers (the layers
``make_knorm_cache`` would give an ``L2NormKVCache`` without ``skip_layers``)
is computed here, in blocks of query rows, so that memory holds one block of
``[heads, rows, T]`` scores at a time. Metrics, all on the continuation, the
last ``T / 2`` positions:

- perplexity of the continuation under each cache;
- attention-mass recall: the share of the full cache's attention that falls
  on the keys a policy keeps (kept sets taken from the full pass's keys),
  averaged over the compressed layers, heads and queries;
- per full-attention layer, the Spearman correlation between a key's norm
  and the attention it receives (mean over continuation queries and the
  query heads of its group), over the context keys ``[n_sink, T / 2)``,
  averaged over KV heads and sequences. The paper predicts it is negative.
"""

from __future__ import annotations

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

from ..cache import L2NormKVCache, make_knorm_cache
from . import BUDGET_FRACTIONS, QUERY_CHUNK
from .policies import POLICIES, POLICY_LABELS, kept_mask, policy_scores


@dataclass(frozen=True)
class LayerPlan:
    """Which layers the eval attends itself, and which of them a policy compresses."""

    attention: tuple[int, ...]
    compressed: tuple[int, ...]
    n_sink: int


def layer_plan(model, budgets, n_sink: int, skip_layers=()) -> LayerPlan:
    """Layers as ``make_knorm_cache`` assigns them; it also validates every argument."""
    def knorm_layers(caches):
        return tuple(i for i, cache in enumerate(caches) if isinstance(cache, L2NormKVCache))

    if not budgets:
        raise ValueError("budgets must not be empty")
    for budget in budgets:
        compressed = knorm_layers(make_knorm_cache(model, budget=budget, n_sink=n_sink, skip_layers=skip_layers))
    attention = knorm_layers(make_knorm_cache(model, budget=budgets[0], n_sink=n_sink))
    if not compressed:
        raise ValueError(f"skip_layers {tuple(skip_layers)} leaves no full-attention layer to compress "
                         f"(full-attention layers: {attention})")
    return LayerPlan(attention, compressed, n_sink)


class _LayerProbe(KVCache):
    """One full-attention layer's cache in a teacher-forced pass: hands its attention to the pass."""

    def __init__(self, layer: int, attend):
        super().__init__()
        self.layer = layer
        self.attend = attend


@contextmanager
def _attention_through_probes():
    """Route mlx-lm's ``scaled_dot_product_attention`` to the probes while the block runs.

    mlx-lm's model modules import the function from ``mlx_lm.models.base`` by
    name, so it is replaced in every loaded model module; layers whose cache
    is not a probe (sliding-window, recurrent) run the original.
    """
    original = mlx_lm_base.scaled_dot_product_attention

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, _LayerProbe):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            raise ValueError("the eval does not support models with attention sinks (sinks=...)")
        # The model's mask is the causal mask of a fresh cache; the pass builds its own.
        return cache.attend(cache.layer, queries, keys, values, scale)

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


def causal(first: int, stop: int) -> mx.array:
    """Boolean ``[1, stop - first, stop]``: query ``t`` in ``[first, stop)`` sees keys ``[0, t]``."""
    return (mx.arange(stop)[None, :] <= mx.arange(first, stop)[:, None])[None]


def chunked_attention(queries, keys, values, scale, allowed, observe=None, chunk: int = QUERY_CHUNK):
    """Masked GQA attention over ``[1, H, T, D]`` inputs, ``chunk`` query rows at a time.

    ``allowed(first, stop)`` gives the boolean ``[Hkv or 1, stop - first,
    stop]`` mask of those rows; ``observe(first, stop, probs [Hkv, group,
    rows, stop])`` may return arrays to evaluate with the block. Scores and
    softmax are float32. Each block is evaluated before the next is built,
    so peak memory is one block's scores, not ``[H, T, T]``.
    """
    batch, heads, length, _ = queries.shape
    if batch != 1:
        raise ValueError(f"the eval runs one sequence at a time, got batch {batch}")
    kv_heads = keys.shape[1]
    q = (queries[0].astype(mx.float32) * scale).reshape(kv_heads, heads // kv_heads, length, -1)
    k = keys[0].astype(mx.float32)[:, None]
    v = values[0].astype(mx.float32)[:, None]
    blocks = []
    for first in range(0, length, chunk):
        stop = min(first + chunk, length)
        scores = q[:, :, first:stop] @ k[:, :, :stop].swapaxes(-1, -2)
        mask = allowed(first, stop)[:, None]
        probs = mx.softmax(mx.where(mask, scores, mx.array(-mx.inf, mx.float32)), axis=-1, precise=True)
        observed = observe(first, stop, probs) if observe else []
        block = probs @ v[:, :, :stop]
        mx.eval(block, *observed)
        blocks.append(block)
    out = mx.concatenate(blocks, axis=2).reshape(1, heads, length, -1)
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
    compressed_layers: tuple[int, ...]
    # (policy, budget) -> per-sequence values; ("full", None) for the full cache.
    nll: dict = field(default_factory=dict)
    # (policy, budget) -> per sequence, per compressed layer.
    recall: dict = field(default_factory=dict)
    # per sequence, per attention layer
    spearman: list = field(default_factory=list)

    def perplexity(self, policy, budget=None) -> float:
        return math.exp(float(np.mean(self.nll[(policy, budget)])))

    def mean_recall(self, policy, budget=None) -> float:
        return float(np.mean(self.recall[(policy, budget)]))

    def layer_recall(self, policy, budget) -> dict[int, float]:
        means = np.mean(np.array(self.recall[(policy, budget)]), axis=0)
        return dict(zip(self.compressed_layers, means.tolist()))

    def layer_spearman(self) -> dict[int, float]:
        return dict(zip(self.attention_layers, np.mean(np.array(self.spearman), axis=0).tolist()))

    def verdict(self) -> str:
        budget = min(self.budgets)
        low, rand = self.mean_recall("keep-low", budget), self.mean_recall("random", budget)
        line = (f"keep=low keeps more attention mass than random on this model at "
                f"{budget / self.seq_len:.0%} (budget {budget} of {self.seq_len}): "
                f"{'yes' if low > rand else 'no'}, recall {low:.3f} vs {rand:.3f} ({low - rand:+.3f})")
        if ("keep-low", budget) in self.nll:
            line += (f"; perplexity {self.perplexity('keep-low', budget):.3f} vs "
                     f"{self.perplexity('random', budget):.3f} (full cache {self.perplexity('full'):.3f})")
        return line

    def report(self) -> dict:
        return {
            "seq_len": self.seq_len, "n_seqs": self.n_seqs, "n_sink": self.n_sink,
            "budgets": self.budgets, "attention_layers": list(self.attention_layers),
            "compressed_layers": list(self.compressed_layers),
            "full_perplexity": self.perplexity("full"),
            "perplexity": {f"{p}@{b}": self.perplexity(p, b) for p, b in self.nll if b},
            "recall": {f"{p}@{b}": self.mean_recall(p, b) for p, b in self.recall if b},
            "layer_recall": {f"{p}@{b}": self.layer_recall(p, b) for p, b in self.recall if b},
            "layer_spearman": self.layer_spearman(),
            "verdict": self.verdict(),
        }


class _Evaluator:
    """Runs the passes of one sequence and records their numbers in ``results``."""

    def __init__(self, model, plan: LayerPlan, results: Results, policies, seed: int,
                 query_chunk: int, bar):
        self.model, self.plan, self.results = model, plan, results
        self.policies, self.query_chunk, self.bar = policies, query_chunk, bar
        self.n_layers = len(self.caches())
        # One random-eviction key per (sequence, layer), shared by the recall and perplexity passes.
        self.random_keys = mx.random.split(mx.random.key(seed), results.n_seqs * self.n_layers)

    def caches(self) -> list:
        return make_knorm_cache(self.model, budget=self.results.budgets[0], n_sink=self.plan.n_sink)

    def scores(self, sequence: int, layer: int, policy: str, keys, values):
        return policy_scores(policy, keys[0], values[0], self.random_keys[sequence * self.n_layers + layer])

    def run(self, tokens: mx.array, attend) -> mx.array:
        """Logits ``[T, vocab]`` of the model on ``tokens [T]`` with ``attend`` in its attention layers."""
        attended = []

        def record(layer, *args):
            attended.append(layer)
            out = attend(layer, *args)
            self.bar.update()
            return out

        caches = [_LayerProbe(i, record) if isinstance(c, L2NormKVCache) else c
                  for i, c in enumerate(self.caches())]
        with _attention_through_probes():
            logits = self.model(tokens[None], cache=caches)[0]
        if sorted(attended) != list(self.plan.attention):
            raise ValueError(
                f"{type(self.model).__module__} computes attention in layers "
                f"{sorted(set(self.plan.attention) - set(attended))} without "
                "mlx_lm.models.base.scaled_dot_product_attention; the eval cannot observe it")
        return logits

    def record_nll(self, cut, logits: mx.array, tokens: mx.array) -> None:
        start = len(tokens) // 2
        nll = nn.losses.cross_entropy(logits[start - 1 : -1].astype(mx.float32), tokens[start:],
                                      reduction="mean")
        self.results.nll.setdefault(cut, []).append(nll.item())

    def full_pass(self, sequence: int, tokens: mx.array) -> None:
        length = len(tokens)
        start, n_sink = length // 2, self.plan.n_sink
        cuts = [(p, b) for p in self.policies for b in self.results.budgets]
        recall = {cut: [] for cut in [("full", None), *cuts]}
        rho = []

        def attend(layer, queries, keys, values, scale):
            compressed = layer in self.plan.compressed
            scores = {p: self.scores(sequence, layer, p, keys, values) for p in self.policies} if compressed else {}
            # Per-row attention mass (a float32 sum over one row's keys), added up
            # in float64 once the layer is done: one float32 sum over every row
            # drifts by ~1e-5.
            mass = {cut: [] for cut in recall}
            received = mx.zeros((keys.shape[1], start), mx.float32)

            def observe(first, stop, probs):
                nonlocal received
                if stop <= start:
                    return []
                rows = probs[:, :, max(first, start) - first :]
                received = received + rows[..., :start].sum(axis=(1, 2))
                mass[("full", None)].append(rows.sum(axis=-1))
                for policy, budget in cuts if compressed else []:
                    policy_score, keep = scores[policy]
                    kept = kept_mask(policy_score, budget, n_sink, keep, max(first, start), stop)
                    mass[(policy, budget)].append((rows * kept[:, None]).sum(axis=-1))
                return [received] + [partials[-1] for partials in mass.values() if partials]

            out = chunked_attention(queries, keys, values, scale, causal, observe, self.query_chunk)
            norms, _ = policy_scores("keep-low", keys[0, :, :start], values[0, :, :start], None)
            per_head = [spearman(n[n_sink:], r[n_sink:]) for n, r in zip(np.array(norms), np.array(received))]
            rho.append(float(np.mean(per_head)))
            if compressed:
                rows_seen = queries.shape[1] * (length - start)
                for cut in recall:
                    recall[cut].append(sum(np.array(rows).sum(dtype=np.float64) for rows in mass[cut]) / rows_seen)
            return out

        self.record_nll(("full", None), self.run(tokens, attend), tokens)
        self.results.spearman.append(rho)
        for cut, values in recall.items():
            self.results.recall.setdefault(cut, []).append(values)

    def masked_logits(self, sequence: int, tokens: mx.array, policy: str | None, budget: int) -> mx.array:
        """Logits under ``policy`` at ``budget``; the full cache for ``policy=None``."""
        def attend(layer, queries, keys, values, scale):
            allowed = causal
            if policy is not None and layer in self.plan.compressed:
                scores, keep = self.scores(sequence, layer, policy, keys, values)

                def allowed(first, stop):
                    return kept_mask(scores, budget, self.plan.n_sink, keep, first, stop)

            return chunked_attention(queries, keys, values, scale, allowed, chunk=self.query_chunk)

        return self.run(tokens, attend)

    def masked_pass(self, sequence: int, tokens: mx.array, policy: str, budget: int) -> None:
        self.record_nll((policy, budget), self.masked_logits(sequence, tokens, policy, budget), tokens)


def _check_args(policies, query_chunk) -> None:
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policies entries must be among {POLICIES}, got {policy!r}")
    if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")


def teacher_forced_logits(model, tokens, policy: str | None = None, budget: int | None = None,
                          n_sink: int = 4, skip_layers=(), seed: int = 0,
                          query_chunk: int = QUERY_CHUNK) -> mx.array:
    """Logits ``[T, vocab]`` of ``model`` on ``tokens [T]`` under ``policy`` at ``budget``.

    What ``evaluate`` scores for the first sequence: the same masks, the same
    random-eviction key for ``seed``. ``policy=None`` is the full cache.
    """
    _check_args([] if policy is None else [policy], query_chunk)
    tokens = mx.array(tokens, dtype=mx.int32)
    budget = len(tokens) if budget is None else budget
    plan = layer_plan(model, [budget], n_sink, skip_layers)
    results = Results(len(tokens), 1, n_sink, [budget], plan.attention, plan.compressed)
    with tqdm(disable=True) as bar:
        evaluator = _Evaluator(model, plan, results, [], seed, query_chunk, bar)
        return evaluator.masked_logits(0, tokens, policy, budget)


def evaluate(model, sequences: np.ndarray, n_sink: int = 4, skip_layers=(), fractions=BUDGET_FRACTIONS,
             seed: int = 0, policies=POLICIES, perplexity: bool = True, query_chunk: int = QUERY_CHUNK,
             progress: bool = False) -> Results:
    """Run every policy at every budget on ``sequences [n, T]`` (token ids).

    Budgets are ``round(fraction * T)``. ``perplexity=False`` skips the
    masked passes: recall, Spearman and the full cache's perplexity only.
    """
    sequences = np.asarray(sequences)
    if sequences.ndim != 2 or sequences.shape[0] < 1 or sequences.shape[1] < 4:
        raise ValueError(f"sequences must be [n >= 1, T >= 4] token ids, got shape {sequences.shape}")
    _check_args(policies, query_chunk)
    if not ("keep-low" in policies and "random" in policies):
        raise ValueError("policies must include 'keep-low' and 'random' (the verdict compares them)")
    for fraction in fractions:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fractions must lie in (0, 1], got {fraction!r}")
    n_seqs, length = sequences.shape
    budgets = [int(round(f * length)) for f in fractions]
    plan = layer_plan(model, budgets, n_sink, skip_layers)
    results = Results(length, n_seqs, n_sink, budgets, plan.attention, plan.compressed)
    passes = 1 + (len(policies) * len(budgets) if perplexity else 0)
    bar = tqdm(total=n_seqs * passes * len(plan.attention), desc="eval", unit="layer", disable=not progress)
    evaluator = _Evaluator(model, plan, results, policies, seed, query_chunk, bar)
    for s, row in enumerate(sequences):
        tokens = mx.array(row, dtype=mx.int32)
        evaluator.full_pass(s, tokens)
        if perplexity:
            for policy in policies:
                for budget in budgets:
                    evaluator.masked_pass(s, tokens, policy, budget)
    bar.close()
    return results


def markdown_table(results: Results) -> str:
    budgets = results.budgets
    header = ([f"ppl @ {b}" for b in budgets] if ("keep-low", budgets[0]) in results.nll else []) \
        + [f"recall @ {b}" for b in budgets]
    lines = ["| policy | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    with_ppl = len(header) > len(budgets)
    full = ([f"{results.perplexity('full'):.3f}"] * len(budgets) if with_ppl else []) \
        + [f"{results.mean_recall('full'):.3f}"] * len(budgets)
    lines.append("| full cache | " + " | ".join(full) + " |")
    for policy in [p for p in POLICIES if (p, budgets[0]) in results.recall]:
        ppl = [f"{results.perplexity(policy, b):.3f}" for b in budgets] if with_ppl else []
        rec = [f"{results.mean_recall(policy, b):.3f}" for b in budgets]
        lines.append(f"| {POLICY_LABELS[policy]} | " + " | ".join(ppl + rec) + " |")
    rho = results.layer_spearman()
    lines += ["", "| layer | " + " | ".join(str(i) for i in rho) + " |", "|---|" + "---|" * len(rho),
              "| Spearman(key norm, attention received) | " + " | ".join(f"{r:+.3f}" for r in rho.values()) + " |"]
    return "\n".join(lines)


def plot(results: Results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ppl = ("keep-low", results.budgets[0]) in results.nll
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    fractions = [b / results.seq_len for b in results.budgets]
    for policy in [p for p in POLICIES if (p, results.budgets[0]) in results.recall]:
        if with_ppl:
            axes[0].plot(fractions, [results.perplexity(policy, b) for b in results.budgets], "o-", label=policy)
        axes[1].plot(fractions, [results.mean_recall(policy, b) for b in results.budgets], "o-", label=policy)
    axes[0].axhline(results.perplexity("full"), color="k", ls="--", label="full cache")
    axes[1].axhline(1.0, color="k", ls="--", label="full cache")
    axes[0].set(xlabel="budget / sequence length", ylabel="continuation perplexity (tokens)",
                title="Perplexity (lower is better)")
    axes[1].set(xlabel="budget / sequence length", ylabel="attention-mass recall",
                title="Attention-mass recall (higher is better)")
    rho = results.layer_spearman()
    axes[2].bar(range(len(rho)), list(rho.values()), color="tab:purple")
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_xticks(range(len(rho)), [str(i) for i in rho])
    axes[2].set(xlabel="layer", ylabel="Spearman rho", title="key norm vs attention received")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: {results.n_seqs} sequences of {results.seq_len} tokens; metrics on the last half")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
