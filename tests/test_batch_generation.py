"""mlx-lm 0.32's BatchGenerator and batch_generate with eviction caches
(docs/spec.md §8, batches): greedy tokens and per-token log-probabilities of
every sequence equal generating it alone with L2NormKVCache, and the
extracted caches keep the positions the lone run keeps, while sequences of
different lengths prefill in right-padded chunks, finish early and join
late."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import BatchKVCache

from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import L2NormKVCache, make_knorm_cache
from mlx_knorm.commands.loading import install_cache
from tiny_models import VOCAB, tiny_model

PROMPT_LENGTHS = [5, 23, 14, 40, 9]
MAX_TOKENS = [30, 12, 25, 20, 28]
PREFILL_STEP = 8


def prompts(lengths=PROMPT_LENGTHS, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def alone(model, prompt, max_tokens, config):
    """Greedy tokens, log-probabilities and the cache of one sequence with
    unlinked L2NormKVCaches (the batch cache has no exact small blocks)."""
    cache = [L2NormKVCache(**config) for _ in model.layers]
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=max_tokens,
                                   prefill_step_size=PREFILL_STEP):
        tokens.append(token)
        logprobs.append(lp[token].item())
    return tokens, logprobs, cache


def batched(model, prompt_list, max_tokens, caches, **kwargs):
    gen = BatchGenerator(model, prefill_step_size=PREFILL_STEP, **kwargs)
    uids = gen.insert(prompt_list, max_tokens, caches=caches)
    tokens = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    finished = {}
    batch_types = set()
    while responses := gen.next_generated():
        batch_types |= {type(c) for c in gen._generation_batch.prompt_cache}
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs[r.token].item())
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
    gen.close()
    return [tokens[u] for u in uids], [logprobs[u] for u in uids], [finished[u] for u in uids], batch_types


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("layout", ["slots", "temporal"])
def test_batch_generator_equals_one_at_a_time(arch, layout):
    model = tiny_model(arch, dtype=mx.float32)
    config = dict(budget=8, n_sink=2, recent=2, layout=layout)
    prompt_list = prompts()
    # Two sequences prefill at a time, so the others join the decoding batch
    # later (extend); different max_tokens make them leave early (filter).
    got_tokens, got_logprobs, got_caches, batch_types = batched(
        model, prompt_list, MAX_TOKENS, [make_knorm_cache(model, **config) for _ in prompt_list],
        prefill_batch_size=2, completion_batch_size=4,
    )
    assert batch_types == {BatchL2NormKVCache}
    for index, (prompt, n) in enumerate(zip(prompt_list, MAX_TOKENS)):
        tokens, logprobs, cache = alone(model, prompt, n, config)
        assert got_tokens[index] == tokens, f"sequence {index}"
        np.testing.assert_allclose(got_logprobs[index], logprobs, rtol=1e-4, atol=1e-4)
        for layer, (a, b) in enumerate(zip(got_caches[index], cache)):
            assert type(a) is L2NormKVCache
            assert a.offset == b.offset
            assert mx.array_equal(a.positions, b.positions).item(), f"sequence {index} layer {layer}"
            np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), atol=1e-4)


def test_eviction_is_not_dropped():
    """The same prompts without eviction give other log-probabilities: the
    batch really evicts (a cache inheriting KVCache.merge would not)."""
    model = tiny_model("llama", dtype=mx.float32)
    prompt_list = prompts([30, 35])
    config = dict(budget=8, n_sink=2, recent=0)
    _, evicting, caches, types_seen = batched(model, prompt_list, [10, 10],
                                              [make_knorm_cache(model, **config) for _ in prompt_list])
    _, full, _, full_types = batched(model, prompt_list, [10, 10], None)
    assert types_seen == {BatchL2NormKVCache} and full_types == {BatchKVCache}
    assert all(c.size() == 8 for cs in caches for c in cs)
    assert not np.allclose(evicting, full, atol=1e-3)


def test_batch_generate_and_the_evaluate_path():
    """batch_generate with given prompt caches, and with none: then it builds
    caches through make_prompt_cache, i.e. model.make_cache(), which the
    commands install (mlx_lm.evaluate's generation path)."""
    model = tiny_model("qwen2", dtype=mx.float32)
    config = dict(budget=8, n_sink=1, recent=1)
    prompt_list = prompts([12, 3, 21])
    tokenizer = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    expected = [alone(model, p, 15, config)[0] for p in prompt_list]
    given = batch_generate(model, tokenizer, prompt_list, max_tokens=15, return_token_ids=True,
                           prompt_caches=[make_knorm_cache(model, **config) for _ in prompt_list],
                           prefill_step_size=PREFILL_STEP)
    assert given.token_ids == expected
    install_cache(model, lambda m: make_knorm_cache(m, **config))
    built = batch_generate(model, tokenizer, prompt_list, max_tokens=15, return_token_ids=True,
                           return_prompt_caches=True, prefill_step_size=PREFILL_STEP)
    assert built.token_ids == expected
    assert all(type(c) is L2NormKVCache and c.size() == 8 for cs in built.caches for c in cs)


def test_prompt_caches_with_history_merge():
    """Sequences that arrive with a cache already holding a prefix (a prompt
    cache hit) continue as they would alone."""
    model = tiny_model("llama", dtype=mx.float32)
    config = dict(budget=8, n_sink=2, recent=1)
    prefixes, rests = prompts([19, 4, 0 + 1]), prompts([6, 13, 9], seed=5)
    caches = []
    for prefix in prefixes:
        cache = [L2NormKVCache(**config) for _ in model.layers]
        mx.eval(model(mx.array(prefix)[None], cache=cache))
        caches.append(cache)
    got, _, _, _ = batched(model, rests, [12, 12, 12], caches)
    for index, (prefix, rest) in enumerate(zip(prefixes, rests)):
        cache = [L2NormKVCache(**config) for _ in model.layers]
        mx.eval(model(mx.array(prefix)[None], cache=cache))
        tokens = [t for t, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=12,
                                              prefill_step_size=PREFILL_STEP)]
        assert got[index] == tokens, f"sequence {index}"
