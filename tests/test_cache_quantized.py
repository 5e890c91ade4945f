"""QuantizedL2NormKVCache (docs/spec.md §8): eviction with KV quantization.
The same kept positions as the float cache, every stored row mx.quantize of
the float cache's, mlx-lm's quantized attention and kv_bits path, and a
state that round-trips through files and is checked field by field."""

from __future__ import annotations

import copy
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

import mlx_knorm
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache, link_prompt_cache, make_knorm_cache
from mlx_knorm.cache_state import (
    QUANTIZATION_BITS,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZED_FIELDS,
    OVERFLOWED_NORM,
    check_state,
    norm_distance,
    quantized_norm_bound,
)

from conftest import ALL_BACKENDS, assert_bitwise_equal
from generators import fill
from tiny_models import teacher_forced, tiny_model, tokens

LAYOUTS = ("slots", "temporal")
WIDTH = 64  # head width of the quantized tests' rows and models: mx.quantize groups are 32 or more


def quantized_model(dtype=mx.float16):
    """The tests' tiny llama with heads wide enough for every group size."""
    return tiny_model("llama", dtype, head_dim=WIDTH)


def test_the_quantization_settings_are_what_mx_quantize_takes():
    def takes(group_size, bits):
        try:
            mx.eval(mx.quantize(mx.ones((1, 256), mx.float16), group_size=group_size, bits=bits))
        except ValueError:
            return False
        return True

    assert [b for b in range(1, 9) if takes(64, b)] == list(QUANTIZATION_BITS)
    assert [g for g in (16, 32, 64, 128, 256) if takes(g, 4)] == list(QUANTIZATION_GROUP_SIZES)


def stream(shape, seed: int, palette: str = "normal", dtype: str = "float16"):
    rng = np.random.default_rng(seed)
    return fill(rng, shape, palette, dtype), fill(rng, shape, palette, dtype)


def both_caches(config, blocks, batch, seed, palette="normal", dtype="float16", group_size=32, bits=4):
    """A float and a quantized cache fed the same blocks; after each update,
    what each returned."""
    keys, values = stream((batch, 2, sum(blocks), WIDTH), seed, palette, dtype)
    ours = L2NormKVCache(**config)
    quantized = QuantizedL2NormKVCache(**config, group_size=group_size, bits=bits)
    start, returned = 0, []
    for size in blocks:
        k, v = keys[:, :, start : start + size], values[:, :, start : start + size]
        returned.append((ours.update_and_fetch(k, v), quantized.update_and_fetch(k, v)))
        start += size
    return ours, quantized, returned


def assert_same_state(a, b) -> None:
    """Two states field by field, arrays bit for bit (tuples and the lists a
    file gives back alike)."""
    a, b = tree_flatten(list(a)), tree_flatten(list(b))
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b):
        if isinstance(y, mx.array):
            assert_bitwise_equal(x, y, name)
        else:
            assert x == y, name


def quantize(rows, group_size, bits):
    return tuple(mx.quantize(rows, group_size=group_size, bits=bits))


configs = st.fixed_dictionaries(
    dict(
        budget=st.integers(5, 12),
        n_sink=st.integers(0, 2),
        recent=st.integers(0, 2),
        keep=st.sampled_from(["low", "high"]),
        layout=st.sampled_from(LAYOUTS),
    )
)


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(
    config=configs,
    blocks=st.lists(st.one_of(st.just(1), st.integers(0, 9)), min_size=1, max_size=30),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    palette=st.sampled_from(["normal", "ties", "large", "subnormal"]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    quantization=st.sampled_from([(32, 4), (64, 8), (32, 2), (64, 3), (32, 6)]),
)
def test_the_quantized_cache_keeps_the_float_caches_rows_quantized(
    config, blocks, batch, seed, palette, dtype, quantization
):
    group_size, bits = quantization
    ours, quantized, returned = both_caches(config, blocks, batch, seed, palette, dtype, group_size, bits)
    for (float_k, float_v), (q_k, q_v) in returned:
        # Every update returns the float cache's rows, each quantized.
        for a, b in zip(q_k + q_v, quantize(float_k, *quantization) + quantize(float_v, *quantization)):
            assert_bitwise_equal(a, b)
    assert (quantized.filled, quantized.offset, quantized.trimmable()) == (ours.filled, ours.offset, ours.trimmable())
    filled = ours.filled
    assert_bitwise_equal(quantized.slot_positions[..., :filled], ours.slot_positions[..., :filled], "positions")
    assert_bitwise_equal(quantized.norms[..., :filled], ours.norms[..., :filled], "norms")
    for q, f in ((quantized.keys, ours.keys), (quantized.values, ours.values)):
        for a, b in zip(q, quantize(f[..., :filled, :], *quantization)):
            assert_bitwise_equal(a[..., :filled, :], b)
        if filled:  # (mx.dequantize refuses empty arrays)
            dequantized = mx.dequantize(*(a[..., :filled, :] for a in q), group_size=group_size, bits=bits)
            expected = mx.dequantize(*quantize(f[..., :filled, :], *quantization), group_size=group_size, bits=bits)
            assert_bitwise_equal(dequantized, expected)
    # The state passes the load check (the norms are within the bound) and loads back.
    assert_same_state(QuantizedL2NormKVCache.from_state(quantized.state).state, quantized.state)


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
def test_long_streams_keep_the_float_caches_positions(backend):
    config = dict(budget=24, n_sink=2, recent=3, keep="low", layout="slots")
    blocks = [40] + [1] * 60 + [5, 1, 9] + [1] * 30
    with mlx_knorm.use_backend(backend):
        for layout, keep in [("slots", "low"), ("temporal", "high")]:
            config.update(layout=layout, keep=keep)
            ours, quantized, _ = both_caches(config, blocks, batch=2, seed=5, group_size=64, bits=4)
            assert mx.array_equal(quantized.positions, ours.positions).item()
            assert quantized.size() == 24 and quantized.offset == sum(blocks)


def test_to_quantized_is_the_quantized_cache_fed_the_same_blocks():
    config = dict(budget=10, n_sink=1, recent=1)
    blocks = [12, 1, 1, 3, 1]
    keys, values = stream((1, 2, 30, WIDTH), 3)
    ours, direct = L2NormKVCache(**config), QuantizedL2NormKVCache(**config, group_size=32, bits=8)
    start = 0
    for size in blocks:
        for cache in (ours, direct):
            cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
        start += size
    converted = ours.to_quantized(group_size=32, bits=8)
    assert isinstance(converted, QuantizedL2NormKVCache) and not hasattr(converted, "to_quantized")
    assert (converted.bits, converted.group_size) == (8, 32)
    assert isinstance(ours.keys, mx.array)  # the float cache is left as it was
    for cache in (converted, direct):
        cache.update_and_fetch(keys[:, :, start:], values[:, :, start:])
    assert (converted.filled, converted.offset, converted.trimmable()) == (direct.filled, direct.offset, direct.trimmable())
    assert_same_state(converted.state, direct.state)
    # An empty cache converts too, and checks its widths at the first block.
    empty = L2NormKVCache(budget=8).to_quantized(group_size=64)
    with pytest.raises(ValueError, match="keys width 32 must be a multiple of group_size 64"):
        empty.update_and_fetch(keys[:, :, :2, :32], values[:, :, :2, :32])
    assert empty.empty()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_logits_are_quantized_kvcaches_while_nothing_is_evicted(dtype):
    model = quantized_model(dtype)
    ids = tokens(2, 20, seed=4)
    blocks = [8, 1, 1, 4, 1, 1, 1]  # 17 tokens: one past the budget still attends to all
    ours = [QuantizedL2NormKVCache(budget=16, n_sink=2, group_size=64, bits=4) for _ in model.layers]
    theirs = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    full = [KVCache() for _ in model.layers]
    runs = [teacher_forced(model, cache, ids[:, :17], blocks) for cache in (ours, theirs, full)]
    for step, (a, b, c) in enumerate(zip(*runs)):
        # The same rows quantized the same way: the same logits.
        assert mx.array_equal(a, b).item(), f"step {step}"
        assert not mx.allclose(b, c, rtol=1e-3, atol=1e-3).item()  # quantization does show


@pytest.mark.parametrize("bits", QUANTIZATION_BITS)
def test_every_bit_width_attends_through_mlx_lms_quantized_path(bits):
    model = quantized_model()
    cache = [QuantizedL2NormKVCache(budget=12, n_sink=1, group_size=32, bits=bits) for _ in model.layers]
    logits = teacher_forced(model, cache, tokens(1, 20), [14, 1, 5])
    assert all(mx.all(mx.isfinite(x)).item() for x in logits)
    assert cache[0].size() == 12 and cache[0].offset == 20


def by_hand(model, prompt: mx.array, budget: int, max_tokens: int, group_size: int, bits: int) -> list[int]:
    """generate_step's schedule with kv_bits and quantized_kv_start=0, by hand:
    the prompt but its last token into float caches, each converted, then
    greedy decoding on the quantized caches."""
    cache = make_knorm_cache(model, budget=budget, n_sink=2)
    model(prompt[None, :-1], cache=cache)
    cache = [c.to_quantized(group_size=group_size, bits=bits) for c in cache]
    token, out = prompt[None, -1:], []
    for _ in range(max_tokens):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        out.append(token.item())
    return out


def test_generate_step_kv_bits_converts_the_eviction_caches():
    model = quantized_model()
    prompt = tokens(1, 30, seed=8)[0]
    cache = make_knorm_cache(model, budget=16, n_sink=2)
    generated = [
        int(t) for t, _ in generate_step(
            prompt, model, prompt_cache=cache, max_tokens=10, kv_bits=4, kv_group_size=32, quantized_kv_start=0
        )
    ]
    assert all(type(c) is QuantizedL2NormKVCache and c.bits == 4 and c.group_size == 32 for c in cache)
    assert generated == by_hand(model, prompt, 16, 10, 32, 4)
    # skip_layers keep mlx-lm's KVCache, which mlx-lm quantizes as usual.
    cache = make_knorm_cache(model, budget=16, n_sink=2, skip_layers=(0,))
    list(generate_step(prompt, model, prompt_cache=cache, max_tokens=3, kv_bits=8, kv_group_size=64,
                       quantized_kv_start=0))
    assert [type(c) for c in cache] == [QuantizedKVCache] + [QuantizedL2NormKVCache] * 2
    # Before quantized_kv_start the caches stay float.
    cache = make_knorm_cache(model, budget=16)
    list(generate_step(prompt, model, prompt_cache=cache, max_tokens=2, kv_bits=4, quantized_kv_start=1000))
    assert all(type(c) is L2NormKVCache for c in cache)


def test_a_short_block_of_linked_quantized_caches_attends_as_single_steps():
    model = quantized_model(mx.float32)
    ids = tokens(1, 30, seed=9)
    results = []
    for sizes in ([6], [1] * 6):
        cache = [c.to_quantized(group_size=64, bits=8) for c in make_knorm_cache(model, budget=16, n_sink=2)]
        assert cache[0]._mask_plan is cache[1]._mask_plan is not None
        model(ids[:, :24], cache=cache)
        results.append(mx.concatenate(teacher_forced(model, cache, ids[:, 24:], sizes), axis=1))
    assert mx.allclose(*results, rtol=1e-4, atol=1e-4).item()


def test_trim_and_copies():
    keys, values = stream((1, 2, 20, WIDTH), 1)
    cache = QuantizedL2NormKVCache(budget=8, n_sink=1, group_size=32, bits=4)
    cache.update_and_fetch(keys[:, :, :12], values[:, :, :12])
    cache.update_and_fetch(keys[:, :, 12:15], values[:, :, 12:15])
    assert cache.trimmable() == 3
    clone = copy.deepcopy(cache)
    # Four asked, the three of the last update removed.
    assert cache.trim(4) == 3 and cache.offset == 12 and clone.offset == 15
    reference = QuantizedL2NormKVCache(budget=8, n_sink=1, group_size=32, bits=4)
    reference.update_and_fetch(keys[:, :, :12], values[:, :, :12])
    assert_same_state(cache.state, reference.state)


def test_memory_at_4_bits_group_64():
    """Per row and head: the float cache's 2 * 64 float16 plus a norm and a
    position against 2 * (32 bytes packed + a float16 scale and bias); at
    this budget neither keeps an order tree."""
    keys, values = stream((1, 3, 40, WIDTH), 2)
    ours, quantized = L2NormKVCache(budget=32), QuantizedL2NormKVCache(budget=32, group_size=64, bits=4)
    for cache in (ours, quantized):
        cache.update_and_fetch(keys, values)
        cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    assert ours.keys.shape[2] == quantized.keys[0].shape[2] == 33
    assert ours.order_tree is None and quantized.order_tree is None
    assert ours.nbytes == 33 * 3 * (2 * 64 * 2 + 8)
    assert quantized.nbytes == 33 * 3 * (2 * (32 + 4) + 8)


def saved_and_loaded(caches):
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/cache.safetensors"
        save_prompt_cache(path, caches)
        return load_prompt_cache(path)


def test_files_round_trip_and_continue_identically():
    model = quantized_model()
    ids = tokens(1, 40, seed=12)
    # In temporal order, as the file holds the rows: the same sums after loading.
    caches = make_knorm_cache(model, budget=16, n_sink=2, layout="temporal")
    cache = [c.to_quantized(group_size=64, bits=4) for c in caches]
    model(ids[:, :30], cache=cache)
    loaded = saved_and_loaded(cache)
    assert all(type(c) is QuantizedL2NormKVCache and c.bits == 4 for c in loaded)
    # A file holds states, not the link between layers: link them again
    # for the 10-token block to attend as single steps.
    assert link_prompt_cache(loaded)
    for a, b in zip(cache, loaded):
        assert_same_state(a.state, b.state)
    a, b = model(ids[:, 30:], cache=cache), model(ids[:, 30:], cache=loaded)
    assert mx.array_equal(a, b).item()


def quantized_state():
    keys, values = stream((1, 2, 14, WIDTH), 6)
    cache = QuantizedL2NormKVCache(budget=8, n_sink=2, recent=1, group_size=32, bits=4)
    for start, stop in ((0, 7), (7, 8), (8, 13), (13, 14)):
        cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
    return cache.state


def field(name):
    return QUANTIZED_FIELDS.index(name)


def tampered(state, name, value):
    out = list(state)
    out[field(name)] = value(out[field(name)]) if callable(value) else value
    return out


def swap(i, value):
    return lambda rows: tuple(value(r) if j == i else r for j, r in enumerate(rows))


TAMPERED = {
    "norms doubled": ("norms", lambda n: n * 2, ValueError, "'norms'"),
    "norms of other rows": ("norms", lambda n: n[:, :, ::-1] * 0 + 0.5, ValueError, "'norms'"),
    "a negative norm": ("norms", lambda n: -n, ValueError, "'norms'"),
    "packed as int32": ("keys", swap(0, lambda p: p.view(mx.int32)), ValueError, r"'keys\[0\]'"),
    "int32 scales": ("keys", swap(1, lambda s: s.astype(mx.int32)), ValueError, r"'keys\[1\]'"),
    "biases of another dtype": ("values", swap(2, lambda b: b.astype(mx.bfloat16)), ValueError, r"'values\[2\]'"),
    "packed of another width": ("keys", swap(0, lambda p: p[..., :4]), ValueError, "'keys'"),
    "scales of other rows": ("values", swap(1, lambda s: s[:, :, :3]), ValueError, r"'values\[1\]'"),
    "keys an array": ("keys", lambda rows: rows[0], TypeError, "'keys'"),
    "values of two arrays": ("values", lambda rows: rows[:2], TypeError, "'values'"),
    "bits 7": ("bits", 7, ValueError, "bits"),
    "group size 16": ("group_size", 16, ValueError, "group_size"),
    "bits a float": ("bits", 4.0, TypeError, "bits"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_quantized_state_raises_naming_the_field(case):
    name, value, error, match = TAMPERED[case]
    if match.startswith("'"):  # a field: the message names the quantized class too
        match = "QuantizedL2NormKVCache state field " + match
    good = quantized_state()
    check_state(good, quantized=True)
    with pytest.raises(error, match=match):
        QuantizedL2NormKVCache.from_state(tampered(good, name, value))


def test_each_cache_refuses_the_others_state():
    good = quantized_state()
    with pytest.raises(ValueError, match="10 fields"):
        L2NormKVCache.from_state(good)
    with pytest.raises(ValueError, match="12 fields"):
        QuantizedL2NormKVCache.from_state(good[:10])


def test_meta_state_keeps_the_quantization():
    cache = QuantizedL2NormKVCache.from_state(quantized_state())
    assert cache.meta_state == ("8", "2", "1", "low", "slots", "32", "4")
    cache.meta_state = ("6", "2", "1", "low", "temporal", "32", "4")
    assert cache.size() == 6 and cache.layout == "temporal"
    check_state(cache.state, quantized=True)
    with pytest.raises(ValueError, match="'bits'"):
        cache.meta_state = ("6", "2", "1", "low", "temporal", "32", "8")
    bare = QuantizedL2NormKVCache.__new__(QuantizedL2NormKVCache)
    bare.meta_state = ("6", "2", "1", "low", "temporal", "64", "8")
    assert bare.empty() and (bare.group_size, bare.bits) == (64, 8)


def test_construction_and_conversion_validate_their_arguments():
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizedL2NormKVCache(bits=7)
    with pytest.raises(ValueError, match="group_size must be one of"):
        L2NormKVCache().to_quantized(group_size=48)
    with pytest.raises(TypeError, match="bits"):
        L2NormKVCache().to_quantized(bits="4")
    cache = L2NormKVCache(budget=8)
    cache.update_and_fetch(*stream((1, 2, 3, 96), 0))
    with pytest.raises(ValueError, match="group_size 64 must divide the keys width 96"):
        cache.to_quantized(group_size=64)


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(
    seed=st.integers(0, 2**16),
    palette=st.sampled_from(["normal", "ties", "large", "subnormal", "zeros"]),
    scale=st.sampled_from([1e-6, 1e-3, 1.0, 300.0]),
    offset=st.sampled_from([0.0, 1.0, -50.0, 1000.0]),
    dtype=st.sampled_from([mx.float16, mx.bfloat16]),
    quantization=st.sampled_from([(g, b) for g in QUANTIZATION_GROUP_SIZES for b in QUANTIZATION_BITS]),
)
def test_the_norm_bound_holds_for_every_quantized_row(seed, palette, scale, offset, dtype, quantization):
    """The load check's bound on a quantized key's norm (docs/spec.md §8)
    against mx.quantize itself: rows of every shape of spread and offset."""
    group_size, bits = quantization
    rng = np.random.default_rng(seed)
    x = fill(rng, (3, 2, 4, 128), palette, "float32") * scale + offset
    keys = x.astype(dtype)
    if not mx.all(mx.isfinite(keys)).item():
        return
    norms = mlx_knorm.key_norms(keys)
    dequantized_norms, bound = quantized_norm_bound(quantize(keys, group_size, bits), group_size, bits)
    # Rows whose bound overflows are not checked (the load check skips them too).
    assert mx.all((norm_distance(norms, dequantized_norms) <= bound) | ~mx.isfinite(bound)).item()


# A §2 sum overflows float32 from a norm of about 2**64 (sqrt of float32's range).
OVERFLOW_NORM = 2.0**64


@pytest.mark.parametrize("backend", ["kernel", "fallback"])
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(
    seed=st.integers(0, 2**16),
    palette=st.sampled_from(["normal", "ties", "large"]),
    dtype=st.sampled_from(["bfloat16", "float32"]),
    quantization=st.sampled_from([(g, b) for g in QUANTIZATION_GROUP_SIZES for b in QUANTIZATION_BITS]),
    groups=st.integers(1, 2),
    spread=st.sampled_from([0.003, 0.03, 0.3]),
)
def test_keys_near_the_overflow_threshold_are_accepted_and_read_back(backend, seed, palette, dtype, quantization,
                                                                     groups, spread):
    """What update_and_fetch accepts, the load check accepts (docs/spec.md
    §8): keys whose norms lie around 2**64, where the key's own norm or its
    dequantized key's may overflow alone, at every bit width and group
    size, through ``state`` and through a file."""
    group_size, bits = quantization
    rng = np.random.default_rng(seed)
    shape = (1, 2, 24, group_size * groups)
    x = np.asarray(fill(rng, shape, palette, "float32").astype(mx.float32), dtype=np.float64)
    x[np.all(x == 0, axis=-1)] = 1.0
    # Each row to its own norm within `spread` of the threshold, either side.
    target = OVERFLOW_NORM * np.exp(rng.uniform(-spread, spread, size=(*shape[:3], 1)))
    x = x / np.linalg.norm(x, axis=-1, keepdims=True) * target
    keys = mx.array(x.astype(np.float32)).astype(getattr(mx, dtype))
    values = fill(rng, shape, "normal", dtype)
    cache = QuantizedL2NormKVCache(budget=16, n_sink=1, recent=2, group_size=group_size, bits=bits)
    with mlx_knorm.use_backend(backend):
        for start, stop in ((0, 9), (9, 10), (10, 24)):
            cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        state = cache.state
    assert_same_state(QuantizedL2NormKVCache.from_state(state).state, state)
    [loaded] = saved_and_loaded([cache])
    assert_same_state(loaded.state, state)


def test_an_overflowed_norm_is_refused_on_a_row_far_below_the_threshold():
    """An infinite norm stands for a key norm from OVERFLOWED_NORM up, not for any."""
    good = quantized_state()
    for norm in (OVERFLOWED_NORM / 4, float("inf")):
        bad = tampered(good, "norms", lambda n, norm=norm: mx.where(mx.arange(n.shape[2]) == 3, norm, n))
        with pytest.raises(ValueError, match="QuantizedL2NormKVCache state field 'norms'"):
            QuantizedL2NormKVCache.from_state(bad)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_key_whose_dequantized_norm_alone_overflows_reads_back(backend):
    """A float32 key of norm 0.9985 * 2**64 at 4 bits, group 32: its norm
    is finite, its dequantized key's (one step of 1.2e18 up) overflows."""
    x = np.zeros((1, 1, 1, 32))
    x[..., :2] = [1.8285897e19, 2.0e18]
    keys = mx.array(x.astype(np.float32))
    cache = QuantizedL2NormKVCache(budget=4, n_sink=1, recent=0, group_size=32, bits=4)
    with mlx_knorm.use_backend(backend):
        cache.update_and_fetch(keys, keys)
        state = cache.state
    dequantized, _ = quantized_norm_bound(state[0], 32, 4)
    assert mx.isfinite(state[2]).item() and dequantized.item() == float("inf")
    cache.state = state
    [loaded] = saved_and_loaded([cache])
    assert_same_state(loaded.state, state)
