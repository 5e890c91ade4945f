"""The cache-step benchmark: one decode step of one layer's KV cache, for
mlx-lm's ``KVCache`` and ``RotatingKVCache``, the reference's
``L2NormKVCache`` and ours in both layouts, side by side.

A step is ``cache.update_and_fetch(k, v)`` with one new token
``[B, H, 1, D]`` and one ``mx.eval`` of what attention reads (the returned
keys and values) and of what the cache stores for the next step; the
returned arrays are dropped before the next step, as a model's attention
drops them. Each cache is first filled past its budget (a prefill in chunks,
then decode steps), so every timed step of an evicting cache evicts.

All caches live in one warm process: other MLX work runs first and MLX's
buffer cache is never cleared. They are timed in rounds, each a run of steps
of every cache in turn, the order rotating from round to round, so that the
machine's drift hits all alike. Next to them run the floor the temporal
layout is held to, one copy of K + V of the budget's size into fresh arrays,
and the slot layout's op alone: the ``evict_and_fill`` of its step on
donated slot buffers, without the cache around it.
"""

from __future__ import annotations

import functools
import types
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..cache import DEFAULT_RECENT, L2NormCacheBase, L2NormKVCache
from ..defaults import uses_order_tree
from ..ops.evict_and_fill import evict_and_fill_unchecked
from ..ops.key_norms import key_norms
from ..validation import FLOAT_DTYPES
from .cases import N_SINK, random_arrays
from .progress import Progress
from .timing import summary, time_runs, warm_up

PREFILL_CHUNK = 512  # mlx-lm's prefill_step_size as bench/decode_e2e.py sets it
# Decode steps after the prefill: the evicting caches evict on every one
# after the first.
FILL_DECODE_STEPS = 4
MEMCPY = "memcpy of K+V"
OP = "evict_and_fill"


@dataclass(frozen=True)
class StepConfig:
    budget: int
    batch: int
    heads: int
    dim: int
    dtype: str = "float16"

    @property
    def label(self) -> str:
        return f"budget={self.budget} B={self.batch}"

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.budget, self.dim)


@dataclass(frozen=True)
class Schedule:
    """Rounds of ``steps`` steps per cache; the first round is an untimed
    warm-up. A cache stops its round early after ``max_seconds`` (and at
    least timing.MIN_REPS steps), so a slow cache does not dominate the run."""

    rounds: int
    steps: int
    max_seconds: float


QUICK = Schedule(rounds=4, steps=25, max_seconds=0.4)
FULL = Schedule(rounds=11, steps=50, max_seconds=2.0)


@functools.cache
def reference_cache_class():
    """The reference's ``L2NormKVCache``, or None when veloxquant-mlx is not installed."""
    try:
        from veloxquant_mlx.cache.knorm_cache import L2NormKVCache as reference
    except ImportError:
        return None
    return reference


def cache_kinds() -> dict:
    """name -> make(budget): a fresh cache of each kind under test."""
    kinds = {
        "KVCache": lambda budget: KVCache(),
        "RotatingKVCache": lambda budget: RotatingKVCache(max_size=budget, keep=N_SINK),
    }
    reference = reference_cache_class()
    if reference is not None:
        kinds["reference"] = lambda budget: reference(
            types.SimpleNamespace(knorm_budget=budget, knorm_n_sink=N_SINK))
    for layout in ("slots", "temporal"):
        kinds[layout] = lambda budget, layout=layout: L2NormKVCache(
            budget=budget, n_sink=N_SINK, recent=0, layout=layout)
    return kinds


def stored_arrays(cache) -> list[mx.array]:
    """The arrays ``cache`` holds for its next step: what a step evaluates
    besides the attended keys and values (a quantized cache's keys and
    values are each a tuple of arrays)."""
    if isinstance(cache, L2NormCacheBase):
        tree = [] if cache.order_tree is None else [cache.order_tree]
        return [cache.keys, cache.values, cache.norms, cache.slot_positions, *tree]
    reference = reference_cache_class()
    if reference is not None and isinstance(cache, reference):
        return [cache._keys, cache._values, cache._norms, cache._positions]
    return [cache.keys, cache.values]


class CacheStep:
    """One cache under test: a decode step, with its outputs dropped on return."""

    def __init__(self, cache):
        self.cache = cache

    def step(self, keys: mx.array, values: mx.array) -> None:
        attended = self.cache.update_and_fetch(keys, values)
        mx.eval(*attended, *stored_arrays(self.cache))

    def fill(self, config: StepConfig, tokens) -> None:
        """Prefill ``budget`` tokens in chunks, then a decode step per token of ``tokens``."""
        dtype = FLOAT_DTYPES[config.dtype]
        chunk = min(PREFILL_CHUNK, config.budget)
        for start in range(0, config.budget, chunk):
            shape = (config.batch, config.heads, min(chunk, config.budget - start), config.dim)
            self.step(*random_arrays([shape, shape], dtype, seed=start))
        for keys, values in tokens:
            self.step(keys, values)


class StateCopy:
    """A copy of K + V ``[B, H, budget, D]`` into fresh arrays per step."""

    def __init__(self, config: StepConfig):
        shape = config.state_shape
        self.state = random_arrays([shape, shape], FLOAT_DTYPES[config.dtype], seed=2)
        mx.eval(self.state)

    def step(self, keys: mx.array, values: mx.array) -> None:
        mx.eval([mx.array(x) for x in self.state])


class SlotsOp:
    """The op of the slot layout's decode step alone: ``evict_and_fill`` on
    slot buffers ``[B, H, budget + 1, *]`` holding the kept rows and the
    previous step's new row, donated (the previous buffers dropped first),
    with the cache's configuration and, where the cache keeps one, the
    previous step's order tree (the first step builds it); the
    L2NormKVCache around it adds its Python and the views it returns."""

    def __init__(self, config: StepConfig):
        self.budget = config.budget
        slots = config.budget + 1
        shape = (config.batch, config.heads, slots, config.dim)
        keys, values, order = random_arrays(
            [shape, shape, shape[:3]], FLOAT_DTYPES[config.dtype], seed=3)
        # Every slot filled, the positions a permutation of [0, slots) per head.
        positions = mx.argsort(order, axis=-1).astype(mx.int32)
        self.buffers = [keys, values, key_norms(keys), positions]
        mx.eval(self.buffers)
        self.tree = uses_order_tree("slots", config.budget, DEFAULT_RECENT)
        self.offset = slots

    def step(self, keys: mx.array, values: mx.array) -> None:
        inputs = [*self.buffers, keys, values]
        tree, self.buffers, self.tree = self.tree, None, False
        out = evict_and_fill_unchecked(
            *inputs, filled=self.budget + 1, offset=self.offset, capacity=self.budget + 1,
            budget=self.budget, n_sink=N_SINK, recent=DEFAULT_RECENT, keep="low", tree=tree,
        )
        self.buffers = list(out[:4])
        if tree is not False:
            self.tree = out[4]
        del inputs, tree, out  # the last references: the op may now update the buffers in place
        mx.eval(self.buffers, *([] if self.tree is False else [self.tree]))
        self.offset += 1


def time_steps(entry, tokens, schedule: Schedule) -> tuple[list[float], int]:
    """Seconds per step and the minor page faults of one round of ``entry``
    over the round's ``tokens``."""
    remaining = iter(tokens)
    return time_runs(lambda: entry.step(*next(remaining)), len(tokens), 0, schedule.max_seconds)


def run_config(config: StepConfig, schedule: Schedule, progress: Progress) -> dict:
    """Every cache and the copy floor at one configuration, interleaved."""
    # A fresh token per step, the same stream for every cache: which row a
    # step evicts varies as in a real stream.
    shape = (config.batch, config.heads, 1, config.dim)
    dtype = FLOAT_DTYPES[config.dtype]
    tokens = [tuple(random_arrays([shape, shape], dtype, seed=100 + i))
              for i in range(FILL_DECODE_STEPS + schedule.rounds * schedule.steps)]
    mx.eval(tokens)
    fill_tokens, tokens = tokens[:FILL_DECODE_STEPS], tokens[FILL_DECODE_STEPS:]
    entries = {}
    for name, make in cache_kinds().items():
        progress.step(f"{config.label}: fill {name}")
        entries[name] = CacheStep(make(config.budget))
        entries[name].fill(config, fill_tokens)
    progress.step(f"{config.label}: fill {OP}")
    entries[OP] = SlotsOp(config)
    entries[MEMCPY] = StateCopy(config)
    names = list(entries)
    samples = {name: [] for name in names}
    faults = dict.fromkeys(names, 0)
    for r in range(schedule.rounds):
        progress.step(f"{config.label}: round {r + 1}/{schedule.rounds}")
        round_tokens = tokens[r * schedule.steps : (r + 1) * schedule.steps]
        for name in names[r % len(names):] + names[: r % len(names)]:
            s, f = time_steps(entries[name], round_tokens, schedule)
            if r > 0:
                samples[name] += s
                faults[name] += f
    timings = {name: summary(samples[name], faults[name]) for name in names}
    memcpy = timings.pop(MEMCPY)
    op = timings.pop(OP)
    rotating_ms = timings["RotatingKVCache"]["median_ms"]
    for timing in [*timings.values(), op]:
        timing["ratio_to_rotating"] = timing["median_ms"] / rotating_ms
        timing["ratio_to_memcpy"] = timing["median_ms"] / memcpy["median_ms"]
    op["ratio_to_slots"] = op["median_ms"] / timings["slots"]["median_ms"]
    return {
        "config": asdict(config),
        "label": config.label,
        "kv_bytes": kv_bytes(config),
        "caches": timings,
        "evict_and_fill": op,
        "memcpy": memcpy,
    }


def kv_bytes(config: StepConfig) -> int:
    """Bytes of K + V at the budget: what the copy floor copies."""
    b, h, n, d = config.state_shape
    return 2 * b * h * n * d * FLOAT_DTYPES[config.dtype].size


def configs(budgets, batches, heads: int, dim: int, dtype: str = "float16") -> list[StepConfig]:
    return [StepConfig(b, n, heads, dim, dtype) for b in budgets for n in batches]


def run_cache_suite(step_configs: list[StepConfig], schedule: Schedule, show_progress: bool = True) -> list[dict]:
    """Each configuration in turn, in a warm process."""
    # Per configuration: a fill per cache and the op's, then the rounds.
    per_config = len(cache_kinds()) + 1 + schedule.rounds
    progress = Progress(len(step_configs) * per_config, show_progress)
    try:
        warm_up()
        return [run_config(c, schedule, progress) for c in step_configs]
    finally:
        progress.close()
