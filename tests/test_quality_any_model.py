"""``mlx-knorm eval --model DIR --text FILE`` on tiny mlx-lm models built here, offline.

Each model directory holds random weights of an mlx-lm architecture and a
byte-level BPE tokenizer trained in the test with ``tokenizers``: what
``mlx_lm.load`` reads from a downloaded model, without a download.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.models import gemma2, llama, qwen3
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlx_knorm.__main__ import main
from mlx_knorm.cache import L2NormKVCache, make_knorm_cache
from mlx_knorm.quality import data
from mlx_knorm.quality.eval import evaluate, teacher_forced_logits

VOCAB = 320

ARCHITECTURES = {
    # GQA llama with a sliding-window layer between two full-attention layers:
    # the sliding layer keeps mlx-lm's RotatingKVCache and its own attention.
    "llama": (llama, {
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 3, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "tie_word_embeddings": True,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 16,
    }),
    # qwen3 normalises queries and keys per head before RoPE.
    "qwen3": (qwen3, {
        "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 3, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0,
    }),
    # gemma2 soft-caps its attention logits in its own attention code.
    "gemma2": (gemma2, {
        "model_type": "gemma2", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    }),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(data.heldout_texts()[:6]), encoding="utf-8")
    return path


def _tokenizer(text: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def build_model_dir(directory, architecture: str, text: str):
    module, config = ARCHITECTURES[architecture]
    config = {**config, "vocab_size": VOCAB}
    mx.random.seed(1)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Norm weights start at one; qwen3's per-head key norm would then give every
    # key the same L2 norm and leave keep-low/high nothing but ties to choose by.
    model.update(tree_unflatten([(name, mx.random.uniform(0.5, 1.5, value.shape))
                                 for name, value in tree_flatten(model.parameters())
                                 if name.endswith("norm.weight")]))
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    _tokenizer(text).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return directory


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory, corpus):
    return build_model_dir(tmp_path_factory.mktemp("models") / request.param, request.param,
                           corpus.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(str(model_dir))


def test_text_sequences_are_tokenised_windows(loaded, corpus):
    _, tokenizer = loaded
    text = corpus.read_text(encoding="utf-8")
    sequences = data.text_sequences(tokenizer, text, 40, 3)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert sequences.shape == (3, 40)
    # This tokenizer names a BOS token but its encode adds none: windows start with text, as its prompts do.
    assert tokenizer.bos_token_id is not None and tokenizer.encode("ab") == tokenizer.encode("ab", add_special_tokens=False)
    assert sequences[0].tolist() == ids[:40] and sequences[-1].tolist() == ids[-40:]
    with pytest.raises(ValueError, match="n_seqs"):
        data.text_sequences(tokenizer, text[:200], 40, 50)


class _AddsBOS:
    """A tokenizer whose encode puts a BOS token (id 1) first, as Llama 3's does."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [10 + ord(c) for c in text]


def test_windows_start_with_bos_where_the_tokenizer_adds_it():
    assert data.text_start(_AddsBOS()) == [1]
    sequences = data.text_sequences(_AddsBOS(), "abcdefgh", 4, 2)
    assert sequences.tolist() == [[1, 107, 108, 109], [1, 112, 113, 114]]


def test_eval_command_on_a_model_directory_and_a_text_file(model_dir, corpus, tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    # No --seq-len: the default is the model's max_position_embeddings (64) when below 1024.
    argv = ["eval", "--model", str(model_dir), "--text", str(corpus), "--n-seqs", "2",
            "--budgets", "0.75,0.9", "--skip-layers", "0", "--query-chunk", "24",
            "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "keep=low keeps more attention mass than random on this model at 75% (budget 48 of 64): " in printed
    report = json.loads(out.read_text())
    assert report["budgets"] == [48, 58] and report["skip_layers"] == [0] and report["seq_len"] == 64
    attention = [0, 2] if model_dir.name == "llama" else [0, 1, 2]
    assert report["attention_layers"] == attention
    policies = report["policies"]
    assert policies["keep-low+skip=0"]["compressed_layers"] == attention[1:]
    assert policies["keep-low+recent=1/4+skip=0,1"]["compressed_layers"] == [i for i in attention if i > 1]
    assert set(report["layer_spearman"]) == {str(i) for i in attention}
    assert {"keep-low+skip=0@48", "random+skip=0@58", "keep-low+recent=1/2+skip=0@58"} <= set(report["recall"])
    # Equal memory: with layer 0 of 3 (llama: 2) attention layers whole, the others share what is left.
    rows = report["cuts"]["keep-low+skip=0@48"]["rows_per_compressed_layer"]
    assert rows == (48 * len(attention) - 64) // (len(attention) - 1)
    assert all(0.0 < r < 1.0 for r in report["recall"].values())
    assert all(low <= report["recall"][k] <= high for k, (low, high) in report["recall_ci"].items())
    assert report["verdict"].startswith("keep=low keeps more attention mass than random")
    assert png.stat().st_size > 0


@pytest.mark.parametrize("policy", ["keep-low", "keep-high", "keep-low+recent=1/4", "keep-high+recent=1/2"])
def test_masked_pass_equals_knorm_cache_decoding(loaded, corpus, policy):
    """Teacher-forced masks == the model fed one token at a time through make_knorm_cache."""
    model, tokenizer = loaded
    budget, n_sink, skip = 12, 2, (0,)
    tokens = mx.array(data.text_sequences(tokenizer, corpus.read_text(encoding="utf-8"), 48, 1)[0])
    masked = teacher_forced_logits(model, tokens, policy, budget, n_sink, skip, query_chunk=10)
    full = teacher_forced_logits(model, tokens, query_chunk=10)
    assert mx.allclose(full, model(tokens[None])[0], atol=1e-4).item()
    recent = {"keep-low": 0, "keep-high": 0, "keep-low+recent=1/4": 3, "keep-high+recent=1/2": 6}[policy]
    keep = "high" if "high" in policy else "low"
    cache = make_knorm_cache(model, budget=budget, n_sink=n_sink, recent=recent, keep=keep, skip_layers=skip)
    assert any(isinstance(c, L2NormKVCache) for c in cache)
    decoded = mx.concatenate([model(tokens[None, t : t + 1], cache=cache)[0] for t in range(len(tokens))])
    # Up to the cache's float16 storage of keys and values.
    assert mx.abs(decoded - masked).max().item() < 5e-3
    assert mx.abs(masked - full)[budget + 1 :].max().item() > 0.1  # eviction changed something


def test_results_do_not_depend_on_the_query_chunk(loaded, corpus):
    model, tokenizer = loaded
    sequences = data.text_sequences(tokenizer, corpus.read_text(encoding="utf-8"), 40, 1)
    whole, blocks = (evaluate(model, sequences, n_sink=2, fractions=(0.25, 1.0), query_chunk=chunk)
                     for chunk in (40, 7))
    for cut in whole.nll:
        assert whole.perplexity(*cut) == pytest.approx(blocks.perplexity(*cut), rel=1e-5)
    for cut in whole.recall:
        assert whole.mean_recall(*cut) == pytest.approx(blocks.mean_recall(*cut), abs=1e-5)
    assert whole.layer_spearman() == pytest.approx(blocks.layer_spearman(), abs=1e-9)
    budget = whole.budgets[1]
    for policy in whole.policies():
        assert whole.mean_recall(policy, budget) == pytest.approx(1.0, abs=1e-5)
        assert whole.perplexity(policy, budget) == pytest.approx(whole.perplexity("full"), rel=1e-5)


def test_masked_passes_from_a_shared_prefix_score_what_one_whole_pass_scores(loaded, corpus):
    """The eval runs each cut from a full-attention prefix and skips the logits before the scored half."""
    model, tokenizer = loaded
    sequences = data.text_sequences(tokenizer, corpus.read_text(encoding="utf-8"), 48, 2)
    policies = ["keep-low", "random", "window", "keep-high+recent=1/4", "keep-low+recent=1/2+skip=0"]
    results = evaluate(model, sequences, n_sink=2, fractions=(0.25, 0.75), policies=policies, query_chunk=9)
    # Budget 12: prefix 13, then the unscored positions 13..22, then the scored ones; 36: prefix 23.
    assert {c.rows for c in results.cuts if not c.policy.skip} == {12, 36}
    skipping = [c for c in results.cuts if c.policy.skip]  # equal memory: fewer rows in the other layers
    assert skipping and all(c.rows < c.budget for c in skipping)
    for cut in results.cuts:
        for s, row in enumerate(sequences):
            tokens = mx.array(row)
            if s:  # teacher_forced_logits uses the first sequence's random keys; give it the second's
                continue
            logits = teacher_forced_logits(model, tokens, cut.policy, cut.rows, n_sink=2, query_chunk=9)
            nll = nn.losses.cross_entropy(logits[23:-1], tokens[24:], reduction="mean").item()
            assert results.nll[cut.key][s] == pytest.approx(nll, rel=1e-4), cut.key


def test_bad_arguments_are_named(loaded):
    model, _ = loaded
    sequences = np.zeros((1, 32), dtype=np.int64)
    with pytest.raises(ValueError, match="leaves no full-attention layer"):
        evaluate(model, sequences, skip_layers=(0, 1, 2))
    with pytest.raises(ValueError, match="skip_layers"):
        evaluate(model, sequences, skip_layers=(7,))
    with pytest.raises(ValueError, match=r"budgets \[4\] leave keep-low\+skip=0 no room"):
        evaluate(model, sequences, skip_layers=(0,), fractions=(0.125,))
    with pytest.raises(ValueError, match="fractions"):
        evaluate(model, sequences, fractions=(0.0,))
    with pytest.raises(ValueError, match="query_chunk"):
        evaluate(model, sequences, query_chunk=0)
    with pytest.raises(ValueError, match="policies"):
        evaluate(model, sequences, policies=("keep-low", "oldest"))
    with pytest.raises(ValueError, match="sequences"):
        evaluate(model, np.zeros(32, dtype=np.int64))
    with pytest.raises(SystemExit):
        main(["eval", "--budgets", "0.25,2"])


def test_a_model_with_its_own_attention_code_is_refused(tmp_path, corpus):
    model_dir = build_model_dir(tmp_path / "gemma2", "gemma2", corpus.read_text(encoding="utf-8"))
    model, _ = load(str(model_dir))
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        evaluate(model, np.arange(32)[None], fractions=(0.5,), perplexity=False)
