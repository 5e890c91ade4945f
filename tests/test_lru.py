"""mlx_knorm.lru.LRUPromptCache: mlx-lm's prompt cache store, never asking a
cache for a trim it cannot do (docs/spec.md §8, trim)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_knorm.cache import L2NormKVCache
from mlx_knorm.lru import LRUPromptCache, can_trim_prompt_cache, tokens_held

from tiny_models import HEAD_DIM, KV_HEADS

MODEL = "tiny"
PROMPT = list(range(100, 140))  # 40 tokens


def prompt_cache(tokens: list[int], blocks: list[int], budget: int, skip_first: bool = False) -> list:
    """Two layers fed ``tokens`` in ``blocks`` (a KVCache first when ``skip_first``)."""
    layers = [KVCache() if skip_first else L2NormKVCache(budget=budget, n_sink=2), L2NormKVCache(budget=budget, n_sink=2)]
    keys = mx.random.normal((1, KV_HEADS, len(tokens), HEAD_DIM), key=mx.random.key(len(tokens))).astype(mx.float16)
    start = 0
    for size in blocks:
        for layer in layers:
            layer.update_and_fetch(keys[:, :, start : start + size], keys[:, :, start : start + size])
        start += size
    assert start == len(tokens)
    return layers


def check_answer(tokens: list[int], cache, rest: list[int]) -> int:
    """A fetched cache holds exactly the prompt's tokens it does not return."""
    held = len(tokens) - len(rest)
    assert rest == tokens[held:]
    if cache is not None:
        assert {layer.offset for layer in cache} == {held}
    else:
        assert held == 0
    return held


@pytest.mark.parametrize("skip_first", [False, True])
def test_a_cache_that_evicted_is_not_trimmed_past_its_last_block(skip_first):
    # Prefill 39 over a budget of 16, one decode step: only that step's token can go.
    store = LRUPromptCache()
    store.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [39, 1], 16, skip_first))
    question = PROMPT[:30] + [7, 8]
    cache, rest = store.fetch_nearest_cache(MODEL, question)
    assert cache is None and rest == question
    # mlx-lm's own class trims it anyway, ignoring the count trimmed (the
    # last step's token): the cache then holds 39 tokens where it says it
    # answers for 30.
    theirs = mlx_lm_cache.LRUPromptCache()
    theirs.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [39, 1], 16, skip_first))
    cache, rest = theirs.fetch_nearest_cache(MODEL, question)
    assert len(question) - len(rest) == 30 and cache[-1].offset == 39
    # With a last block of 2, a prompt one token shorter is within it (the
    # store keeps the prompt's last token to process, so it trims 2).
    store.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [38, 2], 16, skip_first))
    cache, rest = store.fetch_nearest_cache(MODEL, PROMPT[:-1])
    assert check_answer(PROMPT[:-1], cache, rest) == 38


def test_a_cache_that_never_evicted_trims_as_mlx_lm_does():
    store = LRUPromptCache()
    store.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [30, 1, 9], 64))
    question = PROMPT[:25] + [1, 2, 3]
    cache, rest = store.fetch_nearest_cache(MODEL, question)
    assert check_answer(question, cache, rest) == 25
    # The stored entry is untouched: fetch trims a copy.
    cache, rest = store.fetch_nearest_cache(MODEL, PROMPT)
    assert rest == PROMPT[-1:] and cache[0].offset == 39  # an exact hit keeps a token to process
    assert store.fetch_nearest_cache(MODEL, PROMPT)[0][0].offset == 39


def test_prefixes_the_new_cache_cannot_stand_in_for_are_kept():
    store = LRUPromptCache()
    short = PROMPT[:20]
    store.insert_cache(MODEL, short, prompt_cache(short, [20], 16))
    # Evicting past its last block: the 20-token entry still answers its prompt.
    store.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [39, 1], 16))
    assert len(store) == 2
    cache, rest = store.fetch_nearest_cache(MODEL, short + [5])
    assert check_answer(short + [5], cache, rest) == 20
    # A cache that can trim back to the prefix replaces it, as in mlx-lm.
    store = LRUPromptCache()
    store.insert_cache(MODEL, short, prompt_cache(short, [20], 64))
    store.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [39, 1], 64))
    assert len(store) == 1
    cache, rest = store.fetch_nearest_cache(MODEL, short)
    assert check_answer(short, cache, rest) == 19


def test_can_trim_prompt_cache_asks_each_layer():
    layers = prompt_cache(PROMPT, [39, 1], 16, skip_first=True)
    assert can_trim_prompt_cache(layers, 1) and not can_trim_prompt_cache(layers, 2)
    assert can_trim_prompt_cache([KVCache()], 5)


@pytest.mark.parametrize("skip_first", [False, True])
def test_a_cache_is_stored_under_the_tokens_it_holds(skip_first):
    # Speculative decoding's last token, the target's own, is in the server's
    # key but not in the caches: a follow-up must feed it again.
    store = LRUPromptCache()
    answered = PROMPT + [7]
    store.insert_cache(MODEL, answered, prompt_cache(PROMPT, [39, 1], 16, skip_first))
    follow_up = answered + [8, 9]
    cache, rest = store.fetch_nearest_cache(MODEL, follow_up)
    assert check_answer(follow_up, cache, rest) == 40 and rest == [7, 8, 9]
    # mlx-lm's own class answers from the 40 tokens as if they were 41.
    theirs = mlx_lm_cache.LRUPromptCache()
    theirs.insert_cache(MODEL, answered, prompt_cache(PROMPT, [39, 1], 16, skip_first))
    cache, rest = theirs.fetch_nearest_cache(MODEL, follow_up)
    assert rest == [8, 9] and cache[0].offset == 40
    # A key no longer than the cache's offset is kept as given.
    assert tokens_held(prompt_cache(PROMPT, [40], 16), 40) == 40
    assert tokens_held([], 3) == 3


@pytest.mark.parametrize("trimmable", [True, False])
def test_an_exact_hit_leaves_the_prompt_s_last_token_to_process(trimmable):
    """mlx-lm's store answers a prompt equal to a stored key with no tokens,
    which generation refuses; ours trims the cache by one where it can."""
    store = LRUPromptCache()
    store.insert_cache(MODEL, PROMPT[:20], prompt_cache(PROMPT[:20], [20], 64))
    if trimmable:
        stored = prompt_cache(PROMPT, [39, 1], 16)
    else:  # a RotatingKVCache that wrapped cannot trim
        stored = [RotatingKVCache(max_size=16)]
        keys = mx.zeros((1, KV_HEADS, len(PROMPT), HEAD_DIM), mx.float16)
        stored[0].update_and_fetch(keys, keys)
    store.insert_cache(MODEL, PROMPT, stored)
    cache, rest = store.fetch_nearest_cache(MODEL, PROMPT)
    held = check_answer(PROMPT, cache, rest)
    assert held == (39 if trimmable else 20) and rest
    theirs = mlx_lm_cache.LRUPromptCache()
    theirs.insert_cache(MODEL, PROMPT, prompt_cache(PROMPT, [39, 1], 16))
    assert theirs.fetch_nearest_cache(MODEL, PROMPT)[1] == []


class SettingsKeyed(LRUPromptCache):
    """The store as the server keys it: by model and cache settings."""

    def fetch_nearest_cache(self, model, tokens):
        return super().fetch_nearest_cache((model, "settings"), tokens)

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        super().insert_cache((model, "settings"), tokens, prompt_cache, cache_type=cache_type)


def reloaded(layers: list) -> list:
    """``layers`` through their state, as a batch's extract() gives them:
    past the budget, a cache whose history is unknown trims nothing."""
    for layer in layers:
        layer.state = layer.state
    assert not can_trim_prompt_cache(layers, 1)
    return layers


@pytest.mark.parametrize("store_class", [LRUPromptCache, SettingsKeyed])
def test_an_exact_hit_on_a_cache_that_cannot_trim_falls_back_once_keyed(store_class):
    """The fallback of an exact hit looks up the prompt without its last
    token under the key as the store holds it (the server's subclass adds
    its settings once): the cache stored there as it is, else the nearest."""
    store = store_class()
    store.insert_cache(MODEL, PROMPT[:20], reloaded(prompt_cache(PROMPT[:20], [20], 16)))
    store.insert_cache(MODEL, PROMPT, reloaded(prompt_cache(PROMPT, [40], 16)))
    cache, rest = store.fetch_nearest_cache(MODEL, PROMPT)
    assert check_answer(PROMPT, cache, rest) == 20
    store.insert_cache(MODEL, PROMPT[:-1], reloaded(prompt_cache(PROMPT[:-1], [39], 16)))
    cache, rest = store.fetch_nearest_cache(MODEL, PROMPT)
    assert check_answer(PROMPT, cache, rest) == 39


def test_remove_drops_one_entry_and_its_bytes():
    store = LRUPromptCache()
    short, long = PROMPT[:20], PROMPT
    store.insert_cache(MODEL, short, prompt_cache(short, [20], 16), cache_type="user")
    store.insert_cache(MODEL, long, prompt_cache(long, [39, 1], 16))
    assert len(store) == 2 and store.entry(MODEL, PROMPT[:10]) is None
    kept = store.entry(MODEL, long).nbytes
    assert store.remove(MODEL, short) and not store.remove(MODEL, short)
    assert len(store) == 1 and store.nbytes == kept and store.entry(MODEL, short) is None
    assert store.stats_by_type()["user"] == {"n_sequences": 0, "n_bytes": 0}
    # The longer entry still answers, and the store evicts it as before.
    cache, rest = store.fetch_nearest_cache(MODEL, long + [5])
    assert check_answer(long + [5], cache, rest) == 40
    store.trim_to(n_sequences=0)
    assert len(store) == 0 and store.nbytes == 0
