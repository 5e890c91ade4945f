"""EvictAndFill's order tree (docs/spec.md §4 step 4): the tree every backend
outputs is the spec's, and a decode step through the previous step's tree
gives, bit for bit, what ranking every row gives."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import ALL_BACKENDS, EMULATOR_SETTINGS, NATIVE_BACKENDS, assert_bitwise_equal, requires_emulator
from generators import evict_and_fill_arrays, fill
from mlx_knorm.ops.evict_and_fill import evict_and_fill_unchecked
from spec_oracle import order_tree as oracle_order_tree

INT32_MAX = 2**31 - 1


@st.composite
def tree_streams(draw, max_heads=3, max_budget=12):
    """A cache's life: a prompt in chunks, decode steps (now and then a
    chunk or an empty block between them), the buffers growing now and then;
    the configuration, valid ranges or none, and the norms' palette."""
    budget = draw(st.integers(1, max_budget))
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - 1 - n_sink))
    blocks = draw(st.lists(st.integers(0, 2 * budget), min_size=1, max_size=2))
    blocks += draw(st.lists(st.sampled_from([1] * 8 + [0, 3]), min_size=1, max_size=3 * budget + 4))
    n_heads = draw(st.integers(1, max_heads))
    total = sum(blocks)
    ranges = None
    if draw(st.booleans()):
        ranges = []
        for _ in range(n_heads):
            lo = draw(st.integers(0, max(0, total - 1)))
            ranges.append((lo, draw(st.one_of(st.just(INT32_MAX), st.integers(lo, total)))))
    config = dict(budget=budget, n_sink=n_sink, recent=recent,
                  keep=draw(st.sampled_from(["low", "high"])),
                  layout=draw(st.sampled_from(["slots", "slots", "temporal"])))
    grow = draw(st.sampled_from([0, 0, 1, 3]))
    palette = draw(st.sampled_from(["normal", "ties", "special"]))
    return n_heads, blocks, ranges, config, grow, palette, draw(st.integers(0, 2**32 - 1))


def run_stream(backend, case, chain_tree=True):
    """The stream's outputs after each step: rows of the defined slots and
    the tree. chain_tree: each step is given the previous step's tree (else
    it is asked for one, so it ranks every row)."""
    n_heads, blocks, ranges, config, grow, palette, seed = case
    rng = np.random.default_rng(seed)
    total, dim = sum(blocks), 3
    keys = fill(rng, (n_heads, total, dim), palette, "float16")
    values = fill(rng, (n_heads, total, dim), "normal", "float16")
    valid = None if ranges is None else mx.array(ranges, dtype=mx.int32)
    state = [mx.zeros((n_heads, 0, dim), mx.float16), mx.zeros((n_heads, 0, dim), mx.float16),
             mx.zeros((n_heads, 0), mx.float32), mx.zeros((n_heads, 0), mx.int32)]
    tree = True
    filled = offset = 0
    steps = []
    with mlx_knorm.use_backend(backend):
        for n_new in blocks:
            kept = min(filled, config["budget"])
            slots = state[0].shape[1]
            # The cache's rule: keep the buffers while they fit, else grow.
            capacity = slots if kept + n_new <= slots else kept + n_new + grow
            *state, out_tree = mlx_knorm.evict_and_fill(
                *state, keys[:, offset : offset + n_new], values[:, offset : offset + n_new],
                filled=filled, offset=offset, capacity=capacity, valid=valid,
                tree=tree if chain_tree else True, **config)
            tree = out_tree
            filled, offset = kept + n_new, offset + n_new
            mx.eval(state, tree)
            steps.append(([np.array(x[:, :filled]) for x in state], np.array(tree)))
    return steps


def assert_same_streams(got, expected):
    for step, ((rows, tree), (rows_e, tree_e)) in enumerate(zip(got, expected, strict=True)):
        for name, a, e in zip(("keys", "values", "norms", "positions"), rows, rows_e):
            assert a.tobytes() == e.tobytes(), f"{name} after step {step}"
        assert np.array_equal(tree, tree_e), f"tree after step {step}"


def assert_trees_are_the_specs(steps, case):
    n_heads, blocks, ranges, config, *_ = case
    offset = 0
    for (rows, tree), n_new in zip(steps, blocks):
        offset += n_new
        norms, positions = rows[2], rows[3]
        count = norms.shape[1]
        for n in range(n_heads):
            spec = oracle_order_tree(
                norms[n].tolist(), positions[n].tolist(), tree.shape[-1] - 1, count, offset,
                config["n_sink"], config["recent"], config["keep"],
                None if ranges is None else ranges[n])
            assert tree[n].tolist() == spec, f"head {n} at offset {offset}"


@given(case=tree_streams())
def test_evict_and_fill_order_tree_of_the_fallback_is_the_specs(case):
    assert_trees_are_the_specs(run_stream("fallback", case), case)


@given(case=tree_streams())
def test_evict_and_fill_through_the_order_tree_matches_ranking_every_row(case):
    expected = run_stream("fallback", case, chain_tree=False)
    assert_same_streams(run_stream("kernel", case), expected)
    assert_same_streams(run_stream("kernel", case, chain_tree=False), expected)


@given(case=tree_streams(max_heads=4, max_budget=40))
def test_evict_and_fill_through_the_order_tree_matches_ranking_every_row_long_streams(case):
    assert_same_streams(run_stream("kernel", case), run_stream("fallback", case, chain_tree=False))


@pytest.mark.parametrize("ranges", [None, [(0, INT32_MAX), (3, 60), (0, 25)]])
def test_evict_and_fill_order_tree_without_window_keeps_the_constant_window_half(ranges):
    """recent = 0: no row is ever in the window, so the CPU kernel leaves the
    given window half as it is (each node the lowest slot below it) and
    updates the eviction half alone; every step's tree is still the spec's
    and the rows those of ranking every row."""
    case = (3, [9, *[1] * 60], ranges, dict(budget=8, n_sink=2, recent=0, keep="low", layout="slots"),
            0, "ties", 7)
    steps = run_stream("kernel", case)
    assert_same_streams(steps, run_stream("fallback", case, chain_tree=False))
    assert_trees_are_the_specs(steps, case)
    n = steps[-1][1].shape[-1] - 1
    lowest = [0] + [min(s for s in range(n) if _descends(n + s, node)) for node in range(1, n)] + [0]
    for _, tree in steps[1:]:
        assert tree[:, 1, 1:].tolist() == [lowest[1:]] * 3


def test_evict_and_fill_order_tree_without_window_follows_a_stored_position_past_the_offset():
    """recent = 0, yet a stored row whose position lies past the offset (a
    direct call's buffers) is in the window until the offset reaches it:
    the step through the tree then updates both halves, as the spec's tree
    and ranking every row say."""
    budget = 8
    config = dict(budget=budget, n_sink=0, recent=0, keep="low", layout="slots")
    first_norms = [1.0, 1.1, 1.2, 1.3, 1.4, 9.0, 1.5, 1.6, 0.0]
    first_positions = [0, 1, 2, 3, 4, 12, 5, 6, 0]

    def run(backend, chain_tree):
        rows = mx.array(np.array([[[v, 0.0] for v in first_norms]], np.float16))
        state = [rows, rows, mx.array([first_norms], mx.float32), mx.array([first_positions], mx.int32)]
        filled, offset, tree, steps = budget, budget - 1, True, []
        with mlx_knorm.use_backend(backend):
            for step in range(9):
                new = mx.array(np.full((1, 1, 2), 0.5 + 0.01 * step, np.float16))
                *state, tree = mlx_knorm.evict_and_fill(
                    *state, new, new, filled=filled, offset=offset, capacity=budget + 1,
                    tree=tree if chain_tree else True, **config)
                filled, offset = min(filled, budget) + 1, offset + 1
                mx.eval(state, tree)
                steps.append((np.array(state[3][0, :filled]).tolist(), np.array(tree).tolist()))
        return steps

    assert run("kernel", True) == run("fallback", False)


def _descends(leaf: int, node: int) -> bool:
    while leaf > node:
        leaf //= 2
    return leaf == node


@requires_emulator
@EMULATOR_SETTINGS
@given(case=tree_streams(max_heads=2, max_budget=8))
def test_evict_and_fill_order_tree_metal_emulator_matches_ranking_every_row(case):
    assert_same_streams(run_stream("metal-emulator", case), run_stream("fallback", case, chain_tree=False))


def decode_state(n_heads=2, budget=8, n_sink=1, recent=2, seed=0):
    """A full slot-layout state (filled = budget + 1) with its tree, from a
    prompt and one decode step."""
    rng = np.random.default_rng(seed)
    config = dict(budget=budget, n_sink=n_sink, recent=recent, keep="low", layout="slots")
    keys = fill(rng, (n_heads, budget + 2, 4), "normal", "float16")
    with mlx_knorm.use_backend("fallback"):
        state = mlx_knorm.evict_and_fill(
            mx.zeros((n_heads, 0, 4), mx.float16), mx.zeros((n_heads, 0, 4), mx.float16),
            mx.zeros((n_heads, 0), mx.float32), mx.zeros((n_heads, 0), mx.int32),
            keys[:, : budget + 1], keys[:, : budget + 1], filled=0, offset=0,
            capacity=budget + 1, tree=True, **config)
    mx.eval(state)
    step = dict(filled=budget + 1, offset=budget + 1, capacity=budget + 1, **config)
    new = keys[:, budget + 1 :]
    return list(state), step, new


def tree_step(backend, state, step, new, tree):
    *rows, _ = state
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.evict_and_fill(*rows, new, new, tree=tree, **step)
        mx.eval(out)
        return out


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_order_tree_given_is_the_one_built(backend):
    state, step, new = decode_state()
    through = tree_step(backend, state, step, new, state[4])
    ranked = tree_step("fallback", state, step, new, True)
    for a, e, name in zip(through, ranked, ("keys", "values", "norms", "positions", "tree")):
        assert_bitwise_equal(a, e, name)


def test_evict_and_fill_order_tree_is_read_by_the_cpu_kernel():
    """A tree whose eviction winner is a protected row, in range: the CPU
    kernel evicts that row (it reads the tree instead of the rows), so the
    checks above compare a path that is taken."""
    state, step, new = decode_state()
    tree = np.array(state[4])
    sink = int(np.argmin(np.array(state[3][0])))
    tree[0, 0, -1] = sink
    through = tree_step("kernel", state, step, new, mx.array(tree))
    ranked = tree_step("fallback", state, step, new, True)
    assert np.array(through[3][0]).tolist().count(0) == 0, "the sink was evicted"
    assert np.array_equal(np.array(through[3][1]), np.array(ranked[3][1])), "head 1 as ranked"


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
@pytest.mark.parametrize("flaw", ["winner_past_filled", "winner_negative", "window_winner_past_c",
                                  "window_winner_negative", "stamp_count", "stamp_offset", "garbage"])
def test_evict_and_fill_order_tree_not_of_this_step_stays_in_bounds(backend, flaw):
    """A tree whose stamps are not this step's, or whose winner is out of
    range, makes the step rank every row (the contract's result); any other
    int32 garbage gives an unspecified kept set, read and written within the
    buffers."""
    state, step, new = decode_state()
    tree = np.array(state[4])
    n = tree.shape[-1] - 1
    if flaw == "winner_past_filled":
        tree[:, 0, n] = n + 5
    elif flaw == "winner_negative":
        tree[:, 0, n] = -3
    elif flaw == "window_winner_past_c":
        tree[:, 1, n] = n
    elif flaw == "window_winner_negative":
        tree[:, 1, n] = -1
    elif flaw == "stamp_count":
        tree[:, 0, 0] += 1
    elif flaw == "stamp_offset":
        tree[:, 1, 0] -= 1
    else:
        tree[...] = np.random.default_rng(1).integers(-2**31, 2**31 - 1, tree.shape, dtype=np.int64)
    out = tree_step(backend, state, step, new, mx.array(tree.astype(np.int32)))
    ranked = tree_step("fallback", state, step, new, True)
    if flaw == "garbage":
        assert sorted(np.array(out[3][0]).tolist())[-1] == step["offset"]
        return
    for a, e, name in zip(out, ranked, ("keys", "values", "norms", "positions", "tree")):
        assert_bitwise_equal(a, e, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 5])
def test_evict_and_fill_order_tree_of_small_buffers(backend, capacity):
    n_new = min(capacity, 2)
    arrays = evict_and_fill_arrays(np.random.default_rng(2), 2, 0, n_new, 4, 4)
    with mlx_knorm.use_backend(backend):
        *_, tree = mlx_knorm.evict_and_fill(
            *arrays, filled=0, offset=7, capacity=capacity, budget=4, n_sink=1, recent=1,
            keep="low", tree=True)
    assert tree.shape == (2, 2, capacity + 1) and tree.dtype == mx.int32
    norms = np.zeros(capacity, np.float32)
    positions = list(range(7, 7 + n_new)) + [0] * (capacity - n_new)
    spec = oracle_order_tree(norms.tolist(), positions, capacity, n_new, 7 + n_new, 1, 1, "low")
    assert np.array(tree[0]).tolist()[0] == spec[0]
    assert np.array(tree[0]).tolist()[1] == spec[1]


TREE_ERRORS = [
    ("type", lambda t: [1, 2], TypeError, "tree must be a bool or an mlx.core.array"),
    ("rank", lambda t: t[0], ValueError, "tree must have rank 3"),
    ("dtype", lambda t: t.astype(mx.uint32), TypeError, "tree must be int32"),
    ("halves", lambda t: t[:, :1], ValueError, r"tree must be \[N, 2, C \+ 1\]"),
    ("slots", lambda t: t[..., :-1], ValueError, r"tree must be \[N, 2, C \+ 1\]"),
    ("heads", lambda t: t[:1], ValueError, r"tree must be \[N, 2, C \+ 1\]"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("flaw, bad, error, message", TREE_ERRORS, ids=[e[0] for e in TREE_ERRORS])
def test_evict_and_fill_order_tree_errors(backend, flaw, bad, error, message):
    state, step, new = decode_state()
    *rows, tree = state
    with mlx_knorm.use_backend(backend), pytest.raises(error, match=message):
        mlx_knorm.evict_and_fill(*rows, new, new, tree=bad(tree), **step)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", [None, 1, [0], np.zeros((2, 2, 10), np.int32), np.True_],
                         ids=["None", "int", "list", "numpy", "numpy-bool"])
def test_evict_and_fill_order_tree_of_another_type_is_refused_by_the_cache_entry(backend, bad):
    """The cache's entry point (no Python checks on the kernel's decode
    path) names a tree that is neither a bool nor an array, as the op does."""
    state, step, new = decode_state()
    *rows, _ = state
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match="tree must be a bool or an mlx.core.array"):
        evict_and_fill_unchecked(*rows, new, new, tree=bad, **step)


def test_evict_and_fill_order_tree_inside_compile():
    state, step, new = decode_state()
    *rows, tree = state

    def decode(*arrays):
        return mlx_knorm.evict_and_fill(*arrays[:4], arrays[5], arrays[5], tree=arrays[4], **step)

    eager = decode(*rows, tree, new)
    compiled = mx.compile(decode)(*rows, tree, new)
    for a, e in zip(compiled, eager):
        assert_bitwise_equal(a, e, "compiled")
