"""recent = 0: the kept set does not depend on how the stream was split."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_knorm
from conftest import assert_bitwise_equal, requires_emulator
from generators import fill


def run_blocks(keys, values, splits, budget, n_sink, keep):
    state = mlx_knorm.init_knorm_state(n_sink, budget, keys.shape[1], 0, keep)
    start = 0
    for stop in [*splits, keys.shape[0]]:
        state = mlx_knorm.knorm_update(state, keys[start:stop], values[start:stop])
        start = stop
    return state


def splits_agree(data, n_tokens, budget, dim, palette, seed):
    n_sink = data.draw(st.integers(0, budget - 1))
    keep = data.draw(st.sampled_from(["low", "high"]))
    splits = sorted(data.draw(st.lists(st.integers(0, n_tokens), max_size=10)))
    rng = np.random.default_rng(seed)
    keys = fill(rng, (n_tokens, dim), palette, "float16")
    values = fill(rng, (n_tokens, dim), "normal", "float16")
    one_shot = run_blocks(keys, values, [], budget, n_sink, keep)
    for split in (splits, list(range(1, n_tokens))):
        other = run_blocks(keys, values, split, budget, n_sink, keep)
        for field in ("keys", "values", "norms"):
            assert_bitwise_equal(getattr(other, field), getattr(one_shot, field), field)


@given(
    n_tokens=st.integers(1, 80),
    budget=st.integers(1, 40),
    dim=st.sampled_from([3, 64, 128]),
    palette=st.sampled_from(["normal", "ties", "special"]),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_token_by_token_random_splits_and_one_shot_agree(n_tokens, budget, dim, palette, data, seed):
    splits_agree(data, n_tokens, budget, dim, palette, seed)


@requires_emulator
@settings(max_examples=15)  # every token is two emulated launches
@given(
    n_tokens=st.integers(1, 16),
    budget=st.integers(1, 10),
    dim=st.sampled_from([3, 64]),
    palette=st.sampled_from(["normal", "ties", "special"]),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_path_independence_through_the_metal_emulator(n_tokens, budget, dim, palette, data, seed):
    with mlx_knorm.use_backend("metal-emulator"):
        splits_agree(data, n_tokens, budget, dim, palette, seed)


def test_batched_decode_equals_one_shot_prefill():
    rng = np.random.default_rng(11)
    keys = fill(rng, (8, 300, 64), "normal", "bfloat16")
    values = fill(rng, (8, 300, 64), "normal", "bfloat16")
    empty_kv = mx.zeros((8, 0, 64), mx.bfloat16)
    empty_norms = mx.zeros((8, 0), mx.float32)
    prefill = mlx_knorm.knorm_update_batched(empty_kv, empty_kv, empty_norms, keys, values, 64, 4, 0, "low")
    state = (empty_kv, empty_kv, empty_norms)
    for t in range(300):
        state = mlx_knorm.knorm_update_batched(*state, keys[:, t : t + 1], values[:, t : t + 1], 64, 4, 0, "low")
    for name, a, b in zip(("keys", "values", "norms"), state, prefill):
        assert_bitwise_equal(a, b, name)
