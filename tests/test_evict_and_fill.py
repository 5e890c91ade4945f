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

import mlx_knorm
from conftest import EMULATOR_SETTINGS, NATIVE_BACKENDS, assert_bitwise_equal, requires_emulator
from generators import fill, fill_norms, step_cases
from spec_oracle import step_sources

OUTPUTS = ("keys", "values", "norms", "positions")


def step_on(backend: str, arrays, config):
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.evict_and_fill(*arrays, **config)
        mx.eval(out)
        return out


def defined_slots(config, arrays) -> int:
    return min(config["filled"], config["budget"]) + arrays[4].shape[1]


def assert_same_step(actual, expected, arrays, config):
    """Same shapes and dtypes; the same bits on the defined slots."""
    defined = defined_slots(config, arrays)
    for name, a, e in zip(OUTPUTS, actual, expected):
        assert a.shape == e.shape, name
        assert_bitwise_equal(a[:, :defined], e[:, :defined], name)


def assert_matches_oracle(out, arrays, config):
    """Each kept output slot holds the input row docs/spec.md §4 puts there,
    and the new rows follow with their norms and positions."""
    keys, values, norms, positions, new_keys, new_values = arrays
    kept = min(config["filled"], config["budget"])
    n_new = new_keys.shape[1]
    spec = {k: config[k] for k in ("filled", "offset", "budget", "n_sink", "recent", "keep", "layout")}
    sources = mx.array(
        [step_sources(norms[n].tolist(), positions[n].tolist(), **spec) for n in range(keys.shape[0])],
        dtype=mx.int32,
    ).reshape(keys.shape[0], kept)
    for name, got, stored, new in zip(
        OUTPUTS, out, (keys, values, norms, positions),
        (new_keys, new_values, mlx_knorm.key_norms(new_keys),
         mx.broadcast_to(mx.arange(n_new, dtype=mx.int32) + config["offset"], new_keys.shape[:2])),
    ):
        index = sources.reshape(*sources.shape, *([1] * (stored.ndim - 2)))
        assert_bitwise_equal(got[:, :kept], mx.take_along_axis(stored, index, axis=1), name)
        assert_bitwise_equal(got[:, kept : kept + n_new], new, f"new {name}")


@given(case=step_cases())
def test_kernel_matches_fallback_on_cache_states(case):
    arrays, config = case
    assert_same_step(step_on("kernel", arrays, config), step_on("fallback", arrays, config), arrays, config)


@given(case=step_cases(cache_like=False))
def test_kernel_matches_fallback_on_any_state(case):
    arrays, config = case
    assert_same_step(step_on("kernel", arrays, config), step_on("fallback", arrays, config), arrays, config)


@given(case=step_cases(dims=[1, 3, 8]))
def test_kernel_matches_spec_oracle_on_cache_states(case):
    arrays, config = case
    assert_matches_oracle(step_on("kernel", arrays, config), *case)


@given(case=step_cases(cache_like=False, dims=[1, 3, 8]))
def test_kernel_matches_spec_oracle_on_any_state(case):
    arrays, config = case
    assert_matches_oracle(step_on("kernel", arrays, config), *case)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=step_cases(max_heads=2, dims=[1, 3, 8, 33, 80, 128, 256], long_rows=True))
def test_metal_emulator_matches_fallback_on_cache_states(case):
    arrays, config = case
    assert_same_step(step_on("metal-emulator", arrays, config), step_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=step_cases(cache_like=False, max_heads=2, max_new=34, dims=[1, 3, 8, 33, 80], long_rows=True))
def test_metal_emulator_matches_fallback_on_any_state(case):
    arrays, config = case
    assert_same_step(step_on("metal-emulator", arrays, config), step_on("fallback", arrays, config), arrays, config)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=step_cases(cache_like=False, max_heads=2, dims=[1, 3]))
def test_metal_emulator_matches_spec_oracle(case):
    arrays, config = case
    assert_matches_oracle(step_on("metal-emulator", arrays, config), *case)


@given(case=step_cases(cache_like=False, max_budget=6, dims=[2]))
def test_fallback_matches_spec_oracle(case):
    arrays, config = case
    assert_matches_oracle(step_on("fallback", arrays, config), *case)


def slot_state(n_heads=2, slots=12, dim=4, seed=0, positions=None, norms=None):
    rng = np.random.default_rng(seed)
    if positions is None:
        positions = np.stack([rng.permutation(slots) for _ in range(n_heads)]).astype(np.int32)
    return (
        fill(rng, (n_heads, slots, dim), "normal", "float16"),
        fill(rng, (n_heads, slots, dim), "normal", "bfloat16"),
        fill_norms(rng, (n_heads, slots), "normal") if norms is None else norms,
        mx.array(positions),
        fill(rng, (n_heads, 1, dim), "normal", "float16"),
        fill(rng, (n_heads, 1, dim), "normal", "bfloat16"),
    )


def config_for(**change):
    return {**dict(filled=12, offset=12, capacity=12, budget=11, n_sink=1, recent=2, keep="low", layout="slots"),
            **change}


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_decode_moves_the_spare_row_into_the_hole(backend):
    """Slots hold positions 0..11 in order; position 5 has the worst norm:
    slot 11 (the spare slot) moves into slot 5, the new row goes to slot 11."""
    norms = mx.array([[1.0] * 12])
    norms[0, 5] = 9.0
    arrays = slot_state(n_heads=1, positions=np.arange(12, dtype=np.int32)[None], norms=norms)
    out = step_on(backend, arrays, config_for())
    assert out[3][0].tolist() == [0, 1, 2, 3, 4, 11, 6, 7, 8, 9, 10, 12]
    temporal = step_on(backend, arrays, config_for(layout="temporal"))
    assert temporal[3][0].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_decode_evicting_the_spare_row_moves_nothing(backend):
    norms = mx.array([[1.0] * 11 + [9.0]])
    arrays = slot_state(n_heads=1, positions=np.arange(12, dtype=np.int32)[None], norms=norms)
    out = step_on(backend, arrays, config_for(recent=0))
    assert out[3][0].tolist() == list(range(11)) + [12]
    assert_bitwise_equal(out[0][:, :11], arrays[0][:, :11], "keys")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_nan_and_inf_never_evict_protected_rows(backend):
    nan, inf = math.nan, math.inf
    norms = mx.array([[nan, inf, 1.0, nan, 0.5, -inf, 2.0, nan]], dtype=mx.float32)
    arrays = slot_state(n_heads=1, slots=8, positions=np.arange(8, dtype=np.int32)[None], norms=norms)
    for keep, kept in (("low", [0, 1, 4, 5, 7]), ("high", [0, 1, 2, 6, 7])):
        config = config_for(filled=8, offset=8, capacity=6, budget=5, n_sink=2, recent=1, keep=keep, layout="temporal")
        assert step_on(backend, arrays, config)[3][0, :5].tolist() == kept


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_equal_positions_tie_by_slot(backend):
    """Only reachable by passing such buffers: equal ranks keep the lower slot."""
    positions = np.array([[3, 3, 3, 3, 3, 3]], dtype=np.int32)
    arrays = slot_state(n_heads=1, slots=6, positions=positions, norms=mx.zeros((1, 6)))
    out = step_on(backend, arrays, config_for(filled=6, offset=6, capacity=6, budget=5, n_sink=0, recent=0))
    assert_bitwise_equal(out[0][:, :5], arrays[0][:, :5], "keys")
    general = step_on(backend, arrays, config_for(filled=6, offset=6, capacity=6, budget=3, n_sink=0, recent=0))
    assert_bitwise_equal(general[0][:, :3], arrays[0][:, :3], "keys")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_empty_steps(backend):
    arrays = slot_state(slots=0)
    arrays = (*arrays[:4], arrays[4][:, :0], arrays[5][:, :0])
    out = step_on(backend, arrays, config_for(filled=0, offset=0, capacity=0))
    assert [o.shape for o in out] == [(2, 0, 4), (2, 0, 4), (2, 0), (2, 0)]
    assert [o.dtype for o in out] == [mx.float16, mx.bfloat16, mx.float32, mx.int32]
    grown = step_on(backend, slot_state(slots=3), config_for(filled=0, offset=7, capacity=5))
    assert grown[3][:, :1].tolist() == [[7], [7]]


@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_large_steps_use_several_threads_and_agree(layout):
    """Heads split over threads above the size threshold; a decode step, a
    prefill chunk with many pending evictions, and more rows than budget."""
    rng = np.random.default_rng(7)
    n_heads, slots, dim = 32, 4096 + 257, 128
    positions = np.stack([rng.permutation(slots) for _ in range(n_heads)]).astype(np.int32)
    if layout == "temporal":
        positions.sort(axis=1)
    arrays = (
        fill(rng, (n_heads, slots, dim), "normal", "float16"),
        fill(rng, (n_heads, slots, dim), "normal", "float16"),
        fill_norms(rng, (n_heads, slots), "ties"),
        mx.array(positions),
        fill(rng, (n_heads, 3, dim), "normal", "float16"),
        fill(rng, (n_heads, 3, dim), "normal", "float16"),
    )
    for filled, budget in ((4097, 4096), (slots, 4096), (slots, 1000)):
        config = config_for(filled=filled, offset=slots, capacity=slots + 3, budget=budget, n_sink=4, recent=16,
                            layout=layout)
        assert_same_step(step_on("kernel", arrays, config), step_on("fallback", arrays, config), arrays, config)


def test_non_contiguous_inputs():
    arrays = slot_state(n_heads=4, slots=12, dim=8, seed=3)
    strided = tuple(a[::2] for a in arrays)
    copies = tuple(mx.contiguous(a) for a in strided)
    config = config_for(filled=10, budget=8, capacity=11)
    assert_same_step(step_on("kernel", strided, config), step_on("fallback", copies, config), copies, config)


def test_inside_compile():
    arrays = slot_state(seed=4)
    config = config_for(filled=12, budget=9, capacity=10, layout="temporal")
    compiled = mx.compile(lambda *a: mlx_knorm.evict_and_fill(*a, **config))
    assert_same_step(compiled(*arrays), step_on("kernel", arrays, config), arrays, config)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_heads_on_several_axes_step_as_one(backend):
    """[B, H, C, D] buffers, as a model's cache holds them, give the [B*H, C, D]
    step's bits in the same shape."""
    arrays = slot_state(n_heads=6, slots=12, dim=8, seed=9)
    config = config_for(filled=12, budget=9, capacity=13)
    flat = step_on(backend, arrays, config)
    by_batch = step_on(backend, tuple(a.reshape(2, 3, *a.shape[1:]) for a in arrays), config)
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
