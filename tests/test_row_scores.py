"""RowScores: docs/spec.md §2a on every backend, bit for bit, against an
independent reading of the spec (spec_oracle.row_scores); keydiff's state
carried across blocks; the checks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_knorm
from conftest import ALL_BACKENDS, EMULATOR_SETTINGS, NATIVE_BACKENDS, assert_bitwise_equal, requires_emulator
from generators import DTYPES, PALETTES, fill, fill_norms
import spec_oracle

SCORERS = ("knorm", "vnorm", "qfilter", "keydiff")


@st.composite
def row_score_cases(draw, max_rows=12, dims=(0, 1, 3, 31, 33, 64, 80, 128, 256)):
    """``(arrays, config)`` of one row_scores call."""
    lead = draw(st.sampled_from([(1,), (3,), (2, 2)]))
    rows = draw(st.integers(0, max_rows))
    dim = draw(st.sampled_from(dims))
    value_dim = draw(st.sampled_from(dims))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    palette = draw(st.sampled_from(PALETTES))
    scorer = draw(st.sampled_from(SCORERS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    keys = fill(rng, (*lead, rows, dim), palette, dtype)
    values = fill(rng, (*lead, rows, value_dim), palette, dtype) if scorer == "vnorm" else None
    state = None
    if scorer in ("qfilter", "keydiff"):
        state = fill(rng, (*lead, dim), draw(st.sampled_from(["normal", "zeros", "special"])), "float32")
    offset = draw(st.integers(0, 5))
    valid = None
    if draw(st.booleans()):
        valid = mx.array(rng.integers(0, 12, size=(*lead, 2)).astype(np.int32))
    return (keys, values, state), dict(scorer=scorer, offset=offset, valid=valid)


def scores_on(backend, arrays, config):
    with mlx_knorm.use_backend(backend):
        out = mlx_knorm.row_scores(*arrays, **config)
        mx.eval([o for o in out if o is not None])
        return out


def assert_same(actual, expected):
    assert_bitwise_equal(actual[0], expected[0], "scores")
    if expected[1] is None:
        assert actual[1] is None
    else:
        assert_bitwise_equal(actual[1], expected[1], "state")


@given(case=row_score_cases())
def test_row_scores_kernel_matches_fallback(case):
    arrays, config = case
    assert_same(scores_on("kernel", arrays, config), scores_on("fallback", arrays, config))


@requires_emulator
@EMULATOR_SETTINGS
@given(case=row_score_cases(max_rows=6))
def test_row_scores_metal_emulator_matches_fallback(case):
    arrays, config = case
    assert_same(scores_on("metal-emulator", arrays, config), scores_on("fallback", arrays, config))


@given(case=row_score_cases(max_rows=6, dims=(0, 1, 3, 8, 33)))
def test_row_scores_follow_the_spec(case):
    """The kernel's scores and state equal the spec read element by element
    in numpy (spec_oracle), head by head."""
    arrays, config = case
    keys, values, state = arrays
    scores, out_state = scores_on("kernel", arrays, config)
    lead = keys.shape[:-2]
    heads = int(np.prod(lead))
    k = np.array(keys.astype(mx.float32)).reshape(heads, *keys.shape[-2:])
    v = None if values is None else np.array(values.astype(mx.float32)).reshape(heads, *values.shape[-2:])
    s = None if state is None else np.array(state).reshape(heads, keys.shape[-1])
    valid = None if config["valid"] is None else np.array(config["valid"]).reshape(heads, 2)
    got = np.array(scores).reshape(heads, keys.shape[-2]).view(np.uint32)
    for h in range(heads):
        expected, expected_state = spec_oracle.row_scores(
            k[h], None if v is None else v[h], None if s is None else s[h], config["scorer"], config["offset"],
            None if valid is None else tuple(valid[h]))
        assert got[h].tolist() == expected.view(np.uint32).tolist(), (h, config["scorer"])
        if config["scorer"] == "keydiff":
            assert np.array(out_state).reshape(heads, keys.shape[-1])[h].view(np.uint32).tolist() == \
                expected_state.view(np.uint32).tolist()


def keydiff_carries_across_blocks(backend, data):
    """keydiff is path independent: a stream scored in blocks, each taking
    the state the one before returned, scores and ends like one block."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = data.draw(st.integers(1, 16))
    dtype = data.draw(st.sampled_from(sorted(DTYPES)))
    keys = fill(rng, (2, 3, rows, 40), data.draw(st.sampled_from(PALETTES)), dtype)
    valid = mx.array(np.tile(np.array([1, rows - 1], np.int32), (2, 3, 1)))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, rows - 1), max_size=4)) if rows > 1 else []))
    whole = scores_on(backend, (keys, None, mx.zeros((2, 3, 40))), dict(scorer="keydiff", valid=valid))
    state = mx.zeros((2, 3, 40))
    parts = []
    for start, stop in zip([0, *cuts], [*cuts, rows]):
        block, state = scores_on(backend, (keys[..., start:stop, :], None, state),
                                 dict(scorer="keydiff", offset=start, valid=valid))
        parts.append(block)
    assert_bitwise_equal(mx.concatenate(parts, axis=-1), whole[0], "scores")
    assert_bitwise_equal(state, whole[1], "state")


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@given(data=st.data())
def test_keydiff_state_carries_across_blocks(backend, data):
    keydiff_carries_across_blocks(backend, data)


@requires_emulator
@EMULATOR_SETTINGS
@given(data=st.data())
def test_keydiff_state_carries_across_blocks_through_the_metal_emulator(data):
    keydiff_carries_across_blocks("metal-emulator", data)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_knorm_scores_are_the_key_norms(backend):
    keys = fill(np.random.default_rng(1), (4, 9, 96), "special", "bfloat16")
    with mlx_knorm.use_backend(backend):
        assert_bitwise_equal(mlx_knorm.row_scores(keys, scorer="knorm")[0], mlx_knorm.key_norms(keys), "norms")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_keydiff_scores_by_hand(backend):
    """Two orthogonal keys and one against the first: cosines 0 (nothing
    before), 0, then -1/sqrt(2) against the sum of the two unit keys; a NaN
    key scores NaN and joins nothing; a zero key scores 0 and joins nothing;
    the last, (1, 1) against (0, 1), 1/sqrt(2)."""
    keys = mx.array([[[3.0, 0.0], [0.0, 2.0], [-5.0, 0.0], [float("nan"), 1.0], [0.0, 0.0], [1.0, 1.0]]])
    scores, state = scores_on(backend, (keys, None, mx.zeros((1, 2))), dict(scorer="keydiff"))
    got = np.array(scores[0])
    assert got[:2].tolist() == [0.0, 0.0]
    assert np.float32(got[2]) == np.float32(-1.0) / np.float32(np.sqrt(np.float32(2.0)))
    assert np.array(scores.view(mx.uint32))[0, 3] == 0x7FC00000 and got[4] == 0.0
    unit = np.float32(1.0) / np.float32(np.sqrt(np.float32(2.0)))
    assert np.array(state).tolist() == [[unit, np.float32(1.0) + unit]]
    assert got[5] == np.float32(1.0) / np.float32(np.float32(np.sqrt(2.0)) * np.float32(1.0))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_padding_rows_score_zero_and_join_nothing(backend):
    keys = fill(np.random.default_rng(2), (2, 6, 16), "normal", "float16")
    valid = mx.array([[2, 4], [0, 6]], dtype=mx.int32)
    scores, state = scores_on(backend, (keys, None, mx.zeros((2, 16))), dict(scorer="keydiff", offset=0, valid=valid))
    assert np.array(scores)[0, [0, 1, 4, 5]].tolist() == [0.0] * 4
    alone, alone_state = scores_on(backend, (keys[:1, 2:4], None, mx.zeros((1, 16))), dict(scorer="keydiff"))
    assert_bitwise_equal(scores[:1, 2:4], alone, "real rows")
    assert_bitwise_equal(state[:1], alone_state, "state")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_qfilter_scores_are_minus_the_projection(backend):
    keys = mx.array([[[1.0, 2.0, 0.0], [0.0, -1.0, 4.0]]], dtype=mx.float32)
    f = mx.array([[0.5, 1.0, 0.25]])
    scores, state = scores_on(backend, (keys, None, f), dict(scorer="qfilter"))
    assert np.array(scores).tolist() == [[-2.5, 0.0]] and state is f


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_row_scores_refuse_bad_arguments_by_name(backend):
    keys = mx.zeros((2, 3, 8), mx.float16)
    with mlx_knorm.use_backend(backend):
        cases = [
            (dict(scorer="mean"), ValueError, "scorer"),
            (dict(scorer="keydiff"), ValueError, "needs state"),
            (dict(state=mx.zeros((2, 8)), scorer="knorm"), ValueError, "takes no state"),
            (dict(state=mx.zeros((2, 7)), scorer="qfilter"), ValueError, "state"),
            (dict(state=mx.zeros((2, 8), mx.float16), scorer="keydiff"), TypeError, "state"),
            (dict(values=mx.zeros((2, 3, 8)), scorer="vnorm"), TypeError, "values"),
            (dict(values=mx.zeros((2, 2, 8), mx.float16), scorer="vnorm"), ValueError, "values"),
            (dict(scorer="knorm", valid=mx.zeros((2, 3), mx.int32)), ValueError, "valid"),
            (dict(scorer="knorm", valid=mx.zeros((2, 2))), TypeError, "valid"),
            (dict(scorer="knorm", offset=-1), ValueError, "offset"),
        ]
        for kwargs, error, name in cases:
            with pytest.raises(error, match=name):
                mlx_knorm.row_scores(keys, **kwargs)
        with pytest.raises(TypeError, match="keys"):
            mlx_knorm.row_scores(mx.zeros((2, 3, 8), mx.int32), scorer="knorm")


@requires_emulator
def test_the_metal_kernels_take_rows_up_to_512():
    keys = mx.zeros((1, 2, 513), mx.float16)
    with mlx_knorm.use_backend("metal-emulator"):
        with pytest.raises(ValueError, match="keys: the Metal row-score kernels support D <= 512"):
            mx.eval(mlx_knorm.row_scores(keys, scorer="knorm")[0])


def test_row_scores_define_no_gradient():
    keys = mx.ones((1, 2, 4))
    for backend in NATIVE_BACKENDS + ["fallback"]:
        with mlx_knorm.use_backend(backend):
            with pytest.raises(ValueError):
                mx.grad(lambda k: mlx_knorm.row_scores(k, scorer="knorm")[0].sum())(keys)
