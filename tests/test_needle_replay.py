"""Replaying the full cache's forward pass into a policy's cache (quality/replay.py) and the needle grid's sharing.

A replayed chunk must leave every cache exactly as the model's own forward
pass would, and a chunk where that would not hold must be refused with the
caches untouched. Checked on the shipped byte-level model (an mlx-lm llama).
"""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlx_knorm.cache import EXACT_BLOCK
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.quality.needle import (KEY_DIGITS, answer, build_prompt, make_haystack, make_keys, prefill,
                                      run_grid)
from mlx_knorm.quality.policies import Policy, attention_layers, policy_cache
from mlx_knorm.quality.replay import Replay, mask_requests, same_rows

STEP, CHUNKS, BUDGET, CONTEXT = 24, 6, 64, 128  # STEP > EXACT_BLOCK, as in use


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


def _arrays(cache):
    return [a for a in cache.state if isinstance(a, mx.array)] if not cache.empty() else []


def _tokens(n, seed=3):
    return [int(i) for i in np.random.default_rng(seed).integers(32, 127, size=n)]


def _expected_chunks(model, policy):
    """Chunks a cache holds every earlier row for: ``rows // STEP + 1`` (the window: while no query
    of the chunk reaches past its ``rows + 1`` rows, so that its mask is still "causal")."""
    if policy is None:
        return CHUNKS
    rows = policy.layer_budget(BUDGET, CONTEXT, attention_layers(model), 4)
    if policy.score == "window":
        return min(CHUNKS, (rows + 1) // STEP)
    return min(CHUNKS, rows // STEP + 1)


@pytest.mark.parametrize("name", [None, "keep-low", "keep-high+recent=1/2", "window", "random", "keep-low+skip=0"])
def test_replayed_chunks_leave_every_cache_as_the_model_would(shipped, name):
    model, _ = shipped
    policy = None if name is None else Policy.parse(name)
    ids = _tokens((CHUNKS + 1) * STEP)
    run = policy_cache(model, policy, BUDGET, CONTEXT)
    prefill(model, run, ids[: CHUNKS * STEP], STEP)

    replay = Replay(model, STEP)
    replayed = policy_cache(model, policy, BUDGET, CONTEXT)
    chunk = 0
    while chunk < CHUNKS and replay.chunk(replayed, ids, chunk):
        chunk += 1
    assert chunk == _expected_chunks(model, policy) and replay.replayed_tokens == chunk * STEP
    prefill(model, replayed, ids[chunk * STEP : CHUNKS * STEP], STEP)

    for a, b in zip(run, replayed):
        assert type(a) is type(b) and a.offset == b.offset
        assert all(same_rows(x, y) for x, y in zip(_arrays(a), _arrays(b), strict=True))
    # And they go on alike: the next chunk's logits, bit for bit.
    assert same_rows(model(mx.array(ids[CHUNKS * STEP :])[None], cache=run),
                     model(mx.array(ids[CHUNKS * STEP :])[None], cache=replayed))


def test_a_block_small_enough_for_the_exact_segment_mask_is_not_replayed(shipped):
    """At the chunk whose rows overflow the budget, a block of at most EXACT_BLOCK rows gets the segment
    mask (docs/spec.md §8), not "causal": the model would not read what the full cache reads."""
    model, _ = shipped
    step = EXACT_BLOCK
    replay = Replay(model, step)
    caches = policy_cache(model, Policy("keep-low"), BUDGET, CONTEXT)
    ids, chunk = _tokens(8 * step), 0
    while replay.chunk(caches, ids, chunk):
        chunk += 1
    # Every row is still held at chunk BUDGET // step, but its mask is the segment mask.
    assert chunk == BUDGET // step and caches[0].size() == chunk * step


class _ReversedKVCache(KVCache):
    """Holds every row, under the causal mask, but hands back the keys (or
    only the values) last first: not what the full cache hands."""

    reverse_keys = True

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return (k[..., ::-1, :] if self.reverse_keys else k), v[..., ::-1, :]


class _ReversedValuesKVCache(_ReversedKVCache):
    reverse_keys = False


@pytest.mark.parametrize("odd", [_ReversedKVCache, _ReversedValuesKVCache])
def test_a_chunk_the_model_would_read_otherwise_is_refused_and_changes_nothing(shipped, odd):
    model, _ = shipped
    ids = _tokens(3 * STEP)
    replay = Replay(model, STEP)
    caches = policy_cache(model, None, BUDGET, CONTEXT)
    assert replay.chunk(caches, ids, 0)
    caches[-1] = odd()
    held = list(caches)
    assert not replay.chunk(caches, ids, 1)  # the last layer holds no rows: size() says so
    for cache, (k, v) in zip(caches[-1:], replay.records.chunk(ids, 0)[-1:]):
        cache.update_and_fetch(mx.array(k), mx.array(v))
    before = [[mx.array(a) for a in _arrays(c)] for c in caches]
    assert not replay.chunk(caches, ids, 1)  # it holds them, but hands some back reversed
    assert caches == held and replay.replayed_tokens == STEP
    for cache, saved in zip(caches, before):
        assert all(same_rows(a, b) for a, b in zip(_arrays(cache), saved, strict=True))


def test_caches_at_another_offset_or_quantized_are_refused(shipped):
    model, _ = shipped
    ids = _tokens(2 * STEP)
    replay = Replay(model, STEP)
    shifted = policy_cache(model, None, BUDGET, CONTEXT)
    for cache in shifted:
        cache.offset = 5  # holds no rows, but RoPE would rotate from position 5
    assert not replay.chunk(shifted, ids, 0)
    quantized = [QuantizedKVCache(group_size=64, bits=4) for _ in policy_cache(model, None, BUDGET, CONTEXT)]
    assert not replay.chunk(quantized, ids, 0) and replay.replayed_tokens == 0


def test_a_cache_that_keeps_the_handed_rows_cannot_write_into_the_records(shipped):
    """RotatingKVCache(max_size=STEP) keeps the first chunk's keys as its buffer, then writes the next
    token into that buffer: into its own handle, not into the records."""
    model, _ = shipped
    ids = _tokens(2 * STEP)
    replay = Replay(model, STEP)
    before = [(mx.array(k) + 0, mx.array(v) + 0) for k, v in replay.records.chunk(ids, 0)]
    caches = policy_cache(model, Policy("window"), STEP - 1, CONTEXT)
    assert replay.chunk(caches, ids, 0)
    mx.eval(model(mx.array(ids[STEP : STEP + 1])[None], cache=caches))
    after = replay.records.chunk(ids, 0)
    assert all(same_rows(a, b) and same_rows(c, d) for (a, c), (b, d) in zip(before, after))


def test_models_whose_own_cache_is_not_kv_caches_never_replay():
    model = types.SimpleNamespace(make_cache=lambda: [KVCache(), RotatingKVCache(max_size=8)])
    assert mask_requests(model) is None
    replay = Replay(model, STEP)
    assert replay.records is None and not replay.chunk([KVCache(), RotatingKVCache(max_size=8)], _tokens(STEP), 0)


def test_records_are_computed_once_and_dropped_oldest_first_past_their_bytes(shipped):
    model, _ = shipped
    ids = _tokens(3 * STEP)
    replay = Replay(model, STEP)
    first = replay.records.chunk(ids, 2)
    assert replay.records.computed_tokens == 3 * STEP
    assert replay.records.chunk(ids, 2) is first and replay.records.computed_tokens == 3 * STEP
    one_chunk = sum(k.nbytes + v.nbytes for k, v in first)
    small = Replay(model, STEP, max_bytes=one_chunk)
    again = small.records.chunk(ids, 2)
    assert all(same_rows(a, b) for pair, other in zip(first, again) for a, b in zip(pair, other))
    small.records.chunk(ids, 0)  # dropped when chunk 1 came, then chunk 2: computed again
    assert small.records.computed_tokens == 4 * STEP
    with pytest.raises(ValueError, match=f"needs {3 * STEP} tokens"):
        replay.records.chunk(ids[:40], 2)


def test_dropped_records_cost_one_forward_pass_each(shipped):
    """With room for one chunk, asking for the last of ten computes each of them once, not each earlier
    one again for every later one."""
    model, _ = shipped
    ids = _tokens(10 * STEP)
    full = Replay(model, STEP).records.chunks(ids, 9)
    one_chunk = sum(k.nbytes + v.nbytes for k, v in full[0])
    small = Replay(model, STEP, max_bytes=one_chunk)
    assert all(same_rows(a, b) for pair, other in zip(full[9], small.records.chunk(ids, 9))
               for a, b in zip(pair, other))
    assert small.records.computed_tokens == 10 * STEP
    # Asked again: chunk 9 is dropped when chunk 0 is computed again, so all ten are, once each.
    small.records.chunks(ids, 9)
    assert small.records.computed_tokens == 20 * STEP


def test_records_of_equal_chunks_after_other_prefixes_are_their_own(shipped):
    model, _ = shipped
    first, second = _tokens(2 * STEP, seed=3), _tokens(2 * STEP, seed=4)
    second[STEP:] = first[STEP:]
    records = Replay(model, STEP).records
    a, b = records.chunk(first, 1), records.chunk(second, 1)
    assert records.computed_tokens == 4 * STEP
    assert not all(same_rows(x, y) for pair, other in zip(a, b) for x, y in zip(pair, other))


@pytest.mark.parametrize("policy", [None, "keep-low", "window", "keep-low+recent=1/2", "keep-low+skip=0"])
def test_a_policy_shared_across_contexts_answers_as_generate_step_on_each_whole_prompt(shipped, policy):
    """Budget 160 is a half of 320 and a quarter of 640: one task, one haystack pass, both contexts
    (with layer 0 kept whole the rows per layer differ: two tasks)."""
    model, tokenizer = shipped
    parsed = None if policy is None else Policy.parse(policy)
    contexts, fractions, step = (320, 640), (0.5, 0.25), 48
    grid = run_grid(model, tokenizer, haystacks=("passkey",), contexts=contexts, depths=(0.0, 1.0),
                    fractions=fractions, policies=[] if parsed is None else [parsed], keys=1,
                    prefill_step_size=step, full=parsed is None)
    haystack = make_haystack("passkey", tokenizer, max(contexts))
    rng, layers = np.random.default_rng(0), attention_layers(model)
    expected = []
    for context in contexts:
        keys = {d: make_keys(rng, 1) for d in (0.0, 1.0)}
        cuts = [None] if parsed is None else [
            f for f in fractions if parsed.layer_budget(round(f * context), context, layers, 4) is not None]
        expected += [(context, f, d, k) for f in cuts for d in (0.0, 1.0) for k in keys[d]]
    assert [(t.context, t.budget_fraction, t.depth, t.key) for t in grid.trials] == expected
    for trial in grid.trials:
        prompt = build_prompt(haystack, tokenizer, trial.context, trial.depth, trial.key)
        caches = policy_cache(model, parsed, trial.budget or trial.context, trial.context)
        assert trial.answer == answer(model, tokenizer, prompt.tokens, caches, step, KEY_DIGITS + 3)
    # The haystack was read once per (policy, rows): once for both contexts at budget 160.
    tasks = {}
    for t in grid.trials:
        rows = None if parsed is None else parsed.layer_budget(t.budget, t.context, layers, 4)
        tasks.setdefault(rows, []).append(t)
    cuts = {(t.context, t.budget) for t in grid.trials}
    # One merge (the full cache at both contexts; budget 160) unless kept layers make the rows differ.
    assert len(tasks) == len(cuts) - (0 if parsed is not None and parsed.skip else 1)
    at = {id(t): (t.needle_at // step) * step for t in grid.trials}
    assert grid.prefill_tokens == sum(max(at[id(t)] for t in group) + sum(t.prompt_tokens - at[id(t)] for t in group)
                                      for group in tasks.values())
    # The full cache replays only to record for the policies: alone, it has none to record for.
    assert (grid.replayed_tokens > 0 and grid.recorded_tokens > 0) == (parsed is not None)


def test_the_grid_gives_the_same_trials_with_and_without_replay(shipped):
    model, tokenizer = shipped
    kwargs = dict(haystacks=("passkey",), contexts=(320, 640), depths=(0.0, 0.5, 1.0), fractions=(0.25, 0.5),
                  policies=["keep-low", "window", "random", "keep-low+recent=1/4+skip=0"], keys=1,
                  prefill_step_size=32)
    replayed = run_grid(model, tokenizer, **kwargs)
    computed = run_grid(model, tokenizer, replay=False, **kwargs)
    assert replayed.trials == computed.trials and replayed.prefill_tokens == computed.prefill_tokens
    assert computed.replayed_tokens == computed.recorded_tokens == 0 < replayed.replayed_tokens
    with pytest.raises(ValueError, match="replay must be a bool"):
        run_grid(model, tokenizer, replay=1, **kwargs)


def test_a_prompt_of_whole_chunks_leaves_its_last_token_to_the_model(shipped):
    """A trial's prompt whose tail after the snapshot is whole chunks: the last token is the model's to
    read (generate_step's prefill stops one short), so the last whole chunk is not replayed."""
    model, tokenizer = shipped
    haystack = make_haystack("passkey", tokenizer, 400)
    key = make_keys(np.random.default_rng(0), 1)[0]  # the key run_grid draws for depth 0 at seed 0

    def length(context):
        return len(build_prompt(haystack, tokenizer, context, 0.0, key).tokens)

    # A step above EXACT_BLOCK dividing the prompt (the snapshot is at a chunk boundary).
    context, step = next((c, s) for c in range(300, 400) for s in range(EXACT_BLOCK + 1, length(c) // 2)
                         if length(c) % s == 0)
    kwargs = dict(haystacks=("passkey",), contexts=(context,), depths=(0.0,), fractions=(0.99,),
                  policies=["keep-low", "window"], keys=1, prefill_step_size=step)
    replayed = run_grid(model, tokenizer, **kwargs)
    assert replayed.replayed_tokens > 0
    assert replayed.trials == run_grid(model, tokenizer, replay=False, **kwargs).trials
