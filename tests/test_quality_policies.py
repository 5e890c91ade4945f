"""Eviction policies of the evaluations: names, equal memory, masks with a recent window, their caches; error bars."""

from __future__ import annotations

import math
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_knorm.cache import L2NormKVCache
from mlx_knorm.quality.policies import (DEFAULT_POLICIES, Policy, RandomEvictionCache, kept_mask,
                                        parse_policies, policy_cache)
from mlx_knorm.quality.stats import bootstrap_interval, perplexity_interval, wilson_interval

from tiny_models import tiny_model


def test_policy_names_parse_back_to_the_same_policy():
    policy = Policy.parse("keep-low+recent=0.25+skip=1,0")
    assert policy == Policy("keep-low", Fraction(1, 4), (0, 1))
    assert policy.name == "keep-low+recent=1/4+skip=0,1" and Policy.parse(policy.name) == policy
    assert [p.name for p in parse_policies("keep-low; window random")] == ["keep-low", "window", "random"]
    assert len({p.name for p in DEFAULT_POLICIES}) == 9
    assert "recent 1/2 of budget" in Policy.parse("keep-high+recent=1/2").label


@pytest.mark.parametrize("text, match", [
    ("oldest", "score must be one of"), ("keep-low+recent=1", r"\[0, 1\)"), ("keep-low+recent=x", "expected"),
    ("window+recent=1/4", "takes no \\+recent"), ("keep-low+skip=0,0", "distinct"), ("keep-low+keep=2", "expected"),
    ("keep-low+recent=1/0", "expected"), ("keep-low+skip=-1", "distinct layer indices"),
])
def test_bad_policy_names_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)
    with pytest.raises(ValueError):
        parse_policies("")


def test_equal_memory_gives_skipped_layers_the_whole_context_and_the_others_the_rest():
    layers = tuple(range(30))
    plain, skipping = Policy("keep-low"), Policy("keep-low", skip=(0, 1))
    assert plain.layer_budget(128, 1024, layers, 4) == 128
    # 30 layers x 128 rows = 2 x 1024 + 28 x 64.
    assert skipping.layer_budget(128, 1024, layers, 4) == 64
    assert skipping.layer_budget(256, 1024, layers, 4) == (30 * 256 - 2048) // 28
    # Layers not attended (sliding-window ones) do not count.
    assert Policy("keep-low", skip=(5,)).layer_budget(100, 400, (0, 1, 2, 3), 4) == 100
    # No room: the skipped layers alone exceed the memory, or the recent window and sinks fill it.
    assert skipping.layer_budget(64, 1024, layers, 4) is None
    assert Policy("keep-low", Fraction(1, 2)).layer_budget(8, 1024, layers, 4) is None
    assert Policy("keep-low", Fraction(1, 4)).recent_rows(64) == 16


def test_kept_mask_protects_the_recent_window_of_each_prefix():
    # Key norms rise with position, so keep-low alone keeps the oldest rows.
    scores = mx.arange(10, dtype=mx.float32)[None] + 1
    plain = np.array(kept_mask(scores, budget=4, n_sink=1, keep="low"))[0]
    assert np.flatnonzero(plain[9]).tolist() == [0, 1, 2, 3, 9]
    recent = np.array(kept_mask(scores, budget=4, n_sink=1, keep="low", recent=2))[0]
    # Query 9 sees sink 0, the lowest evictable row (1), the recent window [7, 9) and itself.
    assert np.flatnonzero(recent[9]).tolist() == [0, 1, 7, 8, 9]
    assert np.flatnonzero(recent[6]).tolist() == [0, 1, 4, 5, 6]
    high = np.array(kept_mask(scores, budget=4, n_sink=1, keep="high", recent=2))[0]
    assert np.flatnonzero(high[9]).tolist() == [0, 6, 7, 8, 9]
    for first, stop in [(0, 4), (4, 9), (9, 10)]:
        block = np.array(kept_mask(scores, 4, 1, "low", first, stop, recent=2))[0]
        assert np.array_equal(block, recent[first:stop, :stop])


def _positions(keys: mx.array) -> np.ndarray:
    return np.array(keys[0, :, :, 0]).astype(int)


def test_random_eviction_cache_keeps_sinks_the_recent_window_and_the_lowest_draws():
    budget, n_sink, recent = 8, 2, 2
    cache = RandomEvictionCache(budget, n_sink, mx.random.key(3), recent)
    seen = 0
    for block in (5, 6, 1, 1, 9):
        stored = None if cache.keys is None else (_positions(cache.keys), np.array(cache.scores[0]))
        # Each row's first value is its position, so the rows can be told apart.
        keys = mx.broadcast_to(mx.arange(seen, seen + block, dtype=mx.float32)[None, None, :, None], (1, 2, block, 4))
        k, v = cache.update_and_fetch(keys, keys + 1)
        mask = cache.make_mask(block)
        seen += block
        assert cache.offset == seen and mx.array_equal(v, k + 1).item()
        returned = _positions(k)
        assert (returned[:, -block:] == np.arange(seen - block, seen)).all()  # the new rows, attended
        if stored is not None and stored[0].shape[1] > budget:
            positions, scores = stored
            for head in range(2):
                rows = positions[head]
                protected = (rows < n_sink) | (rows >= rows.max() + 1 - recent)
                order = np.argsort(np.where(protected, -np.inf, scores[head]), kind="stable")
                assert returned[head, :-block].tolist() == sorted(rows[order[:budget]].tolist())
            assert not np.array_equal(scores[0], scores[1])  # each head draws its own numbers
        assert mask == "causal" or mask is None
    assert cache.size() == budget and cache.nbytes > 0


def test_policy_caches_are_the_real_caches_at_the_policys_rows():
    model = tiny_model("llama", dtype=mx.float32, layers=4)
    assert all(type(c) is KVCache for c in policy_cache(model, None, 16, 64))
    low = policy_cache(model, Policy.parse("keep-high+recent=1/4"), 16, 64, n_sink=2)
    assert all(isinstance(c, L2NormKVCache) and (c.budget, c.recent, c.keep, c.n_sink) == (16, 4, "high", 2)
               for c in low)
    skipping = policy_cache(model, Policy.parse("keep-low+skip=0,1"), 24, 32)
    assert [type(c).__name__ for c in skipping] == ["KVCache", "KVCache", "L2NormKVCache", "L2NormKVCache"]
    assert skipping[2].budget == (4 * 24 - 2 * 32) // 2
    window = policy_cache(model, Policy("window"), 16, 64)
    assert all(isinstance(c, RotatingKVCache) and (c.max_size, c.keep) == (17, 4) for c in window)
    random = policy_cache(model, Policy.parse("random+recent=1/2"), 16, 64)
    assert all(isinstance(c, RandomEvictionCache) and (c.budget, c.recent) == (16, 8) for c in random)
    with pytest.raises(ValueError, match="no room"):
        policy_cache(model, Policy.parse("keep-low+skip=0,1"), 8, 64)
    with pytest.raises(ValueError, match="cannot skip layers"):
        policy_cache(model, Policy("window", skip=(0,)), 16, 64)


def test_wilson_interval_known_values():
    assert wilson_interval(0, 4) == pytest.approx((0.0, 0.4899), abs=1e-4)
    assert wilson_interval(4, 4) == pytest.approx((0.5101, 1.0), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_bootstrap_intervals_cover_the_estimate_and_collapse_on_constant_data():
    assert bootstrap_interval([0.3] * 8) == pytest.approx((0.3, 0.3))
    assert perplexity_interval([math.log(17.0)] * 8) == pytest.approx((17.0, 17.0))
    values = np.random.default_rng(0).normal(size=8)
    low, high = bootstrap_interval(values)
    assert low < values.mean() < high
    # Per-window rows (per layer) are averaged within a resample.
    rows = np.stack([values, values + 1], axis=1)
    assert bootstrap_interval(rows) == pytest.approx((low + 0.5, high + 0.5))


def test_quantized_policies_are_the_quantized_caches_holding_packed_rows():
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_knorm.cache import QuantizedL2NormKVCache
    from mlx_knorm.quality.policies import row_bytes
    from tiny_models import KV_HEADS, tokens

    model = tiny_model("llama", dtype=mx.float32, layers=3, head_dim=64)
    quantized = policy_cache(model, Policy.parse("keep-low+recent=1/2+bits=4"), 16, 48)
    floats = policy_cache(model, Policy.parse("keep-low+recent=1/2"), 16, 48)
    assert all(type(c) is QuantizedL2NormKVCache and (c.bits, c.group_size, c.budget, c.recent) == (4, 64, 16, 8)
               for c in quantized)
    ids = tokens(1, 48)
    for start in range(0, 48, 8):
        for cache in (quantized, floats):
            mx.eval(model(ids[:, start : start + 8], cache=cache))
    # Layer 0's keys do not depend on attention: the same kept rows, scored before quantization.
    assert mx.array_equal(quantized[0].positions, floats[0].positions)
    for q, f in zip(quantized, floats):
        packed, scales, _ = q.keys
        assert packed.dtype == mx.uint32 and packed.shape[-1] == 64 * 4 // 32 and scales.shape[-1] == 1
        slots = packed.shape[2]
        assert q.nbytes == KV_HEADS * slots * row_bytes(64, 4, bits=4) == KV_HEADS * slots * 88
        assert f.nbytes == KV_HEADS * f.keys.shape[2] * row_bytes(64, 4) == KV_HEADS * f.keys.shape[2] * 520
    alone = policy_cache(model, Policy.parse("full+bits=8"), 16, 48)
    assert all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (8, 64) for c in alone)
    skipping = policy_cache(model, Policy.parse("keep-low+skip=0+bits=8"), 24, 32)
    assert [type(c).__name__ for c in skipping] == ["QuantizedKVCache"] + ["QuantizedL2NormKVCache"] * 2


@pytest.mark.parametrize("text", ["window+bits=4", "random+bits=8", "full", "full+recent=1/4+bits=4",
                                  "full+skip=0+bits=4", "keep-low+bits=7", "keep-low+bits=x"])
def test_bad_quantized_policies_are_refused(text):
    with pytest.raises(ValueError, match="policy"):
        Policy.parse(text)
