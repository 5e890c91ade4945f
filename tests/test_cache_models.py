"""make_knorm_cache across mlx-lm architectures: keys and values of different
widths (multi-head latent attention), models that share one array mask across
layers, and skip_layers. Tiny random models, no downloads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

import mlx_knorm
from mlx_knorm.cache import L2NormKVCache, make_knorm_cache

from tiny_models import (
    HEAD_DIM,
    KV_HEADS,
    MLA_KEY_DIM,
    MLA_LATENT_DIM,
    MLA_ROPE_DIM,
    MLA_VALUE_DIM,
    QUERY_HEADS,
    teacher_forced,
    tiny_model,
    tokens,
)

BUDGET, N_SINK, RECENT = 16, 2, 1
# Prefill, decode to one past the budget (still attending to every token),
# then multi-token blocks and decoding after eviction has started.
BLOCKS = [10] + [1] * 7 + [7, 1, 1, 12] + [1] * 6 + [5]
UNTIL_BUDGET = 8  # the calls before the first eviction: 10 + 7 = budget + 1 tokens
# tests/test_protected_topk_gather.py runs the Metal emulator with D_k != D_v.
BACKENDS = ("kernel", "fallback")

# (heads, key width, value width) of each architecture's attention cache.
CACHE_SHAPES = {
    "llama": (KV_HEADS, HEAD_DIM, HEAD_DIM),
    "qwen2": (KV_HEADS, HEAD_DIM, HEAD_DIM),
    "gemma2": (KV_HEADS, HEAD_DIM, HEAD_DIM),
    # One row per query head: nope and rope parts as keys, v_head_dim values.
    "deepseek_v2": (QUERY_HEADS, MLA_KEY_DIM, MLA_VALUE_DIM),
    # The compressed latent as keys, the shared rope part as values.
    "deepseek_v3": (1, MLA_LATENT_DIM, MLA_ROPE_DIM),
}
# Build one array mask from the first layer's cache and give it to every layer.
SHARED_ARRAY_MASK = ("gemma2", "deepseek_v3")
SKIP_WORKS = ("llama", "qwen2", "deepseek_v2")


def stored(layer) -> tuple[mx.array, mx.array]:
    """The keys and values a layer holds: the first ``size()`` rows of the
    first two parts of its mlx-lm state (KVCache's state is its buffers)."""
    keys, values = layer.state[:2]
    return keys[..., : layer.size(), :], values[..., : layer.size(), :]


def check_layers(cache, arch: str, seen: int) -> None:
    """Every compressed layer holds min(seen, budget) rows of the right widths;
    skipped layers hold everything."""
    heads, key_dim, value_dim = CACHE_SHAPES[arch]
    for layer in cache:
        rows = min(seen, BUDGET) if isinstance(layer, L2NormKVCache) else seen
        keys, values = stored(layer)
        assert keys.shape == (1, heads, rows, key_dim) and values.shape == (1, heads, rows, value_dim)
        assert layer.size() == rows and layer.offset == seen
        if isinstance(layer, L2NormKVCache):
            assert layer.knorm_kept_bytes == heads * rows * (key_dim + value_dim) * 2
            assert layer.full_seq_bytes == heads * seen * (key_dim + value_dim) * 2
        else:
            assert type(layer) is KVCache


def run(arch: str, backend: str, skip_layers=()):
    """Teacher-forced logits of every call on ``backend``, checking the layers after each."""
    model = tiny_model(arch, layers=4)
    cache = make_knorm_cache(model, budget=BUDGET, n_sink=N_SINK, recent=RECENT, skip_layers=skip_layers)
    seen = []

    def after_step(cache):
        seen.append(cache[0].offset)
        check_layers(cache, arch, seen[-1])

    with mlx_knorm.use_backend(backend):
        logits = teacher_forced(model, cache, tokens(1, sum(BLOCKS), seed=13), BLOCKS, after_step)
    return logits, cache


@pytest.mark.parametrize(
    "arch, skip_layers",
    [(arch, ()) for arch in ("gemma2", "deepseek_v2", "deepseek_v3")]
    + [(arch, (0, 1)) for arch in SKIP_WORKS],
    ids=lambda value: "-".join(map(str, value)) if isinstance(value, tuple) else value,
)
def test_every_backend_gives_kvcache_logits_until_the_budget_and_one_result_after(arch, skip_layers):
    runs = {backend: run(arch, backend, skip_layers) for backend in BACKENDS}
    model = tiny_model(arch, layers=4)
    full = teacher_forced(model, [KVCache() for _ in model.layers], tokens(1, sum(BLOCKS), seed=13), BLOCKS)
    kernel_logits, kernel_cache = runs["kernel"]
    for step in range(UNTIL_BUDGET):
        assert mx.array_equal(kernel_logits[step], full[step]).item(), f"step {step}"
    # Past the budget the compressed layers attend to fewer rows than KVCache.
    assert not mx.array_equal(kernel_logits[-1], full[-1]).item()
    for backend, (logits, cache) in runs.items():
        for step, (ours, theirs) in enumerate(zip(logits, kernel_logits)):
            assert mx.array_equal(ours, theirs).item(), f"{backend}, step {step}"
        for ours, theirs in zip(cache, kernel_cache):
            assert all(mx.array_equal(a, b).item() for a, b in zip(stored(ours), stored(theirs)))
    assert [type(c) for c in kernel_cache] == [
        KVCache if index in skip_layers else L2NormKVCache for index in range(4)
    ]


@pytest.mark.parametrize("arch", SKIP_WORKS)
def test_a_skipped_first_layer_keeps_what_kvcache_keeps(arch):
    """Layer 0's keys depend on the tokens alone, so skipped it holds exactly
    KVCache's rows, while the compressed layers past it hold the budget."""
    _, cache = run(arch, "kernel", skip_layers=(0,))
    model = tiny_model(arch, layers=4)
    full = [KVCache() for _ in model.layers]
    teacher_forced(model, full, tokens(1, sum(BLOCKS), seed=13), BLOCKS)
    assert all(mx.array_equal(a, b).item() for a, b in zip(stored(cache[0]), stored(full[0])))
    assert [c.size() for c in cache] == [sum(BLOCKS)] + [BUDGET] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_latent_attention_keeps_the_lowest_key_norm_rows_with_their_values(backend):
    """deepseek_v2, keys 24 wide and values 16: layer 0's rows depend on the
    tokens alone, so a full cache has them all. The kept rows are the sinks
    and the lowest key norms of the rest, each key with its own value."""
    model = tiny_model("deepseek_v2", layers=2)
    ids = tokens(1, 40, seed=19)
    cache = make_knorm_cache(model, budget=BUDGET, n_sink=N_SINK, recent=0)
    with mlx_knorm.use_backend(backend):
        teacher_forced(model, cache, ids, [25, 1, 1, 13])
    full = [KVCache() for _ in model.layers]
    teacher_forced(model, full, ids, [40])
    all_keys, all_values = stored(full[0])
    norms = np.array(mlx_knorm.key_norms(all_keys))
    keys, values = stored(cache[0])
    for head in range(QUERY_HEADS):
        rest = N_SINK + np.argsort(norms[0, head, N_SINK:], kind="stable")[: BUDGET - N_SINK]
        rows = mx.array(np.concatenate([np.arange(N_SINK), np.sort(rest)]))
        assert mx.array_equal(keys[0, head], all_keys[0, head][rows]).item()
        assert mx.array_equal(values[0, head], all_values[0, head][rows]).item()


@pytest.mark.parametrize("arch", SHARED_ARRAY_MASK)
def test_models_sharing_one_array_mask_refuse_skip_layers(arch):
    model = tiny_model(arch, layers=4)
    for skip in [(0,), (1, 2), (3,)]:
        with pytest.raises(ValueError, match=r"skip_layers=.*one array attention mask.*layer 0"):
            make_knorm_cache(model, budget=BUDGET, skip_layers=skip)
    # Nothing compressed, nothing to disagree with: every layer a plain KVCache.
    assert [type(c) for c in make_knorm_cache(model, skip_layers=range(4))] == [KVCache] * 4

    # Why: built by hand, such a cache breaks on the first multi-token block
    # after eviction, when the first layer's mask no longer fits the others.
    cache = [KVCache()] + [L2NormKVCache(budget=BUDGET, n_sink=N_SINK) for _ in range(3)]
    ids = tokens(1, 30)
    mx.eval(model(ids[:, :20], cache=cache), model(ids[:, 20:21], cache=cache))
    with pytest.raises(ValueError, match="broadcast"):
        mx.eval(model(ids[:, 21:], cache=cache))


@pytest.mark.parametrize("arch", ("deepseek_v2", "gemma2"))
def test_generate_step_past_the_budget(arch):
    model = tiny_model(arch, mx.bfloat16)
    prompt = tokens(1, 40, seed=17)[0]
    generated = {}
    for backend in ("kernel", "fallback"):
        cache = make_knorm_cache(model, budget=BUDGET, n_sink=N_SINK)
        with mlx_knorm.use_backend(backend):
            generated[backend] = [
                int(token)
                for token, _ in generate_step(prompt, model, prompt_cache=cache, prefill_step_size=12, max_tokens=24)
            ]
        assert all(c.size() == BUDGET and c.offset == prompt.size + 24 for c in cache)
    assert generated["kernel"] == generated["fallback"]
