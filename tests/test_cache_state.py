"""A saved ``L2NormKVCache`` state is checked field by field before it is
loaded (mlx_knorm/cache_state.py): a tampered or mismatched prompt-cache
file raises naming the field, and a failed load changes nothing."""

from __future__ import annotations

import tempfile

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import mlx_knorm
import spec_oracle
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache
from mlx_knorm.cache_state import FIELDS, check_state

BUDGET, N_SINK, RECENT = 8, 2, 1


def filled_cache(layout: str = "slots") -> L2NormKVCache:
    cache = L2NormKVCache(budget=BUDGET, n_sink=N_SINK, recent=RECENT, layout=layout)
    for size in (7, 1, 5, 1):
        kv = mx.random.normal((1, 2, size, 4), key=mx.random.key(size)).astype(mx.float16)
        cache.update_and_fetch(kv, kv)
    return cache


def tampered(state, **fields) -> list:
    out = list(state)
    for name, value in fields.items():
        out[FIELDS.index(name)] = value(out[FIELDS.index(name)]) if callable(value) else value
    return out


def reversed_rows(a: mx.array) -> mx.array:
    return a[:, :, ::-1]


def held_positions(*rows: int):
    """Positions of 8 increasing rows, for 14 positions seen."""
    return lambda positions: mx.broadcast_to(mx.array(rows, mx.int32), positions.shape)


CASES = {
    "negative offset": (dict(offset=-5), ValueError, "'offset'"),
    "offset below the rows held": (dict(offset=3), ValueError, "'keys'"),
    "norms of another length": (dict(norms=lambda n: n[..., :5]), ValueError, "'norms'"),
    "norms not of these keys": (dict(norms=lambda n: n * 2), ValueError, "'norms'"),
    "integer keys": (dict(keys=lambda k: k.astype(mx.int32)), ValueError, "'keys'"),
    "values of another dtype": (dict(values=lambda v: v.astype(mx.bfloat16)), ValueError, "'values'"),
    "values of other rows": (dict(values=lambda v: v[:, :, :4]), ValueError, "'values'"),
    "int64 positions": (dict(positions=lambda p: p.astype(mx.int64)), ValueError, "'positions'"),
    "positions out of order": (dict(positions=reversed_rows), ValueError, "'positions'"),
    "positions past offset": (dict(positions=lambda p: p + 100), ValueError, "'positions'"),
    "a sink missing": (dict(positions=held_positions(0, 2, 3, 4, 5, 6, 7, 13)), ValueError, "sink positions"),
    "the recent row missing": (dict(positions=held_positions(0, 1, 3, 4, 5, 6, 7, 12)), ValueError, "recent window"),
    "keys missing": (dict(keys=None), TypeError, "'keys'"),
    "norms a list": (dict(norms=lambda n: n.tolist()), TypeError, "'norms'"),
    "bad budget": (dict(budget=2), ValueError, "budget"),
    "bad layout": (dict(layout="rows"), ValueError, "layout"),
    "offset a float": (dict(offset=14.0), TypeError, "offset"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_tampered_state_raises_naming_the_field_and_loads_nothing(case):
    fields, error, name = CASES[case]
    cache = filled_cache()
    good = cache.state
    before = [np.array(x) if isinstance(x, mx.array) else x for x in good]
    with pytest.raises(error, match=name):
        cache.state = tampered(good, **fields)
    with pytest.raises(error, match=name):
        L2NormKVCache.from_state(tampered(good, **fields))
    after = cache.state
    for a, b in zip(before, after):
        assert np.array_equal(a, np.array(b)) if isinstance(b, mx.array) else a == b


def test_a_state_of_another_length_raises():
    state = filled_cache().state
    with pytest.raises(ValueError, match="10 fields"):
        L2NormKVCache.from_state(state[:8])


def test_an_empty_state_needs_offset_zero():
    empty = L2NormKVCache(budget=BUDGET).state
    assert L2NormKVCache.from_state(empty).empty()
    with pytest.raises(ValueError, match="offset is 4"):
        L2NormKVCache.from_state(tampered(empty, offset=4))


@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_a_valid_state_round_trips_exactly(layout):
    cache = filled_cache(layout)
    back = L2NormKVCache.from_state(cache.state)
    for a, b in zip(cache.state, back.state):
        assert mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
    assert back.layout == layout and back.size() == BUDGET and back.offset == 14


def test_a_tampered_file_fails_at_load_naming_the_field(tmp_path):
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [filled_cache()])
    arrays, metadata = mx.load(path, return_metadata=True)
    # Field 4 of layer 0's state is the offset.
    arrays["0.4"] = mx.array(-5)
    mx.save_safetensors(path, arrays, metadata)
    with pytest.raises(ValueError, match="'offset'"):
        load_prompt_cache(path)


@pytest.mark.parametrize("shape", [(0, 2, 5, 4), (1, 0, 5, 4), (1, 2, 5, 0), (1, 2, 0, 4)])
def test_states_without_elements_round_trip(shape, tmp_path):
    """No batch, no heads, no width or no rows: what the cache accepts, a
    file holds and loads back."""
    cache = L2NormKVCache(budget=4, n_sink=1)
    for _ in range(2):
        mx.eval(cache.update_and_fetch(mx.ones(shape, mx.float16), mx.ones(shape, mx.float16)))
    path = str(tmp_path / "empty.safetensors")
    save_prompt_cache(path, [cache])
    (back,) = load_prompt_cache(path)
    assert back.offset == cache.offset == 2 * shape[2]
    for a, b in zip(cache.state[:4], back.state[:4]):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


# meta_state (the older two-part protocol): a new configuration and layout
# for the stored rows, checked as the state it makes (docs/spec.md §8).


def rows_in_temporal_order(cache: L2NormKVCache) -> dict:
    """The filled slots (the kept rows and the rows of the pending
    eviction) by position: what a new configuration evicts from."""
    order = mx.argsort(cache.slot_positions[..., : cache.filled], axis=2)
    take = lambda b: mx.take_along_axis(b[:, :, : cache.filled], order if b.ndim == 3 else order[..., None], axis=2)
    return dict(keys=take(cache.keys), norms=take(cache.norms), positions=take(cache.slot_positions))


@pytest.mark.parametrize("change", [("slots", "temporal"), ("temporal", "slots")])
def test_a_layout_change_converts_the_storage_order(change, tmp_path):
    before, after = change
    cache = filled_cache(before)
    state = cache.state
    cache.meta_state = (str(BUDGET), str(N_SINK), str(RECENT), "low", after)
    assert cache.layout == after
    # Stored in temporal order, which both layouts accept: the rows are the same.
    stored = np.array(cache.slot_positions[..., : cache.filled])
    assert np.all(np.diff(stored, axis=-1) > 0)
    assert cache.state[-1] == after
    for a, b in zip(state[:-1], cache.state[:-1]):
        assert mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    (back,) = load_prompt_cache(path)
    assert back.layout == after and np.array_equal(np.array(back.positions), np.array(cache.positions))
    # And it goes on: the next steps give what a cache built with that layout gives.
    fresh = filled_cache(after)
    for seed in range(3):
        kv = mx.random.normal((1, 2, 1 + seed, 4), key=mx.random.key(50 + seed)).astype(mx.float16)
        cache.update_and_fetch(kv, kv)
        fresh.update_and_fetch(kv, kv)
        for a, b in zip(cache.state[:4], fresh.state[:4]):
            assert mx.array_equal(a, b).item()


# (budget, n_sink, recent, keep) the stored rows satisfy: for filled_cache
# (14 positions seen, 8 kept, positions 0-1 and 13 protected).
SATISFIED = {
    "a lower budget evicts": (5, 2, 1, "low"),
    "the pending row stays under budget + 1": (9, 2, 1, "low"),
    "fewer sinks": (8, 0, 1, "low"),
    "keep high re-ranks": (6, 2, 1, "high"),
    "no recent window": (8, 2, 0, "low"),
}


@pytest.mark.parametrize("layout", ["slots", "temporal"])
@pytest.mark.parametrize("case", SATISFIED)
def test_a_configuration_the_rows_satisfy_evicts_under_it(case, layout):
    """The new state is the filled rows evicted under the new configuration
    (spec_oracle's §3 over them in temporal order), and it loads back."""
    budget, n_sink, recent, keep = SATISFIED[case]
    cache = filled_cache(layout)
    rows = rows_in_temporal_order(cache)
    cache.meta_state = (str(budget), str(n_sink), str(recent), keep, layout)
    assert (cache.budget, cache.n_sink, cache.recent, cache.keep) == (budget, n_sink, recent, keep)
    norms, positions = np.array(rows["norms"]), np.array(rows["positions"])
    for b in range(norms.shape[0]):
        for h in range(norms.shape[1]):
            kept = spec_oracle.kept_rows(norms[b, h].tolist(), budget, n_sink, recent, keep)
            assert cache.positions[b, h].tolist() == positions[b, h, kept].tolist()
            assert mx.array_equal(cache.state[0][b, h], rows["keys"][b, h][mx.array(kept)]).item()
    back = L2NormKVCache.from_state(cache.state)
    assert back.meta_state == cache.meta_state


# Configurations the stored rows cannot satisfy: filled_cache evicted
# positions 2-4 and holds position 13 as its recent window.
UNSATISFIED = {
    "n_sink raised past evicted positions": (("8", "5", "1", "low", "slots"), "'n_sink'"),
    "recent raised past evicted positions": (("8", "2", "4", "low", "slots"), "'recent'"),
    "budget above the rows held": (("12", "2", "1", "low", "slots"), "'budget'"),
}
MALFORMED = {
    "4 fields": (("8", "2", "1", "low"), ValueError, "meta_state must have the 5 fields"),
    "not a sequence": ("8,2,1", ValueError, "meta_state must have the 5 fields"),
    "budget eight": (("eight", "2", "1", "low", "slots"), ValueError, "field 'budget' must be a decimal integer, got 'eight'"),
    "n_sink 2.0": (("8", "2.0", "1", "low", "slots"), ValueError, "field 'n_sink' must be a decimal integer"),
    "recent None": (("8", "2", None, "low", "slots"), TypeError, "meta_state field 'recent' must be an int, got NoneType"),
    "budget a float": ((8.0, "2", "1", "low", "slots"), TypeError, "meta_state field 'budget' must be an int"),
    "keep mid": (("8", "2", "1", "mid", "slots"), ValueError, "keep must be 'low' or 'high'"),
    "layout rows": (("8", "2", "1", "low", "rows"), ValueError, "layout must be 'slots' or 'temporal'"),
    "n_sink + recent = budget": (("8", "6", "2", "low", "slots"), ValueError, r"n_sink \(6\) \+ recent \(2\) must be < budget \(8\)"),
}


def assert_unchanged(cache: L2NormKVCache, before: list, meta: tuple) -> None:
    after = [np.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(before, after))
    assert cache.meta_state == meta


@pytest.mark.parametrize("case", [*UNSATISFIED, *MALFORMED])
def test_a_meta_state_the_cache_cannot_take_raises_naming_the_field(case):
    cache = filled_cache()
    before = [np.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    meta = cache.meta_state
    if case in UNSATISFIED:
        new, field = UNSATISFIED[case]
        error, fragment = ValueError, f"meta_state field {field}: the stored rows cannot satisfy"
    else:
        new, error, fragment = MALFORMED[case]
    with pytest.raises(error, match=fragment):
        cache.meta_state = new
    assert_unchanged(cache, before, meta)


def test_meta_state_through_the_older_from_state():
    """The older protocol makes the object with cls.__new__, then sets state
    and meta_state."""
    cache = filled_cache("temporal")
    bare = L2NormKVCache.__new__(L2NormKVCache)
    bare.meta_state = cache.meta_state
    assert bare.empty() and bare.meta_state == cache.meta_state
    loaded = L2NormKVCache.__new__(L2NormKVCache)
    loaded.state = cache.state
    loaded.meta_state = cache.meta_state
    assert all(mx.array_equal(a, b).item() for a, b in zip(loaded.state[:4], cache.state[:4]))


# Whatever a cache accepts, a file holds: random sequences of changes, some
# of them bad, on every backend. After each accepted change the state passes
# the load check and a saved and loaded copy continues exactly like the
# cache; after each refused one nothing has changed.


# The quantized cache's (group_size, bits): widths are multiples of 32.
QUANTIZATIONS = [(32, 4), (64, 8), (32, 3)]


@st.composite
def changes(draw, quantized: bool = False):
    batch, heads = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    if quantized:
        key_dim, value_dim = draw(st.sampled_from([0, 64])), draw(st.sampled_from([0, 32]))
    else:
        key_dim, value_dim = draw(st.sampled_from([0, 3, 8])), draw(st.sampled_from([0, 5]))
    dtype = draw(st.sampled_from([mx.float16, mx.bfloat16, mx.float32]))
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["block", "block", "block", "meta", "reload"]))
        if kind == "block":
            # Decode steps often: in the slot layout they leave rows out of
            # temporal order.
            rows = draw(st.one_of(st.just(1), st.integers(0, 6)))
            keys, values = [batch, heads, rows, key_dim], [batch, heads, rows, value_dim]
            flaw = draw(st.sampled_from([None, None, None, "rows", "heads", "key_dim", "rank", "int32"]))
            if flaw == "rows":
                values[2] += 1
            elif flaw == "heads":
                keys[1] += 1
                values[1] += 1
            elif flaw == "key_dim":
                keys[3] += 32 if quantized else 1
            steps.append(("block", keys[:3] if flaw == "rank" else keys, values,
                          mx.int32 if flaw == "int32" else dtype, draw(st.integers(0, 2**16))))
        elif kind == "meta":
            budget = draw(st.integers(0, 10))
            meta = (str(budget), str(draw(st.integers(0, 4))), str(draw(st.integers(0, 3))),
                    draw(st.sampled_from(["low", "high"])), draw(st.sampled_from(["slots", "temporal"])))
            if quantized:
                # Mostly the cache's own quantization, which cannot change.
                meta += tuple(map(str, draw(st.sampled_from([None, None, *QUANTIZATIONS])) or ("keep",)))
            steps.append(("meta", meta))
        else:
            steps.append(("reload",))
    config = draw(st.sampled_from([(6, 1, 1), (4, 0, 0), (8, 2, 2)]))
    quantization = draw(st.sampled_from(QUANTIZATIONS)) if quantized else None
    return config, draw(st.sampled_from(["slots", "temporal"])), steps, quantization


def apply(cache: L2NormKVCache, step) -> None:
    if step[0] == "block":
        _, keys, values, dtype, seed = step
        key = mx.random.key(seed)
        cache.update_and_fetch(mx.random.normal(keys, key=key).astype(dtype),
                               mx.random.normal(values, key=key).astype(dtype))
    elif step[0] == "meta":
        meta = step[1]
        if meta[-1] == "keep":
            meta = (*meta[:-1], *cache.meta_state[5:])
        cache.meta_state = meta
    else:
        cache.state = cache.state


def saved_and_loaded(cache: L2NormKVCache) -> L2NormKVCache:
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/cache.safetensors"
        save_prompt_cache(path, [cache])
        (back,) = load_prompt_cache(path)
    return back


def values_of(cache: L2NormKVCache) -> list:
    """The state with each array as (shape, dtype, bytes): bfloat16 and NaN
    payloads compare too."""
    return [
        (x.shape, x.dtype, bytes(np.array(x.reshape(-1).view(mx.uint8)))) if isinstance(x, mx.array) else x
        for _, x in tree_flatten(list(cache.state))
    ]


# Each example saves and loads files: a third of the examples, on the CPU
# kernel and the fallback (the emulator's cache steps equal the fallback's
# bit for bit, tests/test_cache_reference.py).
def check_what_a_cache_accepts_round_trips(backend, case):
    (budget, n_sink, recent), layout, steps, quantization = case
    with mlx_knorm.use_backend(backend):
        if quantization is None:
            cache = L2NormKVCache(budget=budget, n_sink=n_sink, recent=recent, layout=layout)
        else:
            group_size, bits = quantization
            cache = QuantizedL2NormKVCache(budget=budget, n_sink=n_sink, recent=recent, layout=layout,
                                           group_size=group_size, bits=bits)
        copy = saved_and_loaded(cache)
        for step in steps:
            before = values_of(cache)
            try:
                apply(cache, step)
            except (ValueError, TypeError):
                assert values_of(cache) == before, f"a refused {step[0]} changed the cache"
                continue
            check_state(cache.state, quantized=quantization is not None)
            # The loaded copy took the same changes (or holds what the
            # change made) and saves and loads back what the cache holds.
            copy = saved_and_loaded(cache) if step[0] != "block" else copy
            if step[0] == "block":
                apply(copy, step)
            assert values_of(cache) == values_of(copy)
            copy = saved_and_loaded(copy)
            assert values_of(cache) == values_of(copy)


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(case=changes())
def test_what_a_cache_accepts_round_trips(backend, case):
    check_what_a_cache_accepts_round_trips(backend, case)


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@settings(max_examples=max(10, settings.default.max_examples // 6))
@given(case=changes(quantized=True))
def test_what_a_quantized_cache_accepts_round_trips(backend, case):
    check_what_a_cache_accepts_round_trips(backend, case)
