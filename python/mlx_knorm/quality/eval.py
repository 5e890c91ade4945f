"""Compare eviction policies on the shipped model, teacher-forced and exact.

Each held-out sequence of ``T`` bytes is run once with the full cache, which
gives the attention maps and keys, and once per (policy, budget) with that
policy's kept sets applied as attention masks, layer by layer (a layer's kept
set depends on its keys, which depend on the eviction below it), which is
what the cache does when decoding token by token. Metrics, all on the
continuation, the last ``T / 2`` positions:

- perplexity of the continuation bytes under each cache;
- attention-mass recall: the share of the full cache's attention that falls
  on the keys a policy keeps (kept sets taken from the full pass's keys),
  averaged over layers, heads and queries;
- per layer, the Spearman correlation between a key's norm and the attention
  it receives (mean over continuation queries and query heads of its group),
  over the context keys ``[n_sink, T / 2)``, averaged over KV heads and
  sequences. The paper predicts it is negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from ..ops import key_norms
from .policies import POLICIES, kept_mask, policy_scores

BUDGET_FRACTIONS = (0.25, 0.5, 0.75)


def attend(queries, keys, values, mask, scale):
    """Masked GQA attention; returns ``(out [Hq, T, D], probs [Hq, T, T])``.

    Written out rather than ``mx.fast.scaled_dot_product_attention`` because
    the eval needs the probabilities and a different mask per KV head.
    """
    heads, length, dim = queries.shape
    kv_heads = keys.shape[0]
    grouped = queries.reshape(kv_heads, heads // kv_heads, length, dim)
    scores = (grouped * scale) @ keys[:, None].swapaxes(-1, -2)
    scores = mx.where(mask[:, None], scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs @ values[:, None]
    return out.reshape(heads, length, dim), probs.reshape(heads, length, length)


def forward(model, tokens: mx.array, mask_fn):
    """Logits ``[T, vocab]`` of a llama-format mlx-lm model on ``tokens [T]``.

    ``mask_fn(layer_index, keys [Hkv, T, D]) -> [Hkv, T, T]`` bool gives each
    layer's mask from that layer's post-RoPE keys. Also returns per layer the
    keys and attention probabilities.
    """
    inner = model.model
    h = inner.embed_tokens(tokens[None])
    trace = []
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        length = x.shape[1]
        q = attn.rope(attn.q_proj(x).reshape(length, attn.n_heads, -1).transpose(1, 0, 2))
        k = attn.rope(attn.k_proj(x).reshape(length, attn.n_kv_heads, -1).transpose(1, 0, 2))
        v = attn.v_proj(x).reshape(length, attn.n_kv_heads, -1).transpose(1, 0, 2)
        out, probs = attend(q, k, v, mask_fn(index, k), attn.scale)
        h = h + attn.o_proj(out.transpose(1, 0, 2).reshape(1, length, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        trace.append((k, probs))
    h = inner.norm(h)
    logits = inner.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return logits[0], trace


def causal_mask(kv_heads: int, length: int) -> mx.array:
    position = mx.arange(length)
    return mx.broadcast_to(position[None, :] <= position[:, None], (kv_heads, length, length))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass
class Results:
    seq_len: int
    n_seqs: int
    budgets: list[int]
    # (policy, budget) -> (sum, count) over sequences; budget None for the full cache
    nll: dict = field(default_factory=dict)
    recall: dict = field(default_factory=dict)
    spearman: list = field(default_factory=list)  # per sequence, per layer

    def add(self, table, key, value):
        total, count = table.get(key, (0.0, 0))
        table[key] = (total + value, count + 1)

    def perplexity(self, policy, budget=None) -> float:
        total, count = self.nll[(policy, budget)]
        return math.exp(total / count)

    def mean_recall(self, policy, budget) -> float:
        total, count = self.recall[(policy, budget)]
        return total / count

    def layer_spearman(self) -> list[float]:
        return np.mean(np.array(self.spearman), axis=0).tolist()


def continuation_nll(logits: mx.array, tokens: mx.array, start: int) -> float:
    """Mean NLL (nats) of ``tokens[start:]`` given everything before."""
    return nn.losses.cross_entropy(logits[start - 1 : -1], tokens[start:], reduction="mean").item()


def evaluate(model, sequences: np.ndarray, n_sink: int = 4, seed: int = 0,
             fractions=BUDGET_FRACTIONS, progress: bool = False) -> Results:
    """Run every policy at every budget on ``sequences [n, T]`` (uint8 bytes)."""
    n_seqs, length = sequences.shape
    start = length // 2
    budgets = [int(round(f * length)) for f in fractions]
    kv_heads = model.model.layers[0].self_attn.n_kv_heads
    full = causal_mask(kv_heads, length)
    results = Results(length, n_seqs, budgets)
    n_layers = len(model.model.layers)
    # One random-eviction key per (sequence, layer), shared by the recall and perplexity passes.
    random_keys = mx.random.split(mx.random.key(seed), n_seqs * n_layers)
    bar = tqdm(total=n_seqs * (1 + len(POLICIES) * len(budgets)), desc="eval", disable=not progress)

    for s, row in enumerate(sequences):
        tokens = mx.array(row, dtype=mx.int32)
        logits, trace = forward(model, tokens, lambda i, k: full)
        results.add(results.nll, ("full", None), continuation_nll(logits, tokens, start))
        results.spearman.append([_layer_spearman(k, p, kv_heads, n_sink, start) for k, p in trace])
        # 1 up to rounding: the full cache keeps every key a query can see.
        full_mass = [probs[:, start:].sum(axis=-1).mean().item() for _, probs in trace]
        results.add(results.recall, ("full", None), float(np.mean(full_mass)))
        bar.update()

        for policy in POLICIES:
            for budget in budgets:
                def mask_fn(layer, keys):
                    scores, keep = policy_scores(policy, keys, random_keys[s * n_layers + layer])
                    return kept_mask(scores, budget, n_sink, keep)

                # Recall: the policy's kept sets on the full pass's keys, weighed by its attention.
                recalls = []
                for layer, (keys, probs) in enumerate(trace):
                    mask = mx.repeat(mask_fn(layer, keys), probs.shape[0] // kv_heads, axis=0)
                    mass = (probs[:, start:] * mask[:, start:]).sum(axis=-1)
                    recalls.append(mass.mean().item())
                results.add(results.recall, (policy, budget), float(np.mean(recalls)))

                logits, _ = forward(model, tokens, mask_fn)
                results.add(results.nll, (policy, budget), continuation_nll(logits, tokens, start))
                bar.update()
    bar.close()
    return results


def _layer_spearman(keys, probs, kv_heads, n_sink, start) -> float:
    """Mean over KV heads of Spearman(norm, attention received) on context keys."""
    group = probs.shape[0] // kv_heads
    received = probs[:, start:, :start].mean(axis=1)  # [Hq, start]
    received = received.reshape(kv_heads, group, start).mean(axis=1)
    norms = key_norms(keys[:, :start])
    received, norms = np.array(received[:, n_sink:]), np.array(norms[:, n_sink:])
    return float(np.mean([spearman(norms[h], received[h]) for h in range(kv_heads)]))


def markdown_table(results: Results) -> str:
    labels = {"keep-low": "keep-low (paper)", "keep-high": "keep-high (ablation)",
              "window": "sinks + recent window", "random": "random"}
    head = ["policy"] + [f"ppl @ {b}" for b in results.budgets] + [f"recall @ {b}" for b in results.budgets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full_ppl, full_recall = results.perplexity("full"), results.mean_recall("full", None)
    lines.append("| full cache | " + " | ".join([f"{full_ppl:.3f}"] * len(results.budgets)
                                              + [f"{full_recall:.3f}"] * len(results.budgets)) + " |")
    for policy in POLICIES:
        ppl = [f"{results.perplexity(policy, b):.3f}" for b in results.budgets]
        rec = [f"{results.mean_recall(policy, b):.3f}" for b in results.budgets]
        lines.append(f"| {labels[policy]} | " + " | ".join(ppl + rec) + " |")
    rho = results.layer_spearman()
    lines.append("")
    lines.append("| layer | " + " | ".join(str(i) for i in range(len(rho))) + " |")
    lines.append("|---|" + "---|" * len(rho))
    lines.append("| Spearman(key norm, attention received) | " + " | ".join(f"{r:+.3f}" for r in rho) + " |")
    return "\n".join(lines)


def plot(results: Results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    fractions = [b / results.seq_len for b in results.budgets]
    for policy in POLICIES:
        axes[0].plot(fractions, [results.perplexity(policy, b) for b in results.budgets], "o-", label=policy)
        axes[1].plot(fractions, [results.mean_recall(policy, b) for b in results.budgets], "o-", label=policy)
    axes[0].axhline(results.perplexity("full"), color="k", ls="--", label="full cache")
    axes[1].axhline(1.0, color="k", ls="--", label="full cache")
    axes[0].set(xlabel="budget / sequence length", ylabel="continuation perplexity (bytes)",
                title="Perplexity (lower is better)")
    axes[1].set(xlabel="budget / sequence length", ylabel="attention-mass recall",
                title="Attention-mass recall (higher is better)")
    rho = results.layer_spearman()
    axes[2].bar(range(len(rho)), rho, color="tab:purple")
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_xticks(range(len(rho)))
    axes[2].set(xlabel="layer", ylabel="Spearman rho", title="key norm vs attention received")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    fig.suptitle(f"{results.n_seqs} held-out sequences of {results.seq_len} bytes; metrics on the last half")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
