"""Decode steps on a donated state: the kernels reuse the prior's buffers
when nothing else holds them, and only then."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from conftest import NATIVE_BACKENDS, assert_bitwise_equal, data_address
from generators import evict_and_fill_arrays, fill, protected_topk_gather_arrays

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def copies(arrays):
    return [mx.array(np.array(a)) for a in arrays]


# protected_topk_gather (docs/spec.md §7): keys, values and norms in place,
# each when its prior is donated and keeps its shape.


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


def steps_for(backend):
    """Decode steps per test: the emulator runs every GPU thread as a thread."""
    return 40 if backend == "kernel" else 6


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_protected_topk_gather_donated_decode_matches_the_fallback(backend):
    state, new = full_state()
    new = new[: steps_for(backend)]
    mx.eval(state, new)
    in_place = decode(copies(state), new, backend, hold=False)
    reference = decode(copies(state), new, "fallback", hold=False)
    for a, b in zip(in_place, reference):
        assert_bitwise_equal(a, b, "in place vs fallback")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_protected_topk_gather_never_writes_a_prior_the_caller_holds(backend):
    state, new = full_state()
    mx.eval(state, new)
    snapshot = [np.array(x) for x in state]
    with mlx_knorm.use_backend(backend):
        for token in new[: steps_for(backend)]:
            mx.eval(mlx_knorm.knorm_update_batched(*state, token, token, 64, 2, 3, "low"))
    for before, after in zip(snapshot, state):
        assert np.array_equal(before, np.array(after), equal_nan=True)


def test_protected_topk_gather_donation_saves_the_state_copy():
    def peak(hold):
        state, new = full_state(n_rows=16, budget=512, dim=128, seed=1)
        mx.eval(state, new)
        mx.reset_peak_memory()
        decode(state, new[:5], "kernel", hold=hold)
        return mx.get_peak_memory()

    state_bytes = 16 * 512 * (2 * 128 * 2 + 4)
    assert peak(hold=True) - peak(hold=False) >= state_bytes


def protected_topk_gather_state(n_heads, budget, n_new, evicted, seed=0):
    """A full prior of ``budget`` rows and ``n_new`` new ones. With
    ``evicted`` (one new row), keep="low" evicts exactly row ``evicted`` of
    prior ++ new: the only norm above 1 (``budget`` is the new row); without
    it, norms full of ties."""
    rng = np.random.default_rng(seed)
    arrays = protected_topk_gather_arrays(rng, n_heads, budget, n_new, 16, 33)
    if evicted is None:
        norms = rng.integers(0, 4, size=(n_heads, budget + n_new)).astype(np.float32)
    else:
        norms = rng.uniform(0.0, 1.0, size=(n_heads, budget + n_new)).astype(np.float32)
        norms[:, evicted] = 10.0
    arrays[2] = mx.array(np.ascontiguousarray(norms[:, :budget]))
    arrays[5] = mx.array(np.ascontiguousarray(norms[:, budget:]))
    mx.eval(arrays)
    return arrays


def protected_topk_gather_dropping(backend, arrays: list, budget, stream=None):
    """One gather whose inputs are referenced by ``arrays`` alone, which is
    emptied before evaluation: the op's inputs are then donated."""
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.protected_topk_gather(*arrays, budget, 2, 0, "low", stream=stream)
    arrays.clear()
    mx.eval(out)
    return out


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize(
    "budget, n_new, evicted",
    [(32, 1, 32), (32, 1, 2), (32, 1, 20), (600, 1, 600), (600, 1, 3), (600, 1, 300), (600, 9, None),
     (600, 200, None)],
)
def test_protected_topk_gather_on_a_donated_prior_runs_in_place(backend, budget, n_new, evicted):
    """A decode step from a full state evicting the new row (nothing moves),
    an early row (nearly every row moves) or one in between, within one
    256-row chunk of the Metal kernel and over three; then steps evicting
    several rows among ties, 200 of them in a block whose new rows the Metal
    kernel copies in a second dispatch. Keys, values and norms are the
    prior's buffers."""
    arrays = protected_topk_gather_state(4 if budget < 256 else 2, budget, n_new, evicted)
    expected = protected_topk_gather_dropping("fallback", copies(arrays), budget)
    addresses = [data_address(a) for a in arrays[:3]]
    out = protected_topk_gather_dropping(backend, arrays, budget)
    assert [data_address(o) for o in out[:3]] == addresses
    if evicted is not None:
        assert not np.any(np.array(out[3]) == evicted)
    for name, a, e in zip(("keys", "values", "norms", "indices"), out, expected):
        assert_bitwise_equal(a, e, name)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("budget, n_new, held_keys", [(32, 1, True), (600, 200, True), (600, 200, False)])
def test_protected_topk_gather_never_writes_a_held_prior(backend, budget, n_new, held_keys):
    """The prior values and (with held_keys) a view of the prior keys are
    held elsewhere: those outputs are fresh buffers and what is held is
    unchanged; the rest, donated, is compacted in place. With 200 new rows
    the Metal kernel copies rows in a second dispatch, from the prior for
    fresh outputs, only the new ones for those in place."""
    arrays = protected_topk_gather_state(4 if budget < 256 else 2, budget, n_new, 3 if n_new == 1 else None)
    expected = protected_topk_gather_dropping("fallback", copies(arrays), budget)
    keys_view = arrays[0][:, 3:9] if held_keys else None
    values = arrays[1]
    held = [np.array(values)] + ([np.array(keys_view)] if held_keys else [])
    addresses = [data_address(a) for a in arrays[:3]]
    out = protected_topk_gather_dropping(backend, arrays, budget)
    for name, a, e in zip(("keys", "values", "norms", "indices"), out, expected):
        assert_bitwise_equal(a, e, name)
    got = [data_address(o) for o in out[:3]]
    assert (got[0] != addresses[0]) == held_keys
    assert got[1] != addresses[1]
    assert got[2] == addresses[2]
    for before, after in zip(held, [values] + ([keys_view] if held_keys else [])):
        assert np.array_equal(before, np.array(after))


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal GPU")
def test_protected_topk_gather_on_a_donated_prior_on_the_gpu():
    """The step whose new rows the Metal kernel copies in a second dispatch,
    on the GPU with the prior donated: both dispatches bind one buffer as
    input and output, and MLX's encoder must order them."""
    arrays = protected_topk_gather_state(2, 600, 200, None)
    expected = protected_topk_gather_dropping("fallback", copies(arrays), 600)
    addresses = [data_address(a) for a in arrays[:3]]
    out = protected_topk_gather_dropping("kernel", arrays, 600, stream=mx.gpu)
    assert [data_address(o) for o in out[:3]] == addresses
    for name, a, e in zip(("keys", "values", "norms", "indices"), out, expected):
        assert_bitwise_equal(a, e, name)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_protected_topk_gather_no_donation_when_the_prior_feeds_another_op(backend):
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
    with mlx_knorm.use_backend(backend):
        eager = two_steps(*state, token)
        compiled = mx.compile(two_steps)(*state, token)
    for a, b, c in zip(eager, compiled, expected):
        assert_bitwise_equal(a, c, "eager")
        assert_bitwise_equal(b, c, "compiled")
    for before, after in zip(snapshot, state):
        assert np.array_equal(before, np.array(after), equal_nan=True)


# evict_and_fill (docs/spec.md §7): in place per buffer, when that buffer is
# donated and the capacity is unchanged.


def evict_and_fill_state(n_heads=4, slots=32, dim=16, layout="slots", seed=0):
    """A cache's buffers holding positions 0..slots-1 (shuffled for the slot
    layout) and one new row."""
    arrays = evict_and_fill_arrays(np.random.default_rng(seed), n_heads, slots, 1, dim, layout=layout)
    mx.eval(arrays)
    return arrays


def evict_and_fill_config(slots, budget, layout, capacity=None):
    return dict(filled=slots, offset=slots, capacity=slots if capacity is None else capacity,
                budget=budget, n_sink=2, recent=3, keep="low", layout=layout)


def evict_and_fill_dropping(backend, arrays: list, config):
    """One step whose inputs are referenced by ``arrays`` alone, which is
    emptied before evaluation: the op's inputs are then donated."""
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.evict_and_fill(*arrays, **config)
    arrays.clear()
    mx.eval(out)
    return out


def assert_evict_and_fill_equal(actual, expected, defined):
    for name, a, e in zip(("keys", "values", "norms", "positions"), actual, expected):
        assert_bitwise_equal(a[:, :defined], e[:, :defined], name)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize(
    "slots, filled, budget",
    [(32, 32, 31), (32, 32, 27), (33, 32, 32), (700, 700, 699), (700, 700, 300)],
)
def test_evict_and_fill_on_donated_buffers_runs_in_place(backend, layout, slots, filled, budget):
    """A decode step (one row leaves), a step that evicts several rows and
    one that evicts none, then the same over several 256-slot chunks of the
    Metal kernel: every output is its input's buffer."""
    arrays = evict_and_fill_state(n_heads=4 if slots < 256 else 2, slots=slots, layout=layout)
    config = evict_and_fill_config(filled, budget, layout, capacity=slots)
    expected = evict_and_fill_dropping("fallback", copies(arrays), config)
    addresses = [data_address(a) for a in arrays[:4]]
    out = evict_and_fill_dropping(backend, arrays, config)
    assert [data_address(o) for o in out] == addresses
    assert_evict_and_fill_equal(out, expected, min(filled, budget) + 1)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_never_writes_held_buffers(backend, layout):
    """A view of the keys and the values array are held elsewhere: those two
    outputs are fresh buffers and what is held is unchanged; the norms and
    positions, donated, are updated in place."""
    arrays = evict_and_fill_state(layout=layout)
    config = evict_and_fill_config(32, 27, layout)
    expected = evict_and_fill_dropping("fallback", copies(arrays), config)
    keys_view = arrays[0][:, 3:9]
    values = arrays[1]
    held = [np.array(keys_view), np.array(values)]
    addresses = [data_address(a) for a in arrays[:4]]
    out = evict_and_fill_dropping(backend, arrays, config)
    assert_evict_and_fill_equal(out, expected, 28)
    got = [data_address(o) for o in out]
    assert got[0] != addresses[0] and got[1] != addresses[1]
    assert got[2:] == addresses[2:]
    for before, after in zip(held, (keys_view, values)):
        assert np.array_equal(before, np.array(after))


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_decode_loop_in_place_matches_the_fallback(backend, layout):
    """The cache's loop: buffers of budget + 1 slots, one eviction and one
    new row per step, the previous buffers dropped before each evaluation."""
    # The emulator runs every GPU thread as a thread: fewer steps.
    budget, steps = 24, 40 if backend == "kernel" else 8
    rng = np.random.default_rng(5)
    tokens = [fill(rng, (3, 1, 8), "ties", "float16") for _ in range(steps)]
    start = evict_and_fill_state(n_heads=3, slots=budget + 1, dim=8, layout=layout, seed=6)[:4]
    results = {}
    for name in (backend, "fallback"):
        state = copies(start)
        addresses = [data_address(a) for a in state]
        for i, token in enumerate(tokens):
            config = evict_and_fill_config(budget + 1, budget, layout)
            config["offset"] = budget + 1 + i
            inputs = [*state, token, token.astype(mx.float32)]
            del state
            state = list(evict_and_fill_dropping(name, inputs, config))
        if name == backend:
            assert [data_address(a) for a in state] == addresses
        results[name] = state
    assert_evict_and_fill_equal(results[backend], results["fallback"], budget + 1)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_evict_and_fill_no_donation_when_the_buffers_feed_another_op(backend):
    """Two steps from one intermediate state that nothing outside the graph
    holds: neither may take its buffers while the other still reads them."""
    arrays = evict_and_fill_state()
    snapshot = [np.array(a) for a in arrays]

    def two_steps(keys, values, norms, positions, new_keys, new_values):
        state = (keys + 0, values + 0, norms + 0, positions + 0)
        first = mlx_knorm.evict_and_fill(*state, new_keys, new_values, **evict_and_fill_config(32, 27, "slots"))
        second = mlx_knorm.evict_and_fill(*state, new_keys, new_values, **evict_and_fill_config(32, 30, "temporal"))
        return first + second

    with mlx_knorm.use_backend("fallback"):
        expected = two_steps(*arrays)
    with mlx_knorm.use_backend(backend):
        eager = two_steps(*arrays)
        compiled = mx.compile(two_steps)(*arrays)
    for i, (a, b, c) in enumerate(zip(eager, compiled, expected)):
        defined = 28 if i < 4 else 31
        assert_bitwise_equal(a[:, :defined], c[:, :defined], "eager")
        assert_bitwise_equal(b[:, :defined], c[:, :defined], "compiled")
    for before, after in zip(snapshot, arrays):
        assert np.array_equal(before, np.array(after))


# Payload tuples (docs/spec.md §7): every payload of a quantized cache's
# (packed, scales, biases) keys and values in place, each when donated.


def quantized_evict_and_fill_state(n_heads=3, slots=32, dim=64, layout="slots", seed=0):
    """A quantized cache's buffers (mx.quantize's triples), positions
    0..slots-1 (shuffled for the slot layout), one new row and its norm."""
    rng = np.random.default_rng(seed)
    positions = np.stack([rng.permutation(slots) for _ in range(n_heads)])
    if layout == "temporal":
        positions.sort(axis=1)
    keys = fill(rng, (n_heads, slots + 1, dim), "normal", "float16")
    values = fill(rng, (n_heads, slots + 1, dim), "normal", "float16")

    def quantized(x):
        return tuple(mx.quantize(x, group_size=32, bits=4))

    arrays = [
        quantized(keys[:, :slots]),
        quantized(values[:, :slots]),
        mlx_knorm.key_norms(keys[:, :slots]),
        mx.array(positions.astype(np.int32)),
        quantized(keys[:, slots:]),
        quantized(values[:, slots:]),
    ]
    new_norms = mlx_knorm.key_norms(keys[:, slots:])
    mx.eval(arrays, new_norms)
    return arrays, new_norms


def tuple_copies(arrays):
    return [tuple(copies(a)) if isinstance(a, tuple) else copies([a])[0] for a in arrays]


def flat_buffers(out) -> list[mx.array]:
    return [*out[0], *out[1], out[2], out[3]]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize("budget", [31, 27])
def test_evict_and_fill_quantized_payloads_on_donated_buffers_run_in_place(backend, layout, budget):
    """A decode step and a step evicting several rows on donated (packed,
    scales, biases) triples: all eight outputs are their inputs' buffers."""
    arrays, new_norms = quantized_evict_and_fill_state(layout=layout)
    config = {**evict_and_fill_config(32, budget, layout), "new_norms": new_norms}
    expected = evict_and_fill_dropping("fallback", tuple_copies(arrays), config)
    addresses = [data_address(a) for a in flat_buffers(arrays)]
    out = evict_and_fill_dropping(backend, arrays, config)
    assert [data_address(o) for o in flat_buffers(out)] == addresses
    for a, e in zip(flat_buffers(out), flat_buffers(expected)):
        assert_bitwise_equal(a[:, : budget + 1], e[:, : budget + 1], "payload")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_evict_and_fill_never_writes_a_held_payload(backend):
    """The value scales are held elsewhere: that output is a fresh buffer
    and what is held is unchanged; every other payload runs in place."""
    arrays, new_norms = quantized_evict_and_fill_state()
    config = {**evict_and_fill_config(32, 27, "slots"), "new_norms": new_norms}
    expected = evict_and_fill_dropping("fallback", tuple_copies(arrays), config)
    scales = arrays[1][1]
    held = np.array(scales)
    addresses = [data_address(a) for a in flat_buffers(arrays)]
    out = evict_and_fill_dropping(backend, arrays, config)
    got = [data_address(o) for o in flat_buffers(out)]
    assert got[4] != addresses[4]
    assert got[:4] + got[5:] == addresses[:4] + addresses[5:]
    assert np.array_equal(held, np.array(scales))
    for a, e in zip(flat_buffers(out), flat_buffers(expected)):
        assert_bitwise_equal(a[:, :28], e[:, :28], "payload")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize("budget", [31, 27])
def test_evict_and_fill_with_valid_ranges_on_donated_buffers_runs_in_place(backend, layout, budget):
    """A batch's step (docs/spec.md §4, valid ranges with padding on both
    sides, one head all padding) on donated buffers: every output is its
    input's buffer, and equals the fallback's."""
    arrays = evict_and_fill_state(n_heads=4, slots=32, layout=layout)
    valid = mx.array([[0, 2**31 - 1], [5, 2**31 - 1], [3, 20], [40, 50]], dtype=mx.int32)
    config = {**evict_and_fill_config(32, budget, layout), "valid": valid}
    expected = evict_and_fill_dropping("fallback", copies(arrays), config)
    addresses = [data_address(a) for a in arrays[:4]]
    out = evict_and_fill_dropping(backend, arrays, config)
    assert [data_address(o) for o in out] == addresses
    assert_evict_and_fill_equal(out, expected, budget + 1)


# The order tree (docs/spec.md §7): updated in place when the given tree is
# donated and C_out = C; a tree the caller holds is never written.


def order_tree_decode(backend, steps, hold):
    """A slot-layout cache's decode loop through the op, each step given the
    previous step's tree; the trees' data addresses, and the trees held when
    hold (each step's input kept alive), with copies taken before."""
    rng = np.random.default_rng(5)
    budget, dim = 16, 8
    config = dict(budget=budget, n_sink=1, recent=3, keep="low", layout="slots")
    prompt = fill(rng, (3, budget + 1, dim), "normal", "float16")
    tokens = [fill(rng, (3, 1, dim), "ties", "float16") for _ in range(steps)]
    with mlx_knorm.use_backend(backend):
        *state, tree = mlx_knorm.evict_and_fill(
            mx.zeros((3, 0, dim), mx.float16), mx.zeros((3, 0, dim), mx.float16),
            mx.zeros((3, 0), mx.float32), mx.zeros((3, 0), mx.int32), prompt, prompt,
            filled=0, offset=0, capacity=budget + 1, tree=True, **config)
        mx.eval(state, tree)
        addresses, held = [data_address(tree)], []
        for j, token in enumerate(tokens):
            if hold:
                held.append((tree, np.array(tree)))
            *state, tree = mlx_knorm.evict_and_fill(
                *state, token, token, filled=budget + 1, offset=budget + 1 + j,
                capacity=budget + 1, tree=tree, **config)
            mx.eval(state, tree)
            addresses.append(data_address(tree))
    return state, tree, addresses, held


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_evict_and_fill_order_tree_donated_is_updated_in_place(backend):
    steps = steps_for(backend)
    state, tree, addresses, _ = order_tree_decode(backend, steps, hold=False)
    assert len(set(addresses)) == 1, "every step wrote the donated tree"
    expected_state, expected_tree, _, _ = order_tree_decode("fallback", steps, hold=False)
    assert_bitwise_equal(tree, expected_tree, "tree")
    for a, e in zip(state, expected_state):
        assert_bitwise_equal(a, e, "rows")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_evict_and_fill_never_writes_a_held_order_tree(backend):
    _, tree, addresses, held = order_tree_decode(backend, steps_for(backend), hold=True)
    assert len(set(addresses)) == len(addresses), "a held tree is copied, never written"
    for given, before in held:
        assert np.array_equal(np.array(given), before)
    _, expected_tree, _, _ = order_tree_decode("fallback", steps_for(backend), hold=False)
    assert_bitwise_equal(tree, expected_tree, "tree")
