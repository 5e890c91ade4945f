"""The shipped byte-level model and the eviction-policy eval: fast checks only."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest


from mlx_lm.utils import load_model

from mlx_knorm.cache import make_knorm_cache
from mlx_knorm.quality import MODEL_DIR, data
from mlx_knorm.quality.eval import causal_mask, evaluate, forward
from mlx_knorm.quality.policies import POLICIES, kept_mask, policy_scores


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR)[0]


@pytest.fixture(scope="module")
def sequences():
    return data.heldout_sequences(128, 2)


def test_split_is_deterministic_and_by_file():
    train, heldout = data.split_files()
    assert (train, heldout) == data.split_files()
    assert heldout and train and not set(train) & set(heldout)
    assert all(data.is_heldout(f) for f in heldout) and not any(data.is_heldout(f) for f in train)
    assert np.array_equal(data.heldout_sequences(64, 3), data.heldout_sequences(64, 3))


def test_shipped_model_is_llama_gqa_and_gives_finite_logits(model):
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert (MODEL_DIR / "TRAINING.json").exists()
    tokens = mx.array([list(b"import os\n\ndef main():\n")], dtype=mx.int32)
    logits = model(tokens)
    assert logits.shape == (1, tokens.shape[1], 256)
    assert mx.all(mx.isfinite(logits)).item()


def test_eval_forward_equals_mlx_lm_forward(model, sequences):
    tokens = mx.array(sequences[0], dtype=mx.int32)
    kv_heads = model.model.layers[0].self_attn.n_kv_heads
    logits, _ = forward(model, tokens, lambda i, k: causal_mask(kv_heads, len(sequences[0])))
    assert mx.allclose(logits, model(tokens[None])[0], atol=1e-4).item()


def test_keep_low_masks_reproduce_knorm_cache_decoding(model, sequences):
    """Teacher-forced masks == L2NormKVCache fed one token at a time (up to its float16 storage)."""
    budget, n_sink = 32, 4
    tokens = mx.array(sequences[1][:96], dtype=mx.int32)
    cache = make_knorm_cache(model, budget=budget, n_sink=n_sink)
    decoded = mx.concatenate([model(tokens[None, t : t + 1], cache=cache)[0] for t in range(len(tokens))])

    def mask_fn(layer, keys):
        scores, keep = policy_scores("keep-low", keys, mx.random.key(0))
        return kept_mask(scores, budget, n_sink, keep)

    masked, _ = forward(model, tokens, mask_fn)
    full, _ = forward(model, tokens, lambda i, k: causal_mask(k.shape[0], len(tokens)))
    assert mx.abs(decoded - masked).max().item() < 0.05
    assert mx.abs(masked - full)[budget + 1 :].max().item() > 0.05  # eviction did change something


def test_kept_mask_is_the_streaming_selection():
    scores = mx.array([[5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 6.0, 0.1]])
    mask = np.array(kept_mask(scores, budget=3, n_sink=1, keep="low"))[0]
    # Query 7 sees the 3 kept of [0, 7) (sink 0, then the lowest: 3 (0.5), 1 (1.0)) plus itself.
    assert np.flatnonzero(mask[7]).tolist() == [0, 1, 3, 7]
    # Until the budget is exceeded every earlier key is kept.
    assert np.flatnonzero(mask[3]).tolist() == [0, 1, 2, 3]
    window = np.array(kept_mask(-mx.arange(8, dtype=mx.float32)[None], 3, 1, "low"))[0]
    assert np.flatnonzero(window[7]).tolist() == [0, 5, 6, 7]


def test_eval_on_a_tiny_slice_gives_sane_numbers(model, sequences):
    results = evaluate(model, sequences, fractions=(0.25, 1.0))
    small, everything = results.budgets
    assert results.mean_recall("full", None) == pytest.approx(1.0, abs=1e-5)
    full_ppl = results.perplexity("full")
    assert 1.0 < full_ppl < 256.0
    for policy in POLICIES:
        # A budget of the whole sequence evicts nothing.
        assert results.perplexity(policy, everything) == pytest.approx(full_ppl, rel=1e-5)
        assert results.mean_recall(policy, everything) == pytest.approx(1.0, abs=1e-5)
        assert 0.0 < results.mean_recall(policy, small) < 1.0
        assert np.isfinite(results.perplexity(policy, small))
    assert all(-1.0 <= r <= 1.0 for r in results.layer_spearman())


def test_eval_and_demo_commands_run(tmp_path, capsys):
    from mlx_knorm.__main__ import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--n-seqs", "1", "--seq-len", "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budgets"] == [32, 64, 96] and len(report["layer_spearman"]) == 4
    assert main(["demo", "--max-tokens", "40", "--budget", "16"]) == 0
    assert "% saved" in capsys.readouterr().out
