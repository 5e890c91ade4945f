"""KeyNorms: SPEC section 2 on every backend, bit for bit."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import EMULATOR_SETTINGS, assert_bitwise_equal, requires_emulator
from generators import DIMS, DTYPES, PALETTES, fill


def norms_on(backend: str, keys: mx.array) -> mx.array:
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.key_norms(keys)
        mx.eval(out)
        return out


def pinned_norm(row: np.ndarray) -> np.float32:
    """SPEC section 2 step by step in numpy float32."""
    squares = row.astype(np.float32) * row.astype(np.float32)
    width = 1
    while width < len(squares):
        width *= 2
    s = np.concatenate([squares, np.zeros(width - len(squares), np.float32)])
    while len(s) > 1:
        s = s[: len(s) // 2] + s[len(s) // 2 :]
    return np.sqrt(s[0])


@given(
    shape=st.tuples(st.integers(1, 3), st.integers(0, 9)),
    dim=st.sampled_from(DIMS + [5, 129, 257, 512]),
    dtype=st.sampled_from(sorted(DTYPES)),
    palette=st.sampled_from(PALETTES),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_matches_fallback(shape, dim, dtype, palette, seed):
    keys = fill(np.random.default_rng(seed), (*shape, dim), palette, dtype)
    assert_bitwise_equal(norms_on("kernel", keys), norms_on("fallback", keys), "norms")


@requires_emulator
@EMULATOR_SETTINGS
@given(
    rows=st.integers(0, 9),
    dim=st.sampled_from(DIMS + [0, 5, 129, 257, 512]),
    dtype=st.sampled_from(sorted(DTYPES)),
    palette=st.sampled_from(PALETTES),
    seed=st.integers(0, 2**32 - 1),
)
def test_metal_emulator_matches_fallback(rows, dim, dtype, palette, seed):
    """Rows past 4 span several threadgroups (one SIMD group per row, 4 per group)."""
    keys = fill(np.random.default_rng(seed), (rows, dim), palette, dtype)
    assert_bitwise_equal(norms_on("metal-emulator", keys), norms_on("fallback", keys), "norms")


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@pytest.mark.parametrize("dim", [1, 3, 80, 128, 255])
def test_matches_pinned_order_in_numpy(backend, dim):
    rows = np.random.default_rng(dim).standard_normal((16, dim)).astype(np.float32) * 3
    expected = np.array([pinned_norm(r) for r in rows], dtype=np.float32)
    actual = np.array(norms_on(backend, mx.array(rows)))
    assert actual.tobytes() == expected.tobytes()


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
def test_exact_small_cases(backend):
    keys = mx.array([[3.0, 4.0], [0.0, 0.0], [-5.0, 12.0], [float("nan"), 1.0], [float("inf"), 0.0]])
    out = norms_on(backend, keys).tolist()
    assert out[:3] == [5.0, 0.0, 13.0]
    assert math.isnan(out[3]) and out[4] == math.inf


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
def test_shapes_and_empty(backend):
    assert norms_on(backend, mx.zeros((2, 3, 4, 8))).shape == (2, 3, 4)
    assert norms_on(backend, mx.zeros((0, 8))).shape == (0,)
    assert norms_on(backend, mx.zeros((5,), mx.float16)).shape == ()
    assert_bitwise_equal(norms_on(backend, mx.zeros((3, 0))), mx.zeros((3,)), "D = 0")


def test_non_contiguous_input():
    keys = mx.random.normal((8, 6, 32), key=mx.random.key(1)).astype(mx.float16)
    strided = keys.transpose(1, 0, 2)[:, ::2]
    assert_bitwise_equal(
        norms_on("kernel", strided), norms_on("fallback", mx.array(np.array(strided))), "strided"
    )


def test_inside_compile():
    keys = mx.random.normal((4, 128), key=mx.random.key(2))
    compiled = mx.compile(lambda k: mlx_knorm.key_norms(k) * 2)
    assert_bitwise_equal(compiled(keys), norms_on("kernel", keys) * 2, "compiled")
