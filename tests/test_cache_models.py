"""make_knorm_cache across mlx-lm architectures: keys and values of different
widths (multi-head latent attention), models that share one array mask across
layers, and skip_layers. Tiny random models, no downloads."""

from __future__ import annotations

import mlx.core as mx
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


def check_layers(cache, arch: str, seen: int) -> None:
    """Every compressed layer holds min(seen, budget) rows of the right widths
    and the norms of its own keys; skipped layers hold everything."""
    heads, key_dim, value_dim = CACHE_SHAPES[arch]
    for layer in cache:
        if isinstance(layer, L2NormKVCache):
            kept = min(seen, BUDGET)
            assert layer.keys.shape == (1, heads, kept, key_dim)
            assert layer.values.shape == (1, heads, kept, value_dim)
            assert layer.knorm_kept_bytes == heads * kept * (key_dim + value_dim) * 2
            assert layer.full_seq_bytes == heads * seen * (key_dim + value_dim) * 2
            assert mx.array_equal(layer.norms, mlx_knorm.key_norms(layer.keys)).item()
        else:
            assert type(layer) is KVCache
        assert layer.offset == seen


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
            assert mx.array_equal(ours.keys, theirs.keys).item()
            assert mx.array_equal(ours.values, theirs.values).item()
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
    state, full_state = cache[0].state, full[0].state
    assert all(mx.array_equal(a, b).item() for a, b in zip(state, full_state))
    assert [c.size() for c in cache] == [sum(BLOCKS)] + [BUDGET] * 3


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
