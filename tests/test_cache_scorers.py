"""The caches ranking by the scorers of docs/spec.md §2a: the rows kept are
the protected top-k of the stream's scores (whatever the blocks), trim
rebuilds keydiff's running sum exactly, states and files carry the scorer,
batches keep each sequence's rows, and the commands and the server take
``--scorer``."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import mlx_knorm
from conftest import ALL_BACKENDS, EMULATOR_SETTINGS, assert_bitwise_equal, requires_emulator
from generators import fill
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache, make_knorm_cache
from mlx_knorm.cache_state import StateError
from mlx_knorm.scorers import QueryFilters
from spec_oracle import kept_rows
from tiny_models import tiny_model, tokens

SCORERS = ("keydiff", "vnorm", "qfilter")
HEADS, DIM = 2, 16


def filters_for(scorer, rng=None):
    if scorer != "qfilter":
        return None
    rng = rng or np.random.default_rng(0)
    return mx.array(rng.standard_normal((HEADS, DIM)).astype(np.float32))


def stream_scores(scorer, keys, values, filters):
    """The scores of every row of a whole stream [1, H, T, D], in one block."""
    state = {"keydiff": mx.zeros((1, HEADS, DIM)), "qfilter": None}.get(scorer)
    if scorer == "qfilter":
        state = mx.broadcast_to(filters, (1, HEADS, DIM))
    return mlx_knorm.row_scores(keys, values if scorer == "vnorm" else None, state, scorer=scorer)[0]


def feed(cache, keys, values, blocks):
    start = 0
    for size in blocks:
        cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
        mx.eval(cache.norms, cache.slot_positions)
        start += size
    return cache


def kept_rows_are_the_top_k(backend, scorer, data, max_length):
    """Whatever the blocks, the cache keeps the rows docs/spec.md §3 keeps
    by the scores of the whole stream (computed once), with those scores."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    length = data.draw(st.integers(1, max_length))
    budget = data.draw(st.integers(3, 24))
    n_sink = data.draw(st.integers(0, 2))
    recent = data.draw(st.integers(0, budget - 1 - n_sink))
    dtype = data.draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    keys = fill(rng, (1, HEADS, length, DIM), data.draw(st.sampled_from(["normal", "ties", "special"])), dtype)
    values = fill(rng, (1, HEADS, length, DIM), "normal", dtype)
    filters = filters_for(scorer, rng)
    blocks = []
    while sum(blocks) < length:
        blocks.append(min(data.draw(st.integers(1, 9)), length - sum(blocks)))
    with mlx_knorm.use_backend(backend):
        cache = feed(L2NormKVCache(budget=budget, n_sink=n_sink, recent=recent, scorer=scorer, filters=filters),
                     keys, values, blocks)
        scores = stream_scores(scorer, keys, values, filters)
    state = cache.state  # the kept rows, the pending eviction applied
    for h in range(HEADS):
        positions = np.array(state[3][0, h]).tolist()
        assert positions == kept_rows(np.array(scores[0, h]).tolist(), budget, n_sink, recent, "low")
        assert np.array(state[2][0, h]).view(np.uint32).tolist() == \
            np.array(scores[0, h])[positions].view(np.uint32).tolist()


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@pytest.mark.parametrize("scorer", SCORERS)
@given(data=st.data())
def test_the_kept_rows_are_the_protected_top_k_of_the_streams_scores(backend, scorer, data):
    kept_rows_are_the_top_k(backend, scorer, data, 60)


@requires_emulator
@EMULATOR_SETTINGS
@pytest.mark.parametrize("scorer", SCORERS)
@given(data=st.data())
def test_the_kept_rows_through_the_metal_emulator(scorer, data):
    """The same through the emulated kernels: every block two or three emulated launches."""
    kept_rows_are_the_top_k("metal-emulator", scorer, data, 24)


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("split", [[30], [1] * 30, [7, 5, 18], [29, 1]])
def test_any_split_keeps_what_one_block_keeps(scorer, split):
    """Path independence (recent = 0 and with a window): the same rows,
    scores, positions and running sum, block by block or at once."""
    rng = np.random.default_rng(len(split))
    keys = fill(rng, (1, HEADS, 30, DIM), "normal", "float16")
    values = fill(rng, (1, HEADS, 30, DIM), "normal", "float16")
    filters = filters_for(scorer, rng)
    for recent in (0, 3):
        make = lambda: L2NormKVCache(budget=9, n_sink=2, recent=recent, scorer=scorer, filters=filters)
        # One more block of one row each, so that both have evicted down to
        # the budget before it.
        last = fill(rng, (1, HEADS, 1, DIM), "normal", "float16")
        one = feed(feed(make(), keys, values, [30]), last, last, [1])
        many = feed(feed(make(), keys, values, split), last, last, [1])
        for name, a, b in zip(("keys", "values", "scores", "positions"), one.state[:4], many.state[:4]):
            assert_bitwise_equal(a, b, name)
        if scorer == "keydiff":
            assert_bitwise_equal(many._score_sum, one._score_sum, "running sum")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_trim_rebuilds_keydiffs_running_sum_exactly(backend):
    """Under the budget call after call, and past it within what
    trimmable() allows: the cache equals the cache that never saw the rows
    trimmed, its running sum included."""
    rng = np.random.default_rng(5)
    keys = fill(rng, (1, HEADS, 40, DIM), "normal", "bfloat16")
    values = fill(rng, (1, HEADS, 40, DIM), "normal", "bfloat16")
    make = lambda: L2NormKVCache(budget=24, n_sink=2, recent=4, scorer="keydiff")
    with mlx_knorm.use_backend(backend):
        cache = feed(make(), keys, values, [10])
        assert cache.trim(7) == 7 and cache.trim(4) == 3
        assert cache.offset == 0 and cache._score_sum is None
        cache = feed(make(), keys, values, [6, 4, 5])
        assert cache.trim(6) == 6
        fresh = feed(make(), keys, values, [6, 3])
        assert_bitwise_equal(cache._score_sum, fresh._score_sum, "sum under budget")
        for name, a, b in zip(("keys", "values", "scores", "positions"), cache.state[:4], fresh.state[:4]):
            assert_bitwise_equal(a, b, name)
        cache = feed(make(), keys, values, [20, 8, 3])  # the step of 3 evicts
        assert cache.trimmable() == 3 and cache.trim(5) == 3
        fresh = feed(make(), keys, values, [20, 8])
        assert_bitwise_equal(cache._score_sum, fresh._score_sum, "sum past budget")
        # The next step, from either, keeps the same rows.
        for c in (cache, fresh):
            feed(c, keys[:, :, 28:], values[:, :, 28:], [12])
        assert_bitwise_equal(cache.state[2], fresh.state[2], "scores after")


@pytest.mark.parametrize("scorer", SCORERS)
def test_files_carry_the_scorer_and_refuse_tampered_scores(tmp_path, scorer):
    rng = np.random.default_rng(1)
    keys = fill(rng, (1, HEADS, 20, DIM), "normal", "float16")
    values = fill(rng, (1, HEADS, 20, DIM), "normal", "float16")
    filters = filters_for(scorer, rng)
    for length in (12, 20):  # under the budget, and past it
        cache = feed(L2NormKVCache(budget=14, n_sink=1, recent=2, scorer=scorer, filters=filters),
                     keys[:, :, :length], values[:, :, :length], [length])
        save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
        loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
        assert loaded.scorer == scorer and loaded.offset == cache.offset
        for a, b in zip(cache.state, loaded.state):
            if isinstance(a, mx.array):
                assert_bitwise_equal(b, a, "state")
        state = list(cache.state)
        # Scores no row has: past keydiff's bound once rows are evicted
        # (±(D + 1): a cosine whose norms may drop tiny squares).
        state[2] = state[2] + (DIM + 2.0)
        with pytest.raises(StateError, match="norms"):
            L2NormKVCache().state = state
        if scorer == "keydiff" and length == 12:
            state = list(cache.state)
            state[11] = state[11] * 2
            with pytest.raises(StateError, match="running sum"):
                L2NormKVCache().state = state


def test_a_scorer_is_checked_by_name():
    with pytest.raises(ValueError, match="scorer"):
        L2NormKVCache(scorer="mean")
    with pytest.raises(ValueError, match="calibrate"):
        L2NormKVCache(scorer="qfilter")
    with pytest.raises(ValueError, match="filters are for the qfilter"):
        L2NormKVCache(scorer="keydiff", filters=mx.zeros((2, 4)))
    cache = L2NormKVCache(scorer="qfilter", filters=mx.zeros((3, DIM)))
    with pytest.raises(ValueError, match="calibrate"):
        cache.update_and_fetch(mx.zeros((1, HEADS, 2, DIM)), mx.zeros((1, HEADS, 2, DIM)))
    assert cache.offset == 0 and cache.keys is None


def test_a_users_scorer_ranks_and_is_checked(tmp_path):
    """A callable scorer: its scores rank the rows (here the position, so
    the cache keeps the earliest), its state comes back; wrong scores raise
    naming it; its cache has no file state."""
    seen = []

    def earliest(keys, values, state):
        seen.append(state)
        first = 0 if state is None else int(state.item())
        positions = mx.arange(first, first + keys.shape[2], dtype=mx.float32)
        return mx.broadcast_to(positions, keys.shape[:3]), mx.array(first + keys.shape[2])

    keys = fill(np.random.default_rng(2), (1, HEADS, 21, DIM), "normal", "float16")
    cache = feed(L2NormKVCache(budget=8, n_sink=0, recent=0, scorer=earliest), keys, keys, [5, 5, 5, 5, 1])
    # The earliest 8 of 21, the last block's row ranked last.
    assert np.array(cache.positions)[0, 0].tolist() == list(range(8))
    assert seen[0] is None and int(seen[-1].item()) == 20
    # mlx-lm evaluates every cache's state while it prefills: the user's state is in it.
    assert cache.state[-1] is cache._score_sum and int(cache.state[-1].item()) == 21
    with pytest.raises(ValueError, match=r"user's scorer \(earliest\): a cache that ranks by one has no state"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    assert not (tmp_path / "c.safetensors").exists()
    with pytest.raises(StateError, match="scorer"):
        cache.state = cache.state
    with pytest.raises(ValueError, match="cannot check its rows under a new configuration"):
        cache.meta_state = ("9", "1", "0", "low", "slots")
    assert np.array(cache.positions)[0, 0].tolist() == list(range(8))
    batch = L2NormKVCache.merge([cache])
    assert int(batch.state[-1].item()) == 21
    with pytest.raises(ValueError, match="no state a file can hold"):
        save_prompt_cache(str(tmp_path / "b.safetensors"), [batch])
    bad = L2NormKVCache(budget=8, scorer=lambda k, v, s: (mx.zeros(k.shape[:3], mx.float16), None))
    with pytest.raises(ValueError, match="must return float32 scores"):
        bad.update_and_fetch(keys[:, :, :2], keys[:, :, :2])


def test_to_quantized_keeps_the_scores_and_trims_no_further_back():
    rng = np.random.default_rng(3)
    keys = fill(rng, (1, HEADS, 20, 64), "normal", "float16")
    cache = feed(L2NormKVCache(budget=32, n_sink=1, recent=2, scorer="keydiff"), keys, keys, [12])
    quantized = cache.to_quantized(group_size=32, bits=8)
    assert quantized.scorer == "keydiff" and quantized.trimmable() == 0 and cache.trimmable() == 12
    assert_bitwise_equal(quantized.state[2], cache.state[2], "scores")
    feed(quantized, keys[:, :, 12:], keys[:, :, 12:], [8])
    assert quantized.trimmable() == 8 and quantized.trim(3) == 3
    state = quantized.state
    restored = QuantizedL2NormKVCache(group_size=32, bits=8)
    restored.state = state
    assert restored.scorer == "keydiff"


def test_batches_keep_each_sequences_rows():
    """merge, batched steps, extract: each sequence's rows, scores and
    running sum are those of its own cache fed alone."""
    rng = np.random.default_rng(4)
    keys = [fill(rng, (1, HEADS, n, DIM), "normal", "float16") for n in (9, 14)]
    more = fill(rng, (2, HEADS, 12, DIM), "normal", "float16")
    make = lambda: L2NormKVCache(budget=10, n_sink=1, recent=2, scorer="keydiff")
    singles = [feed(make(), k, k, [k.shape[2]]) for k in keys]
    batch = L2NormKVCache.merge([copy.deepcopy(c) for c in singles])
    for t in range(12):
        batch.update_and_fetch(more[:, :, t : t + 1], more[:, :, t : t + 1])
        for i, single in enumerate(singles):
            single.update_and_fetch(more[i : i + 1, :, t : t + 1], more[i : i + 1, :, t : t + 1])
    for i, single in enumerate(singles):
        alone = batch.extract(i)
        for name, a, b in zip(("keys", "values", "scores", "positions"), alone.state[:4], single.state[:4]):
            assert_bitwise_equal(a, b, f"sequence {i} {name}")
        assert_bitwise_equal(alone._score_sum, single._score_sum, f"sequence {i} running sum")


@pytest.mark.parametrize("scorer", ["keydiff", "vnorm"])
def test_generation_with_a_scorer_equals_mlx_lms_within_the_budget_and_drafts_exactly(scorer):
    """Greedy tokens equal mlx-lm's own cache's while every token fits the
    budget; past it, speculative decoding with the model as its own draft
    gives the tokens of plain decoding."""
    model = tiny_model("llama", mx.float32)
    prompt = tokens(1, 12)[0]

    def greedy(cache, n, draft=None):
        if draft is None:
            steps = generate_step(prompt, model, prompt_cache=cache)
        else:
            from mlx_lm.generate import speculative_generate_step

            steps = speculative_generate_step(prompt, model, draft, prompt_cache=cache,
                                              num_draft_tokens=3)
        return [int(t) for (t, *_), _ in zip(steps, range(n))]

    ours = greedy(make_knorm_cache(model, budget=64, scorer=scorer), 20)
    assert ours == greedy(make_prompt_cache(model), 20)
    plain = greedy(make_knorm_cache(model, budget=16, scorer=scorer), 30)
    draft_cache = make_knorm_cache(model, budget=16, scorer=scorer) + make_knorm_cache(model, budget=16, scorer=scorer)
    assert greedy(draft_cache, 30, draft=model) == plain


def test_make_knorm_cache_gives_each_layer_its_filters(tmp_path):
    model = tiny_model("llama", mx.float32)
    heads, dim = model.args.num_key_value_heads, model.args.hidden_size // model.args.num_attention_heads
    filters = QueryFilters({i: np.eye(heads, dim, k=i, dtype=np.float32) for i in range(3)})
    path = filters.save(tmp_path / "f.safetensors")
    caches = make_knorm_cache(model, budget=8, scorer="qfilter", filters=path)
    for i, c in enumerate(caches):
        assert c.scorer == "qfilter" and np.array(c._filters).tolist() == filters.filters[i].tolist()
    with pytest.raises(ValueError, match="calibrate"):
        make_knorm_cache(model, budget=8, scorer="qfilter")
    with pytest.raises(ValueError, match="filters are for the qfilter"):
        make_knorm_cache(model, budget=8, scorer="keydiff", filters=path)
    with pytest.raises(ValueError, match="cover layers 0, this model's full-attention layers are 0 to 2"):
        make_knorm_cache(model, budget=8, scorer="qfilter", filters=QueryFilters({0: filters.filters[0]}))
    # Filters of a deeper model with the same head shapes (issue 52, item 10), through the Python API too.
    deeper = QueryFilters(dict(filters.filters), metadata={"model": "deeper", "layers": 30})
    with pytest.raises(ValueError, match="of a model of 30 layers, this model has 3"):
        make_knorm_cache(model, budget=8, scorer="qfilter", filters=deeper)


@pytest.fixture(scope="module")
def command_setup(tmp_path_factory):
    from command_runs import command_env, write_tiny_llama

    env = {**command_env(tmp_path_factory.mktemp("home")), "MLX_KNORM_CACHE": str(tmp_path_factory.mktemp("cache"))}
    return env, write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_generate_takes_a_scorer_and_qfilter_finds_calibrate_s_file(command_setup):
    """--scorer keydiff decodes past the budget; --scorer qfilter without
    filters is refused naming calibrate; after `mlx-knorm calibrate --model
    M` it finds the file and decodes."""
    from command_runs import MLX_KNORM, kv_lines, mlx_lm_stat, run, succeeded

    env, tiny = command_setup
    args = ["generate", "--model", tiny, "--prompt", "hello there", "--max-tokens", "60", "--budget", "32"]
    out = succeeded(run([*MLX_KNORM, *args, "--scorer", "keydiff"], env)).stdout
    assert mlx_lm_stat(out, "Generation") == 60 and kv_lines(out)
    refused = run([*MLX_KNORM, *args, "--scorer", "qfilter"], env)
    assert refused.returncode != 0 and "mlx-knorm calibrate" in refused.stderr
    succeeded(run([*MLX_KNORM, "calibrate", "--model", tiny, "--n-seqs", "1", "--seq-len", "64"], env))
    out = succeeded(run([*MLX_KNORM, *args, "--scorer", "qfilter"], env)).stdout
    assert mlx_lm_stat(out, "Generation") == 60
    bad = run([*MLX_KNORM, *args, "--scorer", "mean"], env)
    assert bad.returncode == 2 and "--scorer" in bad.stderr


def test_the_documented_user_scorer_runs_in_a_models_caches():
    """docs/scorers.md's example scorer, run as written: its scores are the
    cosine of each key with the key before it (the first with itself), its
    state carries the last key across blocks, so a stream split into blocks
    keeps the rows its scores computed at once rank; then the model decodes
    through the documented make_knorm_cache call."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "scorers.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                   if "def unlike_the_previous_key" in block)
    model = tiny_model("llama", layers=2)
    namespace = {"model": model}
    exec(compile(example, "docs/scorers.md", "exec"), namespace)
    scorer, cache = namespace["unlike_the_previous_key"], namespace["cache"]

    rng = np.random.default_rng(11)
    keys = fill(rng, (1, HEADS, 21, DIM), "normal", "float16")
    k = np.array(keys.astype(mx.float32), dtype=np.float64)[0]
    before = np.concatenate([k[:, :1], k[:, :-1]], axis=1)
    cosine = (k * before).sum(-1) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(before, axis=-1))
    whole, _ = scorer(keys, keys, None)
    np.testing.assert_allclose(np.array(whole)[0], cosine, rtol=1e-5)

    def precomputed(block, values, state):
        start = 0 if state is None else int(state.item())
        return whole[:, :, start : start + block.shape[2]], mx.array(start + block.shape[2])

    blocks = [5, 3, 6, 1, 5, 1]
    ours = feed(L2NormKVCache(budget=8, n_sink=1, recent=2, scorer=scorer), keys, keys, blocks)
    at_once = feed(L2NormKVCache(budget=8, n_sink=1, recent=2, scorer=precomputed), keys, keys, blocks)
    assert np.array_equal(np.array(ours.positions), np.array(at_once.positions))

    # A batch joins and splits the state along its first axis: each
    # sequence's rows and last key are those of its cache fed alone.
    other = fill(rng, (1, HEADS, 13, DIM), "normal", "float16")
    make = lambda: L2NormKVCache(budget=8, n_sink=1, recent=2, scorer=scorer)
    singles = [feed(make(), keys, keys, [21]), feed(make(), other, other, [13])]
    batch = L2NormKVCache.merge([copy.deepcopy(c) for c in singles])
    step = fill(rng, (2, HEADS, 1, DIM), "normal", "float16")
    batch.update_and_fetch(step, step)
    for i, single in enumerate(singles):
        single.update_and_fetch(step[i : i + 1], step[i : i + 1])
        alone = batch.extract(i)
        assert np.array_equal(np.array(alone._score_sum), np.array(single._score_sum))
        assert np.array_equal(np.array(alone.positions), np.array(single.positions))

    assert len(cache) == 2 and all(c.scorer is scorer for c in cache)
    for _ in generate_step(tokens(1, 300)[0], model, prompt_cache=cache, max_tokens=4):
        pass
    assert all(c.offset >= 300 and c.filled <= c.budget + 1 == 257 for c in cache)
