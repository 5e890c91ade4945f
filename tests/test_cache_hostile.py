"""The caches under hostile use, round two (issue 52, items 1-7 and the
speculative case): a batch with a user's scorer whose state is not an
array refuses filter and extend before anything changes; copies of a cache
keep its scorer, so they batch with it; a batch state is refused for what
its own next step would refuse (a sequence with no token whose keydiff sum
moved, a field that is not an array); a sequence extracted from a batch
with a user's scorer trims back to its scorer's state; a quantized knorm
cache that took a NaN key reads its own state back; and the caches
themselves refuse a speculative verify block that would attend as a block."""

from __future__ import annotations

import copy
import functools
import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import (EXACT_BLOCK, MAX_DRAFT_TOKENS, L2NormKVCache, QuantizedL2NormKVCache,
                             make_knorm_cache)

HEADS, DIM = 2, 8
CONFIG = dict(budget=6, n_sink=1, recent=2)


def rows(seed: int, count: int, batch: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((batch, HEADS, count, DIM)).astype(np.float32))


def fed(cache, keys):
    cache.update_and_fetch(keys, keys)
    mx.eval(cache.keys)
    return cache


def squares(keys, values, state):
    return mx.sum(keys * keys, axis=-1).astype(mx.float32), state


def dict_state(keys, values, state):
    """A user's scorer whose state is not an array."""
    return mx.sum(keys, axis=-1).astype(mx.float32), {"rows": keys.shape[2] + (state or {}).get("rows", 0)}


def counted(keys, values, state):
    """A path-independent user's scorer: its state counts each head's rows."""
    count = mx.full(keys.shape[:2], keys.shape[2], mx.float32) + (0 if state is None else state)
    return mx.sum(keys * keys, axis=-1).astype(mx.float32), count


def bits(cache) -> list:
    """Every array the batch cache holds, as bytes, and its host fields."""
    arrays = [*cache._buffers(), cache._score_sum if isinstance(cache._score_sum, mx.array) else None]
    return [None if a is None else (a.shape, np.array(a).tobytes()) for a in arrays] + [
        cache._lo, cache._hi, cache._real, cache.filled, cache.timeline, repr(cache._score_sum)]


def batch_of_dict_states():
    batch = L2NormKVCache.merge([L2NormKVCache(**CONFIG, scorer=dict_state) for _ in range(2)])
    batch.update_and_fetch(rows(0, 3, batch=2), rows(0, 3, batch=2))
    assert batch._score_sum == {"rows": 3}
    return batch


def test_filter_with_a_users_scorer_state_that_is_not_an_array_is_refused_before_it_changes_anything():
    batch = batch_of_dict_states()
    before = bits(batch)
    with pytest.raises(ValueError, match=r"dict_state\) batches only with a state that is None or an array"):
        batch.filter([0])
    assert bits(batch) == before and batch.batch_size == 2
    batch.update_and_fetch(rows(1, 1, batch=2), rows(1, 1, batch=2))  # still a working batch of two
    with pytest.raises(ValueError, match=r"batch_indices \[2\] must lie in \[0, 2\)"):
        batch.filter([2])


def test_extend_with_a_users_scorer_state_that_is_not_an_array_changes_nothing():
    batch, other = batch_of_dict_states(), batch_of_dict_states()
    before, theirs = bits(batch), bits(other)
    with pytest.raises(ValueError, match="batches only with a state that is None or an array"):
        batch.extend(other)
    assert bits(batch) == before and bits(other) == theirs
    assert batch.keys.shape[0] == batch.batch_size == 2


@pytest.mark.parametrize("make_scorer", [
    lambda: functools.partial(squares),
    lambda: type("Scorer", (), {"__call__": lambda self, k, v, s: squares(k, v, s)})(),
], ids=["partial", "callable object"])
def test_copies_of_a_cache_with_a_users_scorer_batch_with_it(make_scorer):
    scorer = make_scorer()
    cache = fed(L2NormKVCache(**CONFIG, scorer=scorer), rows(0, 4))
    copied = copy.deepcopy(cache)
    assert copied.scorer is scorer
    batch = L2NormKVCache.merge([copied, fed(L2NormKVCache(**CONFIG, scorer=scorer), rows(1, 2))])
    assert batch.batch_size == 2 and batch.scorer is scorer
    batch.extend(copy.deepcopy(batch))  # a batch's copy joins it too
    assert batch.batch_size == 4
    assert np.array_equal(np.array(batch.extract(0).state[0]), np.array(cache.state[0]))


def test_a_batch_state_whose_keydiff_sum_moved_for_a_sequence_with_no_token_is_refused():
    batch = L2NormKVCache.merge([fed(L2NormKVCache(**CONFIG, scorer="keydiff"), rows(0, 3)),
                                 L2NormKVCache(**CONFIG, scorer="keydiff")])
    state = list(batch.state)
    BatchL2NormKVCache([0, 0], **CONFIG, keep="low").state = state  # the batch's own state loads
    state[14] = mx.concatenate([state[14][:1], mx.ones((1, HEADS, DIM))])
    target = BatchL2NormKVCache([0, 0], **CONFIG, keep="low")
    with pytest.raises(ValueError, match=r"'scorer_state'.*no token.*\[1\]"):
        target.state = state
    assert target.keys is None and target.scorer == "knorm"


@pytest.mark.parametrize("field", ["keys", "values", "norms", "positions"])
def test_a_batch_state_field_that_is_not_an_array_is_refused_naming_it(field):
    batch = L2NormKVCache.merge([fed(L2NormKVCache(**CONFIG), rows(0, 3))])
    state = list(batch.state)
    state[("keys", "values", "norms", "positions").index(field)] = np.array(state[2])
    target = BatchL2NormKVCache([0], **CONFIG, keep="low")
    with pytest.raises(TypeError, match=f"field '{field}' must be an mlx.core.array, got ndarray"):
        target.state = state
    assert target.keys is None


def test_a_sequence_extracted_with_a_users_scorer_trims_back_to_its_scorers_state():
    batch = L2NormKVCache.merge([L2NormKVCache(**CONFIG, scorer=counted) for _ in range(2)])
    for seed in range(4):
        batch.update_and_fetch(rows(seed, 3, batch=2), rows(seed, 3, batch=2))
    cache = batch.extract(1)
    assert cache.offset == 12 and cache.size() == CONFIG["budget"]  # it has evicted
    loaded = np.array(cache._score_sum)
    assert loaded.shape == (1, HEADS) and (loaded == 12).all()
    fed(cache, rows(9, 1))
    assert (np.array(cache._score_sum) == 13).all()
    assert cache.trim(1) == 1
    assert cache._score_sum is not None and np.array_equal(np.array(cache._score_sum), loaded)


@pytest.mark.parametrize("bits_", [4, 8])
def test_a_quantized_knorm_cache_that_took_a_nan_key_reads_its_own_state_back(tmp_path, bits_):
    keys = np.random.default_rng(0).standard_normal((1, HEADS, 5, 64)).astype(np.float32)
    keys[0, 1, 2, 7] = np.nan
    cache = QuantizedL2NormKVCache(**CONFIG, bits=bits_)
    fed(cache, mx.array(keys))
    assert np.isnan(np.array(cache.state[2])[0, 1, 2])
    reloaded = QuantizedL2NormKVCache.from_state(cache.state)
    assert np.array_equal(np.array(reloaded.state[2]), np.array(cache.state[2]), equal_nan=True)
    save_prompt_cache(str(tmp_path / "q.safetensors"), [cache])
    (loaded,) = load_prompt_cache(str(tmp_path / "q.safetensors"))
    assert np.array_equal(np.array(loaded.state[2]), np.array(cache.state[2]), equal_nan=True)
    # A number that does not fit the row is still refused.
    state = list(cache.state)
    state[2] = mx.where(mx.isnan(state[2]), 0.0, state[2] * 4)
    with pytest.raises(ValueError, match="'norms'"):
        QuantizedL2NormKVCache(**CONFIG, bits=bits_).state = state


@pytest.fixture(scope="module")
def byte_model():
    from mlx_knorm.quality.cli import load

    model, tokenizer, _ = load(None)
    draft, _, _ = load(None)
    draft.model.layers = draft.model.layers[:2]
    return model, draft, tokenizer


def test_the_caches_refuse_a_verify_block_that_would_attend_as_a_block(byte_model):
    model, draft, tokenizer = byte_model
    prompt = mx.array(tokenizer.encode("The caches refuse what they cannot serve exactly. " * 2))
    caches = lambda m: make_knorm_cache(m, budget=48, n_sink=2)
    target, drafts = caches(model), caches(draft)
    steps = speculative_generate_step(prompt, model, draft, prompt_cache=target + drafts, max_tokens=40,
                                      num_draft_tokens=MAX_DRAFT_TOKENS + 1)
    with pytest.raises(ValueError, match=rf"num_draft_tokens must be at most {MAX_DRAFT_TOKENS} .*got "
                                         rf"{MAX_DRAFT_TOKENS + 1}"):
        list(steps)
    # Refused before any layer took the block: every layer holds the prompt
    # but for the drafts that mlx-lm's own clean-up (its `finally`) trims.
    assert {c.offset for c in target} == {prompt.size - 1 - (MAX_DRAFT_TOKENS + 1)}
    # mlx-lm's generate with a draft model takes the same path.
    with pytest.raises(ValueError, match="num_draft_tokens must be at most"):
        mlx_lm.generate(model, tokenizer, prompt.tolist(), max_tokens=40, draft_model=draft,
                        prompt_cache=caches(model) + caches(draft), num_draft_tokens=MAX_DRAFT_TOKENS + 5)
    # At the limit the verify blocks are exact: the tokens of ordinary decoding.
    plain = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=caches(model), max_tokens=40)]
    spec = speculative_generate_step(prompt, model, draft, prompt_cache=caches(model) + caches(draft),
                                     max_tokens=40, num_draft_tokens=MAX_DRAFT_TOKENS)
    assert [int(t) for t, _, _ in spec] == plain


def test_a_long_block_past_the_budget_outside_speculative_decoding_attends_as_a_block(byte_model):
    """A prefill chunk (generate_step's, here EXACT_BLOCK + 4 tokens at a
    time, past the budget) is served as docs/spec.md §8 has it."""
    model, _, tokenizer = byte_model
    prompt = mx.array(tokenizer.encode("A chunked prompt longer than the budget, served as blocks. " * 3))
    cache = make_knorm_cache(model, budget=24, n_sink=2)
    tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=3,
                                               prefill_step_size=EXACT_BLOCK + 4)]
    assert len(tokens) == 3 and cache[0].offset >= prompt.size + 2


def test_a_batch_that_kept_no_sequence_reads_its_own_state_back():
    batch = L2NormKVCache.merge([fed(L2NormKVCache(**CONFIG), rows(0, 3))])
    batch.filter([])
    target = BatchL2NormKVCache([], **CONFIG, keep="low")
    target.state = batch.state
    assert target.batch_size == 0 and target.filled == batch.filled


def test_a_second_right_padded_prefill_before_finalize_is_refused():
    """Its ranges would make the padding rows the first one stored real
    (a state that the batch's own load check then refuses)."""
    batch = L2NormKVCache.merge([fed(L2NormKVCache(**CONFIG), rows(0, 3)), L2NormKVCache(**CONFIG)])
    batch.prepare(lengths=[2, 0], right_padding=[0, 2])
    batch.update_and_fetch(rows(1, 2, batch=2), rows(1, 2, batch=2))
    before = bits(batch)
    with pytest.raises(ValueError, match="right-padded prefill is pending; finalize"):
        batch.prepare(lengths=[1, 3], right_padding=[2, 0])
    assert bits(batch) == before
    batch.finalize()
    BatchL2NormKVCache([0, 0], **CONFIG, keep="low").state = batch.state


def test_a_batch_whose_left_padding_outlasts_the_budget_reads_its_state_back_mid_prefill():
    """A left padding longer than the first block, evicted before the
    sequence's first token: the step writes its later padding rows at the
    timeline's positions, past their slots, and the batch's state (which
    mlx-lm evaluates after every prefill chunk) still loads."""
    batch = BatchL2NormKVCache([5, 0], budget=2, n_sink=0, recent=1, keep="low")
    for count in (3, 3, 2):
        batch.update_and_fetch(rows(count, count, batch=2), rows(count + 1, count, batch=2))
        reloaded = BatchL2NormKVCache([0, 0], budget=2, n_sink=0, recent=1, keep="low")
        reloaded.state = batch.state
        assert bits(reloaded)[:4] == bits(batch)[:4]
    # Padding out of slot order is still refused.
    state = list(batch.state)
    state[3] = mx.concatenate([state[3][:1, :, ::-1], state[3][1:]])
    with pytest.raises(ValueError, match="sequence 0: field 'positions'"):
        BatchL2NormKVCache([0, 0], budget=2, n_sink=0, recent=1, keep="low").state = state


def test_a_right_padded_prefill_inside_a_left_padding_is_refused():
    batch = BatchL2NormKVCache([7, 0], budget=2, n_sink=0, recent=1, keep="low")
    batch.update_and_fetch(rows(0, 3, batch=2), rows(1, 3, batch=2))
    before = bits(batch)
    with pytest.raises(ValueError, match=r"sequences \[0\] are still in their left padding"):
        batch.prepare(lengths=[2, 1], right_padding=[0, 1])
    assert bits(batch) == before


def in_place_counter(fail):
    """A user's scorer that keeps its running count as numpy code would, in
    place (``state += ...``), and refuses while ``fail["on"]``."""

    def scorer(keys, values, state):
        if state is None:
            state = mx.zeros(keys.shape[:2])
        state += keys.shape[2]
        keys *= 2
        if fail["on"]:
            raise RuntimeError("the scorer refuses")
        return mx.sum(keys * keys, axis=-1), state

    return scorer


def test_a_users_scorer_updating_its_state_in_place_changes_no_cache_when_it_raises():
    fail = {"on": False}
    cache = L2NormKVCache(budget=6, n_sink=1, recent=2, scorer=in_place_counter(fail))
    cache.update_and_fetch(rows(1, 7), rows(2, 7))
    state, stored = np.array(cache._score_sum), np.array(cache.keys)
    fail["on"] = True
    keys, values = rows(3, 1), rows(4, 1)
    given = np.array(keys)
    with pytest.raises(RuntimeError, match="refuses"):
        cache.update_and_fetch(keys, values)
    assert np.array_equal(np.array(cache._score_sum), state)
    assert np.array_equal(np.array(cache.keys), stored) and np.array_equal(np.array(keys), given)


def test_a_users_scorer_updating_its_state_in_place_trims_back_exactly():
    cache = L2NormKVCache(budget=6, n_sink=1, recent=2, scorer=in_place_counter({"on": False}))
    for seed, count in enumerate((7, 1, 1)):
        keys = rows(seed, count)
        cache.update_and_fetch(keys, rows(seed + 10, count))
    assert np.array_equal(np.array(cache.keys[:, :, cache.filled - 1]), np.array(keys[:, :, 0]))
    assert cache.trim(1) == 1
    assert np.array(cache._score_sum).tolist() == [[8.0, 8.0]]


def test_a_users_scorer_that_feeds_its_own_cache_is_refused_and_changes_nothing():
    box = {}

    def feeding(keys, values, state):
        box["cache"].update_and_fetch(rows(9, 1), rows(9, 1))
        return squares(keys, values, state)

    cache = box["cache"] = L2NormKVCache(**CONFIG, scorer=squares)
    fed(cache, rows(0, 7))
    cache.scorer = feeding
    before = [cache.offset, cache.filled, np.array(cache.keys).tobytes(), np.array(cache.positions).tobytes()]
    with pytest.raises(RuntimeError, match="another operation is changing this cache"):
        cache.update_and_fetch(rows(1, 1), rows(1, 1))
    assert [cache.offset, cache.filled, np.array(cache.keys).tobytes(), np.array(cache.positions).tobytes()] == before
    cache.scorer = squares
    fed(cache, rows(1, 1))
    assert cache.offset == 8


def test_a_second_thread_changing_a_cache_mid_step_is_refused():
    inside, tried = threading.Event(), threading.Event()

    def waiting(keys, values, state):
        inside.set()
        assert tried.wait(10)
        return squares(keys, values, state)

    cache = L2NormKVCache(**CONFIG, scorer=squares)
    fed(cache, rows(0, 7))
    cache.scorer = waiting
    refused = []

    def other():
        assert inside.wait(10)
        try:
            cache.trim(1)
        except RuntimeError as e:
            refused.append(str(e))
        tried.set()

    thread = threading.Thread(target=other)
    thread.start()
    cache.update_and_fetch(rows(1, 1), rows(1, 1))
    thread.join()
    assert refused and "another operation is changing this cache" in refused[0]
    assert cache.offset == 8 and cache.trimmable() == 1
