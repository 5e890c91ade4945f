"""``L2NormKVCache`` keeps what the reference's ``L2NormKVCache`` keeps
(docs/spec.md §4, §8): over long streams of prefill chunks and decode steps,
in both layouts and on every backend, each head holds the same positions
with the same keys and values in temporal order.

Keys take small integer values, so the reference's ``mx.sum`` norms equal
docs/spec.md §2's bit for bit and the two caches rank the same numbers.
NaN and infinite keys go only where the reference protects nothing
(``recent=0``, past the sinks): the reference adds ``-inf`` to protected
scores, which lets such a norm displace a protected row (docs/spec.md §9).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from veloxquant_mlx.cache.knorm_cache import L2NormKVCache as ReferenceCache

import mlx_knorm
from conftest import ALL_BACKENDS
from mlx_knorm.cache import L2NormKVCache

# The reference stores keys and values of one width.
HEADS, KEY_DIM, VALUE_DIM = 2, 16, 16
BUDGET, N_SINK = 24, 3

# keep, recent, dtype, batch, NaN/inf keys
CASES = {
    "low": ("low", 0, mx.float16, 1, False),
    "high-recent": ("high", 3, mx.bfloat16, 2, False),
    "low-special": ("low", 0, mx.float16, 2, True),
    "high-special": ("high", 0, mx.bfloat16, 1, True),
}
# Steps per stream: the emulator runs a threadgroup of real threads per head.
STEPS = {"kernel": 1500, "fallback": 1500, "metal-emulator": 24}
CHECK_EVERY = 97


def stream(case: str, steps: int):
    """``steps`` blocks of (keys, values) ``[B, H, S, D]``: prefill chunks
    of 1 to 40 tokens now and then, decode steps in between."""
    keep, recent, dtype, batch, special = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    offset = 0
    for step in range(steps):
        size = int(rng.integers(1, 41)) if step < 3 or rng.random() < 0.02 else 1
        keys = rng.integers(-3, 4, size=(batch, HEADS, size, KEY_DIM)).astype(np.float32)
        if special:
            positions = offset + np.arange(size)
            rows = (rng.random((batch, HEADS, size)) < 0.05) & (positions >= N_SINK)
            keys[..., 0][rows] = rng.choice([np.nan, np.inf, -np.inf], size=int(rows.sum()))
        values = rng.standard_normal((batch, HEADS, size, VALUE_DIM)).astype(np.float32)
        offset += size
        yield mx.array(keys).astype(dtype), mx.array(values).astype(dtype)


def config(case: str) -> SimpleNamespace:
    keep, recent = CASES[case][:2]
    return SimpleNamespace(knorm_budget=BUDGET, knorm_n_sink=N_SINK, knorm_recent=recent, knorm_keep=keep)


def reference_run(case: str, steps: int) -> list:
    """The reference cache's kept positions, keys and values at the checked steps."""
    cache = ReferenceCache(config(case))
    checked = []
    for step, (keys, values) in enumerate(stream(case, steps)):
        cache.update_and_fetch(keys, values)
        if step % CHECK_EVERY == 0 or step == steps - 1:
            kept = (cache._positions, *cache.state[:2])
            mx.eval(kept)
            checked.append(kept)
    return checked


_reference = {}


def reference(case: str, steps: int) -> list:
    if (case, steps) not in _reference:
        _reference[case, steps] = reference_run(case, steps)
    return _reference[case, steps]


@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_long_streams_keep_the_reference_positions(backend, case, layout):
    steps = STEPS[backend]
    expected = iter(reference(case, steps))
    cache = L2NormKVCache(config(case), layout=layout)
    with mlx_knorm.use_backend(backend):
        for step, (keys, values) in enumerate(stream(case, steps)):
            mx.eval(cache.update_and_fetch(keys, values), cache.keys, cache.values)
            if step % CHECK_EVERY == 0 or step == steps - 1:
                positions, kept_keys, kept_values = next(expected)
                assert mx.array_equal(cache.positions, positions.astype(mx.int32)).item(), step
                keys_now, values_now = cache.state[:2]
                assert mx.array_equal(keys_now, kept_keys, equal_nan=True).item(), step
                assert mx.array_equal(values_now, kept_values).item(), step
    assert cache.size() == BUDGET and cache.offset > steps
