"""``mlx-knorm ruler``: RULER's synthetic tasks (``ruler_tasks``) through the real caches, per policy and budget.

Every sample's prompt goes to ``mlx_lm.generate.generate_step`` with the
policy's cache as its ``prompt_cache`` (``policies.policy_cache``), fed in
``prefill_step_size`` chunks as mlx-lm feeds it, so eviction happens during
the prefill as in use; the answer is greedy, up to the task's token budget,
the end of the sequence, or the moment every expected answer is in it
(more tokens cannot change ``string_match_all``'s score). The same prompts
go to every policy; the full cache (``KVCache``) always runs. Scores are
RULER's (0-100: the mean share of expected answers found), per task and
averaged over tasks, with 95% bootstrap intervals over the samples, and
each policy's difference from the recent window at the same budget, paired
by sample.

Work shared: each sample is built (and tokenized) once for every policy,
and until a cache evicts, the model reads through it what it reads through
the full cache, so those chunks of the prompt are replayed from the full
cache's forward pass (``replay.Replay``, checked exact chunk by chunk, as
the needle grid does; the full cache itself takes every whole chunk from
it); ``generate_step`` then runs on the rest of the prompt, whose chunks
start where the whole prompt's would. The outputs are those of
``replay=False``. A sample's prompt is its own from its first needle on, so
the needle grid's snapshots do not apply.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..atomic import save_figure
from ..scorers import as_query_filters
from . import PREFILL_STEP_SIZE
from .needle import greedy_until
from .policies import FULL, Policy, attention_layers, policy_cache
from .replay import Replay
from .ruler_tasks import TASKS, make_sample, string_match_all
from .stats import bootstrap_interval, resample_indices
from .workers import ModelSpec, check_jobs, map_tasks

# kvpress's compression ratios 25/50/75/87.5%: the budget is the rest.
RULER_BUDGET_FRACTIONS = (0.75, 0.5, 0.25, 0.125)
RULER_CONTEXT = 4096
RULER_SAMPLES = 4
WINDOW = "window"


def ruler_policies() -> tuple[Policy, ...]:
    """The default set: the recent window and each scorer with the default recent window."""
    from ..defaults import DEFAULT_RECENT_SHARE

    return (Policy("window"), *(Policy(score, DEFAULT_RECENT_SHARE) for score in ("keep-low", "keydiff", "vnorm")))


def greedy_answer(model, tokenizer, tokens, caches: list, step: int, max_tokens: int, answers) -> str:
    """``generate_step``'s greedy continuation of ``tokens`` through ``caches``, stopped early once every
    answer is in it."""
    return greedy_until(model, tokenizer, tokens, caches, step, max_tokens,
                        lambda text: string_match_all(text, answers) == 1.0)


@dataclass
class RulerRun:
    """The config and every (sample, policy, budget) output and score of a run."""

    config: dict
    samples: list = field(default_factory=list)  # dicts: task, index, prompt_tokens, answers, outputs

    def scores(self, policy: str, fraction: float | None, task: str) -> list[float]:
        key = _cut_name(policy, fraction)
        return [100 * s["outputs"][key]["score"] for s in self.samples if s["task"] == task and key in s["outputs"]]

    def _matrix(self, policy: str, fraction: float | None) -> np.ndarray | None:
        """Scores ``[samples per task, tasks]``, or None where the policy did not run every sample."""
        rows = [self.scores(policy, fraction, task) for task in self.config["tasks"]]
        if any(len(r) != self.config["samples_per_task"] for r in rows):
            return None
        return np.array(rows, dtype=np.float64).T

    def summary(self) -> list[dict]:
        """Per (policy, budget): each task's mean score with its interval, the average over tasks with its
        interval, and the difference from the window at that budget, paired by sample, with its interval."""
        indices = resample_indices(self.config["samples_per_task"])
        out = []
        for policy, fraction in [(FULL, None)] + [(p, f) for f in self.config["budget_fractions"]
                                                  for p in self.config["policies"]]:
            matrix = self._matrix(policy, fraction)
            if matrix is None:
                continue
            row = {"policy": policy, "budget_fraction": fraction,
                   "compression": None if fraction is None else 1 - fraction,
                   "tasks": {task: {"score": float(matrix[:, i].mean()),
                                    "ci": list(bootstrap_interval(matrix[:, i], np.mean, indices))}
                             for i, task in enumerate(self.config["tasks"])},
                   "average": float(matrix.mean()), "average_ci": list(bootstrap_interval(matrix, np.mean, indices))}
            window = None if fraction is None or policy == WINDOW else self._matrix(WINDOW, fraction)
            if window is not None:
                gap = matrix - window
                row["minus_window"] = float(gap.mean())
                row["minus_window_ci"] = list(bootstrap_interval(gap, np.mean, indices))
            out.append(row)
        return out

    def report(self) -> dict:
        return {**self.config, "score": "RULER's string_match_all x 100, mean over samples",
                "interval": "95% percentile bootstrap over samples (the same resamples for every figure; "
                            "minus_window paired by sample)",
                "summary": self.summary(), "samples": self.samples}


def _cut_name(policy: str, fraction: float | None) -> str:
    return policy if fraction is None else f"{policy}@{fraction:g}"


def run(model, tokenizer, tasks=TASKS, context: int = RULER_CONTEXT, fractions=RULER_BUDGET_FRACTIONS,
        policies=None, samples: int = RULER_SAMPLES, *, seed: int = 0, n_sink: int = 4,
        prefill_step_size: int = PREFILL_STEP_SIZE, haystack_text: str | None = None, max_tokens: int | None = None,
        filters=None, progress: bool = False, jobs: int = 1, model_spec: ModelSpec | None = None,
        replay: bool = True) -> RulerRun:
    """``samples`` prompts of each of ``tasks`` at ``context`` tokens, answered through the full cache and
    every policy at every budget (``round(fraction * context)`` rows per attention layer, on average).

    ``policies``: ``Policy`` objects or names, any set (default ``ruler_policies()``). A policy with no
    room at a budget is left out there. ``haystack_text``: the essay haystack (default: Python's
    reference documentation). ``max_tokens``: the answer budget of every task (default: RULER's per
    task). ``jobs > 1`` shares the samples among processes loading ``model_spec``; the outputs are those
    of ``jobs=1``. ``replay``: take the chunks a cache has not yet evicted from from the full cache's
    forward pass (the module's docstring); the outputs are those of ``replay=False``.
    """
    from tqdm import tqdm

    policies = [p if isinstance(p, Policy) else Policy.parse(p) for p in (policies or ruler_policies())]
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"policies must be distinct, got {names}")
    check_jobs(jobs, model_spec)
    filters = as_query_filters(filters)
    for name, value in (("samples", samples), ("context", context), ("prefill_step_size", prefill_step_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
        raise ValueError(f"n_sink must be a non-negative int, got {n_sink!r}")
    tasks = list(tasks)
    if not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks must be distinct and at least one, got {tasks}")
    for fraction in fractions:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"budget fractions must lie in (0, 1), got {fraction!r}")
    layers = attention_layers(model, n_sink)
    if not isinstance(replay, bool):
        raise ValueError(f"replay must be a bool, got {replay!r}")
    cuts, skipped = [(None, None, None, None)], []
    for fraction in fractions:
        budget = int(round(fraction * context))
        for policy in policies:
            rows = policy.layer_budget(budget, context, layers, n_sink)
            if rows is None:
                skipped.append(_cut_name(policy.name, fraction))
                continue
            policy_cache(model, policy, budget, context, n_sink, filters=filters)  # refuses what cannot run
            cuts.append((policy, fraction, budget, rows))
    built = [make_sample(task, i, tokenizer, context, seed=seed, haystack_text=haystack_text, max_tokens=max_tokens)
             for task in tasks for i in range(samples)]
    config = {"tasks": tasks, "context": context, "samples_per_task": samples, "budget_fractions": list(fractions),
              "budgets": [int(round(f * context)) for f in fractions], "policies": names, "n_sink": n_sink,
              "prefill_step_size": prefill_step_size, "seed": seed, "max_tokens": max_tokens,
              "haystack": "user text" if haystack_text is not None else "pydoc_data.topics",
              "left_out_for_no_room": skipped}
    result = RulerRun(config)
    bar = tqdm(total=len(built) * len(cuts), desc="ruler", unit="answer", disable=not progress)
    answer_all = functools.partial(_answer_sample, cuts=cuts, context=context, n_sink=n_sink, step=prefill_step_size,
                                   seed=seed, filters=filters, replay=replay)
    try:
        outputs = map_tasks(answer_all, built, jobs=jobs, bar=bar, model=model, tokenizer=tokenizer,
                            model_spec=model_spec, costs=[len(s.tokens) for s in built])
    finally:
        bar.close()
    result.config["caches"] = [_cut_name(FULL if p is None else p.name, f) for p, f, _, _ in cuts]
    result.config["prompt_tokens_read"] = sum(len(s.tokens) for s in built) * len(cuts)
    result.config["replayed_tokens"] = sum(counts["replayed"] for _, counts in outputs)
    result.config["recorded_tokens"] = sum(counts["recorded"] for _, counts in outputs)
    for sample, (output, _) in zip(built, outputs):
        result.samples.append({"task": sample.task, "index": sample.index, "prompt_tokens": len(sample.tokens),
                               "answers": list(sample.answers), "max_tokens": sample.max_tokens, "outputs": output})
    return result


def _answer_sample(model, tokenizer, sample, bar, *, cuts, context, n_sink, step, seed, filters,
                   replay=True) -> tuple[dict, dict]:
    """``({cut name: {"output", "score"}}, token counts)`` of one sample through every cut's cache: the
    prompt tokens replayed, and those the full cache's forward passes computed to replay them."""
    out = {}
    records = Replay(model, step) if replay else None
    whole = (len(sample.tokens) - 1) // step  # chunks before the last token: generate_step's prefill
    for policy, fraction, budget, rows in cuts:
        caches = policy_cache(model, policy, budget or context, context, n_sink,
                              seed=zlib.crc32(f"{seed}/{sample.task}/{sample.index}".encode()), filters=filters)
        start = 0
        if records is not None and (policy is None or policy.bits is None):
            # Past chunk rows // step + 1 a cache of ``rows`` has evicted: no replay there.
            chunks = whole if policy is None else min(whole, rows // step + 1)
            while start // step < chunks and records.chunk(caches, sample.tokens, start // step):
                start += step
        text = greedy_answer(model, tokenizer, sample.tokens[start:], caches, step, sample.max_tokens,
                             sample.answers)
        out[_cut_name(FULL if policy is None else policy.name, fraction)] = {
            "output": text, "score": string_match_all(text, sample.answers)}
        bar.update(1)
    if records is None or records.records is None:
        return out, {"replayed": 0, "recorded": 0}
    return out, {"replayed": records.replayed_tokens, "recorded": records.records.computed_tokens}


def markdown_table(run_: RulerRun) -> str:
    """Average and per-task scores per policy and budget, the difference from the window where paired."""
    tasks = run_.config["tasks"]
    lines = ["| policy | compression | average [95% CI] | minus window [95% CI] | " + " | ".join(tasks) + " |",
             "|---|---|---|---|" + "---|" * len(tasks)]
    for row in run_.summary():
        compression = "-" if row["compression"] is None else f"{row['compression']:.1%}"
        average = f"{row['average']:.1f} [{row['average_ci'][0]:.1f}, {row['average_ci'][1]:.1f}]"
        gap = (f"{row['minus_window']:+.1f} [{row['minus_window_ci'][0]:+.1f}, {row['minus_window_ci'][1]:+.1f}]"
               if "minus_window" in row else "-")
        lines.append(f"| {row['policy']} | {compression} | {average} | {gap} | "
                     + " | ".join(f"{row['tasks'][t]['score']:.0f}" for t in tasks) + " |")
    return "\n".join(lines)


def plot(run_: RulerRun, path: str, title: str) -> None:
    """RULER average against compression, one line per policy, the full cache as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run_.summary()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row["policy"] == FULL:
            ax.axhline(row["average"], color="black", linestyle="--", label=f"full cache ({row['average']:.1f})")
    for policy in run_.config["policies"]:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["compression"])
        if mine:
            x = [100 * r["compression"] for r in mine]
            ax.errorbar(x, [r["average"] for r in mine], marker="o", capsize=3, label=policy,
                        yerr=[[r["average"] - r["average_ci"][0] for r in mine],
                              [r["average_ci"][1] - r["average"] for r in mine]])
    ax.set_xlabel("compression (% of the context's KV rows evicted)")
    ax.set_ylabel("RULER average (string match, 0-100)")
    ax.set_title(f"{title}: RULER at {run_.config['context']} tokens, {run_.config['samples_per_task']} samples a task")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
