"""L2NormKVCache's bad input (docs/spec.md §6, §8): every block that
``update_and_fetch`` refuses raises naming the argument and leaves the cache
as it was, on the first call and on later ones, on every backend
(cache_state.check_block); the step has no gradient or vmap on any backend.
The op-level tables are in tests/test_validation.py; states and meta_state
in tests/test_cache_state.py."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from conftest import ALL_BACKENDS, requires_emulator
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache
from test_transformations import TRANSFORMS


def block(shape=(1, 2, 3, 8), dtype=mx.float16, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def good_block(**change):
    return {"keys": block(), "values": block((1, 2, 3, 6), seed=1), **change}


CACHE_BLOCK_ERRORS = {
    # name: (change, error, message fragment, only on later calls)
    "rank-3 keys": (dict(keys=block((2, 3, 8))), ValueError, "keys must be [B, H, S, D] (rank 4), got shape [2, 3, 8]", False),
    "rank-5 values": (dict(values=block((1, 1, 2, 3, 6))), ValueError, "values must be [B, H, S, D] (rank 4)", False),
    "5 key rows, 7 value rows": (
        dict(keys=block((1, 2, 5, 8)), values=block((1, 2, 7, 6))), ValueError,
        "keys and values must agree in B, H and S: keys [1, 2, 5, 8] vs values [1, 2, 7, 6]", False),
    "values of other heads": (dict(values=block((1, 3, 3, 6))), ValueError, "must agree in B, H and S", False),
    "values of another batch": (dict(values=block((2, 2, 3, 6))), ValueError, "must agree in B, H and S", False),
    "int32 keys": (dict(keys=mx.ones((1, 2, 3, 8), mx.int32)), TypeError, "keys must be float16, bfloat16 or float32", False),
    "uint8 values": (dict(values=mx.ones((1, 2, 3, 6), mx.uint8)), TypeError, "values must be float16, bfloat16 or float32", False),
    "keys None": (dict(keys=None), TypeError, "keys must be an mlx.core.array, got NoneType", False),
    "values a list": (dict(values=[[0.0]]), TypeError, "values must be an mlx.core.array, got list", False),
    "keys of other heads than stored": (
        dict(keys=block((1, 1, 3, 8)), values=block((1, 1, 3, 6))), ValueError, "L2NormKVCache holds [B, H, rows, D] = [1, 2, rows, 8]", True),
    "another batch than stored": (
        dict(keys=block((2, 2, 3, 8)), values=block((2, 2, 3, 6))), ValueError, "L2NormKVCache holds", True),
    "keys of another width than stored": (dict(keys=block((1, 2, 3, 4))), ValueError, "L2NormKVCache holds", True),
    "values of another width than stored": (dict(values=block((1, 2, 3, 5))), ValueError, "[..., 6] values", True),
}


# The quantized cache's rows need D a multiple of its group size (32): its
# cases are the float cache's with every width times 32.
WIDEN = {"float": 1, "quantized": 32}


def widened(change: dict, kind: str) -> dict:
    factor = WIDEN[kind]
    return {name: mx.repeat(a, factor, axis=-1) if isinstance(a, mx.array) and factor > 1 else a
            for name, a in change.items()}


def new_cache(kind: str):
    if kind == "quantized":
        return QuantizedL2NormKVCache(budget=4, n_sink=1, recent=1, group_size=32, bits=4)
    return L2NormKVCache(budget=4, n_sink=1, recent=1)


def cache_after(blocks: int, kind: str = "float"):
    cache = new_cache(kind)
    for seed in range(blocks):
        kv = good_block(keys=block(seed=2 * seed), values=block((1, 2, 3, 6), seed=2 * seed + 1))
        mx.eval(cache.update_and_fetch(**widened(kv, kind)))
    return cache


def snapshot(cache) -> list:
    return [np.array(x) if isinstance(x, mx.array) else
            [np.array(y) for y in x] if isinstance(x, (tuple, list)) and x and isinstance(x[0], mx.array) else x
            for x in (*cache.state, cache.filled, cache.nbytes)]


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, list) and a and isinstance(a[0], np.ndarray):
        return all(np.array_equal(x, y) for x, y in zip(a, b))
    return a == b


def quantized_fragment(fragment: str) -> str:
    """The part of a float case's message that names the argument, without
    the widths the quantized case changes."""
    return re.split(r"[0-9\[]", fragment)[0].strip() or fragment.split()[-1]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("kind", ["float", "quantized"])
@pytest.mark.parametrize(
    "case, call",
    # The first block sets the shapes that later ones must keep.
    [(case, call) for case, (*_, later_only) in CACHE_BLOCK_ERRORS.items()
     for call in (["later"] if later_only else ["first", "later"])],
)
def test_cache_block_errors(case, backend, call, kind):
    change, error, fragment, _ = CACHE_BLOCK_ERRORS[case]
    if kind == "quantized":
        fragment = quantized_fragment(fragment)
    with mlx_knorm.use_backend(backend):
        cache = cache_after(0 if call == "first" else 2, kind)
        before = snapshot(cache)
        with pytest.raises(error, match=re.escape(fragment)):
            cache.update_and_fetch(**widened(good_block(**change), kind))
        after = snapshot(cache)
        assert all(same(a, b) for a, b in zip(before, after))
        # Still usable: a good block is absorbed.
        mx.eval(cache.update_and_fetch(**widened(good_block(), kind)))
        assert cache.offset == before[4] + 3


def cache_at_offset(offset: int):
    """A cache holding a sink and the three tokens before ``offset``."""
    cache = cache_after(2)
    state = list(cache.state)
    state[4] = offset
    state[3] = mx.broadcast_to(mx.array([0, offset - 3, offset - 2, offset - 1], mx.int32), state[3].shape)
    cache.state = state
    return cache


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_cache_positions_past_int32_raise(backend):
    with mlx_knorm.use_backend(backend):
        cache = cache_at_offset(2**31 - 2)
        with pytest.raises(ValueError, match=re.escape("offset 2147483646 + 3 new tokens must be < 2**31")):
            cache.update_and_fetch(**good_block())
        assert cache.offset == 2**31 - 2


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_block_like_the_last_one_is_still_checked_against_the_offset(backend):
    """A block of the last one's shapes and dtypes skips check_block's
    shape checks (the verdict would be the same), but not the offset's bound."""
    with mlx_knorm.use_backend(backend):
        cache = cache_at_offset(2**31 - 4)
        mx.eval(cache.update_and_fetch(**good_block()))  # up to position 2**31 - 2
        before = snapshot(cache)
        with pytest.raises(ValueError, match=re.escape("offset 2147483647 + 3 new tokens must be < 2**31")):
            cache.update_and_fetch(**good_block())
        assert all(same(a, b) for a, b in zip(before, snapshot(cache)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_loaded_state_of_other_widths_checks_the_next_block_against_them(backend):
    """The block that passed before a state load of other widths is checked
    against the loaded widths, not waved through as the last one checked."""
    with mlx_knorm.use_backend(backend):
        cache = cache_after(2)
        wide = cache_after(0)
        mx.eval(wide.update_and_fetch(block((1, 2, 3, 16)), block((1, 2, 3, 12), seed=1)))
        cache.state = wide.state
        with pytest.raises(ValueError, match=re.escape("L2NormKVCache holds [B, H, rows, D] = [1, 2, rows, 16]")):
            cache.update_and_fetch(**good_block())
        assert cache.offset == 3
        fresh = cache_after(1)
        assert fresh.trim(3) == 3  # back to the empty cache, which takes any shape
        mx.eval(fresh.update_and_fetch(block((1, 2, 3, 16)), block((1, 2, 3, 12), seed=1)))
        assert fresh.offset == 3 and fresh.keys.shape[-1] == 16


@requires_emulator
def test_cache_keys_past_the_metal_width_raise_on_the_emulator():
    """The first block sets the width (a later one of another width raises
    as above); a state of such keys, made on the CPU kernel, does not load."""
    with mlx_knorm.use_backend("metal-emulator"):
        cache = cache_after(0)
        with pytest.raises(ValueError, match=re.escape("keys: the Metal key-norm kernel supports D <= 512, got D = 600")):
            cache.update_and_fetch(block((1, 2, 3, 600)), block((1, 2, 3, 6)))
        assert cache.empty() and cache.offset == 0
    wide = cache_after(0)
    mx.eval(wide.update_and_fetch(block((1, 2, 3, 600)), block((1, 2, 3, 6))))
    with mlx_knorm.use_backend("metal-emulator"), pytest.raises(
        ValueError, match=re.escape("state field 'keys': the Metal key-norm kernel supports D <= 512")
    ):
        L2NormKVCache.from_state(wide.state)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_the_step_has_no_transform_on_any_backend(transform, backend):
    def step(keys):
        return L2NormKVCache(budget=3, n_sink=1).update_and_fetch(keys, keys)[0]

    keys = block((1, 2, 5, 8))
    with mlx_knorm.use_backend(backend):
        mx.eval(step(keys))
        with pytest.raises(ValueError, match="vmap" if transform == "vmap" else "[vj]p"):
            mx.eval(TRANSFORMS[transform](step, keys))
