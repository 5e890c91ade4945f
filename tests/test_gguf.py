"""GGUF files written by the test (tiny_gguf.py) through ``mlx_knorm.models.load`` and ``convert``.

Each file holds random weights of an mlx-lm architecture, converted as
llama.cpp's converter converts a checkpoint. Its logits through the loader
must equal, bit for bit, those of the mlx-lm model built straight from the
reference arrays (quantized ones as MLX's own GGUF reader repacks them), and
so must those of ``mlx_lm.load`` on the directory ``convert`` writes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from gguf import GGMLQuantizationType as Q
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import load_config

from mlx_knorm.__main__ import main
from mlx_knorm.models import UnsupportedGGUF, convert, is_gguf, load, read_gguf
from mlx_knorm.models.gguf_arch import permute_rope_rows, unpermute_rope_rows
from mlx_knorm.models.gguf_tensors import affine_from_blocks, pack_codes

from tiny_gguf import llama3_rope_factors, llama_cpp_inverse, llama_cpp_permute, reference_model, write_model

TOKENS = mx.array(np.random.default_rng(1).integers(3, 260, size=(1, 24)))

CASES = [
    ("llama", Q.Q4_0, None),
    ("llama", Q.Q8_0, None),
    ("llama", Q.F16, None),
    ("llama", Q.Q4_K, Q.Q6_K),  # K-quants need rows of 256: see the overrides below
    ("qwen2", Q.Q8_0, None),
    ("qwen2", Q.Q4_1, Q.Q8_0),
    ("qwen3", Q.Q4_0, Q.F16),
    ("gemma3", Q.Q8_0, None),
    ("gemma3", Q.F16, Q.Q4_0),
]
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)


def _write(tmp_path, arch, qtype, embedding_type=None, **kw):
    sizes = K_QUANT_SIZES if qtype in (Q.Q4_K, Q.Q6_K) else {}
    return write_model(tmp_path / f"{arch}-{qtype.name}.gguf", arch, qtype, embedding_type=embedding_type,
                       **sizes, **kw)


def _logits(model):
    out = model(TOKENS)
    mx.eval(out)
    return out


@pytest.mark.parametrize("arch,qtype,embedding_type", CASES, ids=lambda v: getattr(v, "name", v))
def test_logits_equal_the_mlx_lm_model_of_the_same_weights(tmp_path, arch, qtype, embedding_type):
    tiny = _write(tmp_path, arch, qtype, embedding_type)
    model, tokenizer, config = load(tiny.path, return_config=True)
    for key, value in tiny.config.items():
        assert config[key] == value, key
    expected = _logits(reference_model(tiny.config, tiny.reference))
    actual = _logits(model)
    assert actual.dtype == expected.dtype
    assert mx.array_equal(actual, expected).item()


def test_the_un_permuted_q_k_rows_matter(tmp_path):
    """The check above can fail: q/k rows left in llama.cpp's order give other logits."""
    tiny = _write(tmp_path, "llama", Q.Q8_0)
    actual = _logits(load(tiny.path)[0])
    wrong = _logits(reference_model(tiny.config, tiny.file_order_reference))
    assert not mx.allclose(actual, wrong, atol=1e-2).item()


@pytest.mark.parametrize("arch,qtype,embedding_type", [CASES[0], CASES[3], CASES[5], CASES[8]],
                         ids=lambda v: getattr(v, "name", v))
def test_convert_writes_a_directory_mlx_lm_loads_to_the_same_logits(tmp_path, arch, qtype, embedding_type):
    tiny = _write(tmp_path, arch, qtype, embedding_type)
    out = tmp_path / "converted"
    assert main(["convert", str(tiny.path), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    converted, tokenizer = mlx_lm_load(str(out))
    ours, our_tokenizer = load(tiny.path)
    assert mx.array_equal(_logits(converted), _logits(ours)).item()
    assert tokenizer.encode("the then in a") == our_tokenizer.encode("the then in a")
    assert tokenizer.chat_template == our_tokenizer.chat_template
    assert load_config(out)["eos_token_id"] == load(tiny.path, return_config=True)[2]["eos_token_id"]


def test_convert_refuses_a_non_empty_directory(tmp_path):
    tiny = _write(tmp_path, "llama", Q.Q8_0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        convert(tiny.path, tmp_path / "out")


@pytest.mark.parametrize("existing", [False, True])
def test_convert_that_fails_part_way_leaves_no_half_model(tmp_path, monkeypatch, existing):
    """The model folder is written whole or not at all: a failure after the
    weights are on disk leaves out_dir as it was (missing, or empty) and no
    temporary folder behind; a later convert then succeeds."""
    import mlx_knorm.models.loader as loader

    tiny = _write(tmp_path, "llama", Q.Q8_0)
    out = tmp_path / "models" / "converted"
    if existing:
        out.mkdir(parents=True)

    def disk_full(directory, gguf_model):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader, "_write_files", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert(tiny.path, out)
    assert (out.is_dir() and not any(out.iterdir())) if existing else not out.exists()
    assert [p.name for p in out.parent.iterdir() if p != out] == []
    monkeypatch.undo()
    assert convert(tiny.path, out) == out and (out / "model.safetensors").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["converted"]


def test_k_quants_are_dequantized_to_float32_and_reported(tmp_path, capsys):
    tiny = _write(tmp_path, "llama", Q.Q4_K, Q.Q6_K)
    model, _ = load(tiny.path)
    err = capsys.readouterr().err
    assert "Q4_K tensors dequantized to float32 (exact)" in err
    assert "1 Q6_K tensor dequantized to float32 (exact)" in err  # the embedding
    assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32


def test_requantize_quantizes_the_types_without_an_exact_form(tmp_path, capsys):
    tiny = _write(tmp_path, "llama", Q.Q4_K, Q.Q8_0)
    model, _, config = load(tiny.path, requantize=(4, 64), return_config=True)
    err = capsys.readouterr().err
    assert "Q4_K tensors re-quantized to MLX 4-bit affine quantization, group 64 (not exact)" in err
    up = model.model.layers[0].mlp.up_proj
    assert (up.bits, up.group_size) == (4, 64)
    assert (model.model.embed_tokens.bits, model.model.embed_tokens.group_size) == (8, 32)  # Q8_0: kept
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    # Re-quantized, the logits are close to the exact model's, not equal.
    exact = _logits(reference_model(tiny.config, tiny.reference))
    approx = _logits(model)
    assert not mx.array_equal(exact, approx).item()
    assert (mx.linalg.norm(exact - approx) / mx.linalg.norm(exact)).item() < 0.05


def _dequantized(reference: dict) -> dict:
    """The reference arrays in float32, quantized ones dequantized (groups of 32, as every exact GGUF type)."""
    out = {}
    for name, value in reference.items():
        base = name[: -len("weight")]
        if name.endswith((".scales", ".biases")):
            continue
        if base + "scales" in reference:
            scales, biases = (reference[base + s].astype(mx.float32) for s in ("scales", "biases"))
            bits = value.shape[-1] // scales.shape[-1]
            value = mx.dequantize(value, scales, biases, group_size=32, bits=bits)
        out[name] = value.astype(mx.float32)
    return out


def test_dtype_float32_dequantizes_every_weight(tmp_path):
    tiny = _write(tmp_path, "qwen2", Q.Q4_1, Q.Q8_0)
    model, _, config = load(tiny.path, dtype=mx.float32, return_config=True)
    assert "quantization" not in config
    assert all(v.dtype == mx.float32 for v in model.parameters()["model"]["layers"][0]["mlp"]["up_proj"].values())
    expected = _logits(reference_model(tiny.config, _dequantized(tiny.reference)))
    assert mx.array_equal(_logits(model), expected).item()


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"requantize": (7, 64)}, "requantize must be"),
    ({"requantize": 4}, "requantize must be"),
    ({"requantize": (4, 64), "dtype": "float32"}, "exclude each other"),
])
def test_bad_weight_options_are_refused_by_name(tmp_path, kwargs, message):
    tiny = _write(tmp_path, "llama", Q.Q8_0)
    with pytest.raises(ValueError, match=message):
        load(tiny.path, **kwargs)


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    tiny = _write(tmp_path, "llama", Q.Q8_0, rope_freqs=llama3_rope_factors(10000.0, 16, 8.0),
                  rope_scaling=scaling)
    model, _, config = load(tiny.path, return_config=True)
    assert config["rope_scaling"] == scaling
    assert mx.array_equal(_logits(model), _logits(reference_model(tiny.config, tiny.reference))).item()


def test_rope_factors_llama3_does_not_reproduce_are_refused(tmp_path):
    factors = llama3_rope_factors(10000.0, 16, 8.0)
    factors[3] *= 1.5
    tiny = _write(tmp_path, "llama", Q.Q8_0, rope_freqs=factors)
    with pytest.raises(UnsupportedGGUF, match="rope_freqs"):
        load(tiny.path)


@pytest.mark.parametrize("change,message", [
    (dict(gguf_arch="phi3"), "architecture 'phi3' is not supported"),
    (dict(extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}), "blk.0.ffn_gate_inp.weight"),
    (dict(extra_tensors={"blk.1.attn_q.weight": (np.zeros((64, 80), np.uint8), Q.Q8_1)}), "Q8_1"),
    (dict(extra_tensors={"blk.1.attn_k.bias": np.zeros(32, np.int32)}), "I32"),
])
def test_what_cannot_be_converted_exactly_is_refused_by_name(tmp_path, capsys, change, message):
    tiny = _write(tmp_path, "qwen2", Q.Q8_0, **change)
    with pytest.raises(UnsupportedGGUF, match=message):
        load(tiny.path)
    with pytest.raises(UnsupportedGGUF, match=message):
        convert(tiny.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(tiny.path), str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err


def test_other_models_go_to_mlx_lm_load(tmp_path):
    tiny = _write(tmp_path, "qwen3", Q.Q4_0)
    out = convert(tiny.path, tmp_path / "converted")
    assert not is_gguf(out)
    model, tokenizer = load(out)  # a directory: mlx_lm.load's
    assert mx.array_equal(_logits(model), _logits(load(tiny.path)[0])).item()
    with pytest.raises(ValueError, match="GGUF files only"):
        load(out, dtype="float32")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load(tmp_path / "missing.gguf")


def test_eval_and_demo_take_a_gguf_file(tmp_path, capsys):
    tiny = _write(tmp_path, "llama", Q.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text("the then in a " * 400)
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny.path), "--text", str(text), "--seq-len", "32", "--n-seqs", "2",
                 "--budgets", "0.5", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["model"] == str(tiny.path)
    assert main(["demo", "--model", str(tiny.path), "--prompt", "the", "--max-tokens", "3", "--budget", "8",
                 "--dtype", "float32"]) == 0


def test_rope_row_permutation_inverts_llama_cpps():
    rows = np.arange(48 * 3).reshape(48, 3)
    for heads in (1, 3, 6):
        assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(rows, heads), heads), rows)
        assert np.array_equal(permute_rope_rows(rows, heads), llama_cpp_permute(rows, heads))
        assert np.array_equal(unpermute_rope_rows(rows, heads), llama_cpp_inverse(rows, heads))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_affine_repacking_holds_the_gguf_values_exactly(qtype):
    from gguf.quants import dequantize, quantize

    values = np.random.default_rng(3).normal(size=(6, 128)).astype(np.float32)
    blocks = quantize(values, qtype)
    weight, scales, biases = affine_from_blocks(qtype, blocks)
    bits = 8 if qtype == Q.Q8_0 else 4
    # In float32 arithmetic, scale * q + bias is the value gguf's dequantize gives, bit for bit.
    ours = mx.dequantize(mx.array(weight), mx.array(scales).astype(mx.float32),
                         mx.array(biases).astype(mx.float32), group_size=32, bits=bits)
    assert mx.array_equal(ours, mx.array(dequantize(blocks, qtype))).item()


@given(qtype=st.sampled_from([Q.Q4_0, Q.Q4_1, Q.Q8_0]), rows=st.integers(1, 5), blocks=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1), log2_scale=st.integers(-24, 15))
def test_affine_repacking_of_any_blocks_holds_their_values_exactly(qtype, rows, blocks, seed, log2_scale):
    """Random bits with finite float16 scales (large ones make -8 d or -128 d overflow float16: the
    biases then go to float32)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.0, size=(rows, blocks)) * 2.0 ** log2_scale).astype(np.float16)
    raw[..., 0:2] = np.where(np.isfinite(scale), scale, np.float16(1))[..., None].view(np.uint8)
    if qtype == Q.Q4_1:
        raw[..., 2:4] = rng.normal(size=(rows, blocks, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    weight, scales, biases = affine_from_blocks(qtype, raw)
    bits = 8 if qtype == Q.Q8_0 else 4
    ours = mx.dequantize(mx.array(weight), mx.array(scales).astype(mx.float32),
                         mx.array(biases).astype(mx.float32), group_size=32, bits=bits)
    assert mx.array_equal(ours, mx.array(dequantize(raw, qtype))).item()


def test_pack_codes_puts_the_first_code_in_the_lowest_bits():
    codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
    assert pack_codes(codes, 4).tolist() == [[0x76543210], [0xFEDCBA98]]
    assert pack_codes(np.array([[1, 2, 3, 4]], np.uint8), 8).tolist() == [[0x04030201]]


def test_read_gguf_maps_every_tensor(tmp_path):
    tiny = _write(tmp_path, "gemma3", Q.Q8_0)
    gguf_model = read_gguf(tiny.path)
    assert set(gguf_model.weights) == set(tiny.reference)
    assert gguf_model.config["query_pre_attn_scalar"] == 32
    assert not any(n.startswith("lm_head") for n in gguf_model.weights)


@pytest.mark.parametrize("keep,message", [(100, "truncated at byte"), (0.6, "runs past the end of the file")])
def test_a_truncated_file_is_refused(tmp_path, keep, message):
    tiny = _write(tmp_path, "llama", Q.Q8_0)
    data = tiny.path.read_bytes()
    tiny.path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(UnsupportedGGUF, match=message):
        load(tiny.path)
