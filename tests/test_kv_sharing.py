"""``keys_and_values()`` and the layers that attend to another layer's rows
(docs/spec.md §8, KV sharing): it returns what the last ``update_and_fetch``
returned, on every cache of ours; gemma3n's and afm7's sharing layers read
exactly the kept rows of the layer they share, with a mask that fits them,
under eviction, in exact small blocks, batched and (gemma3n) quantized, and
afm7's take their queries' true position."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import afm7
from mlx_lm.models.cache import make_prompt_cache

from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import (EXACT_BLOCK, L2NormCacheBase, L2NormKVCache, QuantizedL2NormKVCache, layer_caches,
                             link_prompt_cache, make_knorm_cache)
from mlx_knorm.sharing import Afm7KVReuseAttention, share_positions

from conftest import assert_bitwise_equal
from model_families import build, feed

SHARING = ("gemma3n", "afm7")


def rows(batch: int, size: int, seed: int, width: int = 32):
    k, v = mx.random.split(mx.random.key(seed))
    shape = (batch, 2, size, width)
    return mx.random.normal(shape, key=k), mx.random.normal(shape, key=v)


def assert_same_rows(a, b) -> None:
    for x, y in zip(a, b):
        for p, q in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
            assert_bitwise_equal(p, q)


@given(st.sampled_from(["float", "quantized"]), st.sampled_from(["slots", "temporal"]),
       st.lists(st.integers(1, 7), min_size=1, max_size=6), st.booleans(), st.integers(0, 3))
def test_keys_and_values_is_what_the_last_update_returned(kind, layout, blocks, linked, seed):
    """Single steps, blocks past the budget (eviction pending) and exact
    small blocks of linked caches (segments, computed again)."""
    extra = dict(group_size=32, bits=4) if kind == "quantized" else {}
    make = QuantizedL2NormKVCache if kind == "quantized" else L2NormKVCache
    cache = make(budget=5, n_sink=1, recent=1, layout=layout, **extra)
    if linked:
        link_prompt_cache([cache])
    assert cache.keys_and_values() == (None, None)
    for index, size in enumerate(blocks):
        keys, values = rows(1, size, seed * 10 + index)
        cache.make_mask(size)  # a linked cache plans an exact block here
        returned = cache.update_and_fetch(keys, values)
        mx.eval(returned)
        assert_same_rows(cache.keys_and_values(), returned)
        assert_same_rows(cache.keys_and_values(), returned)
    # After a trim, the slots the cache holds.
    trimmed = cache.trim(1)
    if cache.keys is None:
        assert cache.keys_and_values() == (None, None)
    elif trimmed:
        held = tuple(tuple(a[:, :, : cache.filled] for a in r) if isinstance(r, tuple) else r[:, :, : cache.filled]
                     for r in (cache.keys, cache.values))
        assert_same_rows(cache.keys_and_values(), held)


def test_an_exact_block_s_segments_come_back_from_keys_and_values():
    cache = L2NormKVCache(budget=4, n_sink=1, recent=1)
    link_prompt_cache([cache])
    cache.update_and_fetch(*rows(1, 6, 0))
    mask = cache.make_mask(3)
    keys, values = cache.update_and_fetch(*rows(1, 3, 1))
    assert keys.shape[2] == mask.shape[1] > cache.filled
    assert_same_rows(cache.keys_and_values(), (keys, values))


def test_the_batch_cache_s_keys_and_values():
    """mlx-lm's test_batch_kv_cache: after a filter, the slots left."""
    caches = []
    for size in (3, 5, 4):
        cache = L2NormKVCache(budget=4, n_sink=1)
        cache.update_and_fetch(*rows(1, size, size))
        caches.append(cache)
    batch = L2NormKVCache.merge(caches)
    assert isinstance(batch, BatchL2NormKVCache)
    returned = batch.update_and_fetch(*rows(3, 2, 9))
    assert_same_rows(batch.keys_and_values(), returned)
    batch.filter([0, 2])
    keys, values = batch.keys_and_values()
    assert keys.shape[:3] == (2, 2, batch.filled)
    assert BatchL2NormKVCache([0], budget=4, n_sink=1, recent=0, keep="low").keys_and_values() == (None, None)


def ids(batch: int, length: int, seed: int = 5) -> mx.array:
    return mx.random.randint(0, 32, (batch, length), key=mx.random.key(seed))


def record_shared_reads(cache: list) -> list:
    """``(what keys_and_values() returned, what that layer's last update
    returned)`` for every read of an eviction cache of ``cache``."""
    reads = []
    for layer in layer_caches(cache):
        if isinstance(layer, L2NormCacheBase):
            update, read, last = layer.update_and_fetch, layer.keys_and_values, []

            def recorded_update(k, v, update=update, last=last):
                last[:] = [update(k, v)]
                return last[0]

            def recorded_read(read=read, last=last):
                out = read()
                reads.append((out, last[0]))
                return out

            layer.update_and_fetch, layer.keys_and_values = recorded_update, recorded_read
    return reads


@pytest.mark.parametrize("family", SHARING)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_sharing_layer_reads_the_kept_rows_of_the_layer_it_shares(family, batch):
    """Through a prefill past the budget, single steps and an exact block:
    every read is the rows the shared layer's last update returned."""
    model = build(family)
    cache = make_knorm_cache(model, budget=4, n_sink=1, recent=1)
    reads = record_shared_reads(cache)
    feed(model, cache, ids(batch, 12), [6, 1, 3, 1, 1])
    assert len(reads) == 5  # one a forward pass
    for rows_read, updated in reads:
        assert_same_rows(rows_read, updated)
    # The exact block's read is its segments: more rows than the cache holds.
    assert reads[2][0][0].shape[2] > 4 + 3
    assert all(c.size() <= 4 for c in layer_caches(cache) if isinstance(c, L2NormCacheBase))


def test_afm7_s_reuse_layers_take_their_queries_true_position():
    """Past the budget the rows no longer count the positions: the reuse
    layers rotate their queries from the cache's offset (before the block),
    not from ``rows - L``."""
    model = build("afm7")
    cache = make_knorm_cache(model, budget=4, n_sink=1, recent=1)
    reuse = [layer.self_attn for layer in model.model.kv_reuse_layers]
    assert all(type(a) is Afm7KVReuseAttention for a in reuse) and share_positions(model) == 0
    seen = []

    class Recording(nn.Module):
        def __init__(self, rope):
            super().__init__()
            self._rope = rope

        def __call__(self, x, offset=0):
            seen.append(offset)
            return self._rope(x, offset=offset)

    for attention in reuse:
        attention.rope = Recording(attention.rope)
    start = 0
    for size in [6, 1, 3, 1]:
        before = cache[-1].offset
        seen.clear()
        feed(model, cache, ids(1, 11)[:, start:], [size])
        assert seen == [before] * len(reuse)
        start += size


@pytest.mark.parametrize("family", SHARING)
def test_within_the_budget_sharing_models_give_mlx_lm_s_logits(family):
    model = build(family)
    for batch in (1, 2):
        tokens = ids(batch, 11)
        expected = feed(model, make_prompt_cache(model), tokens, [6, 1, 3, 1])
        got = feed(model, make_knorm_cache(model, budget=64, n_sink=1), tokens, [6, 1, 3, 1])
        for a, b in zip(got, expected):
            assert mx.array_equal(a, b).item()


def unlinked(cache: list) -> list:
    """The batch cache has no exact small blocks: the lone run must not either."""
    for layer in layer_caches(cache):
        if isinstance(layer, L2NormCacheBase):
            layer._mask_plan = None
    return cache


@pytest.mark.parametrize("family", SHARING)
def test_batched_sharing_models_give_each_sequence_s_lone_tokens(family):
    """mlx-lm's BatchGenerator (left padding, joins, leaves) with eviction:
    the sharing layers read the batch cache's rows, with per-sequence
    positions (afm7), as each sequence alone."""
    model = build(family)
    config = dict(budget=6, n_sink=1, recent=2)
    rng = np.random.default_rng(3)
    prompt_list = [rng.integers(0, 32, n).tolist() for n in (4, 13, 9)]
    max_tokens = [12, 6, 9]
    generator = BatchGenerator(model, prefill_step_size=8, prefill_batch_size=2, completion_batch_size=3)
    uids = generator.insert(prompt_list, max_tokens, caches=[make_knorm_cache(model, **config) for _ in prompt_list])
    tokens, kinds = {u: [] for u in uids}, set()
    while responses := generator.next_generated():
        kinds |= {type(c) for c in layer_caches(generator._generation_batch.prompt_cache)}
        for r in responses:
            tokens[r.uid].append(r.token)
    generator.close()
    assert BatchL2NormKVCache in kinds
    for uid, prompt, n in zip(uids, prompt_list, max_tokens):
        cache = unlinked(make_knorm_cache(model, **config))
        alone = [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n,
                                             prefill_step_size=8)]
        assert tokens[uid] == alone


def test_gemma3n_s_sharing_layer_reads_quantized_rows():
    """gemma3n with the eviction cache quantized (mlx-lm's kv_bits): its
    sharing layer reads the quantized tuples, through the quantized
    attention path, and stays within the budget."""
    model = build("gemma3n")
    cache = make_knorm_cache(model, budget=4, n_sink=1, recent=1)
    tokens = ids(1, 12)
    feed(model, cache, tokens, [6])
    cache = [c.to_quantized(group_size=32, bits=8) if isinstance(c, L2NormKVCache) else c for c in cache]
    reads = record_shared_reads(cache)
    for logits in feed(model, cache, tokens[:, 6:], [1, 3, 1, 1]):
        assert mx.all(mx.isfinite(logits)).item()
    assert len(reads) == 4 and all(isinstance(rows_read[0], tuple) for rows_read, _ in reads)
    for rows_read, updated in reads:
        assert_same_rows(rows_read, updated)
    assert all(c.size() <= 4 for c in cache if isinstance(c, QuantizedL2NormKVCache))


def test_the_exact_block_limit_still_applies():
    """Blocks longer than EXACT_BLOCK are ordinary blocks: keys_and_values
    gives slots [0, filled)."""
    cache = L2NormKVCache(budget=4, n_sink=1)
    link_prompt_cache([cache])
    cache.update_and_fetch(*rows(1, 5, 0))
    cache.make_mask(EXACT_BLOCK + 1)
    keys, _ = cache.update_and_fetch(*rows(1, EXACT_BLOCK + 1, 1))
    assert keys.shape[2] == cache.filled == 4 + EXACT_BLOCK + 1
    assert_same_rows(cache.keys_and_values(), (keys, _))


def test_a_plain_afm7_model_is_unchanged_by_the_adapter():
    """The adapted reuse layers give mlx-lm's logits with mlx-lm's own cache."""
    plain, adapted = build("afm7"), build("afm7")
    make_knorm_cache(adapted, budget=8)
    assert type(plain.model.kv_reuse_layers[0].self_attn) is afm7.KVReuseAttention
    tokens = ids(2, 9)
    for a, b in zip(feed(adapted, make_prompt_cache(adapted), tokens, [5, 1, 3]),
                    feed(plain, make_prompt_cache(plain), tokens, [5, 1, 3])):
        assert mx.array_equal(a, b).item()
