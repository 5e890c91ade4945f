"""KeyNorms: docs/spec.md §2 on every backend, bit for bit."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import ALL_BACKENDS, EMULATOR_SETTINGS, assert_bitwise_equal, requires_emulator
from generators import DIMS, DTYPES, PALETTES, key_norms_arrays


def norms_on(backend: str, keys: mx.array) -> mx.array:
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.key_norms(keys)
        mx.eval(out)
        return out


CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)


def pinned_norm(row: np.ndarray) -> np.float32:
    """docs/spec.md §2 step by step in numpy float32."""
    squares = row.astype(np.float32) * row.astype(np.float32)
    squares[squares < np.finfo(np.float32).tiny] = 0.0
    width = 1
    while width < len(squares):
        width *= 2
    s = np.concatenate([squares, np.zeros(width - len(squares), np.float32)])
    while len(s) > 1:
        s = s[: len(s) // 2] + s[len(s) // 2 :]
    norm = np.sqrt(s[0])
    return CANONICAL_NAN if np.isnan(norm) else norm


@given(
    shape=st.tuples(st.integers(1, 3), st.integers(0, 9)),
    dim=st.sampled_from(DIMS + [5, 129, 257, 512]),
    dtype=st.sampled_from(sorted(DTYPES)),
    palette=st.sampled_from(PALETTES),
    seed=st.integers(0, 2**32 - 1),
)
def test_key_norms_kernel_matches_fallback(shape, dim, dtype, palette, seed):
    (keys,) = key_norms_arrays(np.random.default_rng(seed), (*shape, dim), palette=palette, dtype=dtype)
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
def test_key_norms_metal_emulator_matches_fallback(rows, dim, dtype, palette, seed):
    """Rows past 4 span several threadgroups (one SIMD group per row, 4 per group)."""
    (keys,) = key_norms_arrays(np.random.default_rng(seed), (rows, dim), palette=palette, dtype=dtype)
    assert_bitwise_equal(norms_on("metal-emulator", keys), norms_on("fallback", keys), "norms")


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@pytest.mark.parametrize("dim", [1, 3, 80, 128, 255])
def test_key_norms_matches_pinned_order_in_numpy(backend, dim):
    rows = np.random.default_rng(dim).standard_normal((16, dim)).astype(np.float32) * 3
    expected = np.array([pinned_norm(r) for r in rows], dtype=np.float32)
    actual = np.array(norms_on(backend, mx.array(rows)))
    assert actual.tobytes() == expected.tobytes()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("dim", [3, 8, 64, 100])
def test_key_norms_subnormal_squares_flush_to_zero(backend, dtype, dim):
    """Keys of magnitude 2^-65 .. 2^-75 have float32-subnormal squares: each is
    +0 on every backend, whatever the hardware does with subnormals."""
    rng = np.random.default_rng(dim)
    exponents = rng.integers(-75, -64, size=(9, dim))
    rows = (rng.choice([-1.0, 1.0], size=(9, dim)) * np.exp2(exponents.astype(np.float64))).astype(np.float32)
    rows[0, 0] = 2.0**-60  # one normal square beside subnormal ones
    rows[1, :] = 2.0**-63  # the square 2^-126 is the smallest normal: kept
    keys = mx.array(rows).astype(dtype)
    expected = np.array([pinned_norm(r) for r in np.array(keys.astype(mx.float32))], dtype=np.float32)
    assert expected[0] == np.float32(2.0**-60) and expected[1] > 0 and (expected[2:] == 0).all()
    assert np.array(norms_on(backend, keys)).tobytes() == expected.tobytes()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_key_norms_of_float16_subnormal_keys(backend):
    """float16 keys below 2^-14 are subnormal, their squares normal float32:
    their norms are not 0, as a device that flushed float16 subnormals on
    load would make them."""
    rng = np.random.default_rng(5)
    bits = rng.integers(1, 0x400, size=(64, 24)).astype(np.uint16)  # every float16 subnormal magnitude
    bits |= (rng.integers(0, 2, size=bits.shape) << 15).astype(np.uint16)
    keys = mx.array(bits).view(mx.float16)
    expected = np.array([pinned_norm(r) for r in np.array(keys.astype(mx.float32))], dtype=np.float32)
    assert (expected > 0).all()
    assert np.array(norms_on(backend, keys)).tobytes() == expected.tobytes()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_key_norms_sqrt_is_correctly_rounded(backend):
    """The norm's square root is IEEE's, correctly rounded (precise::sqrt
    on a GPU, docs/spec.md §2): sums of squares spread over every binade
    and rounding position, compared with numpy's float32 sqrt."""
    rng = np.random.default_rng(6)
    # The emulator runs std::sqrt, checked as much by the CPU kernel's rows.
    rows = 1 << 9 if backend == "metal-emulator" else 1 << 14
    # Two float32 values a row: a^2 + b^2 lands anywhere in [2^-100, 2^100].
    exponents = rng.integers(-50, 50, size=(rows, 1))
    keys = (rng.uniform(1.0, 2.0, size=(rows, 2)) * np.exp2(exponents)).astype(np.float32)
    expected = np.array([pinned_norm(r) for r in keys], dtype=np.float32)
    assert np.array(norms_on(backend, mx.array(keys))).view(np.uint32).tolist() == \
        expected.view(np.uint32).tolist()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_key_norms_nan_norms_are_one_canonical_nan(backend, dtype):
    """Keys with NaNs of any payload and sign give the norm 0x7FC00000."""
    payloads = {"float16": [0x7E01, 0xFD55, 0x7C01], "bfloat16": [0x7FC1, 0xFF81, 0x7F81],
                "float32": [0x7FC00123, 0xFFA00000, 0x7F800001]}[dtype]
    bits_dtype = np.uint32 if dtype == "float32" else np.uint16
    # 17 rows: two blocks of eight for the CPU's eight-row kernel, one more.
    rows = np.zeros((17, 16), dtype=bits_dtype)
    for i in range(17):
        rows[i, i % 16] = payloads[i % len(payloads)]
    keys = mx.array(rows).view(DTYPES[dtype])
    assert np.array(norms_on(backend, keys)).view(np.uint32).tolist() == [0x7FC00000] * 17


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
def test_key_norms_exact_small_cases(backend):
    keys = mx.array([[3.0, 4.0], [0.0, 0.0], [-5.0, 12.0], [float("nan"), 1.0], [float("inf"), 0.0]])
    out = norms_on(backend, keys).tolist()
    assert out[:3] == [5.0, 0.0, 13.0]
    assert math.isnan(out[3]) and out[4] == math.inf


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
def test_key_norms_shapes_and_empty(backend):
    assert norms_on(backend, mx.zeros((2, 3, 4, 8))).shape == (2, 3, 4)
    assert norms_on(backend, mx.zeros((0, 8))).shape == (0,)
    assert norms_on(backend, mx.zeros((5,), mx.float16)).shape == ()
    assert_bitwise_equal(norms_on(backend, mx.zeros((3, 0))), mx.zeros((3,)), "D = 0")


def test_key_norms_non_contiguous_input():
    keys = mx.random.normal((8, 6, 32), key=mx.random.key(1)).astype(mx.float16)
    strided = keys.transpose(1, 0, 2)[:, ::2]
    assert_bitwise_equal(
        norms_on("kernel", strided), norms_on("fallback", mx.array(np.array(strided))), "strided"
    )


def test_key_norms_inside_compile():
    keys = mx.random.normal((4, 128), key=mx.random.key(2))
    compiled = mx.compile(lambda k: mlx_knorm.key_norms(k) * 2)
    assert_bitwise_equal(compiled(keys), norms_on("kernel", keys) * 2, "compiled")
