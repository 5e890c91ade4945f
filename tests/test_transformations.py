"""Eager calls, ``mx.compile`` and ``mx.compile(shapeless=True)`` agree.

A shapeless compiled function is traced once and replayed for new shapes
without running any Python argument check, so the primitives must check the
shape relations they rely on themselves (docs/spec.md §6). Each case
traces with a valid call, then calls with drawn shapes, valid or not, on
every backend: the outcome must equal the eager call's (the same arrays, or
an exception), and nothing may crash or read past a buffer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_knorm
from conftest import ALL_BACKENDS, EMULATOR_SETTINGS, assert_bitwise_equal, requires_emulator
from generators import (
    evict_and_fill_arrays,
    evict_and_fill_shapes,
    key_norms_arrays,
    protected_topk_gather_arrays,
    protected_topk_gather_shapes,
)

CONFIG = (6, 1, 1, "low")  # budget, n_sink, recent, keep


def gather(*arrays):
    return mlx_knorm.protected_topk_gather(*arrays, *CONFIG)


def norms(keys):
    return mlx_knorm.key_norms(keys)


def protected_topk_gather_call_arrays(n_rows, n_prior, n_new, key_dim, value_dim, shape_changes, seed):
    """Arrays of one protected_topk_gather call, float16 rows;
    ``shape_changes`` maps an argument index to the shape it takes instead
    (an invalid relation)."""
    return protected_topk_gather_arrays(np.random.default_rng(seed), n_rows, n_prior, n_new, key_dim, value_dim,
                                        dtypes=("float16", "float16"), shape_changes=shape_changes)


@st.composite
def drawn_calls(draw, shapes_of, arrays_of):
    """Arrays of one call: ``shapes_of(n_rows, rows, n_new, key_dim,
    value_dim)`` gives the valid shapes, ``arrays_of`` the arrays (with the
    same arguments, then shape changes and a seed)."""
    n_rows = draw(st.integers(1, 3))
    rows = draw(st.integers(0, 12))
    n_new = draw(st.integers(0, 5))
    key_dim = draw(st.sampled_from([1, 4, 8, 24]))
    value_dim = draw(st.sampled_from([key_dim, 8, 64]))
    changes = {}
    if draw(st.booleans()):
        # One argument takes a shape that breaks a relation the kernels rely on.
        shapes = shapes_of(n_rows, rows, n_new, key_dim, value_dim)
        index = draw(st.integers(0, len(shapes) - 1))
        base = shapes[index]
        axis = draw(st.integers(0, len(base) - 1))
        grown = draw(st.sampled_from([1, 7, 300]))
        changes[index] = tuple(n + grown if a == axis else n for a, n in enumerate(base))
    seed = draw(st.integers(0, 2**31 - 1))
    return arrays_of(n_rows, rows, n_new, key_dim, value_dim, changes, seed)


def outcome(fn, args):
    """``("ok", outputs)`` or ``("error", exception type)``."""
    try:
        out = fn(*args)
        mx.eval(out)
    except (ValueError, TypeError, RuntimeError) as err:
        return "error", type(err)
    return "ok", out if isinstance(out, (tuple, list)) else (out,)


def assert_same_outcome(eager, compiled, *, may_refuse: bool, defined: int | None = None):
    """Equal results or an exception; ``may_refuse``: a valid call may raise
    (a backend that refuses shapeless tracing); ``defined``: compare only
    the first slots of each output (the rest is unspecified)."""
    if eager[0] == "error":
        assert compiled[0] == "error", "an invalid call succeeded when compiled"
        return
    if compiled[0] == "error":
        assert may_refuse, f"a valid call raised {compiled[1].__name__} when compiled"
        return
    for got, want in zip(compiled[1], eager[1]):
        if defined is not None:
            assert got.shape == want.shape
            got, want = got[:, :defined], want[:, :defined]
        assert_bitwise_equal(got, want, "compiled vs eager")


def check_all_modes(op, trace_args, args, backend, defined=None):
    with mlx_knorm.use_backend(backend):
        eager = outcome(op, args)
        assert_same_outcome(eager, outcome(mx.compile(op), args), may_refuse=False, defined=defined)
        shapeless = mx.compile(op, shapeless=True)
        # Traced on a valid call first, so the drawn call is a replay.
        traced = outcome(shapeless, trace_args)
        replay = outcome(shapeless, args)
        # The fallback computes its selection from the shapes in Python and
        # refuses shapeless tracing; the primitives infer shapes themselves.
        refuses = backend == "fallback"
        assert traced[0] == ("error" if refuses else "ok")
        assert_same_outcome(eager, replay, may_refuse=refuses, defined=defined)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(EMULATOR_SETTINGS)
@given(args=drawn_calls(protected_topk_gather_shapes, protected_topk_gather_call_arrays))
def test_protected_topk_gather_agrees_under_compile(backend, args):
    trace_args = protected_topk_gather_call_arrays(2, 4, 1, 8, 8, {}, 0)
    check_all_modes(gather, trace_args, args, backend)


# filled 4, budget 3: three rows kept, then S new ones in 7 slots; the
# drawn shapes make C < filled or kept + S > capacity now and then.
EVICT_AND_FILL_CONFIG = dict(filled=4, offset=9, capacity=7, budget=3, n_sink=1, recent=1, keep="low")


def evict_and_fill_call_arrays(n_rows, slots, n_new, key_dim, value_dim, shape_changes, seed):
    """Arrays of one evict_and_fill call, with ``shape_changes`` as in
    ``protected_topk_gather_call_arrays``."""
    return evict_and_fill_arrays(np.random.default_rng(seed), n_rows, slots, n_new, key_dim, value_dim,
                                 positions="random", dtypes=("float16", "float16"), shape_changes=shape_changes)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(EMULATOR_SETTINGS)
@given(args=drawn_calls(evict_and_fill_shapes, evict_and_fill_call_arrays), layout=st.sampled_from(["slots", "temporal"]))
def test_evict_and_fill_agrees_under_compile(backend, args, layout):
    def op(*arrays):
        return mlx_knorm.evict_and_fill(*arrays, **EVICT_AND_FILL_CONFIG, layout=layout)

    trace_args = evict_and_fill_call_arrays(2, 6, 1, 8, 8, {}, 0)
    defined = min(EVICT_AND_FILL_CONFIG["filled"], EVICT_AND_FILL_CONFIG["budget"]) + args[4].shape[1]
    check_all_modes(op, trace_args, args, backend, defined=defined)


def evict_and_fill_payload_shapes(n_rows, slots, n_new, key_dim, value_dim):
    """The shapes of ``evict_and_fill_payload_call_arrays``."""
    return evict_and_fill_shapes(n_rows, slots, n_new, key_dim, value_dim, quantized=True)


def evict_and_fill_payload_call_arrays(n_rows, slots, n_new, key_dim, value_dim, shape_changes, seed):
    """A quantized-style call: keys as (packed, scales), float values, the
    new rows' norms given, valid ranges; ``shape_changes`` as in
    ``protected_topk_gather_call_arrays``."""
    return evict_and_fill_arrays(np.random.default_rng(seed), n_rows, slots, n_new, key_dim, value_dim,
                                 shape_changes=shape_changes, quantized=True)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(EMULATOR_SETTINGS)
@given(args=drawn_calls(evict_and_fill_payload_shapes, evict_and_fill_payload_call_arrays), layout=st.sampled_from(["slots", "temporal"]))
def test_evict_and_fill_payloads_with_ranges_agree_under_compile(backend, args, layout):
    def op(*a):
        keys, values, norms, positions = mlx_knorm.evict_and_fill(
            (a[0], a[1]), a[2], a[3], a[4], (a[5], a[6]), a[7], **EVICT_AND_FILL_CONFIG, layout=layout,
            new_norms=a[8], valid=a[9])
        return [*keys, values, norms, positions]

    trace_args = evict_and_fill_payload_call_arrays(2, 6, 1, 8, 8, {}, 0)
    defined = min(EVICT_AND_FILL_CONFIG["filled"], EVICT_AND_FILL_CONFIG["budget"]) + args[5].shape[1]
    check_all_modes(op, trace_args, args, backend, defined=defined)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(EMULATOR_SETTINGS)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=2),
    dim=st.sampled_from([0, 1, 7, 64, 512, 1024]),
    seed=st.integers(0, 2**31 - 1),
)
def test_key_norms_agree_under_compile(backend, shape, dim, seed):
    check_all_modes(norms, [mx.ones((2, 8))], key_norms_arrays(np.random.default_rng(seed), (*shape, dim)), backend)


def test_protected_topk_gather_replay_with_wider_values_writes_inside_its_buffers():
    """Traced with D_v = D_k, replayed with D_v = 8 * D_k: the values output
    takes the values' width (it once took the keys' and overflowed)."""
    op = mx.compile(gather, shapeless=True)
    mx.eval(op(*protected_topk_gather_call_arrays(2, 4, 1, 8, 8, {}, 0)))
    args = protected_topk_gather_call_arrays(2, 40, 1, 8, 64, {}, 1)
    got = op(*args)
    want = gather(*args)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w, "replay")


def test_protected_topk_gather_replay_with_short_norms_raises():
    """Norms [2, 4] beside keys [2, 4000, 8] would be read past their end."""
    op = mx.compile(gather, shapeless=True)
    mx.eval(op(*protected_topk_gather_call_arrays(2, 4, 1, 8, 8, {}, 0)))
    args = protected_topk_gather_call_arrays(2, 4000, 1, 8, 8, {2: (2, 4)}, 1)
    with pytest.raises(ValueError, match=r"prior_norms must be \[N, n_prior\]"):
        mx.eval(op(*args))


def test_evict_and_fill_replay_with_short_positions_raises():
    """Positions [2, 4] beside buffers of 4000 slots would be read past their end."""
    op = mx.compile(lambda *a: mlx_knorm.evict_and_fill(*a, **EVICT_AND_FILL_CONFIG, layout="slots"), shapeless=True)
    mx.eval(op(*evict_and_fill_call_arrays(2, 6, 1, 8, 8, {}, 0)))
    args = evict_and_fill_call_arrays(2, 4000, 1, 8, 8, {3: (2, 4)}, 1)
    with pytest.raises(ValueError, match=r"positions must be \[N, C\]"):
        mx.eval(op(*args))


@requires_emulator
def test_key_norms_emulator_replay_past_its_key_width_raises():
    """Traced at D = 8, replayed at D = 1024: each lane of the norm kernel
    holds D / 32 squares in an array sized for D <= 512, so the replay must
    raise before the kernel writes past it."""
    with mlx_knorm.use_backend("metal-emulator"):
        op = mx.compile(norms, shapeless=True)
        mx.eval(op(mx.ones((2, 8))))
        with pytest.raises(ValueError, match=r"supports D <= 512, got D = 1024"):
            mx.eval(op(mx.ones((2, 1024))))


# Gradients and vmap: not defined, and the same answer on every backend
# (docs/spec.md §6): the primitives define none, the fallback declares none.
# (The cache's step: tests/test_cache_validation.py.)


def transform_cases():
    rng = np.random.default_rng(7)
    protected_topk_gather_in = protected_topk_gather_call_arrays(2, 5, 2, 8, 8, {}, 1)
    evict_and_fill_in = evict_and_fill_call_arrays(2, 6, 1, 8, 8, {}, 2)
    evict_and_fill_payloads_in = evict_and_fill_payload_call_arrays(2, 6, 1, 8, 8, {}, 3)
    (keys,) = key_norms_arrays(rng, (2, 3, 8))

    def evict_and_fill_payloads(new_norms):
        # Through the given norms of a tuple-form call with valid ranges.
        a = evict_and_fill_payloads_in
        return mlx_knorm.evict_and_fill(
            (a[0], a[1]), a[2], a[3], a[4], (a[5], a[6]), a[7], **EVICT_AND_FILL_CONFIG,
            new_norms=new_norms, valid=a[9])[2]

    return {
        "key_norms": (lambda k: norms(k), [keys]),
        "protected_topk_gather": (lambda k: gather(k, *protected_topk_gather_in[1:])[0],
                                  [protected_topk_gather_in[0]]),
        "evict_and_fill": (lambda k: mlx_knorm.evict_and_fill(k, *evict_and_fill_in[1:], **EVICT_AND_FILL_CONFIG)[0],
                           [evict_and_fill_in[0]]),
        "evict_and_fill payloads": (evict_and_fill_payloads, [evict_and_fill_payloads_in[8]]),
    }


TRANSFORMS = {
    "grad": lambda f, x: mx.grad(lambda a: f(a).astype(mx.float32).sum())(x),
    "value_and_grad": lambda f, x: mx.value_and_grad(lambda a: f(a).astype(mx.float32).sum())(x),
    "vjp": lambda f, x: mx.vjp(f, [x], [mx.ones_like(f(x))]),
    "jvp": lambda f, x: mx.jvp(f, [x], [mx.ones_like(x)]),
    "vmap": lambda f, x: mx.vmap(f)(mx.stack([x, x])),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("op", ["key_norms", "protected_topk_gather", "evict_and_fill", "evict_and_fill payloads"])
def test_no_transform_is_defined_on_any_backend(op, transform, backend):
    with mlx_knorm.use_backend(backend):
        fn, (x,) = transform_cases()[op]
        mx.eval(fn(x))  # the plain call works
        with pytest.raises(ValueError, match="vmap" if transform == "vmap" else "[vj]p"):
            mx.eval(TRANSFORMS[transform](fn, x))
