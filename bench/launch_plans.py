"""The Metal launch plans of Llama cache shapes: for each dispatch, its
threadgroups, threads per threadgroup and threadgroup memory (the lengths
the plan sets for its [[threadgroup(i)]] arguments plus what the kernel
declares itself), as the Metal emulator records them
(``_ext._emulator_debug``; needs a build with the emulator).

Shapes: Llama-3.2-1B (8 KV heads, D 64) and Llama-3.1-8B (8 KV heads,
D 128), float16, B = 1 and 4, budget 2048. evict_and_fill runs through
``L2NormKVCache`` (its defaults, donated buffers, as a model drives it): a
prompt of S = 4096 into an empty cache, the first decode step after it
(4096 rows down to the budget: many leave) and a decode step at the budget
(one leaves), in the slot layout and in the temporal one.
protected_topk_gather is the op: S = 4096 new rows and no
prior, and S = 1 onto 2048 prior rows, held by the caller and donated (in
place). Only the first
threadgroup of each dispatch runs (the plans do not depend on the rows):
the outputs are not meant to be read.

    python bench/launch_plans.py
"""

from __future__ import annotations

import mlx.core as mx

import mlx_knorm
from mlx_knorm import _native
from mlx_knorm.cache import L2NormKVCache

MODELS = (("Llama-3.2-1B", 8, 64), ("Llama-3.1-8B", 8, 128))
BATCHES = (1, 4)
BUDGET = 2048
PROMPT = 4096


def recorded(run) -> list[dict]:
    ext = _native.ext
    ext._emulator_debug(record=True, first_group_only=True)
    try:
        run()
    finally:
        log = ext._emulator_debug()
    return log


def cache_steps(batch: int, heads: int, dim: int, layout: str = "slots"):
    cache = L2NormKVCache(budget=BUDGET, recent=0, layout=layout)

    def step(steps: int) -> None:
        keys = mx.ones((batch, heads, steps, dim), mx.float16)
        out = cache.update_and_fetch(keys, keys)
        mx.eval(out)

    suffix = "" if layout == "slots" else f" ({layout} layout)"
    yield f"evict_and_fill prefill S=4096{suffix}", lambda: step(PROMPT)
    yield f"evict_and_fill decode after prefill{suffix}", lambda: step(1)
    yield f"evict_and_fill decode at budget{suffix}", lambda: step(1)


def temporal_cache_steps(batch: int, heads: int, dim: int):
    yield from cache_steps(batch, heads, dim, layout="temporal")


def gather_steps(batch: int, heads: int, dim: int):
    def gather(n_prior: int, n_new: int, donate: bool = False) -> None:
        # The op's heads are the batch's: [B * H, S, D].
        def rows(n, d):
            return mx.ones((batch * heads, n, d), mx.float16)

        prior = [rows(n_prior, dim), rows(n_prior, dim), mx.ones((batch * heads, n_prior), mx.float32)]
        mx.eval(prior)
        out = mlx_knorm.protected_topk_gather(
            *prior, rows(n_new, dim), rows(n_new, dim), mx.ones((batch * heads, n_new), mx.float32),
            budget=BUDGET, n_sink=4, recent=0, keep="low")
        if donate:
            del prior[:]
        mx.eval(out)

    yield "gather prefill S=4096", lambda: gather(0, PROMPT)
    yield "gather decode S=1", lambda: gather(BUDGET, 1)
    yield "gather decode S=1 in place", lambda: gather(BUDGET, 1, donate=True)


def main() -> None:
    if _native.ext is None or not getattr(_native.ext, "has_metal_emulator", False):
        raise SystemExit("needs the extension built with the Metal emulator")
    print("| model | B | step | kernel | threadgroups | threads | [[threadgroup(i)]] bytes | threadgroup memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with mlx_knorm.use_backend("metal-emulator"), mx.stream(mx.cpu):
        for model, heads, dim in MODELS:
            for batch in BATCHES:
                for steps in (cache_steps, temporal_cache_steps, gather_steps):
                    for name, run in steps(batch, heads, dim):
                        for d in recorded(run):
                            lengths = ", ".join(str(b) for b in d["threadgroup_bytes"]) or "-"
                            print(f"| {model} | {batch} | {name} | {d['kernel']} | {d['groups']} | "
                                  f"{d['group_size']} | {lengths} | {d['threadgroup_memory']} |")


if __name__ == "__main__":
    main()
