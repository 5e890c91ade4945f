"""mlx_knorm.cache against mlx-lm's KVCache, the reference cache and itself,
on tiny randomly initialised mlx-lm models (no downloads)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest


from mlx_lm.generate import generate, generate_step, stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

import mlx_knorm
from mlx_knorm.cache import L2NormKVCache, link_prompt_cache, make_knorm_cache, order_tree_argument
from mlx_knorm.defaults import (DEFAULT_RECENT, DEFAULT_RECENT_SHARE, ORDER_TREE_MIN_BUDGET,
                                ORDER_TREE_MIN_BUDGET_WITH_WINDOW, default_recent, uses_order_tree)

from conftest import ALL_BACKENDS, requires_emulator
from tiny_models import HEAD_DIM, KV_HEADS, VOCAB, teacher_forced, tiny_model, tokens

ARCHS = ("llama", "qwen2")
LAYOUTS = ("slots", "temporal")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def knorm_layers(cache) -> list[L2NormKVCache]:
    return [c for c in cache if isinstance(c, L2NormKVCache)]


def buffers(cache: L2NormKVCache) -> tuple:
    return cache.keys, cache.values, cache.norms, cache.slot_positions


def check_accounting(cache: L2NormKVCache, batch: int, seen: int, budget: int) -> None:
    kept = min(seen, budget)
    keys, values, norms, positions = cache.state[:4]
    assert cache.offset == seen
    assert keys.shape == values.shape == (batch, KV_HEADS, kept, HEAD_DIM)
    assert norms.shape == (batch, KV_HEADS, kept) and norms.dtype == mx.float32
    assert cache.size() == cache.tokens_kept == kept
    assert cache.tokens_seen == batch * KV_HEADS * seen
    assert cache.knorm_kept_bytes == batch * KV_HEADS * kept * HEAD_DIM * 4
    assert cache.full_seq_bytes == batch * KV_HEADS * seen * HEAD_DIM * 4
    assert cache.compression_ratio == seen / kept
    tree = cache.order_tree
    assert (tree is None) == (order_tree_argument(cache.layout, cache.budget, cache.recent, None) is False)
    assert cache.nbytes == sum(b.nbytes for b in buffers(cache)) + (0 if tree is None else tree.nbytes)
    capacity = cache.keys.shape[2]
    assert [b.shape[:3] for b in buffers(cache)] == [(batch, KV_HEADS, capacity)] * 4
    assert cache.filled <= capacity <= max(cache.filled, budget + 1)
    # Stored norms are the keys' own norms: nothing got out of step in the step.
    assert mx.array_equal(norms, mlx_knorm.key_norms(keys)).item()
    assert mx.array_equal(positions, cache.positions).item() and positions.dtype == mx.int32
    assert mx.all(positions[..., 1:] > positions[..., :-1]).item()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_bit_identical_to_kvcache_until_budget(arch, dtype, batch):
    budget = 20
    model = tiny_model(arch, DTYPES[dtype])
    # Prefill 6, decode token by token up to budget + 1 tokens: the step that
    # brings the total to budget + 1 still attends to everything (deferred eviction).
    blocks = [6] + [1] * (budget - 5)
    ids = tokens(batch, sum(blocks))
    knorm = make_knorm_cache(model, budget=budget, n_sink=2)
    full = [KVCache() for _ in model.layers]
    for step, (ours, theirs) in enumerate(
        zip(teacher_forced(model, knorm, ids, blocks), teacher_forced(model, full, ids, blocks))
    ):
        assert ours.dtype == theirs.dtype == DTYPES[dtype]
        assert mx.array_equal(ours, theirs).item(), f"step {step}"
    for layer in knorm_layers(knorm):
        assert layer.keys.dtype == DTYPES[dtype]
        check_accounting(layer, batch, budget + 1, budget)


def test_masks_match_kvcache_before_eviction_and_follow_stored_rows_after():
    ours, theirs = L2NormKVCache(budget=8, n_sink=1), KVCache()
    kv = mx.random.normal((1, KV_HEADS, 6, HEAD_DIM)).astype(mx.float16)
    ours.update_and_fetch(kv, kv)
    theirs.update_and_fetch(kv, kv)
    # KVCache.make_mask needs every argument by keyword, as models pass them.
    for n, return_array, window_size in [(1, False, None), (3, False, None), (3, True, None), (3, False, 4)]:
        a = ours.make_mask(n, return_array=return_array, window_size=window_size)
        b = theirs.make_mask(n, return_array=return_array, window_size=window_size)
        assert type(a) is type(b)
        assert a is None or a == "causal" or mx.array_equal(a, b).item()

    ours.update_and_fetch(kv, kv)  # 12 seen, 8 kept
    mask = ours.make_mask(3, return_array=True)
    # Every kept row precedes the queries; causal among the 3 new rows.
    expected = mx.concatenate([mx.ones((3, 8), mx.bool_), mx.tril(mx.ones((3, 3), mx.bool_))], axis=1)
    assert mx.array_equal(mask, expected).item()
    with pytest.raises(ValueError, match="sliding-window"):
        ours.make_mask(3, window_size=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_and_fallback_bit_identical_far_past_budget(arch, dtype):
    budget, batch = 12, 2
    model = tiny_model(arch, DTYPES[dtype])
    blocks = [20] + [1] * 15 + [7] + [1] * 20  # prefill past the budget, a mid-stream block
    ids = tokens(batch, sum(blocks), seed=5)
    runs = {}
    for backend in ("kernel", "fallback"):
        cache = make_knorm_cache(model, budget=budget, n_sink=3, recent=2)
        with mlx_knorm.use_backend(backend):
            runs[backend] = (teacher_forced(model, cache, ids, blocks), cache)
    for step, (a, b) in enumerate(zip(runs["kernel"][0], runs["fallback"][0])):
        assert mx.array_equal(a, b).item(), f"step {step}"
    for a, b in zip(runs["kernel"][1], runs["fallback"][1]):
        check_accounting(a, batch, sum(blocks), budget)
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state[:4], b.state[:4]))


def test_never_more_than_budget_rows_and_keeps_lowest_norms():
    budget, n_sink = 10, 2
    model = tiny_model("llama")
    cache = make_knorm_cache(model, budget=budget, n_sink=n_sink, recent=0)
    ids = tokens(1, 40, seed=11)
    seen = 0
    for size in [3, 9, 1, 1, 5, 1, 13, 1, 6]:
        model(ids[:, seen : seen + size], cache=cache)
        seen += size
        for layer in cache:
            mx.eval(layer.state)
            assert layer.size() <= budget
            check_accounting(layer, 1, seen, budget)

    # Layer 0's keys depend on the tokens alone, so a full cache has them all:
    # the kept rows must be the sinks plus the lowest-norm rest, in order.
    full = [KVCache() for _ in model.layers]
    model(ids, cache=full)
    all_keys = full[0].keys[:, :, :seen]
    norms = np.array(mlx_knorm.key_norms(all_keys))
    for head in range(KV_HEADS):
        rest = n_sink + np.argsort(norms[0, head, n_sink:], kind="stable")[: budget - n_sink]
        expected = np.concatenate([np.arange(n_sink), np.sort(rest)])
        assert mx.array_equal(cache[0].state[0][0, head], all_keys[0, head][mx.array(expected)]).item()
        assert cache[0].positions[0, head].tolist() == expected.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_kept_rows_and_accounting_as_reference_cache(layout):
    from veloxquant_mlx.cache import knorm_cache as reference

    config = SimpleNamespace(knorm_budget=24, knorm_n_sink=4, knorm_recent=3, knorm_keep="low")
    ours, theirs = L2NormKVCache(config, layout=layout), reference.L2NormKVCache(config)
    key = mx.random.key(19)
    for size in [10, 1, 30, 1, 1, 8, 1]:
        key, k_key, v_key = mx.random.split(key, 3)
        keys = (2 * mx.random.normal((2, KV_HEADS, size, HEAD_DIM), key=k_key)).astype(mx.float16)
        values = mx.random.normal((2, KV_HEADS, size, HEAD_DIM), key=v_key).astype(mx.float16)
        our_k, our_v = ours.update_and_fetch(keys, values)
        ref_k, ref_v = theirs.update_and_fetch(keys, values)
        if layout == "slots":
            # The same rows in storage order: put them in temporal order.
            order = mx.argsort(ours.slot_positions[..., : ours.filled], axis=2)[..., None]
            our_k = mx.take_along_axis(our_k, order, axis=2)
            our_v = mx.take_along_axis(our_v, order, axis=2)
        assert mx.array_equal(our_k, ref_k).item() and mx.array_equal(our_v, ref_v).item()
        assert mx.array_equal(ours.state[0], theirs.state[0]).item()
        assert mx.array_equal(ours.state[1], theirs.state[1]).item()
        assert mx.array_equal(ours.positions, theirs._positions).item()
        assert ours.offset == theirs.offset
        for name in ("knorm_kept_bytes", "full_seq_bytes", "compression_ratio", "tokens_seen", "tokens_kept"):
            assert getattr(ours, name) == getattr(theirs, name), name


def chunked_prefill_reference(model, cache, prompt: mx.array, chunk: int, max_tokens: int) -> list[int]:
    """generate_step's schedule done by hand: chunks of ``chunk`` leaving the
    last prompt token for the first decode step, then greedy decoding."""
    ids = prompt[None]
    done = 0
    while prompt.size - done > 1:
        size = min(chunk, prompt.size - done - 1)
        model(ids[:, done : done + size], cache=cache)
        mx.eval([c.state for c in cache])
        done += size
    token, out = ids[:, done:], []
    for _ in range(max_tokens):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        out.append(token.item())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_step_with_chunked_prefill(arch):
    model = tiny_model(arch, mx.bfloat16)
    prompt = tokens(1, 45, seed=23)[0]
    cache = make_knorm_cache(model, budget=16, n_sink=2)
    generated = [
        int(tok)
        for tok, _ in generate_step(
            prompt, model, prompt_cache=cache, prefill_step_size=8, max_tokens=12
        )
    ]
    by_hand = chunked_prefill_reference(model, make_knorm_cache(model, budget=16, n_sink=2), prompt, 8, 12)
    assert generated == by_hand
    for layer in knorm_layers(cache):
        # generate_step runs one step ahead: the 12th token was fed back too.
        check_accounting(layer, 1, prompt.size + 12, 16)

    # Layer 0's keys depend on nothing but the tokens, so with recent=0 its kept
    # set is the same however the prompt was split (path independence).
    whole = make_knorm_cache(model, budget=16, n_sink=2, recent=0)
    model(prompt[None, :-1], cache=whole)
    chunked = make_knorm_cache(model, budget=16, n_sink=2, recent=0)
    chunked_prefill_reference(model, chunked, prompt, 8, 0)
    assert mx.array_equal(whole[0].state[0], chunked[0].state[0]).item()


def test_skip_layers_keep_plain_kvcache_and_validation():
    model = tiny_model("qwen2", layers=4)
    cache = make_knorm_cache(model, budget=8, n_sink=1, skip_layers=(0, 1))
    assert [type(c) for c in cache] == [KVCache, KVCache, L2NormKVCache, L2NormKVCache]
    teacher_forced(model, cache, tokens(1, 30), [12, 1, 1, 16])
    assert [c.size() for c in cache] == [30, 30, 8, 8]
    assert all(c.offset == 30 for c in cache)
    with pytest.raises(ValueError, match="skip_layers"):
        make_knorm_cache(model, skip_layers=(4,))
    with pytest.raises(TypeError, match="skip_layers"):
        make_knorm_cache(model, skip_layers=("0",))


def test_sliding_window_layers_keep_their_rotating_cache():
    model = tiny_model(
        "llama", layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6
    )
    cache = make_knorm_cache(model, budget=8, n_sink=1)
    assert [type(c) for c in cache] == [RotatingKVCache, L2NormKVCache]
    teacher_forced(model, cache, tokens(1, 20), [10, 1, 9])
    assert cache[1].size() == 8 and cache[1].offset == 20


def test_save_load_round_trip_continues_identically(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    ids = tokens(1, 40, seed=29)
    cache = make_knorm_cache(model, budget=10, n_sink=2, recent=1, keep="high", skip_layers=(0,))
    teacher_forced(model, cache, ids[:, :25], [17, 1, 7])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"note": "knorm"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"note": "knorm"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for ours, back in zip(knorm_layers(cache), knorm_layers(loaded)):
        assert (back.budget, back.n_sink, back.recent, back.keep) == (10, 2, 1, "high")
        assert back.offset == ours.offset and back.keys.dtype == mx.bfloat16
        assert all(mx.array_equal(a, b).item() for a, b in zip(back.state[:4], ours.state[:4]))
    blocks = [1] * 6 + [4] + [1] * 5
    for a, b in zip(
        teacher_forced(model, cache, ids[:, 25:], blocks),
        teacher_forced(model, loaded, ids[:, 25:], blocks),
    ):
        assert mx.array_equal(a, b).item()

    empty_path = str(tmp_path / "empty.safetensors")
    save_prompt_cache(empty_path, [L2NormKVCache(budget=5, n_sink=0)])
    (empty,) = load_prompt_cache(empty_path)
    assert empty.empty() and empty.budget == 5 and empty.nbytes == 0


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0", unk_token="w0")


def test_mlx_lm_generate_and_stream_generate():
    model = tiny_model("llama")
    tokenizer = word_tokenizer()
    prompt = [int(t) for t in tokens(1, 30, seed=31)[0] if int(t) != 0]
    # A budget above prompt + output evicts nothing: same text as mlx-lm's own cache.
    roomy = make_knorm_cache(model, budget=64)
    assert generate(model, tokenizer, prompt, max_tokens=10, prompt_cache=roomy) == generate(
        model, tokenizer, prompt, max_tokens=10
    )
    tight = make_knorm_cache(model, budget=12, n_sink=2, skip_layers=(0,))
    pieces = list(
        stream_generate(model, tokenizer, prompt, max_tokens=10, prompt_cache=tight, prefill_step_size=8)
    )
    assert pieces and all(c.size() <= 12 for c in knorm_layers(tight))
    assert tight[0].size() == tight[1].offset


def test_constructor_forms_and_validation():
    default = L2NormKVCache()
    assert (default.budget, default.n_sink, default.recent, default.keep) == (512, 4, 0, "low")
    config = SimpleNamespace(knorm_budget=64, knorm_n_sink=2, knorm_recent=4, knorm_keep="high")
    from_config = L2NormKVCache(config)
    assert (from_config.budget, from_config.n_sink, from_config.recent, from_config.keep) == (64, 2, 4, "high")
    overridden = L2NormKVCache(config, budget=32, keep="low")
    assert (overridden.budget, overridden.n_sink, overridden.recent, overridden.keep) == (32, 2, 4, "low")
    assert default.is_trimmable() and default.trimmable() == 0 and default.empty() and default.size() == 0
    assert default.nbytes == default.knorm_kept_bytes == default.tokens_seen == 0
    assert default.compression_ratio == 1.0

    for kwargs, error, name in [
        (dict(budget=0), ValueError, "budget"),
        (dict(n_sink=-1), ValueError, "n_sink"),
        (dict(recent=-2), ValueError, "recent"),
        (dict(budget=8, n_sink=4, recent=4), ValueError, "n_sink"),
        (dict(keep="mid"), ValueError, "keep"),
        (dict(budget=16.0), TypeError, "budget"),
        (dict(n_sink=True), TypeError, "n_sink"),
    ]:
        with pytest.raises(error, match=name):
            L2NormKVCache(**kwargs)
        with pytest.raises(error, match=name):
            make_knorm_cache(tiny_model("llama", layers=1), **kwargs)
    with pytest.raises(ValueError, match="budget"):
        L2NormKVCache(SimpleNamespace(knorm_budget=-3))


def test_make_knorm_cache_default_recent_window():
    """make_knorm_cache protects DEFAULT_RECENT_SHARE of the budget unless told
    otherwise, always leaving an evictable row; L2NormKVCache keeps the
    reference's default (none)."""
    model = tiny_model("llama", layers=2)
    assert L2NormKVCache().recent == DEFAULT_RECENT == 0
    for budget, n_sink in [(512, 4), (64, 4), (9, 2), (8, 6), (5, 4), (1, 0)]:
        expected = min(int(round(DEFAULT_RECENT_SHARE * budget)), budget - n_sink - 1)
        assert default_recent(budget, n_sink) == max(expected, 0)
        cache = make_knorm_cache(model, budget=budget, n_sink=n_sink)
        assert {c.recent for c in cache} == {default_recent(budget, n_sink)}
        assert all(n_sink + c.recent < budget for c in cache)
    assert {c.recent for c in make_knorm_cache(model, budget=64, recent=0)} == {0}
    assert {c.recent for c in make_knorm_cache(model, budget=64, recent=7)} == {7}
    # The recent window is kept whatever its norms: the latest rows survive.
    budget, n_sink = 12, 2
    cache = make_knorm_cache(model, budget=budget, n_sink=n_sink)
    teacher_forced(model, cache, tokens(1, 40, seed=5), [20, 1, 1, 17, 1])
    window = default_recent(budget, n_sink)
    for layer in cache:
        positions = np.array(layer.positions[0])
        assert (positions[:, :n_sink] == np.arange(n_sink)).all()
        assert (positions[:, -window:] == np.arange(40 - window, 40)).all()


def test_storage_dtype_follows_input():
    for given, stored in [(mx.bfloat16, mx.bfloat16), (mx.float16, mx.float16), (mx.float32, mx.float32)]:
        cache = L2NormKVCache(budget=4, n_sink=1)
        kv = mx.random.normal((2, KV_HEADS, 6, HEAD_DIM)).astype(given)
        keys, values = cache.update_and_fetch(kv, kv)
        assert keys.dtype == values.dtype == cache.state[0].dtype == cache.state[1].dtype == stored
        keys, _ = cache.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
        assert keys.shape == (2, KV_HEADS, 5, HEAD_DIM) and keys.dtype == stored


def test_meta_state_round_trip():
    cache = L2NormKVCache(budget=9, n_sink=1, recent=2, keep="high", layout="temporal")
    other = L2NormKVCache()
    other.meta_state = cache.meta_state
    assert cache.meta_state == ("9", "1", "2", "high", "temporal")
    assert (other.budget, other.n_sink, other.recent, other.keep, other.layout) == (9, 1, 2, "high", "temporal")
    with pytest.raises(ValueError, match="budget"):
        other.meta_state = ("2", "1", "1", "low", "slots")
    with pytest.raises(ValueError, match="layout"):
        other.meta_state = ("9", "1", "1", "low", "rows")


def decode_token(step: int, dim: int = 64) -> mx.array:
    token = mx.random.normal((1, 8, 1, dim), key=mx.random.key(step)).astype(mx.float16)
    mx.eval(token)
    return token


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_steps_run_in_place_on_buffers_of_budget_plus_one_slots(layout):
    """Once a step's attention has run, the cache holds the only reference to
    its buffers, so a decode step writes into them: no second copy is
    allocated, and the buffers keep budget + 1 slots."""
    budget = 256
    cache = L2NormKVCache(budget=budget, n_sink=4, layout=layout)
    keys = mx.random.normal((1, 8, 300, 64), key=mx.random.key(23)).astype(mx.float16)
    mx.eval(cache.update_and_fetch(keys, keys))
    assert cache.keys.shape[2] == 300
    mx.eval(cache.update_and_fetch(decode_token(0), decode_token(0)))
    # The prefill's larger buffers shrink to what a decode step needs.
    assert cache.keys.shape[2] == budget + 1
    buffer_bytes = cache.nbytes
    for step in range(1, 4):
        token = decode_token(step)
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(cache.update_and_fetch(token, token))
        assert mx.get_peak_memory() - before < buffer_bytes // 8
        assert cache.nbytes == buffer_bytes and cache.size() == budget and cache.offset == 301 + step


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_held_view_is_never_written(layout, backend):
    """A caller still holding last step's keys keeps them as they were: the
    step then writes fresh buffers, with the same result as in place."""
    held, free = (L2NormKVCache(budget=32, n_sink=2, layout=layout) for _ in range(2))
    keys = mx.random.normal((1, 8, 40, 64), key=mx.random.key(3)).astype(mx.float16)
    with mlx_knorm.use_backend(backend):
        for cache in (held, free):
            mx.eval(cache.update_and_fetch(keys, keys))
        for step in range(3):
            token = decode_token(step)
            view, _ = held.update_and_fetch(token, token)
            mx.eval(view, free.update_and_fetch(token, token))
            snapshot = np.array(view)
            token = decode_token(10 + step)
            mx.eval(held.update_and_fetch(token, token), free.update_and_fetch(token, token))
            assert np.array_equal(np.array(view), snapshot)
            for a, b in zip(buffers(held), buffers(free)):
                assert mx.array_equal(a[:, :, : held.filled], b[:, :, : free.filled]).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_layout_logits_follow_temporal_layout_past_the_budget(arch):
    """The layouts store the same rows in different orders: attention sums
    them in another order, so logits agree to rounding, and exactly while
    nothing has been evicted."""
    model = tiny_model(arch, mx.float32)
    budget = 16
    blocks = [10, 1, 1, 1, 1, 1, 1, 9] + [1] * 30
    ids = tokens(2, sum(blocks), seed=41)
    slots, temporal = (make_knorm_cache(model, budget=budget, n_sink=2, layout=layout) for layout in LAYOUTS)
    seen = 0
    for a, b, size in zip(teacher_forced(model, slots, ids, blocks), teacher_forced(model, temporal, ids, blocks), blocks):
        seen += size
        if seen <= budget + 1:
            assert mx.array_equal(a, b).item()
        else:
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()
    # Layer 0's keys depend on the tokens alone: the same rows are kept.
    for x, y in zip(slots[0].state[:5], temporal[0].state[:5]):
        assert x == y if isinstance(x, int) else mx.array_equal(x, y).item()


def test_layout_is_validated():
    with pytest.raises(ValueError, match="layout"):
        L2NormKVCache(layout="rows")
    with pytest.raises(TypeError, match="layout"):
        L2NormKVCache(layout=None)
    with pytest.raises(ValueError, match="layout"):
        make_knorm_cache(tiny_model("llama", layers=1), layout="rows")


def test_the_order_tree_is_kept_on_the_cpu_alone():
    """No step on a GPU reads a given tree (spec §10): there a cache keeps none."""
    budget = ORDER_TREE_MIN_BUDGET
    assert uses_order_tree("slots", budget, 0, mx.cpu)
    assert not uses_order_tree("slots", budget, 0, mx.gpu)
    assert uses_order_tree("slots", budget, 0, mx.default_stream(mx.cpu))
    assert not uses_order_tree("slots", budget - 1, 0, mx.cpu)
    assert not uses_order_tree("slots", budget, 1, mx.cpu)
    assert uses_order_tree("slots", ORDER_TREE_MIN_BUDGET_WITH_WINDOW, 1, mx.cpu)
    assert not uses_order_tree("slots", ORDER_TREE_MIN_BUDGET_WITH_WINDOW, 1, mx.gpu)
    assert not uses_order_tree("temporal", budget, 0, mx.cpu)
    with mx.stream(mx.cpu):
        assert order_tree_argument("slots", budget, 0, None) is True
    assert uses_order_tree("slots", budget, 0) == (mx.default_device().type == mx.DeviceType.cpu)


@requires_emulator
def test_a_cache_stepping_through_the_metal_emulator_keeps_no_order_tree():
    """The emulator runs the Metal kernels, which never read a given tree."""
    budget = ORDER_TREE_MIN_BUDGET
    keys = mx.random.normal((1, 1, budget + 3, 4), key=mx.random.key(5)).astype(mx.float16)
    caches = {}
    for backend in ("kernel", "metal-emulator"):
        with mlx_knorm.use_backend(backend), mx.stream(mx.cpu):
            cache = L2NormKVCache(budget=budget, n_sink=2, recent=0)
            mx.eval(cache.update_and_fetch(keys[:, :, : budget + 1], keys[:, :, : budget + 1]))
            for j in range(budget + 1, budget + 3):
                mx.eval(cache.update_and_fetch(keys[:, :, j : j + 1], keys[:, :, j : j + 1]))
            caches[backend] = cache
    assert caches["kernel"].order_tree is not None and caches["metal-emulator"].order_tree is None
    for a, e in zip(buffers(caches["kernel"]), buffers(caches["metal-emulator"])):
        assert np.array_equal(np.array(a), np.array(e))


@pytest.mark.parametrize("budget, recent, layout", [
    (ORDER_TREE_MIN_BUDGET, 0, "slots"), (ORDER_TREE_MIN_BUDGET, 1, "slots"), (ORDER_TREE_MIN_BUDGET, 0, "temporal"),
    (ORDER_TREE_MIN_BUDGET_WITH_WINDOW, 3, "slots")])
def test_a_cache_keeps_the_order_tree_where_its_configuration_gains(budget, recent, layout):
    """In the slot layout, on the CPU, from ORDER_TREE_MIN_BUDGET on without
    a recent window and from ORDER_TREE_MIN_BUDGET_WITH_WINDOW on with one,
    the cache keeps the order tree and decodes through it: the same rows
    and tree as the fallback, which ranks every row; elsewhere (on a GPU
    too) none."""
    keys = mx.random.normal((1, 2, budget + 8, 4), key=mx.random.key(3)).astype(mx.float16)
    states = {}
    for backend in ("kernel", "fallback"):
        with mlx_knorm.use_backend(backend):
            cache = L2NormKVCache(budget=budget, n_sink=2, recent=recent, layout=layout)
            mx.eval(cache.update_and_fetch(keys[:, :, : budget + 2], keys[:, :, : budget + 2]))
            for j in range(budget + 2, budget + 8):
                mx.eval(cache.update_and_fetch(keys[:, :, j : j + 1], keys[:, :, j : j + 1]))
            states[backend] = cache
    kernel, fallback = states["kernel"], states["fallback"]
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    gains = budget >= (ORDER_TREE_MIN_BUDGET if recent == 0 else ORDER_TREE_MIN_BUDGET_WITH_WINDOW)
    assert (kernel.order_tree is not None) == uses_order_tree(layout, budget, recent) == (
        gains and layout == "slots" and on_cpu)
    filled = kernel.filled
    for a, e in zip(buffers(kernel), buffers(fallback)):
        assert np.array_equal(np.array(a[:, :, :filled]), np.array(e[:, :, :filled]))
    if kernel.order_tree is not None:
        assert np.array_equal(np.array(kernel.order_tree), np.array(fallback.order_tree))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layer_of_a_linked_prompt_cache_copied_alone_is_a_correct_cache(layout, backend):
    """A linked layer deep-copied on its own is an unlinked cache: a short
    block past the budget attends as one block (what caches made one by
    one give), since the model's one mask reaches layers whose plans it
    never saw. Linked again, the copies attend it as single steps, as a
    copy of the whole list does; the original is untouched throughout."""
    with mlx_knorm.use_backend(backend):
        model = tiny_model("llama", mx.float32)
        ids = tokens(1, 30, seed=5)
        prompt, block = ids[:, :24], ids[:, 24:28]
        cache = make_knorm_cache(model, budget=16, n_sink=2, recent=1, layout=layout)
        model(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        before = [c.state for c in cache]

        def fed(caches):
            logits = model(block, cache=caches)
            mx.eval(logits, [c.state for c in caches])
            return logits

        unlinked = copy.deepcopy(cache)
        for c in unlinked:
            c._mask_plan = None  # the same buffers, not linked
        layers = [copy.deepcopy(c) for c in cache]
        assert mx.array_equal(fed(layers), fed(unlinked)).item()

        whole = copy.deepcopy(cache)
        relinked = [copy.deepcopy(c) for c in cache]
        assert link_prompt_cache(relinked)
        at_once = fed(relinked)
        assert mx.array_equal(at_once, fed(whole)).item()
        assert not mx.allclose(at_once, fed([copy.deepcopy(c) for c in unlinked])).item()
        # Evicting after the copy: every copy continues on its own rows.
        for caches in (layers, relinked, whole):
            for t in range(28, 30):
                fed_one = model(ids[:, t : t + 1], cache=caches)
                mx.eval(fed_one)
            assert all(c.offset == 30 and c.size() == 16 for c in caches)
        for c, state in zip(cache, before):
            assert c.offset == 24
            for a, b in zip(c.state[:4], state[:4]):
                assert mx.array_equal(a, b).item()
