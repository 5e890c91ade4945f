"""A saved ``L2NormKVCache`` state is checked field by field before it is
loaded (mlx_knorm/cache_state.py): a tampered or mismatched prompt-cache
file raises naming the field, and a failed load changes nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlx_knorm.cache import L2NormKVCache
from mlx_knorm.cache_state import FIELDS

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
    "float32 keys": (dict(keys=lambda k: k.astype(mx.float32)), ValueError, "'keys'"),
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
