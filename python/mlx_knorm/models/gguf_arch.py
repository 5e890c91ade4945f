"""GGUF architectures as mlx-lm models: the config, the tensor names and what llama.cpp changed.

Each architecture here is one whose every GGUF field and tensor this module
maps onto an mlx-lm model exactly; a file with anything else (another
architecture, a tensor or setting without a place in the mlx-lm model) is
refused with an error naming it. What llama.cpp's converter changed is undone:

- llama: the converter permutes each head's q and k rows (and biases) for its
  RoPE, which rotates adjacent pairs; mlx-lm's llama rotates the two halves of
  a head, as the original checkpoint does, so the rows are put back
  (``unpermute_rope_rows``). A row permutation is exact on quantized rows.
- gemma3: the converter stores every norm weight as ``1 + w`` (gemma's
  RMSNorm multiplies by ``1 + w``), and mlx-lm adds the 1 itself, so 1 is
  subtracted again (in float32).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .gguf_file import GGUFFile, UnsupportedGGUF

TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_ATTENTION_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_PRE_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GEMMA3_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LLAMA_EXTRA = {
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}

BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# Llama 3.1-3.3's RoPE scaling, as their config.json files give it. A llama
# GGUF carries it only as the per-frequency factors llama.cpp computed from it
# (the tensor rope_freqs), so a file is accepted when these parameters, with the
# largest factor in the tensor, reproduce the tensor.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    model_type: str  # mlx-lm's
    block_tensors: dict[str, str]  # GGUF name within a block -> mlx-lm name within model.layers.N
    config: Callable[[GGUFFile], dict]
    permuted_rope_rows: bool = False
    norm_offset: float = 0.0  # the file stores norm weights as offset + w

    def mlx_name(self, gguf_name: str, layers: int) -> str | None:
        """The mlx-lm parameter a GGUF tensor is, or None (for a model of ``layers`` blocks)."""
        if gguf_name in TOP_LEVEL:
            return TOP_LEVEL[gguf_name]
        match = BLOCK.fullmatch(gguf_name)
        if match and match[2] in self.block_tensors and int(match[1]) < layers:
            return f"model.layers.{int(match[1])}.{self.block_tensors[match[2]]}"
        return None


def f32(value) -> float:
    """A float32 from the file as the shortest decimal that reads back as the same float32."""
    value = np.float32(value)
    return float(np.format_float_positional(value, unique=True, trim="-")) if math.isfinite(value) else float(value)


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: in the file, row ``2 j + s`` of a head is the original row ``s * d/2 + j``."""
    head = rows.shape[0] // n_heads
    return rows.reshape(n_heads, head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from the original one (the inverse of ``unpermute_rope_rows``)."""
    head = rows.shape[0] // n_heads
    return rows.reshape(n_heads, 2, head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _required(f: GGUFFile, key: str):
    value = f.arch_key(key)
    if value is None:
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.{key} is missing")
    return value


def _uniform(f: GGUFFile, key: str, default=None):
    """A per-model setting llama.cpp allows per layer; refused unless every layer has the same."""
    value = f.arch_key(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.{key} differs between layers ({value}); "
                                  "the mlx-lm model has one value for all layers")
        value = value[0]
    return value


def _refuse_keys(f: GGUFFile, *keys: str) -> None:
    for key in keys:
        value = f.arch_key(key)
        if value not in (None, 0, 0.0, False):
            raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.{key} = {value!r} has no equivalent in "
                                  f"mlx-lm's {f.architecture} model")


def _base_config(f: GGUFFile, model_type: str) -> dict:
    heads = _uniform(f, "attention.head_count")
    if heads is None:
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.attention.head_count is missing")
    hidden = _required(f, "embedding_length")
    head_dim = f.arch_key("attention.key_length", hidden // heads)
    if f.arch_key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.attention.value_length "
                              f"{f.arch_key('attention.value_length')} differs from key_length {head_dim}")
    rope_dims = f.arch_key("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.rope.dimension_count = {rope_dims} rotates part "
                              f"of each {head_dim}-wide head; mlx-lm's {model_type} rotates all of it")
    _refuse_keys(f, "expert_count", "attention.clamp_kqv", "attn_logit_softcapping", "logit_scale")
    if f.arch_key("attention.causal", True) is not True:
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.attention.causal is false")
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise UnsupportedGGUF(f"{f.path.name}: no token_embd.weight tensor")
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _required(f, "block_count"),
        "intermediate_size": _uniform(f, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(f, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": f32(_required(f, "attention.layer_norm_rms_epsilon")),
        "vocab_size": int(embed.shape[1]),
        "max_position_embeddings": f.arch_key("context_length"),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }


def _rope(f: GGUFFile, config: dict, default_theta: float, *, llama3_factors: bool = False) -> None:
    """``rope_theta`` and ``rope_scaling`` into ``config``."""
    config["rope_theta"] = f32(f.arch_key("rope.freq_base", default_theta))
    kind = f.arch_key("rope.scaling.type")
    factor = f.arch_key("rope.scaling.factor")
    if "rope_freqs.weight" in f.tensors:
        if not llama3_factors:
            raise UnsupportedGGUF(f"{f.path.name}: per-frequency RoPE factors (rope_freqs.weight) are read for "
                                  f"llama files only, not {f.architecture}")
        config["rope_scaling"] = _llama3_rope_scaling(f, config)
    elif kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return
    elif kind == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": f32(factor)}
    else:
        raise UnsupportedGGUF(f"{f.path.name}: RoPE scaling {kind!r} ({f.architecture}.rope.scaling.type) "
                              "is not supported; supported: linear, and Llama 3's (rope_freqs)")


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter computes from a ``llama3`` rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _llama3_rope_scaling(f: GGUFFile, config: dict) -> dict:
    tensor = f.tensors["rope_freqs.weight"]
    from .gguf_tensors import dequantize

    stored = dequantize(tensor.name, tensor.tensor_type, tensor.data).reshape(-1)
    head_dim = config["head_dim"]
    if stored.shape != (head_dim // 2,):
        raise UnsupportedGGUF(f"{f.path.name}: rope_freqs.weight has {stored.size} factors, expected {head_dim // 2}")
    scaling = {"rope_type": "llama3", "factor": f32(stored.max()), **LLAMA3_ROPE_DEFAULTS}
    expected = llama3_rope_factors(head_dim, config["rope_theta"], scaling)
    if not np.allclose(stored, expected, rtol=1e-5, atol=0):
        raise UnsupportedGGUF(f"{f.path.name}: rope_freqs.weight holds RoPE factors that Llama 3's scaling "
                              f"(factor {scaling['factor']}, low/high frequency factors 1 and 4, original "
                              "context 8192) does not reproduce")
    return scaling


def _no_sliding_window(f: GGUFFile, config: dict) -> None:
    window = f.arch_key("attention.sliding_window")
    if window and window < (config["max_position_embeddings"] or math.inf):
        raise UnsupportedGGUF(f"{f.path.name}: {f.architecture}.attention.sliding_window = {window}; "
                              f"mlx-lm's {config['model_type']} attends to the whole context")


def llama_config(f: GGUFFile) -> dict:
    config = _base_config(f, "llama")
    _rope(f, config, 10000.0, llama3_factors=True)
    _no_sliding_window(f, config)
    config["rope_traditional"] = False  # the q/k rows are un-permuted
    config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    if "blk.0.attn_output.bias" in f.tensors and not config["attention_bias"]:
        raise UnsupportedGGUF(f"{f.path.name}: attn_output has a bias but attn_q has none")
    return config


def qwen2_config(f: GGUFFile) -> dict:
    config = _base_config(f, "qwen2")
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedGGUF(f"{f.path.name}: head dimension {config['head_dim']} is not hidden size / heads, "
                              "which mlx-lm's qwen2 assumes")
    del config["head_dim"]
    _rope(f, config, 1_000_000.0)
    _no_sliding_window(f, config)
    return config


def qwen3_config(f: GGUFFile) -> dict:
    config = _base_config(f, "qwen3")
    _rope(f, config, 1_000_000.0)
    _no_sliding_window(f, config)
    return config


def gemma3_config(f: GGUFFile) -> dict:
    config = _base_config(f, "gemma3_text")
    _refuse_keys(f, "final_logit_softcapping")
    _rope(f, config, 1_000_000.0)
    # llama.cpp's own values where the file has no key: local RoPE base 10000,
    # every 6th layer global, and the attention scale by model size (only the
    # 62-layer 27B scales by hidden size / heads instead of the head size).
    config["rope_local_base_freq"] = f32(f.arch_key("rope.freq_base_swa", 10000.0))
    pattern = f.arch_key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        period = pattern.index(False) + 1 if False in pattern else 0
        if not period or pattern != [(i + 1) % period != 0 for i in range(len(pattern))]:
            raise UnsupportedGGUF(f"{f.path.name}: gemma3.attention.sliding_window_pattern {pattern} is not "
                                  "periodic with the last layer of each period global")
        pattern = period
    config["sliding_window_pattern"] = pattern
    window = f.arch_key("attention.sliding_window")
    if not window:
        raise UnsupportedGGUF(f"{f.path.name}: gemma3.attention.sliding_window is missing")
    config["sliding_window"] = window
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    config["query_pre_attn_scalar"] = hidden // heads if layers == 62 else config["head_dim"]
    return config


ARCHITECTURES = {
    arch.name: arch
    for arch in [
        Architecture("llama", "llama", {**_PRE_NORMS, **_ATTENTION, **_ATTENTION_BIASES, **_LLAMA_EXTRA, **_MLP},
                     llama_config, permuted_rope_rows=True),
        Architecture("qwen2", "qwen2", {**_PRE_NORMS, **_ATTENTION, **_ATTENTION_BIASES, **_MLP}, qwen2_config),
        Architecture("qwen3", "qwen3", {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, qwen3_config),
        Architecture("gemma3", "gemma3_text", {**_GEMMA3_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP},
                     gemma3_config, norm_offset=1.0),
    ]
}

# Tensors that carry settings, not weights: the config reads them.
CONFIG_TENSORS = {"rope_freqs.weight"}


def architecture_of(f: GGUFFile) -> Architecture:
    arch = ARCHITECTURES.get(f.architecture)
    if arch is None:
        raise UnsupportedGGUF(f"{f.path.name}: architecture {f.architecture!r} is not supported "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch
