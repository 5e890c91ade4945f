"""EvictAndFill: docs/spec.md §4 on every backend, bit for bit on the
defined slots ``[0, kept + S)``. ``kernel`` runs on the default device: the
Metal kernel where the suite runs on the GPU (the macOS workflow). In-place
updates are tested in test_in_place.py."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import EMULATOR_SETTINGS, NATIVE_BACKENDS, assert_bitwise_equal, requires_emulator
from generators import evict_and_fill_arrays, evict_and_fill_cases, fill, fill_bits, fill_norms
from spec_oracle import evict_and_fill_sources

OUTPUTS = ("keys", "values", "norms", "positions")


def flat_rows(x) -> list[mx.array]:
    """keys, values, new_keys or new_values as a list of payload arrays."""
    return list(x) if isinstance(x, tuple) else [x]


def flat_outputs(out) -> list[tuple[str, mx.array]]:
    """evict_and_fill's outputs (keys, values, norms, positions), payload by payload,
    with their names."""
    named = []
    for name, x in zip(OUTPUTS, out):
        rows = flat_rows(x)
        named += [(name if len(rows) == 1 and not isinstance(x, tuple) else f"{name}[{i}]", r)
                  for i, r in enumerate(rows)]
    return named


def n_new_of(arrays) -> int:
    return flat_rows(arrays[4])[0].shape[-2]


def evict_and_fill_on(backend: str, arrays, config):
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.evict_and_fill(*arrays, **config)
        mx.eval(out)
        return out


def defined_slots(config, arrays) -> int:
    return min(config["filled"], config["budget"]) + n_new_of(arrays)


def assert_same_outputs(actual, expected, arrays, config):
    """Same structure, shapes and dtypes; the same bits on the defined slots."""
    defined = defined_slots(config, arrays)
    for a, e in zip(actual[:2], expected[:2]):
        assert type(a) is type(e)
    for (name, a), (_, e) in zip(flat_outputs(actual), flat_outputs(expected), strict=True):
        assert a.shape == e.shape, name
        assert_bitwise_equal(a[:, :defined], e[:, :defined], name)


def assert_matches_oracle(out, arrays, config):
    """Each kept output slot holds the input row docs/spec.md §4 puts there,
    and the new rows follow with their norms (given or computed) and
    positions. The outputs keep the inputs' structure."""
    keys, values, norms, positions, new_keys, new_values = arrays
    kept = min(config["filled"], config["budget"])
    n_new = n_new_of(arrays)
    n_heads = norms.shape[0]
    spec = {k: config[k] for k in ("filled", "offset", "budget", "n_sink", "recent", "keep", "layout")}
    valid = config.get("valid")
    sources = mx.array(
        [evict_and_fill_sources(norms[n].tolist(), positions[n].tolist(), **spec,
                      valid=None if valid is None else tuple(valid[n].tolist()))
         for n in range(n_heads)],
        dtype=mx.int32,
    ).reshape(n_heads, kept)
    new_norms = config.get("new_norms")
    if new_norms is None:
        new_norms = mlx_knorm.key_norms(new_keys)
    new_positions = mx.broadcast_to(mx.arange(n_new, dtype=mx.int32) + config["offset"], (n_heads, n_new))
    assert isinstance(out[0], tuple) == isinstance(keys, tuple)
    assert isinstance(out[1], tuple) == isinstance(values, tuple)
    stored = [*flat_rows(keys), *flat_rows(values), norms, positions]
    new = [*flat_rows(new_keys), *flat_rows(new_values), new_norms, new_positions]
    for (name, got), s, n in zip(flat_outputs(out), stored, new, strict=True):
        index = sources.reshape(*sources.shape, *([1] * (s.ndim - 2)))
        assert_bitwise_equal(got[:, :kept], mx.take_along_axis(s, index, axis=1), name)
        assert_bitwise_equal(got[:, kept : kept + n_new], n, f"new {name}")


@given(case=evict_and_fill_cases())
def test_evict_and_fill_kernel_matches_fallback_on_cache_states(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@given(case=evict_and_fill_cases(cache_like=False))
def test_evict_and_fill_kernel_matches_fallback_on_any_state(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@given(case=evict_and_fill_cases(dims=[1, 3, 8]))
def test_evict_and_fill_kernel_matches_spec_oracle_on_cache_states(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("kernel", arrays, config), *case)


@given(case=evict_and_fill_cases(cache_like=False, dims=[1, 3, 8]))
def test_evict_and_fill_kernel_matches_spec_oracle_on_any_state(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("kernel", arrays, config), *case)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(max_heads=2, dims=[1, 3, 8, 33, 80, 128, 256], long_rows=True))
def test_evict_and_fill_metal_emulator_matches_fallback_on_cache_states(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("metal-emulator", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(cache_like=False, max_heads=2, max_new=34, dims=[1, 3, 8, 33, 80], long_rows=True))
def test_evict_and_fill_metal_emulator_matches_fallback_on_any_state(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("metal-emulator", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(cache_like=False, max_heads=2, dims=[1, 3]))
def test_evict_and_fill_metal_emulator_matches_spec_oracle(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("metal-emulator", arrays, config), *case)


@given(case=evict_and_fill_cases(cache_like=False, max_budget=6, dims=[2]))
def test_evict_and_fill_fallback_matches_spec_oracle(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("fallback", arrays, config), *case)


# Payloads of any dtype and structure, given norms, valid ranges
# (docs/spec.md §4-§5): the same cross-checks.


@given(case=evict_and_fill_cases(payloads=True, dims=[0, 1, 3, 8, 33]))
def test_evict_and_fill_kernel_matches_fallback_on_payloads(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@given(case=evict_and_fill_cases(ranges=True))
def test_evict_and_fill_kernel_matches_fallback_on_batch_states(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@given(case=evict_and_fill_cases(cache_like=False, payloads=True, ranges=True, dims=[0, 1, 3, 8]))
def test_evict_and_fill_kernel_matches_fallback_on_any_payloads_and_ranges(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@given(case=evict_and_fill_cases(payloads=True, ranges=True, dims=[1, 3, 8]))
def test_evict_and_fill_kernel_matches_spec_oracle_on_payloads_and_batch_states(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("kernel", arrays, config), *case)


@given(case=evict_and_fill_cases(cache_like=False, payloads=True, ranges=True, dims=[1, 3]))
def test_evict_and_fill_kernel_matches_spec_oracle_on_any_payloads_and_ranges(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("kernel", arrays, config), *case)


@given(case=evict_and_fill_cases(cache_like=False, max_budget=6, payloads=True, ranges=True, dims=[2]))
def test_evict_and_fill_fallback_matches_spec_oracle_on_payloads_and_ranges(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("fallback", arrays, config), *case)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(max_heads=2, dims=[0, 1, 3, 8, 33], long_rows=True, payloads=True, ranges=True))
def test_evict_and_fill_metal_emulator_matches_fallback_on_payloads_and_batch_states(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("metal-emulator", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(cache_like=False, max_heads=2, max_new=34, dims=[0, 1, 3, 8], long_rows=True,
                       payloads=True, ranges=True))
def test_evict_and_fill_metal_emulator_matches_fallback_on_any_payloads_and_ranges(case):
    arrays, config = case
    assert_same_outputs(evict_and_fill_on("metal-emulator", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=evict_and_fill_cases(cache_like=False, max_heads=2, dims=[1, 3], payloads=True, ranges=True))
def test_evict_and_fill_metal_emulator_matches_spec_oracle_on_payloads_and_ranges(case):
    arrays, config = case
    assert_matches_oracle(evict_and_fill_on("metal-emulator", arrays, config), *case)


# The hand-written states' keys and values; their positions, unless given,
# are drawn first.
STATE_DTYPES = ("float16", "bfloat16")


def config_for(**change):
    return {**dict(filled=12, offset=12, capacity=12, budget=11, n_sink=1, recent=2, keep="low", layout="slots"),
            **change}


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_decode_moves_the_spare_row_into_the_hole(backend):
    """Slots hold positions 0..11 in order; position 5 has the worst norm:
    slot 11 (the spare slot) moves into slot 5, the new row goes to slot 11."""
    norms = mx.array([[1.0] * 12])
    norms[0, 5] = 9.0
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=1, slots=12, n_new=1,
                                   key_dim=4, positions=np.arange(12, dtype=np.int32)[None], norms=norms,
                                   dtypes=STATE_DTYPES)
    out = evict_and_fill_on(backend, arrays, config_for())
    assert out[3][0].tolist() == [0, 1, 2, 3, 4, 11, 6, 7, 8, 9, 10, 12]
    temporal = evict_and_fill_on(backend, arrays, config_for(layout="temporal"))
    assert temporal[3][0].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_decode_evicting_the_spare_row_moves_nothing(backend):
    norms = mx.array([[1.0] * 11 + [9.0]])
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=1, slots=12, n_new=1,
                                   key_dim=4, positions=np.arange(12, dtype=np.int32)[None], norms=norms,
                                   dtypes=STATE_DTYPES)
    out = evict_and_fill_on(backend, arrays, config_for(recent=0))
    assert out[3][0].tolist() == list(range(11)) + [12]
    assert_bitwise_equal(out[0][:, :11], arrays[0][:, :11], "keys")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_nan_and_inf_never_evict_protected_rows(backend):
    nan, inf = math.nan, math.inf
    norms = mx.array([[nan, inf, 1.0, nan, 0.5, -inf, 2.0, nan]], dtype=mx.float32)
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=1, slots=8, n_new=1,
                                   key_dim=4, positions=np.arange(8, dtype=np.int32)[None], norms=norms,
                                   dtypes=STATE_DTYPES)
    for keep, kept in (("low", [0, 1, 4, 5, 7]), ("high", [0, 1, 2, 6, 7])):
        config = config_for(filled=8, offset=8, capacity=6, budget=5, n_sink=2, recent=1, keep=keep, layout="temporal")
        assert evict_and_fill_on(backend, arrays, config)[3][0, :5].tolist() == kept


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_equal_positions_tie_by_slot(backend):
    """Only reachable by passing such buffers: equal ranks keep the lower slot."""
    positions = np.array([[3, 3, 3, 3, 3, 3]], dtype=np.int32)
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=1, slots=6, n_new=1,
                                   key_dim=4, positions=positions, norms=mx.zeros((1, 6)), dtypes=STATE_DTYPES)
    out = evict_and_fill_on(backend, arrays, config_for(filled=6, offset=6, capacity=6, budget=5, n_sink=0, recent=0))
    assert_bitwise_equal(out[0][:, :5], arrays[0][:, :5], "keys")
    general = evict_and_fill_on(backend, arrays, config_for(filled=6, offset=6, capacity=6, budget=3, n_sink=0, recent=0))
    assert_bitwise_equal(general[0][:, :3], arrays[0][:, :3], "keys")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_empty_blocks_and_buffers(backend):
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=2, slots=0, n_new=1,
                                   key_dim=4, positions_first=True, dtypes=STATE_DTYPES)
    arrays = (*arrays[:4], arrays[4][:, :0], arrays[5][:, :0])
    out = evict_and_fill_on(backend, arrays, config_for(filled=0, offset=0, capacity=0))
    assert [o.shape for o in out] == [(2, 0, 4), (2, 0, 4), (2, 0), (2, 0)]
    assert [o.dtype for o in out] == [mx.float16, mx.bfloat16, mx.float32, mx.int32]
    small = evict_and_fill_arrays(np.random.default_rng(0), n_heads=2, slots=3, n_new=1, key_dim=4,
                                  positions_first=True, dtypes=STATE_DTYPES)
    grown = evict_and_fill_on(backend, small, config_for(filled=0, offset=7, capacity=5))
    assert grown[3][:, :1].tolist() == [[7], [7]]


@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_evict_and_fill_large_calls_use_several_threads_and_agree(layout):
    """Heads split over threads above the size threshold; a decode step, a
    prefill chunk with many pending evictions, and more rows than budget."""
    n_heads, slots, dim = 32, 4096 + 257, 128
    arrays = evict_and_fill_arrays(np.random.default_rng(7), n_heads, slots, 3, dim, layout=layout,
                                   norm_palette="ties", dtypes=("float16", "float16"), positions_first=True)
    for filled, budget in ((4097, 4096), (slots, 4096), (slots, 1000)):
        config = config_for(filled=filled, offset=slots, capacity=slots + 3, budget=budget, n_sink=4, recent=16,
                            layout=layout)
        assert_same_outputs(evict_and_fill_on("kernel", arrays, config), evict_and_fill_on("fallback", arrays, config), arrays, config)


def test_evict_and_fill_non_contiguous_inputs():
    arrays = evict_and_fill_arrays(np.random.default_rng(3), n_heads=4, slots=12, n_new=1,
                                   key_dim=8, positions_first=True, dtypes=STATE_DTYPES)
    strided = tuple(a[::2] for a in arrays)
    copies = tuple(mx.contiguous(a) for a in strided)
    config = config_for(filled=10, budget=8, capacity=11)
    assert_same_outputs(evict_and_fill_on("kernel", strided, config), evict_and_fill_on("fallback", copies, config), copies, config)


def test_evict_and_fill_inside_compile():
    arrays = evict_and_fill_arrays(np.random.default_rng(4), n_heads=2, slots=12, n_new=1,
                                   key_dim=4, positions_first=True, dtypes=STATE_DTYPES)
    config = config_for(filled=12, budget=9, capacity=10, layout="temporal")
    compiled = mx.compile(lambda *a: mlx_knorm.evict_and_fill(*a, **config))
    assert_same_outputs(compiled(*arrays), evict_and_fill_on("kernel", arrays, config), arrays, config)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_heads_on_several_axes_act_as_one(backend):
    """[B, H, C, D] buffers, as a model's cache holds them, give the [B*H, C, D]
    call's bits in the same shape."""
    arrays = evict_and_fill_arrays(np.random.default_rng(9), n_heads=6, slots=12, n_new=1,
                                   key_dim=8, positions_first=True, dtypes=STATE_DTYPES)
    config = config_for(filled=12, budget=9, capacity=13)
    flat = evict_and_fill_on(backend, arrays, config)
    by_batch = evict_and_fill_on(backend, tuple(a.reshape(2, 3, *a.shape[1:]) for a in arrays), config)
    assert [o.shape for o in by_batch] == [(2, 3, *o.shape[1:]) for o in flat]
    defined = defined_slots(config, arrays)
    for name, a, b in zip(OUTPUTS, by_batch, flat):
        assert_bitwise_equal(a.reshape(b.shape)[:, :defined], b[:, :defined], name)
    by_batch_inputs = [a.reshape(2, 3, *a.shape[1:]) for a in arrays]
    with mlx_knorm.use_backend(backend):
        with pytest.raises(ValueError, match="values must have rank 4"):
            mlx_knorm.evict_and_fill(by_batch_inputs[0], *arrays[1:], **config)
        swapped = arrays[1].reshape(3, 2, *arrays[1].shape[1:])
        with pytest.raises(ValueError, match="keys/values mismatch in N or rows"):
            mlx_knorm.evict_and_fill(by_batch_inputs[0], swapped, *by_batch_inputs[2:], **config)


# A batch keeps what each sequence keeps alone (docs/spec.md §4): heads of
# one batch with their own valid ranges, stepped block by block on one
# timeline, against each sequence's real tokens stepped alone.

INT32_MAX = 2**31 - 1


@st.composite
def batch_streams(draw, max_sequences=4, max_budget=12):
    """Sequences of a batch: each one's left padding (lo) and, now and then,
    an end (hi: it finished early), blocks of new rows (a prompt in chunks,
    then decode steps), and the step's configuration."""
    budget = draw(st.integers(1, max_budget))
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - 1 - n_sink))
    blocks = draw(st.lists(st.integers(0, 2 * budget), min_size=1, max_size=3))
    blocks += [1] * draw(st.integers(1, 2 * budget + 4))
    total = sum(blocks)
    n_sequences = draw(st.integers(1, max_sequences))
    ranges = []
    for _ in range(n_sequences):
        lo = draw(st.integers(0, max(0, total - 1)))
        hi = draw(st.one_of(st.just(INT32_MAX), st.integers(lo, total)))
        ranges.append((lo, hi))
    config = dict(budget=budget, n_sink=n_sink, recent=recent,
                  keep=draw(st.sampled_from(["low", "high"])),
                  layout=draw(st.sampled_from(["slots", "temporal"])))
    palette = draw(st.sampled_from(["normal", "ties", "special"]))
    return ranges, blocks, config, palette, draw(st.integers(0, 2**32 - 1))


def real_rows(out, n, filled, lo, hi):
    """Head n's real rows among slots [0, filled) of evict_and_fill's outputs, by
    position, as (position - lo, key bits, value bits, norm bits), and
    whether they sit in temporal order."""
    keys, values, norms, positions = (np.array(x[n, :filled].view(mx.uint8) if x.dtype != mx.int32 else x[n, :filled])
                                      for x in out)
    rows = []
    for s, p in enumerate(positions.tolist()):
        if lo <= p < hi:
            rows.append((p - lo, keys[s].tobytes(), values[s].tobytes(), norms[s * 4 : s * 4 + 4].tobytes()))
    in_order = all(a[0] < b[0] for a, b in zip(rows, rows[1:]))
    return sorted(rows), in_order


def empty_buffers(n_heads, dim):
    return [mx.zeros((n_heads, 0, dim), mx.float16), mx.zeros((n_heads, 0, dim), mx.float16),
            mx.zeros((n_heads, 0), mx.float32), mx.zeros((n_heads, 0), mx.int32)]


def check_batch_against_sequences(backend, case):
    ranges, blocks, config, palette, seed = case
    rng = np.random.default_rng(seed)
    n_sequences, dim, total = len(ranges), 4, sum(blocks)
    keys = fill(rng, (n_sequences, total, dim), palette, "float16")
    values = fill(rng, (n_sequences, total, dim), "normal", "float16")
    valid = mx.array(ranges, dtype=mx.int32)
    batch = empty_buffers(n_sequences, dim)
    alone = [empty_buffers(1, dim) for _ in ranges]
    alone_filled = [0] * n_sequences
    filled = offset = 0
    with mlx_knorm.use_backend(backend):
        for n_new in blocks:
            kept = min(filled, config["budget"])
            batch = mlx_knorm.evict_and_fill(
                *batch, keys[:, offset : offset + n_new], values[:, offset : offset + n_new],
                filled=filled, offset=offset, capacity=kept + n_new, valid=valid, **config)
            filled = kept + n_new
            for b, (lo, hi) in enumerate(ranges):
                # The block's real rows, as the sequence alone sees them.
                start, stop = min(max(offset, lo), hi), min(max(offset + n_new, lo), hi)
                kept_alone = min(alone_filled[b], config["budget"])
                alone[b] = mlx_knorm.evict_and_fill(
                    *alone[b], keys[b : b + 1, start:stop], values[b : b + 1, start:stop],
                    filled=alone_filled[b], offset=start - lo, capacity=kept_alone + stop - start,
                    **config)
                alone_filled[b] = kept_alone + stop - start
            offset += n_new
            mx.eval(batch, alone)
            for b, (lo, hi) in enumerate(ranges):
                got, in_order = real_rows(batch, b, filled, lo, hi)
                expected, _ = real_rows(alone[b], 0, alone_filled[b], 0, INT32_MAX)
                assert got == expected, f"sequence {b} after position {offset}"
                if config["layout"] == "temporal":
                    assert in_order


@given(case=batch_streams())
def test_evict_and_fill_each_sequence_of_a_batch_keeps_what_it_keeps_alone(case):
    check_batch_against_sequences("kernel", case)


@given(case=batch_streams())
def test_evict_and_fill_each_sequence_of_a_batch_keeps_what_it_keeps_alone_fallback(case):
    check_batch_against_sequences("fallback", case)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=batch_streams(max_sequences=3, max_budget=6))
def test_evict_and_fill_each_sequence_of_a_batch_keeps_what_it_keeps_alone_metal_emulator(case):
    check_batch_against_sequences("metal-emulator", case)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_padding_never_outranks_a_real_row(backend):
    """Padding with the best norms (0), real rows with NaN and infinite
    ones: every real row is kept first, padding fills the rest by position,
    and padding below lo + n_sink or in the window is no sink and no recent
    row."""
    nan, inf = math.nan, math.inf
    # Positions 0..7: head 0's tokens are [3, 6) (left and right padding),
    # head 1's [5, 2**31 - 1).
    norms = mx.array([[0.0, 0.0, 0.0, nan, inf, 1.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, nan, 2.0, 1.0]], dtype=mx.float32)
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=2, slots=8, n_new=1,
                                   key_dim=4, positions=np.tile(np.arange(8, dtype=np.int32), (2, 1)), norms=norms,
                                   dtypes=STATE_DTYPES)
    valid = mx.array([[3, 6], [5, INT32_MAX]], dtype=mx.int32)
    config = config_for(filled=8, offset=8, capacity=5, budget=4, n_sink=1, recent=1, layout="temporal",
                        valid=valid)
    out = evict_and_fill_on(backend, arrays, config)
    # Head 0: its three tokens (sink 3, recent 5, the infinite 4), then the
    # first padding row by position; head 1: its three tokens (sink 5,
    # recent 7, then 6), then the first padding row.
    assert out[3][:, :4].tolist() == [[0, 3, 4, 5], [0, 5, 6, 7]]
    # No valid range: the same buffers keep the best norms.
    plain = evict_and_fill_on(backend, arrays, config_for(filled=8, offset=8, capacity=5, budget=4, n_sink=1, recent=1,
                                                layout="temporal"))
    assert plain[3][:, :4].tolist() == [[0, 1, 2, 7], [0, 1, 2, 7]]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_empty_and_extreme_ranges(backend):
    """lo >= hi: every row padding (kept by position); the whole int32
    range: every row real, the sinks counted from -2**31."""
    norms = mx.array([[5.0, 1.0, 4.0, 2.0, 3.0, 0.5]] * 2, dtype=mx.float32)
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=2, slots=6, n_new=1,
                                   key_dim=4, positions=np.tile(np.array([[4, 2, 0, 5, 1, 3]], np.int32), (2, 1)),
                                   norms=norms, dtypes=STATE_DTYPES)
    valid = mx.array([[3, 3], [-(2**31), INT32_MAX]], dtype=mx.int32)
    out = evict_and_fill_on(backend, arrays, config_for(filled=6, offset=6, capacity=4, budget=3, n_sink=1, recent=0,
                                               layout="temporal", valid=valid))
    # Head 0: positions 0, 1, 2 by position. Head 1: n_sink counts from
    # -2**31, so no sink among 0..5: the three best norms (0.5, 1, 2).
    assert out[3][:, :3].tolist() == [[2, 0, 1], [2, 5, 3]]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_quantized_payloads_keep_the_float_rows(backend):
    """A quantized cache's step: keys and values as mx.quantize's (packed,
    scales, biases), the norms taken from the float keys before quantizing.
    The kept positions are the float step's, and each stored row is its
    quantized bits, moved untouched."""
    rng = np.random.default_rng(11)
    n_heads, slots, dim = 3, 40, 64
    float_keys = fill(rng, (n_heads, slots + 1, dim), "normal", "float16")
    float_values = fill(rng, (n_heads, slots + 1, dim), "normal", "float16")
    positions = mx.array(np.stack([rng.permutation(slots) for _ in range(n_heads)]).astype(np.int32))
    norms = mlx_knorm.key_norms(float_keys[:, :slots])
    config = config_for(filled=slots, offset=slots, capacity=slots, budget=31, n_sink=2, recent=3)

    def quantized(x):
        return tuple(mx.quantize(x, group_size=32, bits=4))

    float_out = evict_and_fill_on(backend, (float_keys[:, :slots], float_values[:, :slots], norms, positions,
                                  float_keys[:, slots:], float_values[:, slots:]), config)
    arrays = (quantized(float_keys[:, :slots]), quantized(float_values[:, :slots]), norms, positions,
              quantized(float_keys[:, slots:]), quantized(float_values[:, slots:]))
    out = evict_and_fill_on(backend, arrays, {**config, "new_norms": mlx_knorm.key_norms(float_keys[:, slots:])})
    assert isinstance(out[0], tuple) and len(out[0]) == 3 and isinstance(out[1], tuple)
    defined = 32
    assert_bitwise_equal(out[3][:, :defined], float_out[3][:, :defined], "positions")
    assert_bitwise_equal(out[2][:, :defined], float_out[2][:, :defined], "norms")
    for got, float_rows in ((out[0], float_out[0]), (out[1], float_out[1])):
        expected = quantized(float_rows[:, :defined])
        for g, e in zip(got, expected, strict=True):
            assert_bitwise_equal(g[:, :defined], e, "quantized rows")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_given_norms_are_stored_as_given(backend):
    """new_norms, NaN payloads, -0 and infinities included, land bit for bit;
    the keys' own norms are not taken."""
    arrays = evict_and_fill_arrays(np.random.default_rng(0), n_heads=2, slots=12, n_new=1,
                                   key_dim=4, positions_first=True, dtypes=STATE_DTYPES)
    nan_payload = np.array([0x7FC00001, 0xFFC00000], dtype=np.uint32).view(np.float32)
    new_norms = mx.array(np.array([[nan_payload[0]], [-0.0]], dtype=np.float32))
    out = evict_and_fill_on(backend, arrays, config_for(new_norms=new_norms))
    assert_bitwise_equal(out[2][:, 11:12], new_norms, "norms")
    bits = np.array(out[2][:, 11]).view(np.uint32)
    assert bits.tolist() == [0x7FC00001, 0x80000000]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_six_payloads_of_every_width_and_none_of_width_zero(backend):
    """The most payloads one call takes, of 1, 2, 4 and 8-byte elements, odd
    widths and a width of 0, through a decode step and a step evicting
    several rows, in both layouts: the oracle's rows."""
    rng = np.random.default_rng(3)
    dtypes = [mx.bool_, mx.uint8, mx.int16, mx.bfloat16, mx.complex64, mx.uint32]
    widths = [3, 5, 1, 7, 2, 0]
    slots = 12
    positions = mx.array(np.stack([rng.permutation(slots) for _ in range(2)]).astype(np.int32))
    keys = tuple(fill_bits(rng, (2, slots, w), d) for d, w in zip(dtypes[:4], widths[:4]))
    values = tuple(fill_bits(rng, (2, slots, w), d) for d, w in zip(dtypes[4:], widths[4:]))
    new_keys = tuple(fill_bits(rng, (2, 2, w), d) for d, w in zip(dtypes[:4], widths[:4]))
    new_values = tuple(fill_bits(rng, (2, 2, w), d) for d, w in zip(dtypes[4:], widths[4:]))
    arrays = (keys, values, fill_norms(rng, (2, slots), "ties"), positions, new_keys, new_values)
    for budget, layout in ((11, "slots"), (11, "temporal"), (7, "slots"), (7, "temporal")):
        config = config_for(budget=budget, capacity=budget + 2, layout=layout,
                            new_norms=fill_norms(rng, (2, 2), "special"))
        assert_matches_oracle(evict_and_fill_on(backend, arrays, config), arrays, config)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_evict_and_fill_inputs_that_are_views_of_one_buffer(backend):
    """new_norms and new_keys sliced from the stored norms and keys: views
    that start where those start, of other sizes. Every backend reads them
    as the arrays they are."""
    rng = np.random.default_rng(5)
    keys, values = fill(rng, (1, 4, 8), "normal", "float32"), fill(rng, (1, 4, 8), "normal", "float32")
    norms = mx.array([[0.5, 3.0, 1.0, 2.0]])
    positions = mx.array([[0, 1, 2, 3]], mx.int32)
    config = dict(filled=4, offset=4, capacity=4, budget=3, n_sink=0, recent=0, keep="low")
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.evict_and_fill(keys, values, norms, positions, keys[:, :1], values[:, :1],
                                       new_norms=norms[:, :1], **config)
        mx.eval(out)
    with mlx_knorm.use_backend("fallback"):
        want = mlx_knorm.evict_and_fill(keys, values, norms, positions, mx.array(keys[:, :1]),
                                        mx.array(values[:, :1]), new_norms=mx.array([[0.5]]), **config)
    for name, got, expected in zip(OUTPUTS, out, want):
        assert_bitwise_equal(got, expected, name)
    assert out[2].tolist() == [[0.5, 2.0, 1.0, 0.5]]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
@pytest.mark.parametrize("field", ["valid", "new_norms", "norms"])
def test_evict_and_fill_unchecked_names_an_argument_that_is_no_array(backend, field):
    """The cache's entry point skips the op's checks but not this one: a
    list where an array belongs is a TypeError naming it on every backend."""
    from mlx_knorm.ops.evict_and_fill import evict_and_fill_unchecked

    arrays = dict(keys=mx.zeros((2, 5, 4)), values=mx.zeros((2, 5, 3)), norms=mx.zeros((2, 5)),
                  positions=mx.zeros((2, 5), mx.int32), new_keys=mx.zeros((2, 1, 4)),
                  new_values=mx.zeros((2, 1, 3)))
    extra = {}
    if field == "norms":
        arrays["norms"] = [[0.0] * 5] * 2
    else:
        extra[field] = [[0, 9], [0, 9]]
        if field == "valid":
            extra["new_norms"] = mx.zeros((2, 1))
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match=f"'?{field}'? must be an mlx.core.array"):
        evict_and_fill_unchecked(*arrays.values(), filled=5, offset=5, capacity=6, budget=4, n_sink=1,
                                 recent=1, keep="low", **extra)
