"""ProtectedTopKGather: docs/spec.md §3 on every backend, bit for bit."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given

import mlx_knorm
from conftest import EMULATOR_SETTINGS, NATIVE_BACKENDS, assert_bitwise_equal, data_address, requires_emulator
from generators import protected_topk_gather_arrays, protected_topk_gather_cases
from spec_oracle import kept_rows


def gather_on(backend: str, arrays, config):
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.protected_topk_gather(*arrays, *config)
        mx.eval(out)
        return out


def assert_same_outputs(actual, expected):
    for name, a, e in zip(("keys", "values", "norms", "indices"), actual, expected):
        assert_bitwise_equal(a, e, name)


@given(case=protected_topk_gather_cases())
def test_protected_topk_gather_kernel_matches_fallback(case):
    arrays, config = case
    assert_same_outputs(gather_on("kernel", arrays, config), gather_on("fallback", arrays, config))


@requires_emulator
@EMULATOR_SETTINGS
@given(case=protected_topk_gather_cases(max_rows=2, max_new=34, dims=[1, 3, 8, 33, 80, 128, 256], long_rows=True))
def test_protected_topk_gather_metal_emulator_matches_fallback(case):
    arrays, config = case
    assert_same_outputs(
        gather_on("metal-emulator", arrays, config), gather_on("fallback", arrays, config)
    )


def check_against_spec_oracle(backend, case):
    arrays, config = case
    norms = mx.concatenate([arrays[2], arrays[5]], axis=1)
    _, _, kept_norms, indices = gather_on(backend, arrays, config)
    for row in range(norms.shape[0]):
        expected = kept_rows(norms[row].tolist(), *config)
        assert indices[row].tolist() == expected
    assert_bitwise_equal(kept_norms, mx.take_along_axis(norms, indices, axis=1), "norms")


@given(case=protected_topk_gather_cases(max_rows=2, dims=[1, 3]))
def test_protected_topk_gather_selection_matches_spec_oracle(case):
    check_against_spec_oracle("kernel", case)


@requires_emulator
@EMULATOR_SETTINGS
@given(case=protected_topk_gather_cases(max_rows=2, dims=[1, 3], long_rows=True))
def test_protected_topk_gather_metal_emulator_selection_matches_spec_oracle(case):
    check_against_spec_oracle("metal-emulator", case)


@given(case=protected_topk_gather_cases(max_rows=2, max_prior=20, max_new=20, dims=[4, 80]))
def test_protected_topk_gather_kept_rows_are_the_indexed_input_rows(case):
    arrays, config = case
    keys, values, _, indices = gather_on("kernel", arrays, config)
    all_keys = mx.concatenate([arrays[0], arrays[3]], axis=1)
    all_values = mx.concatenate([arrays[1], arrays[4]], axis=1)
    assert_bitwise_equal(keys, mx.take_along_axis(all_keys, indices[..., None], axis=1), "keys")
    assert_bitwise_equal(values, mx.take_along_axis(all_values, indices[..., None], axis=1), "values")


FLOAT16 = ("float16", "float16")  # the keys' and the values' dtypes


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_protected_topk_gather_nan_and_inf_never_evict_protected_rows(backend):
    nan, inf = math.nan, math.inf
    norms = mx.array([[nan, inf, 1.0, nan, 0.5, -inf, 2.0, nan]], dtype=mx.float32)
    arrays = protected_topk_gather_arrays(np.random.default_rng(0), n_heads=1, n_prior=8, n_new=0, key_dim=4,
                                          dtypes=FLOAT16)
    arrays[2] = norms
    for keep in ("low", "high"):
        _, _, _, indices = gather_on(backend, arrays, (5, 2, 1, keep))
        kept = indices[0].tolist()
        assert kept[:2] == [0, 1] and kept[-1] == 7, (keep, kept)
    assert gather_on(backend, arrays, (5, 2, 1, "low"))[3][0].tolist() == [0, 1, 4, 5, 7]
    assert gather_on(backend, arrays, (5, 2, 1, "high"))[3][0].tolist() == [0, 1, 2, 6, 7]


# float32 NaNs whose bits a float load or store may change: signalling ones
# (quiet bit clear) and quiet ones with payloads, of either sign.
NAN_BITS = [0x7FA00000, 0xFF800001, 0x7F800123, 0x7FC00001, 0xFFC12345]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
@pytest.mark.parametrize("budget, donate", [(12, False), (8, False), (8, True)])
def test_protected_topk_gather_moves_nan_norms_as_bits(backend, budget, donate):
    """Norms move as bits (docs/spec.md §5): the NaNs of kept rows, in
    protected places or with nothing evicted, come out with the bits they
    went in with, whether the outputs are fresh or the prior's buffers."""
    rng = np.random.default_rng(budget)
    arrays = protected_topk_gather_arrays(rng, n_heads=2, n_prior=8, n_new=4, key_dim=4, dtypes=FLOAT16)
    bits = np.array(rng.integers(0x3F000000, 0x40000000, size=(2, 12)), dtype=np.uint32)
    # Sinks 0-1 and the recent rows 9-11 hold NaNs; so do middle rows 3 and 5,
    # evicted first where rows leave.
    for row, (j, b) in enumerate([(0, 0), (1, 1), (3, 2), (5, 3), (9, 4), (10, 0), (11, 1)] * 2):
        bits[row % 2, j] = NAN_BITS[(b + row) % len(NAN_BITS)]
    norms = mx.array(bits).view(mx.float32)
    arrays[2], arrays[5] = norms[:, :8], norms[:, 8:]
    with mlx_knorm.use_backend(backend):
        prior = [mx.array(np.array(a)) for a in arrays[:3]]
        mx.eval(prior)
        addresses = [data_address(a) for a in prior]
        out = mlx_knorm.protected_topk_gather(*prior, *arrays[3:], budget, 2, 3, "low")
        if donate:
            del prior
        mx.eval(out)
    _, _, kept_norms, indices = out
    if donate and backend != "fallback":
        assert data_address(kept_norms) == addresses[2]
    expected = np.take_along_axis(bits, np.array(indices).astype(np.int64), axis=1)
    assert np.array(kept_norms.view(mx.uint32)).tolist() == expected.tolist()
    kept_nans = (expected & 0x7FFFFFFF) > 0x7F800000
    assert kept_nans.sum(axis=1).tolist() == ([7, 7] if budget == 12 else [5, 5])


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_protected_topk_gather_signed_zeros_tie_by_index(backend):
    arrays = protected_topk_gather_arrays(np.random.default_rng(0), n_heads=1, n_prior=6, n_new=0, key_dim=4,
                                          dtypes=FLOAT16)
    arrays[2] = mx.array([[-0.0, 0.0, -0.0, 0.0, -0.0, 0.0]])
    assert gather_on(backend, arrays, (3, 0, 0, "low"))[3][0].tolist() == [0, 1, 2]
    assert gather_on(backend, arrays, (3, 0, 0, "high"))[3][0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_protected_topk_gather_empty_blocks_and_no_eviction(backend):
    prior = protected_topk_gather_arrays(np.random.default_rng(0), n_heads=2, n_prior=0, n_new=0, key_dim=4,
                                         dtypes=FLOAT16)
    keys, values, norms, indices = gather_on(backend, prior, (4, 1, 0, "low"))
    assert keys.shape == (2, 0, 4) and norms.shape == (2, 0) and indices.dtype == mx.uint32
    arrays = protected_topk_gather_arrays(np.random.default_rng(0), n_heads=2, n_prior=3, n_new=2, key_dim=4,
                                          dtypes=FLOAT16)
    keys, _, _, indices = gather_on(backend, arrays, (5, 1, 1, "low"))
    assert indices.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert_bitwise_equal(keys, mx.concatenate([arrays[0], arrays[3]], axis=1), "keys")


@pytest.mark.parametrize("backend", NATIVE_BACKENDS + ["fallback"])
def test_protected_topk_gather_output_dtypes_follow_inputs(backend):
    arrays = protected_topk_gather_arrays(np.random.default_rng(3), n_heads=1, n_prior=4, n_new=2, key_dim=8,
                                          dtypes=("bfloat16", "float32"))
    out = gather_on(backend, arrays, (3, 1, 0, "low"))
    assert [o.dtype for o in out] == [mx.bfloat16, mx.float32, mx.float32, mx.uint32]


def test_protected_topk_gather_non_contiguous_inputs():
    arrays = protected_topk_gather_arrays(np.random.default_rng(5), n_heads=4, n_prior=12, n_new=3, key_dim=8,
                                          dtypes=FLOAT16)
    strided = tuple(a[::2] for a in arrays)
    copies = tuple(mx.array(np.array(a)) for a in strided)
    assert_same_outputs(gather_on("kernel", strided, (9, 1, 2, "low")), gather_on("fallback", copies, (9, 1, 2, "low")))


def test_protected_topk_gather_inside_compile():
    arrays = protected_topk_gather_arrays(np.random.default_rng(0), n_heads=2, n_prior=12, n_new=3, key_dim=8,
                                          dtypes=FLOAT16)
    compiled = mx.compile(lambda *a: mlx_knorm.protected_topk_gather(*a, 9, 1, 2, "high"))
    assert_same_outputs(compiled(*arrays), gather_on("kernel", arrays, (9, 1, 2, "high")))


def test_protected_topk_gather_large_rows_use_several_threads_and_agree():
    arrays = protected_topk_gather_arrays(np.random.default_rng(7), n_heads=32, n_prior=2048, n_new=1, key_dim=128,
                                          dtypes=FLOAT16)
    assert_same_outputs(gather_on("kernel", arrays, (2048, 4, 0, "low")), gather_on("fallback", arrays, (2048, 4, 0, "low")))
    prefill = protected_topk_gather_arrays(np.random.default_rng(8), n_heads=8, n_prior=0, n_new=4096, key_dim=64,
                                           dtypes=FLOAT16)
    assert_same_outputs(gather_on("kernel", prefill, (512, 4, 16, "low")), gather_on("fallback", prefill, (512, 4, 16, "low")))
