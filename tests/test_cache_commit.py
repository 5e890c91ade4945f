"""All-or-nothing by construction (docs/spec.md §8, all or nothing): a failure
injected at every check and every step of every operation that changes a
cache (``update_and_fetch``, ``trim``, the ``state`` and ``meta_state``
setters, ``to_quantized``, ``merge``, ``extend``, ``filter``, ``extract``,
``prepare``, ``finalize``), on the float, quantized and batch caches, and a
user's scorer that raises, leave every cache involved bit for bit what it
was; and hypothesis-drawn tampered states leave the cache they are set on
as it was."""

from __future__ import annotations

import copy
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import L2NormCacheBase, L2NormKVCache, MaskPlan, QuantizedL2NormKVCache, link_prompt_cache

HEADS = 2
CONFIG = dict(budget=6, n_sink=1, recent=2)

# Every function a cache's operation goes through: the checks
# (cache_state, validation), the ops, the scorers, the batch's helpers.
SEAMS = ("check_block", "check_state", "check_scorer_fields", "check_config", "check_layout", "check_int",
         "decimal_int", "parse_meta_state", "score_rows", "evict_and_fill_unchecked", "key_norms_unchecked",
         "step_capacity", "order_tree_argument", "resolve", "note_shared_read", "refuse_long_verify_block",
         "_checked_scorer_array", "_checked_batch_states", "_joined_sums", "_check_same_config",
         "_padding_front", "_slot_positions", "_storage_dtype", "check_quantization", "check_batch_fields",
         "slot_flaws")
# And the methods it calls on the caches.
METHODS = ("_load", "_set_buffers", "_kept_rows", "_step", "_segments", "_planned_block", "_new_rows", "_quantize",
           "_rebuilt_score_sum", "_forget_block", "_ranges_changed", "_occupied", "extract",
           "_capacity", "_as_stored", "_no_rows")
CLASSES = (L2NormCacheBase, L2NormKVCache, QuantizedL2NormKVCache, BatchL2NormKVCache)


class Injected(Exception):
    pass


class Injector:
    """Counts the calls of every seam and method; raises ``Injected`` at the ``fail_at``-th."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.fail_at = 0, None
        modules = [m for name, m in sys.modules.items() if name.startswith("mlx_knorm") and m is not None]
        for name in SEAMS:
            for module in modules:
                original = vars(module).get(name)
                if callable(original):
                    monkeypatch.setattr(module, name, self.wrap(original))
        for cls in CLASSES:
            for name in METHODS:
                if name in vars(cls):
                    monkeypatch.setattr(cls, name, self.wrap(vars(cls)[name]))

    def wrap(self, original):
        def counted(*args, **kwargs):
            self.tick()
            return original(*args, **kwargs)
        return counted

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Injected(f"failure injected at call {self.calls}")


def fingerprint(value, seen=None):
    """Everything a cache holds, arrays as their bits."""
    if isinstance(value, mx.array):
        mx.eval(value)
        view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[value.dtype.size]
        return ("array", str(value.dtype), tuple(value.shape), np.array(value.view(view)).tobytes())
    if isinstance(value, (L2NormCacheBase, BatchL2NormKVCache)):
        return (type(value).__name__, tuple(sorted((k, fingerprint(v)) for k, v in vars(value).items())))
    if isinstance(value, MaskPlan):
        return ("plan", value.block, value.caches, value.holders)
    if isinstance(value, (list, tuple)):
        return tuple(fingerprint(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, fingerprint(v)) for k, v in value.items()))
    if callable(value):
        return ("callable", id(value))
    return repr(value)


def rows(rng, batch, count, dim=64):
    keys = rng.standard_normal((batch, HEADS, count, dim)).astype(np.float32)
    return mx.array(keys), mx.array(rng.standard_normal((batch, HEADS, count, dim)).astype(np.float32))


def counting(keys, values, state):
    """A user's scorer (path-independent: its state counts rows)."""
    count = mx.full(keys.shape[:2], keys.shape[2], mx.float32) + (0 if state is None else state)
    return mx.sum(keys * keys, axis=-1).astype(mx.float32), count


def scoring(scorer) -> dict:
    """The cache arguments of ``scorer`` (qfilter's with filters)."""
    filters = mx.array(np.eye(HEADS, 64, dtype=np.float32)) if scorer == "qfilter" else None
    return dict(scorer=scorer, filters=filters)


def single(scorer, rng, length, layout="slots"):
    cache = L2NormKVCache(**CONFIG, layout=layout, **scoring(scorer))
    if length:
        cache.update_and_fetch(*rows(rng, 1, length))
    return cache


def operations(scorer, seed):
    """``name -> (make, run)``: ``make()`` builds fresh caches, ``run(caches)``
    changes (or reads) them."""
    rng = lambda: np.random.default_rng(seed)

    def planned():
        """Linked caches whose mask plan holds an exact small block."""
        caches = [single(scorer, rng(), 7), single(scorer, rng(), 7)]
        link_prompt_cache(caches)
        caches[0].make_mask(3)
        return caches

    def updated():
        cache = single(scorer, rng(), 3)
        cache.update_and_fetch(*rows(rng(), 1, 2))
        return [cache]

    def batch():
        return [L2NormKVCache.merge([single(scorer, rng(), 7), single(scorer, rng(), 3)])]

    def prepared():
        caches = batch()
        caches[0].prepare(lengths=[1, 2], right_padding=[1, 0])
        caches[0].update_and_fetch(*rows(rng(), 2, 2))
        return caches

    ops = {
        "update_and_fetch": (lambda: [single(scorer, rng(), 7)],
                             lambda c: c[0].update_and_fetch(*rows(np.random.default_rng(seed + 1), 1, 2))),
        "update_and_fetch, exact block": (planned, lambda c: c[1].update_and_fetch(*rows(rng(), 1, 3))),
        "trim": (updated, lambda c: c[0].trim(3)),
        "meta_state": (lambda: [single(scorer, rng(), 7)],
                       lambda c: setattr(c[0], "meta_state", ("5", "1", "1", "low", "temporal"))),
        "state": (lambda: [single(scorer, rng(), 7), single(scorer, rng(), 2)],
                  lambda c: setattr(c[1], "state", c[0].state)),
        "to_quantized": (lambda: [single(scorer, rng(), 7)], lambda c: c[0].to_quantized(bits=8)),
        "quantized update_and_fetch": (lambda: [single(scorer, rng(), 7).to_quantized(bits=8)],
                                       lambda c: c[0].update_and_fetch(*rows(rng(), 1, 2))),
        "merge": (lambda: [single(scorer, rng(), 7), single(scorer, rng(), 3)], L2NormKVCache.merge),
        "batch update_and_fetch": (batch, lambda c: c[0].update_and_fetch(*rows(rng(), 2, 2))),
        "extend": (lambda: batch() + batch(), lambda c: c[0].extend(c[1])),
        "filter": (batch, lambda c: c[0].filter([1])),
        "extract": (batch, lambda c: c[0].extract(0)),
        "batch state": (lambda: batch() + [BatchL2NormKVCache([0, 0], **CONFIG, keep="low", **scoring(scorer))],
                        lambda c: setattr(c[1], "state", c[0].state)),
        "prepare": (batch, lambda c: c[0].prepare(lengths=[1, 2], right_padding=[1, 0])),
        "finalize": (prepared, lambda c: c[0].finalize()),
    }
    if callable(scorer):
        # A user's scorer's cache takes no state, saved or tampered.
        for name in ("state", "batch state", "meta_state"):
            ops.pop(name)
    return ops


SCORERS = ["knorm", "keydiff", "vnorm", "qfilter", counting]


@pytest.mark.parametrize("scorer", SCORERS, ids=["knorm", "keydiff", "vnorm", "qfilter", "user"])
def test_a_failure_at_any_call_of_any_operation_changes_no_cache(monkeypatch, scorer):
    injector = Injector(monkeypatch)
    for name, (make, run) in operations(scorer, seed=0).items():
        caches = make()
        injector.calls, injector.fail_at = 0, None
        run(caches)
        total = injector.calls
        assert total >= 2, name
        for fail_at in range(1, total + 1):
            caches = make()
            before = fingerprint(caches)
            injector.calls, injector.fail_at = 0, fail_at
            with pytest.raises(Injected):
                run(caches)
            injector.fail_at = None
            assert fingerprint(caches) == before, f"{name}: failure at call {fail_at} of {total}"


def test_a_users_scorer_that_raises_changes_no_cache():
    calls = {"n": 0, "fail": None}

    def scorer(keys, values, state):
        calls["n"] += 1
        if calls["n"] == calls["fail"]:
            raise RuntimeError("the user's scorer refuses")
        return counting(keys, values, state)

    for name, (make, run) in operations(scorer, seed=1).items():
        caches = make()
        calls["n"], calls["fail"] = 0, None
        run(caches)
        total = calls["n"]
        for fail in range(1, total + 1):
            caches = make()
            before = fingerprint(caches)
            calls["n"], calls["fail"] = 0, fail
            with pytest.raises(RuntimeError, match="refuses"):
                run(caches)
            assert fingerprint(caches) == before, f"{name}: the scorer's call {fail} of {total}"


@st.composite
def tampered_states(draw):
    """A batch's or a layer cache's state with one field replaced by a bad value."""
    batched = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 3)))
    scorer = draw(st.sampled_from(["knorm", "keydiff", "qfilter"]))
    source = single(scorer, rng, draw(st.integers(0, 9)))
    if batched:
        source = L2NormKVCache.merge([source, single(scorer, rng, draw(st.integers(0, 9)))])
    state = list(source.state)
    index = draw(st.integers(0, len(state) - 1))
    bad = draw(st.sampled_from(["None", "string", "negative", "float", "other shape", "ndarray", "NaN"]))
    field = state[index]
    state[index] = {
        "None": None, "string": "x", "negative": -1, "float": 1.5, "ndarray": np.zeros(3),
        "other shape": mx.zeros((1,)) if not isinstance(field, mx.array) else mx.zeros((*field.shape, 1), field.dtype),
        "NaN": mx.full(field.shape, float("nan")) if isinstance(field, mx.array) else float("nan"),
    }[bad]
    return batched, scorer, state


@given(tampered_states())
def test_a_tampered_state_is_refused_or_taken_whole(case):
    batched, scorer, state = case
    rng = np.random.default_rng(5)
    target = (L2NormKVCache.merge([single(scorer, rng, 8), single(scorer, rng, 2)]) if batched
              else single(scorer, rng, 8))
    before = fingerprint(target)
    try:
        target.state = state
    except (ValueError, TypeError):
        assert fingerprint(target) == before
    else:
        # Taken: the cache holds what it was given, and reads it back.
        copy.deepcopy(target).state = target.state


def _interrupted(name):
    def method(self, *args, **kwargs):
        getattr(dict, name)(self, *args, **kwargs)
        raise KeyboardInterrupt

    return method


class InterruptedDict(dict):
    """A cache's ``__dict__`` on which every change is followed by a
    KeyboardInterrupt, as a signal's handler runs after any call."""

    locals().update({name: _interrupted(name) for name in
                     ("clear", "update", "pop", "popitem", "setdefault", "__setitem__", "__delitem__")})


def test_an_interrupt_while_a_failed_operation_is_put_back_leaves_the_cache_whole():
    rng = np.random.default_rng(0)
    cache = single("knorm", rng, 7)
    before = fingerprint(cache)
    object.__setattr__(cache, "__dict__", InterruptedDict(vars(cache)))
    with pytest.raises((ValueError, KeyboardInterrupt)):
        cache.update_and_fetch(*rows(rng, 2, 1))
    assert fingerprint(cache) == before
