"""The Metal kernels of metal/, run through the emulator of the Metal
execution model (emulate_metal=True), agree bit for bit with the native CPU
kernel on every output.

The emulator runs every thread of a threadgroup as a real thread, so sizes
stay small; rows still span several 256-row compaction chunks and D is often
not a multiple of the SIMD width.
"""
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_knorm import _ext

pytestmark = pytest.mark.skipif(
    not getattr(_ext, "has_metal_emulator", False),
    reason="extension built without the Metal emulator",
)

CPU = mx.cpu
DTYPES = [mx.float16, mx.bfloat16, mx.float32]
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3e38, -3e38,
     1.0, -1.0, 65504.0, 6e-8],
    dtype=np.float32,
)


def bits(a):
    """Raw bit patterns of an array (bfloat16 has no numpy dtype)."""
    a = mx.array(a)
    width = {2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(width))


def assert_same(native, emulated, what):
    assert native.dtype == emulated.dtype, what
    assert native.shape == emulated.shape, what
    nb, eb = bits(native), bits(emulated)
    if native.dtype == mx.float32:
        # NaN payloads are not part of the contract; every other bit is.
        nan = np.isnan(np.array(native)) & np.isnan(np.array(emulated))
        nb, eb = np.where(nan, 0, nb), np.where(nan, 0, eb)
    np.testing.assert_array_equal(nb, eb, err_msg=what)


def values(rng, shape, mode):
    """float32 values: gaussian, small-integer ties, or sprinkled specials."""
    if mode == "ties":
        x = rng.integers(-2, 3, size=shape).astype(np.float32)
    else:
        x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    if mode == "specials" and x.size:
        mask = rng.random(shape) < 0.2
        x[mask] = rng.choice(SPECIALS, size=int(mask.sum()))
    return x


MODES = st.sampled_from(["gaussian", "ties", "specials"])


@SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    dim=st.sampled_from([0, 1, 3, 31, 33, 80, 96, 112, 128, 256, 512]),
    rows=st.integers(0, 9),
    mode=MODES,
    seed=st.integers(0, 2**32 - 1),
)
def test_key_norms(dtype, dim, rows, mode, seed):
    rows = min(rows, 2) if dim >= 256 else rows
    rng = np.random.default_rng(seed)
    keys = mx.array(values(rng, (rows, dim), mode)).astype(dtype)
    native = _ext.key_norms(keys, stream=CPU)
    emulated = _ext.key_norms(keys, emulate_metal=True, stream=CPU)
    assert_same(native, emulated, f"key norms {dtype} D={dim}")


def test_key_norms_batched_shape():
    keys = mx.random.normal((2, 3, 5, 40)).astype(mx.bfloat16)
    assert_same(_ext.key_norms(keys, stream=CPU),
                _ext.key_norms(keys, emulate_metal=True, stream=CPU), "batched")


def test_key_norms_rejects_dim_past_kernel_limit():
    with pytest.raises(ValueError, match="D <= 512"):
        _ext.key_norms(mx.zeros((1, 513)), emulate_metal=True, stream=CPU)


@st.composite
def gather_cases(draw):
    n_prior = draw(st.one_of(st.integers(0, 12), st.integers(250, 700)))
    n_new = draw(st.sampled_from([0, 1, 2, 5, 33]))
    n_total = n_prior + n_new
    budget = draw(st.integers(1, max(1, n_total + 3)))
    if draw(st.booleans()) and n_total > 2:
        budget = max(1, n_total - draw(st.integers(0, 2)))  # budget near n_total
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - 1 - n_sink))
    return dict(
        n_rows=draw(st.integers(1, 3)),
        n_prior=n_prior,
        n_new=n_new,
        dim=draw(st.sampled_from([0, 1, 3, 8, 33, 80, 128])),
        budget=budget,
        n_sink=n_sink,
        recent=recent,
        keep=draw(st.sampled_from(["low", "high"])),
        key_dtype=draw(st.sampled_from(DTYPES)),
        value_dtype=draw(st.sampled_from(DTYPES)),
        mode=draw(MODES),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def run_gather(c):
    rng = np.random.default_rng(c["seed"])
    n, d = c["n_rows"], c["dim"]

    def kv(rows, dtype):
        return mx.array(values(rng, (n, rows, d), "specials")).astype(dtype)

    args = (
        kv(c["n_prior"], c["key_dtype"]),
        kv(c["n_prior"], c["value_dtype"]),
        mx.array(values(rng, (n, c["n_prior"]), c["mode"])),
        kv(c["n_new"], c["key_dtype"]),
        kv(c["n_new"], c["value_dtype"]),
        mx.array(values(rng, (n, c["n_new"]), c["mode"])),
        c["budget"], c["n_sink"], c["recent"], c["keep"],
    )
    native = _ext.protected_topk_gather(*args, stream=CPU)
    emulated = _ext.protected_topk_gather(*args, emulate_metal=True, stream=CPU)
    for name, a, b in zip(["keys", "values", "norms", "indices"], native, emulated):
        assert_same(a, b, f"{name} {c}")


@SETTINGS
@given(gather_cases())
def test_protected_topk_gather(case):
    run_gather(case)


@pytest.mark.parametrize(
    "n_prior,n_new,budget,n_sink,recent",
    [
        (0, 0, 4, 1, 1),        # nothing at all
        (0, 7, 4, 1, 1),        # empty prior
        (9, 0, 4, 1, 1),        # S = 0
        (600, 40, 639, 0, 0),   # evicts one row of many chunks
        (700, 0, 300, 5, 17),   # threshold deep inside the middle
        (513, 0, 2, 1, 0),      # keeps a single middle row
    ],
)
@pytest.mark.parametrize("mode", ["ties", "specials"])
def test_protected_topk_gather_edges(n_prior, n_new, budget, n_sink, recent, mode):
    run_gather(dict(
        n_rows=2, n_prior=n_prior, n_new=n_new, dim=3, budget=budget,
        n_sink=n_sink, recent=recent, keep="low", key_dtype=mx.float16,
        value_dtype=mx.float32, mode=mode, seed=n_prior * 31 + budget))


def test_all_equal_scores_keep_earliest():
    n_prior, budget = 300, 40
    args = (
        mx.zeros((1, n_prior, 4)), mx.zeros((1, n_prior, 4)),
        mx.ones((1, n_prior)), mx.zeros((1, 0, 4)), mx.zeros((1, 0, 4)),
        mx.zeros((1, 0)), budget, 2, 3, "high",
    )
    _, _, _, idx = _ext.protected_topk_gather(*args, emulate_metal=True, stream=CPU)
    expected = list(range(2 + budget - 5)) + list(range(n_prior - 3, n_prior))
    assert np.array(idx)[0].tolist() == expected
