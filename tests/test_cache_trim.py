"""Trim and exact small blocks (docs/spec.md §8): ``trim(n)`` removes the
newest tokens exactly while no eviction has ranked them, as many as that
allows past them, and says how many; a short block of linked caches attends
as single steps do; so mlx-lm's speculative decoding gives the tokens of
ordinary decoding."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import trim_prompt_cache

from mlx_knorm.cache import EXACT_BLOCK, L2NormKVCache, make_knorm_cache

from conftest import assert_bitwise_equal
from tiny_models import HEAD_DIM, KV_HEADS, teacher_forced, tiny_model, tokens

LAYOUTS = ("slots", "temporal")
STREAM = 64  # rows drawn per seed: the blocks of a test take a prefix of them


def rows(total: int, seed: int, batch: int = 1) -> tuple[mx.array, mx.array]:
    key, value = mx.random.split(mx.random.key(seed))
    shape = (batch, KV_HEADS, total, HEAD_DIM)
    return mx.random.normal(shape, key=key).astype(mx.float16), mx.random.normal(shape, key=value).astype(mx.float16)


def fed(blocks: list[int], seed: int = 0, **config) -> L2NormKVCache:
    """A cache fed ``blocks`` of one stream of rows."""
    keys, values = rows(STREAM, seed)
    cache, start = L2NormKVCache(**config), 0
    for size in blocks:
        cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
        start += size
    mx.eval(cache._buffers())
    return cache


def without_last(blocks: list[int], n: int) -> list[int]:
    """``blocks`` with the ``n`` newest tokens removed (emptied blocks dropped)."""
    out = list(blocks)
    while n:
        take = min(n, out[-1])
        out[-1] -= take
        n -= take
        if out[-1] == 0:
            out.pop()
    return out


def assert_same_cache(a: L2NormKVCache, b: L2NormKVCache) -> None:
    """The same stored rows in the same slots, offset and trimmable count."""
    assert (a.filled, a.offset, a.trimmable()) == (b.filled, b.offset, b.trimmable())
    for x, y, name in zip(a._buffers(), b._buffers(), ("keys", "values", "norms", "positions")):
        if x is not None or y is not None:
            assert_bitwise_equal(x[:, :, : a.filled], y[:, :, : b.filled], name)


def assert_same_logical_state(a: L2NormKVCache, b: L2NormKVCache) -> None:
    """The same rows once the pending eviction is applied, and offset (an
    empty cache with or without arrays of no rows alike)."""
    assert a.state[4:] == b.state[4:]
    for x, y, name in zip(a.state[:4], b.state[:4], ("keys", "values", "norms", "positions")):
        if x is None or y is None:
            assert a.offset == 0 and (x is None or x.shape[2] == 0) and (y is None or y.shape[2] == 0)
        else:
            assert_bitwise_equal(x, y, name)


def expected_trimmable(blocks: list[int], budget: int) -> int:
    """The rows of the updates since the last step that evicted a row."""
    filled = count = 0
    for size in blocks:
        count = size + (0 if filled > budget else count)
        filled = min(filled, budget) + size
    return count


configs = st.fixed_dictionaries(
    dict(
        budget=st.integers(4, 10),
        n_sink=st.integers(0, 2),
        recent=st.integers(0, 1),
        keep=st.sampled_from(["low", "high"]),
        layout=st.sampled_from(LAYOUTS),
    )
)


@given(configs, st.lists(st.integers(0, 6), min_size=1, max_size=8),
       st.lists(st.integers(0, 14), min_size=1, max_size=4), st.integers(0, 3))
def test_trims_remove_what_they_can_exactly_and_say_how_much(config, blocks, counts, seed):
    """Call after call, as KVCache's trims while nothing was evicted: each
    removes ``min(n, trimmable())`` and returns it; the cache is the cache
    that never saw the tokens removed, now and at the next block."""
    cache = fed(blocks, seed, **config)
    assert cache.is_trimmable()
    assert cache.trimmable() == expected_trimmable(blocks, config["budget"]) >= blocks[-1]
    removed = 0
    for n in counts:
        before = copy.deepcopy(cache)
        trimmed = cache.trim(n)
        assert trimmed == min(n, before.trimmable())
        assert cache.trimmable() == before.trimmable() - trimmed
        if trimmed == 0:
            assert_same_cache(cache, before)
        removed += trimmed
    if expected_trimmable(blocks, config["budget"]) == sum(blocks):
        # Nothing was ever evicted: KVCache's counts, min(n, tokens left).
        left = sum(blocks)
        for n in counts:
            left -= min(n, left)
        assert cache.offset == left
    never_saw = fed(without_last(blocks, removed), seed, **config)
    assert_same_logical_state(cache, never_saw)
    # The same future: the next block returns the same rows, and trims the same.
    keys, values = rows(3, seed + 100)
    for a, b in zip(cache.update_and_fetch(keys, values), never_saw.update_and_fetch(keys, values)):
        assert_bitwise_equal(a, b)
    assert_same_cache(cache, never_saw)


def test_mlx_lm_s_trim_prompt_cache_counts_are_kvcache_s_under_the_budget():
    """mlx-lm's tests/test_prompt_cache.py::test_trim_cache with eviction
    caches for its KVCaches: ten tokens, trim 7, then 4 asked and 3 left."""
    cache = [fed([10], budget=64, n_sink=1) for _ in range(2)]
    assert trim_prompt_cache(cache, 7) == 7
    assert trim_prompt_cache(cache, 4) == 3
    assert [c.offset for c in cache] == [0, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trim_edges_on_the_last_block(layout):
    config = dict(budget=8, n_sink=1, layout=layout)
    blocks = [12, 1, 1, 4]  # the prefill evicts at the next step, and every step after it
    cache = fed(blocks, **config)
    assert cache.trimmable() == 4
    assert cache.trim(0) == 0 and cache.offset == 18
    # One more than the last block: an older row may have been evicted for
    # them, so it trims the last block and says so.
    assert cache.trim(5) == 4 and cache.trimmable() == 0
    assert cache.offset == 14 and cache.size() == 8
    reference = fed(blocks[:3], **config)
    assert mx.array_equal(cache.positions, reference.positions).item()
    for a, b in zip(cache.state[:4], reference.state[:4]):
        assert_bitwise_equal(a, b)
    assert cache.trim(1) == 0


def test_trims_reach_back_to_the_last_evicting_step():
    # Below the budget nothing is evicted, so everything can be trimmed.
    cache = fed([3, 1, 2], budget=8, n_sink=1)
    assert cache.trimmable() == 6
    assert cache.trim(6) == 6 and cache.offset == 0 and cache.size() == 0 and cache.trimmable() == 0
    # Filling to budget + 1 evicts at the next step only: [5, 4] can still go back to 0.
    cache = fed([5, 4], budget=8, n_sink=1)
    assert cache.trimmable() == 9
    cache = fed([5, 4, 2], budget=8, n_sink=1)
    assert cache.trimmable() == 2


def test_a_trim_past_the_last_evicting_step_would_have_been_wrong():
    """Past the last evicting step, the naive trim (dropping the newest rows)
    differs from the cache that never saw them: the row evicted in their
    favour is gone."""
    config = dict(budget=4, n_sink=0, layout="temporal")
    blocks = [4, 1, 1]
    cache = fed(blocks, **config)
    assert cache.trimmable() == 1
    naive = copy.deepcopy(cache)
    naive.filled -= 2
    naive.offset -= 2
    never_saw = fed(without_last(blocks, 2), **config)
    assert not mx.array_equal(naive.positions, never_saw.positions).item()


def test_trim_arguments_and_loaded_states():
    cache = fed([3, 2], budget=8, n_sink=1)
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.trim(-1)
    with pytest.raises(TypeError, match="n"):
        cache.trim(1.5)
    # A state with every position stored trims back to the start.
    loaded = L2NormKVCache.from_state(cache.state)
    assert loaded.trimmable() == 5 and loaded.trim(5) == 5
    # One that has evicted cannot tell what it evicted for whom.
    evicted = L2NormKVCache.from_state(fed([12, 1], budget=8, n_sink=1).state)
    assert evicted.trimmable() == 0 and evicted.trim(1) == 0
    # Trimmed back to the start, as KVCache, and no further.
    assert loaded.trim(1) == 0 and loaded.offset == 0
    assert L2NormKVCache().trim(1) == 0


def block_and_single_steps(model, cache_of, prompt: mx.array, block: mx.array):
    """Logits of ``block`` fed at once and token by token after ``prompt``."""
    results = []
    for sizes in ([block.shape[1]], [1] * block.shape[1]):
        cache = cache_of(model)
        model(prompt, cache=cache)
        results.append(mx.concatenate(teacher_forced(model, cache, block, sizes), axis=1))
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_short_block_of_linked_caches_attends_as_single_steps(layout):
    model = tiny_model("llama", mx.float32)
    ids = tokens(2, 30, seed=9)
    prompt, block = ids[:, :24], ids[:, 24:]
    linked = lambda m: make_knorm_cache(m, budget=16, n_sink=2, recent=1, layout=layout)
    at_once, one_by_one = block_and_single_steps(model, linked, prompt, block)
    assert mx.allclose(at_once, one_by_one, rtol=1e-5, atol=1e-5).item()
    # Not linked (a plain KVCache layer receives the model's mask), the block
    # attends to rows that the single steps had evicted.
    unlinked = lambda m: make_knorm_cache(m, budget=16, n_sink=2, recent=1, layout=layout, skip_layers=(2,))
    at_once, one_by_one = block_and_single_steps(model, unlinked, prompt, block)
    assert not mx.allclose(at_once, one_by_one, rtol=1e-3, atol=1e-3).item()


def test_the_segment_mask_and_its_plan():
    model = tiny_model("llama", mx.float32)
    cache = make_knorm_cache(model, budget=8, n_sink=1)
    model(tokens(1, 10), cache=cache)
    mask = cache[0].make_mask(3)
    # 8 kept after the pending eviction; query j sees its 9 rows.
    assert mask.shape == (3, 27) and mask.dtype == mx.bool_
    assert mask.astype(mx.int32).sum(axis=1).tolist() == [9, 9, 9]
    assert cache[0].make_mask(EXACT_BLOCK + 1) == "causal"
    # A copy of the list stays linked among itself.
    clone = copy.deepcopy(cache)
    assert clone[0]._mask_plan is clone[1]._mask_plan is not cache[0]._mask_plan
    # A layer holding another row count than the layer the plan came from
    # refuses the block, unchanged.
    kv = mx.zeros((1, KV_HEADS, 3, HEAD_DIM), mx.float16)
    clone[0].make_mask(3)
    clone[1].filled = 7  # 7 kept, where the plan counts 8
    with pytest.raises(ValueError, match="out of step"):
        clone[1].update_and_fetch(kv, kv)
    assert clone[1].offset == 10
    # A trim ends the plan: the block it was made for is gone.
    clone[0].make_mask(3)
    assert cache[0]._mask_plan.block is None and clone[0]._mask_plan.block == (10, 3, 8)
    clone[0].trim(0)
    assert clone[0]._mask_plan.block == (10, 3, 8)
    clone[0].update_and_fetch(kv, kv)
    clone[0].trim(3)
    assert clone[0]._mask_plan.block is None


@pytest.fixture(scope="module")
def byte_model():
    """The shipped trained byte-level model, and a draft of its first two layers."""
    from mlx_knorm.quality.cli import load

    model, tokenizer, _ = load(None)
    draft, _, _ = load(None)
    draft.model.layers = draft.model.layers[:2]
    model.set_dtype(mx.float32)
    draft.set_dtype(mx.float32)
    return model, draft, tokenizer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_speculative_decoding_gives_the_tokens_of_ordinary_decoding(byte_model, layout):
    from mlx_knorm.quality.data import heldout_texts

    model, draft, tokenizer = byte_model
    prompt = mx.array(tokenizer.encode(heldout_texts()[1][:150]))
    caches = lambda m: make_knorm_cache(m, budget=48, n_sink=2, layout=layout)
    plain = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=caches(model), max_tokens=80)]
    target, draft_cache = caches(model), caches(draft)
    spec = list(speculative_generate_step(
        prompt, model, draft, prompt_cache=target + draft_cache, max_tokens=80, num_draft_tokens=3
    ))
    assert [int(t) for t, _, _ in spec] == plain
    accepted = sum(from_draft for _, _, from_draft in spec)
    assert 0 < accepted < len(spec)  # verify blocks both accepted and rejected drafts
    # Every rejected draft was trimmed from the target: it holds the prompt
    # and the answer (its last token fed or not), as the ordinary cache does.
    assert len({c.offset for c in target}) == 1
    assert target[0].offset in (prompt.size + len(plain) - 1, prompt.size + len(plain))
