"""Tiny randomly initialised mlx-lm models (no downloads) and the loop that
feeds them tokens, for the cache tests and the distributed worker."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import deepseek_v2, deepseek_v3, gemma2, llama, qwen2

VOCAB = 64
HEAD_DIM = 16
KV_HEADS = 2
# deepseek_v2 caches one key and value row per query head.
QUERY_HEADS = 4

# Multi-head latent attention: deepseek_v2 caches keys of width
# qk_nope_head_dim + qk_rope_head_dim and values of width v_head_dim.
MLA_ROPE_DIM = 8
MLA_KEY_DIM = 16 + MLA_ROPE_DIM
MLA_VALUE_DIM = 16
# deepseek_v3 caches the compressed latent (kv_lora_rank wide) and the rope part.
MLA_LATENT_DIM = 16

_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=QUERY_HEADS,
    num_key_value_heads=KV_HEADS,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
)

_MLA = dict(
    q_lora_rank=None,
    kv_lora_rank=MLA_LATENT_DIM,
    qk_nope_head_dim=MLA_KEY_DIM - MLA_ROPE_DIM,
    qk_rope_head_dim=MLA_ROPE_DIM,
    v_head_dim=MLA_VALUE_DIM,
    max_position_embeddings=512,
)

ARCHS = {
    "llama": (llama, dict(model_type="llama")),
    "qwen2": (qwen2, dict(model_type="qwen2")),
    # Every layer attends through one array mask built from the first cache.
    "gemma2": (gemma2, dict(model_type="gemma2", head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM)),
    "deepseek_v2": (deepseek_v2, dict(model_type="deepseek_v2", **_MLA, rope_scaling={"factor": 1.0})),
    # Caches the compressed latent and the rotary part; one array mask for all layers.
    "deepseek_v3": (deepseek_v3, dict(model_type="deepseek_v3", **_MLA)),
}


def tiny_model(arch: str, dtype=mx.float16, layers: int = 3, **extra):
    """A small ``arch`` model with weights drawn from a fixed seed, so every
    process that builds it gets the same weights."""
    module, kind = ARCHS[arch]
    args = module.ModelArgs(**_COMMON, **kind, num_hidden_layers=layers, **extra)
    mx.random.seed(7)
    model = module.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tokens(batch: int, length: int, seed: int = 3) -> mx.array:
    return mx.random.randint(0, VOCAB, (batch, length), key=mx.random.key(seed))


def teacher_forced(model, cache, ids: mx.array, blocks: list[int], after_step=None):
    """Logits of each forward call, feeding ``ids`` in blocks of the given sizes;
    ``after_step(cache)`` runs after each evaluated call."""
    out, start = [], 0
    for size in blocks:
        logits = model(ids[:, start : start + size], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        out.append(logits)
        start += size
        if after_step is not None:
            after_step(cache)
    assert start == ids.shape[1]
    return out
