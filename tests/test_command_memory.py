"""The commands' KV memory line (``mlx_knorm.commands.memory``) on tiny
models: what the caches hold of the conversation, what they allocated, and
what a full cache would hold, per kind of cache, and which layers evict."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model_families import build
from tiny_models import HEAD_DIM, KV_HEADS, tiny_model, tokens

from mlx_knorm.cache import make_knorm_cache
from mlx_knorm.commands.memory import MB, kv_memory, kv_memory_line, layer_ranges, parse_kv_memory_lines

LAYERS = 3
# A float16 row of a key and a value in one head; an eviction cache's row
# also carries a float32 norm and an int32 position.
ROW = 2 * HEAD_DIM * 2
ROW_KEPT = ROW + 4 + 4


def fed(model, cache, count: int, block: int):
    """``count`` tokens fed in blocks of ``block``, the caches evaluated."""
    ids = tokens(1, count)
    for start in range(0, count, block):
        model(ids[:, start: start + block], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", layers=LAYERS)


def test_within_the_budget_the_line_holds_the_conversation_not_the_slots(llama):
    # 80 tokens under a budget of 128: the caches hold 80 rows (and their
    # norms and positions) but allocated 129 slots from the first block on.
    cache = fed(llama, make_knorm_cache(llama, budget=128), 80, 80)
    m = kv_memory(cache)
    heads = LAYERS * KV_HEADS
    assert (m.tokens, m.held, m.full) == (80, 80 * heads * ROW_KEPT, 80 * heads * ROW)
    assert m.allocated == sum(c.nbytes for c in cache) == 129 * heads * ROW_KEPT
    line = kv_memory_line(cache)
    assert line == (f"KV cache (80 tokens): {m.held / MB:.3f} MB held, {m.allocated / MB:.3f} MB allocated, "
                    f"{m.full / MB:.3f} MB for a full cache; eviction (budget 128) in layers 0-2")
    # Eviction costs only its norms and positions before the budget is reached.
    assert m.held / m.full == ROW_KEPT / ROW


def test_past_the_budget_the_caches_hold_the_budget_and_a_full_cache_every_token(llama):
    cache = fed(llama, make_knorm_cache(llama, budget=32), 300, 1)
    m = kv_memory(cache)
    heads = LAYERS * KV_HEADS
    assert m.tokens == 300 and m.full == 300 * heads * ROW
    # Between steps a cache holds the budget plus the step's new row.
    assert m.held == m.allocated == 33 * heads * ROW_KEPT < m.full
    [parsed] = parse_kv_memory_lines("...\n" + kv_memory_line(cache) + "\nmore")
    assert parsed["tokens"] == 300 and parsed["kinds"] == "eviction (budget 32) in layers 0-2"
    assert (parsed["held_mb"], parsed["allocated_mb"], parsed["full_mb"]) == tuple(
        round(b / MB, 3) for b in (m.held, m.allocated, m.full))


def test_layers_left_whole_are_named_as_no_eviction_and_the_eviction_layers_by_index(llama):
    cache = fed(llama, make_knorm_cache(llama, budget=16, skip_layers=[1]), 40, 40)
    m = kv_memory(cache)
    evicting, whole = m.kinds
    assert (evicting.kind, evicting.layers, whole.kind, whole.layers) == ("eviction", (0, 2), "no eviction", (1,))
    # mlx-lm's KVCache holds the 40 rows in a buffer of 256.
    assert whole.held == whole.full == 40 * KV_HEADS * ROW and whole.allocated == 256 * KV_HEADS * ROW
    line = kv_memory_line(cache)
    assert "; eviction (budget 16) in layers 0,2: " in line and "; no eviction in 1 layer: " in line


def test_a_sliding_window_family_counts_its_windows_apart_from_the_eviction_layer():
    """gemma3_text (tiny: windows of 4 rows in layers 0-4, full attention in
    layer 5): the windows are the model's own caches, the same with or without
    eviction, so a full cache holds what they hold."""
    model = build("gemma3_text")
    cache = make_knorm_cache(model, budget=8)
    ids = mx.arange(1, 15)[None]
    model(ids, cache=cache)
    for token in range(5):
        model(mx.array([[token]]), cache=cache)
    mx.eval([c.state for c in cache])
    m = kv_memory(cache)
    evicting, windows = m.kinds
    assert evicting.kind == "eviction" and evicting.layers == (5,)
    assert windows.kind == "window" and windows.setting == "4" and windows.layers == (0, 1, 2, 3, 4)
    row = 2 * 32 * 4  # one KV head of 32, float32
    assert windows.held == windows.full == 5 * 4 * row  # each window's 4 rows
    assert evicting.held == 9 * (row + 8) and evicting.full == 19 * row  # 8 kept + the newest, of 19
    assert m.held < m.full and m.held <= m.allocated
    line = kv_memory_line(cache)
    assert line.startswith("KV cache (19 tokens): ")
    assert "; eviction (budget 8) in layer 5: " in line and "; window 4 in 5 layers: " in line


def test_a_cache_list_layer_counts_its_recurrent_state_and_its_eviction_cache_apart():
    # falcon_h1: every layer a CacheList of an attention KVCache and an ArraysCache.
    model = build("falcon_h1")
    cache = make_knorm_cache(model, budget=8)
    model(mx.arange(1, 15)[None], cache=cache)
    mx.eval([c.state for c in cache])
    evicting, recurrent = kv_memory(cache).kinds
    assert (evicting.kind, evicting.layers) == ("eviction", (0, 1, 2, 3))
    assert (recurrent.kind, recurrent.layers) == ("recurrent", (0, 1, 2, 3))
    assert recurrent.held == recurrent.allocated == recurrent.full == sum(c[0].nbytes for c in cache)
    assert "; recurrent in 4 layers: " in kv_memory_line(cache)


def test_quantized_rows_count_their_packed_words_scales_and_biases():
    model = tiny_model("llama", layers=2, head_dim=32)
    cache = fed(model, make_knorm_cache(model, budget=16), 24, 24)
    quantized = [c.to_quantized(group_size=32, bits=4) for c in cache]
    m = kv_memory(quantized)
    # Per head and row: 32 values at 4 bits (16 bytes) and a float16 scale and
    # bias, for the key and the value; then the norm and the position.
    row = 2 * (16 + 2 + 2)
    assert m.held == 2 * KV_HEADS * 24 * (row + 8) and m.full == 2 * KV_HEADS * 24 * row
    assert "eviction (budget 16, 4-bit rows) in layers 0-1" in kv_memory_line(quantized)


def test_an_empty_cache_holds_nothing(llama):
    assert kv_memory_line(make_knorm_cache(llama, budget=16)) == (
        "KV cache (0 tokens): 0.000 MB held, 0.000 MB allocated, 0.000 MB for a full cache; "
        "eviction (budget 16) in layers 0-2")


@pytest.mark.parametrize("layers, text", [
    ((0,), "0"), ((0, 1, 2), "0-2"), ((5, 11, 17), "5,11,17"), ((0, 1, 2, 5, 7, 8), "0-2,5,7-8"),
])
def test_layer_ranges(layers, text):
    assert layer_ranges(layers) == text
