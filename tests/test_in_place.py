"""Decode steps on a donated state: the CPU kernel reuses the prior's
buffers when nothing else holds them, and only then."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from conftest import assert_bitwise_equal
from generators import fill

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def full_state(n_rows=8, budget=64, dim=32, seed=0):
    rng = np.random.default_rng(seed)
    keys = fill(rng, (n_rows, budget, dim), "normal", "float16")
    values = fill(rng, (n_rows, budget, dim), "normal", "float16")
    new = [fill(rng, (n_rows, 1, dim), "ties", "float16") for _ in range(40)]
    return (keys, values, mlx_knorm.key_norms(keys)), new


def decode(state, new, backend, hold):
    """Steps with the state dropped before evaluation (hold=False) or kept alive."""
    history = []
    with mlx_knorm.use_backend(backend):
        for token in new:
            if hold:
                history.append(state)
            state = mlx_knorm.knorm_update_batched(*state, token, token, state[0].shape[1], 2, 3, "low")
            mx.eval(state)
    return state


def test_donated_steps_match_the_fallback():
    state, new = full_state()
    mx.eval(state, new)
    copies = [tuple(mx.array(np.array(x)) for x in state) for _ in range(2)]
    in_place = decode(copies[0], new, "kernel", hold=False)
    reference = decode(copies[1], new, "fallback", hold=False)
    for a, b in zip(in_place, reference):
        assert_bitwise_equal(a, b, "in place vs fallback")


def test_a_prior_the_caller_holds_is_never_written():
    state, new = full_state()
    mx.eval(state, new)
    snapshot = [np.array(x) for x in state]
    for token in new:
        mx.eval(mlx_knorm.knorm_update_batched(*state, token, token, 64, 2, 3, "low"))
    for before, after in zip(snapshot, state):
        assert np.array_equal(before, np.array(after), equal_nan=True)


def test_donation_saves_the_state_copy():
    def peak(hold):
        state, new = full_state(n_rows=16, budget=512, dim=128, seed=1)
        mx.eval(state, new)
        mx.reset_peak_memory()
        decode(state, new[:5], "kernel", hold=hold)
        return mx.get_peak_memory()

    state_bytes = 16 * 512 * (2 * 128 * 2 + 4)
    assert peak(hold=True) - peak(hold=False) >= state_bytes


def test_no_donation_when_the_prior_feeds_another_op_in_the_same_graph():
    """Two steps from one intermediate prior, which nothing outside the graph
    holds: neither may take its buffers while the other still reads them
    (under mx.compile, equal nodes are merged, so both read one buffer)."""
    state, new = full_state()
    mx.eval(state, new)
    snapshot = [np.array(x) for x in state]

    def two_steps(keys, values, norms, token):
        keys, values, norms = keys + 0, values + 0, norms + 0
        token_norms = mlx_knorm.key_norms(token)
        first = mlx_knorm.protected_topk_gather(keys, values, norms, token, token, token_norms, 64, 2, 0, "low")
        second = mlx_knorm.protected_topk_gather(keys, values, norms, token, token, token_norms, 64, 2, 0, "high")
        return first + second

    token = mx.zeros_like(new[0])  # norm 0: "low" evicts a prior row, which moves rows
    with mlx_knorm.use_backend("fallback"):
        expected = two_steps(*state, token)
    eager = two_steps(*state, token)
    compiled = mx.compile(two_steps)(*state, token)
    for a, b, c in zip(eager, compiled, expected):
        assert_bitwise_equal(a, c, "eager")
        assert_bitwise_equal(b, c, "compiled")
    for before, after in zip(snapshot, state):
        assert np.array_equal(before, np.array(after), equal_nan=True)
