"""One decode step of a cache layer, side by side: ``evict_and_fill`` on
donated slot buffers (the L2-norm cache's step: one eviction, one row moved,
the new row written with its norm and position) next to mlx-lm's
``RotatingKVCache.update_and_fetch`` (one row written into a ring buffer),
what a user bounding the cache would pick instead.

    python bench/decode_step.py [--budget 512 2048 8192] [--heads 8] [--dim 128]

Both run in one warm process on the CPU, interleaved in rounds so that the
machine's drift hits both alike, every step evaluated on its own
(``mx.eval``) with the previous buffers dropped first, as a decode loop does.
Reported per step: median and interquartile range in ms, the ratio of the
medians, and minor page faults per step (``ru_minflt``; 0 means no buffer
was allocated fresh).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

import mlx_knorm
from mlx_knorm.ops.evict_and_fill import evict_and_fill_unchecked

N_SINK, RECENT = 4, 16


def make_tokens(rng, n_heads, dim, count):
    tokens = [mx.array(rng.standard_normal((n_heads, 1, dim)).astype(np.float16)) for _ in range(count)]
    mx.eval(tokens)
    return tokens


class SlotCache:
    """The L2-norm cache's storage at steady state: budget + 1 slots per head
    (the kept rows and the last step's new row), one evict_and_fill a step."""

    def __init__(self, rng, n_heads, budget, dim):
        slots = budget + 1
        keys = mx.array(rng.standard_normal((n_heads, slots, dim)).astype(np.float16))
        self.buffers = [
            keys,
            mx.array(rng.standard_normal((n_heads, slots, dim)).astype(np.float16)),
            mlx_knorm.key_norms(keys),
            mx.array(np.stack([rng.permutation(slots) for _ in range(n_heads)]).astype(np.int32)),
        ]
        mx.eval(self.buffers)
        self.budget = budget
        self.offset = slots

    def step(self, token):
        inputs = [*self.buffers, token, token]
        self.buffers = None
        self.buffers = evict_and_fill_unchecked(
            *inputs, filled=self.budget + 1, offset=self.offset, capacity=self.budget + 1,
            budget=self.budget, n_sink=N_SINK, recent=RECENT, keep="low",
        )
        del inputs
        mx.eval(self.buffers)
        self.offset += 1


class RingCache:
    """mlx-lm's RotatingKVCache filled to its size, then one row a step."""

    def __init__(self, rng, n_heads, budget, dim):
        self.cache = RotatingKVCache(max_size=budget, keep=N_SINK)
        for _ in range(budget):
            token = mx.array(rng.standard_normal((1, n_heads, 1, dim)).astype(np.float16))
            mx.eval(self.cache.update_and_fetch(token, token))

    def step(self, token):
        token = token.reshape(1, token.shape[0], 1, token.shape[2])
        mx.eval(self.cache.update_and_fetch(token, token))


def time_steps(cache, tokens, count, start):
    """Seconds per step and minor page faults over ``count`` steps."""
    samples = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(count):
        token = tokens[(start + i) % len(tokens)]
        t0 = time.perf_counter()
        cache.step(token)
        samples.append(time.perf_counter() - t0)
    return samples, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def summary(samples, faults):
    ms = [s * 1e3 for s in samples]
    q = statistics.quantiles(ms, n=4)
    return {"median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2],
            "steps": len(ms), "faults_per_step": faults / len(ms)}


def run_budget(budget, n_heads, dim, rounds, per_round, seed=0):
    rng = np.random.default_rng(seed)
    tokens = make_tokens(rng, n_heads, dim, 64)
    caches = {"evict_and_fill": SlotCache(rng, n_heads, budget, dim),
              "RotatingKVCache": RingCache(rng, n_heads, budget, dim)}
    samples = {name: [] for name in caches}
    faults = {name: 0 for name in caches}
    for name, cache in caches.items():  # warm-up, untimed
        time_steps(cache, tokens, per_round, 0)
    for r in range(rounds):
        for name, cache in caches.items():
            s, f = time_steps(cache, tokens, per_round, r * per_round)
            samples[name] += s
            faults[name] += f
    return {name: summary(samples[name], faults[name]) for name in caches}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/decode_step.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, default=8, help="B * H (default 8)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100, help="steps per round and cache")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not mlx_knorm.native_available():
        print("bench/decode_step.py: the native extension is not loaded", file=sys.stderr)
        return 1
    mx.set_default_device(mx.cpu)
    # Other MLX work first: the process is warm when the timings start.
    mx.eval(mx.random.normal((1024, 1024)) @ mx.random.normal((1024, 1024)))
    print(f"decode step, B*H = {args.heads}, D = {args.dim}, float16, CPU; "
          f"median [p25, p75] ms over {args.rounds} x {args.steps} steps")
    print("| budget | evict_and_fill ms | RotatingKVCache ms | ratio | faults/step (eaf, ring) |")
    print("|---|---|---|---|---|")
    results = {}
    for budget in args.budget:
        r = run_budget(budget, args.heads, args.dim, args.rounds, args.steps)
        results[budget] = r
        e, g = r["evict_and_fill"], r["RotatingKVCache"]
        print(f"| {budget} | {e['median_ms']:.4f} [{e['p25_ms']:.4f}, {e['p75_ms']:.4f}] | "
              f"{g['median_ms']:.4f} [{g['p25_ms']:.4f}, {g['p75_ms']:.4f}] | "
              f"{e['median_ms'] / g['median_ms']:.2f}x | "
              f"{e['faults_per_step']:.2f}, {g['faults_per_step']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heads": args.heads, "dim": args.dim, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
