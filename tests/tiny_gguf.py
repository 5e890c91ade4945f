"""Tiny GGUF files written here as llama.cpp's converter writes them, from weights in the original layout.

``write_model`` draws random weights in the layout of the Hugging Face
checkpoint (which mlx-lm's models use), converts them as
``convert_hf_to_gguf.py`` does (llama's q/k rows permuted for its RoPE,
gemma's norms stored as ``1 + w``, 2-D weights in the chosen GGML type, 1-D
ones in F32) and writes them with the ``gguf`` package's writer. It returns
what the file must load as: the mlx-lm config and the reference arrays, each
derived here without the loader's code (quantized ones as MLX's own GGUF
reader, ``mx.load``, repacks them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from mlx_lm.utils import _get_classes

from mlx_knorm.quality.byte_tokenizer import _byte_characters

MLX_READS = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # the types mx.load repacks as affine
RANDOM_BLOCKS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K)  # no quantizer in gguf-py: random valid blocks


BYTE_CHARS = _byte_characters()  # GPT-2's byte-to-character table of byte-level BPE
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]


def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary: three control tokens, the 256 bytes, a few merges."""
    tokens = BPE_SPECIALS + [BYTE_CHARS[b] for b in range(256)] + ["".join(m) for m in BPE_MERGES]
    types = [3] * len(BPE_SPECIALS) + [1] * (len(tokens) - len(BPE_SPECIALS))
    return tokens, types, [" ".join(m) for m in BPE_MERGES]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: control and unknown tokens, the 256 byte tokens, a few pieces."""
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    config: dict  # the mlx-lm config the file describes
    weights: dict  # mlx-lm name -> the float32 values drawn, in the checkpoint's layout
    written: dict  # mlx-lm name -> (GGUF name, GGML type, shape)

    @cached_property
    def _references(self):
        return _reference(self.path, self.arch, self.config, self.weights, self.written)

    @property
    def reference(self) -> dict:
        """mlx-lm name -> mx.array: what the loaded model must hold."""
        return self._references[0]

    @property
    def file_order_reference(self) -> dict:
        """The same with llama's q/k rows as the file stores them."""
        return self._references[1]


ARCHS = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=True),
    # Six layers: the sixth is gemma3's first global one; the others slide over 8 tokens.
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                   max_position_embeddings=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   sliding_window=8, sliding_window_pattern=6, query_pre_attn_scalar=32),
}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

# mlx-lm names within a block -> GGUF names, per architecture.
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_POST_ATTENTION = {"llama": "ffn_norm", "qwen2": "ffn_norm", "qwen3": "ffn_norm", "gemma3": "post_attention_norm"}
_GEMMA3_EXTRA = {"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(arch: str, mlx_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if mlx_name in top:
        return top[mlx_name]
    _, _, layer, rest = mlx_name.split(".", 3)
    module, param = rest.rsplit(".", 1)
    names = {**_BLOCK_NAMES, "post_attention_layernorm": _POST_ATTENTION[arch], **_GEMMA3_EXTRA}
    return f"blk.{layer}.{names[module]}.{param}"


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama_cpp_inverse(rows: np.ndarray, n_head: int) -> np.ndarray:
    order = llama_cpp_permute(np.arange(rows.shape[0]), n_head)
    return rows[np.argsort(order)]


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float = 1.0, high: float = 4.0,
                        old: int = 8192) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a llama3 rope_scaling."""
    import math

    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _random_blocks(qtype, rows: int, columns: int, rng) -> np.ndarray:
    """Valid random blocks of a K-quant: random bits, with the float16 scales set to small values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    scale = lambda: rng.uniform(0.001, 0.01, size=(rows, columns // block, 1)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K):
        offset = {Q.Q2_K: size - 4, Q.Q4_K: 0, Q.Q5_K: 0}[qtype]
        raw[..., offset:offset + 2] = scale()
        raw[..., offset + 2:offset + 4] = scale()
    else:  # Q3_K, Q6_K: d is the last two bytes
        raw[..., size - 2:] = scale()
    return raw.reshape(rows, -1)


def _mlx_lm_model_weights(config: dict, rng) -> dict[str, np.ndarray]:
    """Random float32 weights, named and shaped as mlx-lm's model for ``config`` has them."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    from mlx.utils import tree_flatten

    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Multiples of 1/64 below 1: w + 1 - 1 == w in float32, so gemma's stored 1 + w reads back exactly.
            weights[name] = rng.integers(-32, 33, size=value.shape).astype(np.float32) / 64
            if config["model_type"] != "gemma3_text":
                weights[name] += 1
        else:
            weights[name] = rng.normal(0, 0.08, size=value.shape).astype(np.float32)
    if config["model_type"] == "gemma3_text":  # tied: the file has no output.weight
        weights.pop("lm_head.weight")
    return weights


def write_model(path: Path, arch: str, qtype, *, embedding_type=None, vocab: str | None = None,
                rope_freqs: np.ndarray | None = None, extra_tensors: dict | None = None,
                gguf_arch: str | None = None, seed: int = 0, **config_overrides) -> TinyGGUF:
    """Write a tiny ``arch`` model whose 2-D weights have GGML type ``qtype`` (the embedding ``embedding_type``).

    ``extra_tensors``: GGUF name -> array, or (raw bytes, GGML type), written instead of the model's
    tensor of that name or besides them.
    """
    rng = np.random.default_rng(seed)
    config = {**ARCHS[arch], **config_overrides}
    vocab = vocab or ("spm" if arch == "gemma3" else "bpe")
    tokens = bpe_vocab()[0] if vocab == "bpe" else spm_vocab()[0]
    config["vocab_size"] = len(tokens)
    weights = _mlx_lm_model_weights(config, rng)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    writer = gguf.GGUFWriter(path, gguf_arch or GGUF_ARCH[arch])
    hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // n_heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if vocab == "bpe":
        tokens, types, merges = bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:
        tokens, scores, types = spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_add_space_prefix(False)
        writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    written = {}
    for name, values in weights.items():
        target = gguf_name(arch, name)
        if target in (extra_tensors or {}):
            continue
        module = target.split(".")[-2]
        file_values = values + 1 if arch == "gemma3" and name.endswith("norm.weight") else values
        if arch == "llama" and module in heads:
            file_values = llama_cpp_permute(file_values, heads[module])
        kind = Q.F32 if values.ndim == 1 else (embedding_type or qtype) if target == "token_embd.weight" else qtype
        if kind == Q.F32:
            writer.add_tensor(target, file_values.astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(target, file_values.astype(np.float16))
        elif kind in RANDOM_BLOCKS:
            raw = _random_blocks(kind, *file_values.shape, rng)
            writer.add_tensor(target, raw, raw_dtype=kind)
        else:
            writer.add_tensor(target, quantize(file_values, kind), raw_dtype=kind)
        written[name] = (target, kind, values.shape)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        if isinstance(array, tuple):
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path=path, arch=arch, config=config, weights=weights, written=written)


def _reference(path, arch, config, weights, written):
    """The arrays the loader must produce, and the same with llama's q/k rows left in the file's order."""
    from gguf import GGUFReader

    mlx_read = None
    reader = {t.name: t for t in GGUFReader(path).tensors}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    reference, file_order = {}, {}
    for name, (target, kind, shape) in written.items():
        module = target.split(".")[-2]
        rows = heads.get(module) if arch == "llama" else None
        prefix = name[: -len("weight")] if name.endswith("weight") else None
        if kind in MLX_READS:
            mlx_read = mlx_read or mx.load(str(path))
            for suffix in ("weight", "scales", "biases"):
                stored = np.array(mlx_read[f"{target[:-len('weight')]}{suffix}"])
                file_order[prefix + suffix] = mx.array(stored)
                reference[prefix + suffix] = mx.array(llama_cpp_inverse(stored, rows) if rows else stored)
            continue
        if kind in RANDOM_BLOCKS:
            stored = dequantize(np.array(reader[target].data), kind).reshape(shape)
            value = mx.array(llama_cpp_inverse(stored, rows) if rows else stored)
        elif kind == Q.F16:
            value = mx.array(weights[name].astype(np.float16))
            stored = llama_cpp_permute(weights[name], rows).astype(np.float16) if rows else None
        else:
            value = mx.array(weights[name])
            stored = llama_cpp_permute(weights[name], rows) if rows else None
        reference[name] = value
        file_order[name] = mx.array(stored) if rows else value
    return reference, file_order


def reference_model(config: dict, weights: dict):
    """An mlx-lm model built straight from ``config`` and ``weights`` (quantized where scales are given)."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = model.sanitize(dict(weights))

    def quantized(path, module):
        if f"{path}.scales" not in weights:
            return False
        columns = module.weight.shape[-1]
        return {"group_size": columns // weights[f"{path}.scales"].shape[-1],
                "bits": weights[f"{path}.weight"].shape[-1] * 32 // columns}

    nn.quantize(model, class_predicate=quantized)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
