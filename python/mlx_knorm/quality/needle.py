"""Needle retrieval through the real caches: a key at a chosen depth of a long context, asked for at the end.

A prompt of ``context`` tokens (less the part of a sentence or line that
would not fit) is an intro, a haystack with one needle holding a 5-digit key
at the sentence (passkey) or paragraph (prose) start nearest to ``depth``
(0: the start of the haystack, 1: its end), and a question whose answer is
the key. The model answers greedily through
``mlx_lm.generate.generate_step`` with the policy's cache as its
``prompt_cache`` (``policies.policy_cache``: ``make_knorm_cache``, mlx-lm's
``RotatingKVCache`` and ``KVCache``, ``policies.RandomEvictionCache``), so the
prompt is fed in chunks of ``prefill_step_size`` tokens as mlx-lm feeds it,
and eviction happens during the prefill as in use. The answer is right when
its first number is the key.

Two haystacks: ``passkey``, the classic filler of the passkey task
(Mohtashami & Jaggi, 2023), and ``prose``, Python's reference documentation
(``pydoc_data.topics``, sorted by topic), with the key in a one-sentence
paragraph.

Work shared between trials, exactly: every trial of a (context, policy,
budget) reads the same tokens up to its needle, so one pass of the haystack
fills the policy's cache chunk by chunk as ``generate_step``'s prefill does
(model call, then ``mx.eval`` of every cache's state) and keeps a copy of
the caches at the chunk boundary before each needle. A trial copies that
snapshot and hands ``generate_step`` the rest of its prompt: its chunks then
start where the whole prompt's would, so the trial computes what
``generate_step`` computes on the whole prompt. The same keys are asked of
every policy, so policies are compared on the same prompts. Two more
shares: a policy that holds the same rows per layer at two contexts (a
quarter of 1024 is an eighth of 2048) builds the same cache at both, so one
pass of the haystack serves both; and until a cache evicts, the model reads
through it what it reads through the full cache, so those chunks are
replayed from the full cache's forward pass (``replay.py``), checked exact
chunk by chunk.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from ..atomic import save_figure
from . import (HAYSTACKS, NEEDLE_BUDGET_FRACTIONS, NEEDLE_CONTEXTS, NEEDLE_DEPTHS, NEEDLE_HAYSTACKS, NEEDLE_KEYS,
               PREFILL_STEP_SIZE)
from ..scorers import as_query_filters
from .data import pydoc_topics
from .policies import (FULL, NEEDLE_POLICIES, Policy, RandomEvictionCache, attention_layers, derived_key,
                       policy_cache)
from .replay import Replay, copy_caches
from .stats import wilson_interval
from .workers import ModelSpec, check_jobs, map_tasks

KEY_DIGITS = 5

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                 "them. I will quiz you about the important information there.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"

PROSE_INTRO = "The following is an excerpt from the Python documentation.\n\n"
PROSE_NEEDLE = "The special magic number is {key}.\n\n"  # a paragraph of its own
PROSE_QUESTION = "What is the special magic number in the text above? The special magic number is"


@dataclass(frozen=True)
class Haystack:
    """A haystack in token ids: what comes before it, its filler, the needle sentence and the question."""

    name: str
    intro: tuple[int, ...]
    filler: tuple[int, ...]
    needle: str  # with a {key} field
    question: tuple[int, ...]
    starts: tuple[int, ...]  # filler positions where the needle may go: sentence (passkey) or paragraph starts
    ends: tuple[int, ...]  # filler positions where the filler may end: sentence (passkey) or line starts

    def needle_ids(self, tokenizer, key: str) -> list[int]:
        return _encode(tokenizer, self.needle.format(key=key))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_starts(tokenizer, ids, kind: str) -> tuple[int, ...]:
    """Positions ``i`` in ``ids`` where a ``kind`` of text starts: ``sentence`` (token ``i - 1`` ends with
    ``.``, ``!`` or ``?`` and token ``i`` starts with a space), ``paragraph`` (after a blank line, at a
    token that does not start with a space: text, not code) or ``line`` (after a newline, at a token
    that does not start with another)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    found = []
    for i in range(1, len(ids)):
        before, piece = "".join(pieces[max(0, i - 2) : i]), pieces[i]
        if kind == "sentence":
            ok = pieces[i - 1].rstrip().endswith((".", "!", "?")) and piece[:1].isspace()
        elif kind == "paragraph":
            ok = before.endswith("\n\n") and not piece[:1].isspace()
        else:
            ok = before.endswith("\n") and not piece.startswith("\n")
        if ok:
            found.append(i)
    return tuple(found)


def make_haystack(name: str, tokenizer, length: int, text: str | None = None) -> Haystack:
    """``name`` in HAYSTACKS with at least ``length`` filler tokens.

    ``text``: the prose haystack's text (default: Python's reference documentation), repeated where
    it is too short.
    """
    if name == "passkey":
        once = _encode(tokenizer, PASSKEY_FILLER)
        filler = once * (length // len(once) + 2)
        intro, needle, question, kinds = PASSKEY_INTRO, PASSKEY_NEEDLE, PASSKEY_QUESTION, ("sentence", "sentence")
    elif name == "prose":
        if text is None:
            text = pydoc_topics()
        elif not text.strip():
            raise ValueError("the haystack text is empty")
        else:
            text = "\n\n".join([text.strip()] * (1 + (6 * length + 1000) // len(text.strip())))
        # About four characters a token: encode a little more than needed.
        filler = _encode(tokenizer, text[: 6 * length + 1000])
        if len(filler) < length:
            filler = _encode(tokenizer, text)
        intro, needle, question, kinds = PROSE_INTRO, PROSE_NEEDLE, PROSE_QUESTION, ("paragraph", "line")
    else:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {name!r}")
    if text is not None and name != "prose":
        raise ValueError(f"a haystack text goes with the prose haystack, not {name!r}")
    if len(filler) < length:
        raise ValueError(f"the {name} haystack has {len(filler)} tokens, {length} needed")
    filler = tuple(filler[: length + 1])
    return Haystack(name, tuple(_encode(tokenizer, intro)), filler, needle, tuple(_encode(tokenizer, question)),
                    text_starts(tokenizer, filler, kinds[0]), text_starts(tokenizer, filler, kinds[1]))


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    needle_at: int  # the needle's first token
    key: str


def build_prompt(haystack: Haystack, tokenizer, context: int, depth: float, key: str) -> Prompt:
    """At most ``context`` tokens: intro, filler with the needle at the start nearest ``depth``, question.

    The filler ends where its last whole sentence (passkey) or line (prose)
    that fits ends, so the prompt falls short of ``context`` by less than one.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    needle = haystack.needle_ids(tokenizer, key)
    room = context - len(haystack.intro) - len(needle) - len(haystack.question)
    ends = [e for e in haystack.ends if e <= room]
    if room > len(haystack.filler) or not ends:
        raise ValueError(f"context {context} leaves {room} filler tokens; the {haystack.name} haystack "
                         f"has {len(haystack.filler)}, and its first place to end is {haystack.ends[:1]}")
    end = ends[-1]
    at = needle_offset(haystack, end, depth)
    tokens = (*haystack.intro, *haystack.filler[:at], *needle, *haystack.filler[at:end], *haystack.question)
    return Prompt(tokens, len(haystack.intro) + at, key)


def needle_offset(haystack: Haystack, end: int, depth: float) -> int:
    """The filler position of the needle: 0, ``end``, or the start nearest ``depth * end``."""
    target = depth * end
    starts = [0, *(b for b in haystack.starts if b < end), end]
    return min(starts, key=lambda b: (abs(b - target), b))


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def is_correct(answer: str, key: str) -> bool:
    """The answer's first number is the key."""
    return first_number(answer) == key


def make_keys(rng: np.random.Generator, count: int) -> list[str]:
    low = 10 ** (KEY_DIGITS - 1)
    return [str(k) for k in rng.integers(low, 10 * low, size=count)]


def prefill(model, caches: list, tokens, step: int) -> None:
    """What ``generate_step``'s prefill does with a chunk: the model call, then ``mx.eval`` of the caches' state."""
    for first in range(0, len(tokens), step):
        model(mx.array(tokens[first : first + step])[None], cache=caches)
        mx.eval([c.state for c in caches])


def greedy_until(model, tokenizer, prompt_tail, caches: list, step: int, max_tokens: int, done) -> str:
    """Greedy text of ``generate_step`` on ``prompt_tail`` after ``caches`` (the prompt fed in ``step``-token
    chunks), up to an end-of-sequence token, ``max_tokens`` or the first text ``done(text)`` accepts."""
    ids = []
    for token, _ in generate_step(mx.array(prompt_tail), model, max_tokens=max_tokens, prompt_cache=caches,
                                  prefill_step_size=step):
        if token in tokenizer.eos_token_ids:
            break
        ids.append(token)
        if done(tokenizer.decode(ids)):
            break
    return tokenizer.decode(ids)


def answer(model, tokenizer, prompt_tail, caches: list, step: int, max_tokens: int) -> str:
    """Greedy text after ``caches`` up to the end of the first number."""
    return greedy_until(model, tokenizer, prompt_tail, caches, step, max_tokens,
                        lambda text: re.search(r"\d+\D", text) is not None)


@dataclass
class Trial:
    haystack: str
    context: int
    depth: float
    needle_at: int
    prompt_tokens: int
    policy: str
    budget_fraction: float | None
    budget: int | None
    key: str
    answer: str
    correct: bool


@dataclass
class Grid:
    """The trials of a run and how many prompt tokens it read."""

    config: dict
    trials: list = field(default_factory=list)
    prefill_tokens: int = 0
    replayed_tokens: int = 0  # of prefill_tokens, chunks replayed from the full cache's forward (replay.py)
    recorded_tokens: int = 0  # the full cache's forward passes that computed them, summed over processes

    def cells(self) -> list[dict]:
        """Accuracy with its 95% Wilson interval per (haystack, context, depth, policy, budget)."""
        groups = {}
        for t in self.trials:
            groups.setdefault((t.haystack, t.context, t.depth, t.policy, t.budget_fraction), []).append(t.correct)
        return [_summary(dict(zip(("haystack", "context", "depth", "policy", "budget_fraction"), k)), v)
                for k, v in groups.items()]

    def totals(self) -> list[dict]:
        """Accuracy per (haystack, policy, budget fraction), over contexts and depths, and per context."""
        groups = {}
        for t in self.trials:
            for context in (t.context, "all"):
                groups.setdefault((t.haystack, t.policy, t.budget_fraction, context), []).append(t.correct)
        return [_summary(dict(zip(("haystack", "policy", "budget_fraction", "context"), k)), v)
                for k, v in groups.items()]

    def report(self) -> dict:
        return {**self.config, "interval": "95% Wilson score interval",
                "prefill_tokens": self.prefill_tokens, "replayed_tokens": self.replayed_tokens,
                "recorded_tokens": self.recorded_tokens,
                "cells": self.cells(), "totals": self.totals(),
                "trials": [vars(t) for t in self.trials]}


def _summary(labels: dict, outcomes: list[bool]) -> dict:
    right = int(sum(outcomes))
    low, high = wilson_interval(right, len(outcomes))
    return {**labels, "correct": right, "trials": len(outcomes), "accuracy": right / len(outcomes),
            "ci": [round(low, 4), round(high, 4)]}


def run_grid(model, tokenizer, haystacks=NEEDLE_HAYSTACKS, contexts=NEEDLE_CONTEXTS, depths=NEEDLE_DEPTHS,
             fractions=NEEDLE_BUDGET_FRACTIONS, policies=NEEDLE_POLICIES, keys: int = NEEDLE_KEYS, n_sink: int = 4,
             prefill_step_size: int = PREFILL_STEP_SIZE, seed: int = 0, full: bool = True,
             progress: bool = False, jobs: int = 1, model_spec: ModelSpec | None = None,
             replay: bool = True, filters=None, haystack_text: str | None = None) -> Grid:
    """Every (haystack, context, depth, policy, budget fraction) with ``keys`` keys; the full cache once per depth.

    ``policies``: ``Policy`` objects or names (``policies.Policy.parse``).
    The keys of a (haystack, context, depth) are the same for every policy.
    A policy with no room at a budget (its skipped layers take more than the
    budget's memory) is left out there. The grid runs as tasks, each a policy
    at one number of rows per layer on one haystack, at every (context,
    budget) where the policy holds those rows (they build the same cache);
    ``jobs > 1`` shares the tasks among that many processes
    (``workers.map_tasks``), each loading ``model_spec`` (the model
    ``model`` is); the trials are those of ``jobs=1``. ``replay``: a
    policy's cache takes the chunks it has not yet evicted from from the
    full cache's forward pass where that is exact (``replay.Replay``); the
    trials are those of ``replay=False``. ``filters``: the model's query
    filters (a ``mlx-knorm calibrate`` file or ``QueryFilters``), which
    qfilter policies need. ``haystack_text``: the prose haystack's text
    (default: Python's reference documentation).
    """
    from tqdm import tqdm

    policies = [p if isinstance(p, Policy) else Policy.parse(p) for p in policies]
    check_jobs(jobs, model_spec)
    filters = as_query_filters(filters)
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
        raise ValueError(f"keys must be a positive int, got {keys!r}")
    if isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be a positive int, got {prefill_step_size!r}")
    for fraction in fractions:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"budget fractions must lie in (0, 1), got {fraction!r}")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {depth!r}")
    if not isinstance(replay, bool):
        raise ValueError(f"replay must be a bool, got {replay!r}")
    max_tokens = KEY_DIGITS + 3
    config = {"haystacks": list(haystacks), "contexts": list(contexts), "depths": list(depths),
              "budget_fractions": list(fractions), "policies": [p.name for p in policies], "keys": keys,
              "n_sink": n_sink, "prefill_step_size": prefill_step_size, "seed": seed,
              "max_tokens": max_tokens,
              "prose_text": "pydoc_data.topics" if haystack_text is None else "user text"}
    grid = Grid(config)
    rng = np.random.default_rng(seed)
    layers = attention_layers(model, n_sink)
    plan = []  # (haystack, its token stream, context, prompts by depth, [(policy, fraction, budget, rows)])
    for name in haystacks:
        haystack = make_haystack(name, tokenizer, max(contexts), haystack_text if name == "prose" else None)
        stream = haystack.intro + haystack.filler
        for context in contexts:
            prompts = {d: [build_prompt(haystack, tokenizer, context, d, k) for k in make_keys(rng, keys)]
                       for d in depths}
            cuts = [(None, None, None, None)] if full else []
            for fraction in fractions:
                budget = int(round(fraction * context))
                for policy in policies:
                    rows = policy.layer_budget(budget, context, layers, n_sink)
                    if rows is None:
                        continue
                    policy_cache(model, policy, budget, context, n_sink, filters=filters)  # refuses what cannot run
                    cuts.append((policy, fraction, budget, rows))
            plan.append((name, stream, context, prompts, cuts))
    # A policy at the same rows per layer builds the same cache at every context: one task reads the
    # haystack once for all of them.
    groups, slots = {}, 0
    for name, stream, context, prompts, cuts in plan:
        for policy, fraction, budget, rows in cuts:
            _, members, chunks = groups.setdefault((name, policy, rows), (stream, [], [0]))
            members.append(_Member(context, prompts, fraction, budget, slots))
            chunks[0] = max(chunks[0], _replay_chunks((policy, fraction, budget, rows), cuts, prefill_step_size)
                            if replay else 0)
            slots += 1
    tasks = [_Task(name, stream, policy, tuple(members), chunks[0])
             for (name, policy, rows), (stream, members, chunks) in groups.items()]
    # Progress in prompt tokens read: trials at long contexts cost more.
    costs = [_tokens_to_read([m.prompts for m in task.members], prefill_step_size) for task in tasks]
    bar = tqdm(total=sum(costs), desc="needle", unit="token", unit_scale=True, disable=not progress)
    run_cut = functools.partial(_run_cut, n_sink=n_sink, step=prefill_step_size, seed=seed, max_tokens=max_tokens,
                                filters=filters)
    by_slot = [None] * slots
    try:
        for task, (trials, counts) in zip(tasks, map_tasks(run_cut, tasks, jobs=jobs, bar=bar, model=model,
                                                            tokenizer=tokenizer, model_spec=model_spec, costs=costs)):
            for member, member_trials in zip(task.members, trials):
                by_slot[member.slot] = member_trials
            grid.prefill_tokens += counts["read"]
            grid.replayed_tokens += counts["replayed"]
            grid.recorded_tokens += counts["recorded"]
    finally:
        _replays.clear()  # this process's records (in workers they go with the process)
        bar.close()
    grid.trials = [t for member_trials in by_slot for t in member_trials]
    return grid


def _replay_chunks(cut, cuts, step: int) -> int:
    """Chunks of a prompt that ``cut`` may take from the full cache's forward: those a cache of its rows
    can hold whole (``rows // step + 1``: the chunk after the last whole one still sees every row), and
    for the full cache the most of any cut of its context, so that it records what they replay."""
    def chunks(rows):
        return rows // step + 1

    policy, _, _, rows = cut
    if policy is None:
        return max((chunks(r) for p, _, _, r in cuts if p is not None and p.bits is None), default=0)
    # A quantized cache is attended through another path: never replayed.
    return 0 if policy.bits is not None else chunks(rows)


_replays = {}  # in this process: (model, its Replay) of the grid running, by prefill step


def _replay_for(model, step: int) -> Replay:
    entry = _replays.get(step)
    if entry is None or entry[0] is not model:
        _replays.clear()  # records of one model at a time
        entry = _replays[step] = (model, Replay(model, step))
    return entry[1]


def _snapshot_at(group, step: int) -> int:
    """The last chunk boundary at or before the earliest needle of ``group``."""
    return (min(p.needle_at for p in group) // step) * step


def _tokens_to_read(prompt_sets: list, step: int) -> int:
    """Prompt tokens one task reads: the shared haystack once, then each trial's tail."""
    at = [(_snapshot_at(group, step), group) for prompts in prompt_sets for group in prompts.values()]
    return max(a for a, _ in at) + sum(len(p.tokens) - a for a, group in at for p in group)


@dataclass(frozen=True)
class _Member:
    """One (context, budget) of a task: its prompts by depth, and its place among the grid's cuts."""

    context: int
    prompts: dict
    fraction: float | None
    budget: int | None
    slot: int


@dataclass(frozen=True)
class _Task:
    """A policy at ``rows`` per compressed layer (the full cache: ``None``) on one haystack, at every
    (context, budget) where it holds those rows: they build the same cache."""

    haystack: str
    stream: tuple
    policy: Policy | None
    members: tuple
    replay_chunks: int


def _run_cut(model, tokenizer, task: _Task, bar, *, n_sink, step, seed, max_tokens, filters=None) -> tuple[list, dict]:
    """``(trials per member, token counts)`` of one task: the shared haystack once, then each trial's tail.

    Every prompt starts with the haystack's stream (intro + filler) up to
    its needle, whatever its context, key or depth: the tokens up to the
    last chunk boundary before each needle are read once. The first
    ``task.replay_chunks`` chunks of the haystack and of each trial's prompt
    are replayed from the full cache's forward pass where exact
    (``replay.Replay``), until the cache has evicted.
    """
    stream, policy, chunks_to_replay = task.stream, task.policy, task.replay_chunks
    replay = _replay_for(model, step) if chunks_to_replay else None
    records = replay.records if replay is not None else None
    recorded = records.computed_tokens if records is not None else 0
    counts = {"read": 0, "replayed": 0}

    def replayed(caches, tokens, start: int, stop: int) -> int:
        """Replays whole chunks of ``tokens`` from ``start`` (a chunk boundary) into ``caches`` while exact,
        up to ``stop``; where they end."""
        while (replay is not None and start + step <= stop and start // step < chunks_to_replay
               and replay.chunk(caches, tokens, start // step)):
            start += step
            counts["replayed"] += step
        return start

    snapshot_at = {(i, d): _snapshot_at(group, step)
                   for i, member in enumerate(task.members) for d, group in member.prompts.items()}
    first = task.members[0]
    caches = policy_cache(model, policy, first.budget or first.context, first.context, n_sink, seed,
                          filters=filters)
    snapshots, done = {}, 0
    for at in sorted(set(snapshot_at.values())):
        start = replayed(caches, stream, done, at)
        prefill(model, caches, stream[start:at], step)
        counts["read"] += at - done
        bar.update(at - done)
        done = at
        snapshots[at] = copy_caches(caches)
    del caches
    trials = []
    for i, member in enumerate(task.members):
        member_trials = []
        for depth, group in member.prompts.items():
            at = snapshot_at[(i, depth)]
            for index, prompt in enumerate(group):
                assert prompt.tokens[:at] == stream[:at]
                caches = copy_caches(snapshots[at])
                for layer, cache in enumerate(caches):
                    if isinstance(cache, RandomEvictionCache):
                        # Each trial draws its own evictions from the snapshot on.
                        cache.reseed(derived_key(seed, member.context, round(depth * 10**6), index, layer))
                # Whole chunks before the last token: generate_step's prefill would run them as chunks.
                start = replayed(caches, prompt.tokens, at, len(prompt.tokens) - 1)
                counts["read"] += len(prompt.tokens) - at
                text = answer(model, tokenizer, prompt.tokens[start:], caches, step, max_tokens)
                member_trials.append(Trial(task.haystack, member.context, depth, prompt.needle_at,
                                           len(prompt.tokens), FULL if policy is None else policy.name,
                                           member.fraction, member.budget, prompt.key, text,
                                           is_correct(text, prompt.key)))
                bar.update(len(prompt.tokens) - at)
        trials.append(member_trials)
    counts["recorded"] = records.computed_tokens - recorded if records is not None else 0
    return trials, counts


def markdown_tables(grid: Grid) -> str:
    """Per haystack and budget fraction: accuracy per policy and context (over depths), with the interval."""
    totals = grid.totals()
    lines = []
    for name in grid.config["haystacks"]:
        contexts = grid.config["contexts"]
        lines += [f"**{name}** (accuracy over {len(grid.config['depths'])} depths x {grid.config['keys']} keys; "
                  "all contexts: over every context)", "",
                  "| policy | budget | " + " | ".join(f"{c}" for c in contexts) + " | all contexts |",
                  "|---|---|" + "---|" * (len(contexts) + 1)]
        rows = {}
        for row in totals:
            if row["haystack"] == name:
                rows[(row["policy"], row["budget_fraction"], row["context"])] = row
        order = [FULL] + grid.config["policies"]
        for fraction in [None] + grid.config["budget_fractions"]:
            for policy in order:
                if (policy == FULL) != (fraction is None) or (policy, fraction, "all") not in rows:
                    continue
                cells = [_cell(rows.get((policy, fraction, c))) for c in contexts + ["all"]]
                budget = "—" if fraction is None else f"1/{round(1 / fraction)}" if (1 / fraction).is_integer() \
                    else f"{fraction:g}"
                lines.append(f"| {policy} | {budget} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(row) -> str:
    if row is None:
        return "—"
    return f"{row['accuracy']:.2f} [{row['ci'][0]:.2f}, {row['ci'][1]:.2f}]"


def plot(grid: Grid, path: str, title: str) -> None:
    """Heatmaps of accuracy: one per haystack and budget, policies by (context, depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = grid.config
    columns = [(c, d) for c in config["contexts"] for d in config["depths"]]
    cells = {(r["haystack"], r["policy"], r["budget_fraction"], r["context"], r["depth"]): r["accuracy"]
             for r in grid.cells()}
    panels = [(h, f) for h in config["haystacks"] for f in config["budget_fractions"]]
    rows = [FULL] + config["policies"]
    # At least 7 inches wide: the panel titles fit a grid of few columns.
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(7.0, 1.0 + 0.55 * len(columns)), 1.2 + 0.42 * len(rows) * len(panels)))
    for ax, (name, fraction) in zip(axes[:, 0], panels):
        values = np.full((len(rows), len(columns)), np.nan)
        for i, policy in enumerate(rows):
            for j, (context, depth) in enumerate(columns):
                values[i, j] = cells.get((name, policy, None if policy == FULL else fraction, context, depth), np.nan)
        image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(values):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.2f}".lstrip("0") if value < 1 else "1", ha="center", va="center",
                        fontsize=6, color="white" if value < 0.5 else "black")
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_xticks(range(len(columns)), [f"{c}\n{d:g}" for c, d in columns], fontsize=6)
        ax.set_title(f"{name}: budget {fraction:g} of the context (full cache: no budget); "
                     f"x: context / needle depth", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.suptitle(f"{title}: needle accuracy, {config['keys']} keys per cell", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
