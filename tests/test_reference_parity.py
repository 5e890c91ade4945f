"""Cross-checks against the reference package, veloxquant_mlx.quantizers.knorm."""

from __future__ import annotations

import dataclasses
import inspect

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import assert_bitwise_equal
from generators import DTYPES, fill, key_norms_arrays

from veloxquant_mlx.quantizers import knorm as reference

API = [
    "KnormState",
    "init_knorm_state",
    "knorm_update",
    "knorm_update_batched",
    "knorm_get_kv",
    "knorm_fp16_bytes",
    "full_knorm_fp16_bytes",
]


@pytest.mark.parametrize("name", API)
def test_same_names_and_signatures(name):
    ours, theirs = getattr(mlx_knorm, name), getattr(reference, name)
    assert inspect.signature(ours) == inspect.signature(theirs)


def test_same_dataclass_fields():
    ours = [(f.name, f.type) for f in dataclasses.fields(mlx_knorm.KnormState)]
    assert ours == [(f.name, f.type) for f in dataclasses.fields(reference.KnormState)]


def ulp_distance(a: mx.array, b: mx.array) -> np.ndarray:
    ia = np.array(a).view(np.int32).astype(np.int64)
    ib = np.array(b).view(np.int32).astype(np.int64)
    return np.abs(ia - ib)


@given(
    dim=st.sampled_from([1, 3, 64, 80, 96, 112, 128, 256, 512]),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**32 - 1),
)
def test_key_norms_close_to_reference_and_to_exact(dim, dtype, seed):
    """Within 4 ulp of the reference's sequential sum for head dims up to 128.

    For larger D the reference's own sequential rounding error grows past
    that (up to 12 ulp seen at D = 512), while the pinned tree stays within
    1 ulp of the correctly rounded norm; there we bound the distance by the
    reference's error plus ours.
    """
    (keys,) = key_norms_arrays(np.random.default_rng(seed), (3, 17, dim), dtype=dtype)
    ours = mlx_knorm.key_norms(keys)
    theirs = mx.sqrt(mx.sum(keys.astype(mx.float32) ** 2, axis=-1))
    x = np.array(keys.astype(mx.float32)).astype(np.float64)
    exact = mx.array(np.sqrt((x * x).sum(-1)).astype(np.float32))
    assert ulp_distance(ours, exact).max() <= 1
    if dim <= 128:
        assert ulp_distance(ours, theirs).max() <= 4
    else:
        assert (ulp_distance(ours, theirs) <= ulp_distance(theirs, exact) + 1).all()


@given(
    n_rows=st.integers(1, 3),
    n_total=st.integers(1, 60),
    dim=st.sampled_from([1, 8, 64]),
    budget=st.integers(1, 64),
    data=st.data(),
    ties=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_batched_selection_identical_given_same_norms(n_rows, n_total, dim, budget, data, ties, seed):
    """All rows as prior with S = 0, so both sides select on the same norms."""
    n_sink = data.draw(st.integers(0, budget - 1))
    recent = data.draw(st.integers(0, budget - 1 - n_sink))
    keep = data.draw(st.sampled_from(["low", "high"]))
    rng = np.random.default_rng(seed)
    keys = fill(rng, (n_rows, n_total, dim), "normal", "float16")
    values = fill(rng, (n_rows, n_total, dim), "normal", "float16")
    if ties:
        norms = mx.array(rng.integers(0, 4, size=(n_rows, n_total)).astype(np.float32))
    else:
        norms = mx.array(np.abs(rng.standard_normal((n_rows, n_total))).astype(np.float32))
    empty = mx.zeros((n_rows, 0, dim), mx.float16)
    args = (keys, values, norms, empty, empty, budget, n_sink, recent, keep)
    ours = mlx_knorm.knorm_update_batched(*args, return_indices=True)
    theirs = reference.knorm_update_batched(*args, return_indices=True)
    assert ours[3].tolist() == theirs[3].tolist()
    for name, a, b in zip(("keys", "values", "norms"), ours[:3], theirs[:3]):
        assert_bitwise_equal(a, b, name)


def integer_keys(rng, n, dim):
    """Small integer keys: every norm is exact, so both packages agree on it."""
    return mx.array(rng.integers(-3, 4, size=(n, dim)).astype(np.float16))


@given(
    blocks=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    budget=st.integers(2, 12),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_state_updates_identical_to_reference(blocks, budget, data, seed):
    n_sink = data.draw(st.integers(0, budget - 1))
    recent = data.draw(st.integers(0, budget - 1 - n_sink))
    keep = data.draw(st.sampled_from(["low", "high"]))
    rng = np.random.default_rng(seed)
    ours = mlx_knorm.init_knorm_state(n_sink, budget, 4, recent, keep)
    theirs = reference.init_knorm_state(n_sink, budget, 4, recent, keep)
    for size in blocks:
        keys, values = integer_keys(rng, size, 4), integer_keys(rng, size, 4)
        ours = mlx_knorm.knorm_update(ours, keys, values)
        theirs = reference.knorm_update(theirs, keys, values)
        for field in ("keys", "values", "norms"):
            assert_bitwise_equal(getattr(ours, field), getattr(theirs, field), field)
        assert mlx_knorm.knorm_fp16_bytes(ours) == reference.knorm_fp16_bytes(theirs)


def test_placeholders_and_byte_counts():
    ours = mlx_knorm.init_knorm_state(4, 16, 8)
    theirs = reference.init_knorm_state(4, 16, 8)
    assert ours == dataclasses.replace(ours, **dataclasses.asdict(theirs))
    for a, b in zip(mlx_knorm.knorm_get_kv(ours), reference.knorm_get_kv(theirs)):
        assert_bitwise_equal(a, b, "placeholder")
    assert mlx_knorm.knorm_fp16_bytes(ours) == reference.knorm_fp16_bytes(theirs) == 0
    assert mlx_knorm.full_knorm_fp16_bytes(1000, 128) == reference.full_knorm_fp16_bytes(1000, 128)


@pytest.mark.parametrize(
    "args",
    [
        dict(n_sink=4, budget=4, head_dim=8),
        dict(n_sink=2, budget=8, head_dim=8, recent=6),
        dict(n_sink=0, budget=8, head_dim=8, keep="middle"),
    ],
)
def test_same_error_types_as_reference(args):
    with pytest.raises(ValueError):
        reference.init_knorm_state(**args)
    with pytest.raises(ValueError):
        mlx_knorm.init_knorm_state(**args)
