"""Writes tests/mlx_lm_configs.json: one tiny configuration per mlx-lm model file.

The configurations are mlx-lm's own test configurations (data only): every
``ModelArgs`` that mlx-lm 0.32.2's ``tests/test_models.py`` hands to its
``model_test_runner``, captured by running that file with the runner
replaced, then made tiny where mlx-lm's is not (a parameter count above
``TINY``: fewer layers, narrower layers, a 1000-token vocabulary, smaller
sliding windows so that windows slide within a few tokens; ``OVERRIDES``
where the generic rule does not fit a family). Model files that test file
does not build through its runner get a configuration written here
(``OWN``, from the same file's or ``test_muse_spark.py``'s data where there
is one). tests/test_model_families.py runs every family of the JSON file.

Regenerate (network: mlx-lm's source distribution carries its tests):

    pip download --no-deps --no-binary :all: mlx-lm==0.32.2 -d /tmp/mlx-lm-sdist
    tar xzf /tmp/mlx-lm-sdist/mlx_lm-0.32.2.tar.gz -C /tmp/mlx-lm-sdist
    python tests/extract_mlx_lm_configs.py /tmp/mlx-lm-sdist/mlx_lm-0.32.2/tests
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import pkgutil
import sys
import unittest
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.models
from mlx.utils import tree_flatten

OUT = Path(__file__).with_name("mlx_lm_configs.json")
# Parameters above which a captured configuration is made smaller.
TINY = 2_000_000
WINDOW = 4
_HIDDEN = ("hidden_size", "d_model", "n_embd", "hidden_dim", "dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_WINDOWS = ("sliding_window", "attention_window_size", "sliding_window_size")

# Where the generic rule does not fit, per model file (on top of it).
OVERRIDES = {
    "afm7": dict(hidden_dim=128, num_heads=4, num_kv_heads=2, num_layers=4, num_hidden_layers=4,
                 num_kv_reuse_layers=2),
    "cohere2": dict(hidden_size=256, num_hidden_layers=4),
    "gptj": dict(rotary_dim=16, n_layer=4),
    "lfm2": dict(block_dim=128, block_ff_dim=256),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(kv_channels=32, num_hidden_layers=4),
    "openelm": dict(model_dim=128, head_dim=32, num_transformer_layers=4, num_kv_heads=[1, 1, 2, 2],
                    num_query_heads=[2, 2, 4, 4], ffn_multipliers=[0.5, 1.0, 1.5, 2.0]),
    "gpt_bigcode": dict(n_layer=4),
    "jamba": dict(mamba_expand=2, mamba_d_state=16, num_hidden_layers=4,
                  layers_block_type=["mamba", "attention", "mamba", "attention"]),
    "longcat_flash_ngram": dict(ngram_vocab_size_ratio=4),
    "phimoe": dict(num_local_experts=4),
    "youtu_llm": dict(num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, kv_lora_rank=32, q_lora_rank=32),
    "falcon_h1": dict(mamba_d_ssm=256, mamba_n_heads=4, num_hidden_layers=4),
    "plamo2": dict(mamba_num_heads=8, hidden_size_per_head=32),
    "gpt_neox": dict(num_hidden_layers=4),
    "cohere": dict(num_hidden_layers=4),
    "gpt_oss": dict(num_local_experts=4),
    "gemma3_text": dict(num_hidden_layers=6),
    "qwen2_moe": dict(num_experts=4),
    "qwen3_moe": dict(num_experts=4),
}
# Kept as mlx-lm has them: their modules name Hadamard blocks of these widths.
AS_CAPTURED = {"prism_hadamard_qwen35"}


def _captured(tests_dir: Path) -> dict:
    """``{model file: (test name, ModelArgs as a dict)}`` of every model
    mlx-lm's tests/test_models.py builds through ``model_test_runner``."""
    sys.path.insert(0, str(tests_dir))
    import test_models

    args_of = {}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except BaseException:  # olmo exits without ai2-olmo
            continue
        model_class = getattr(module, "Model", None)
        if model_class is None or "_captured_init" in model_class.__dict__:
            continue

        def init(self, args, *rest, _original=model_class.__init__, **kwargs):
            args_of[id(self)] = copy.deepcopy(args)
            _original(self, args, *rest, **kwargs)

        model_class.__init__ = init
        model_class._captured_init = True

    captured = {}

    def runner(test, model, model_type, vocab_size, num_layers):
        args = args_of[id(model)]
        name = type(model).__module__.rsplit(".", 1)[-1]
        captured.setdefault(name, (test._testMethodName, dataclasses.asdict(args)))

    test_models.TestModels.model_test_runner = runner
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(test_models.TestModels)
    with open("/dev/null", "w") as sink:
        unittest.TextTestRunner(stream=sink).run(suite)
    return captured


def _own(tests_dir: Path, configs: dict) -> dict:
    """Configurations for the model files mlx-lm's runner does not build
    (``configs``: the captured ones, made tiny)."""
    sys.path.insert(0, str(tests_dir))
    import test_models
    import test_muse_spark

    text = test_models.TestVLSanitize._text_config
    args = lambda family: configs[family]["args"]
    return {
        "gemma3": ("text_config: gemma3_text's", dict(model_type="gemma3", vocab_size=1000,
                                                       text_config=args("gemma3_text"))),
        "qwen2_vl": ("text_config: test_models.py's _text_config('qwen2')",
                     dict(model_type="qwen2_vl", text_config=text(None, "qwen2"))),
        "kimi_k25": ("text_config: deepseek_v3's", dict(model_type="kimi_k25", text_config=args("deepseek_v3"))),
        "mistral3": ("text_config: llama's", dict(model_type="mistral3", text_config=args("llama"))),
        "ministral3": ("ours", _MINISTRAL3),
        "mellum": ("ours", _MELLUM),
        "glm_moe_dsa": ("deepseek_v32's, with rope_parameters",
                        dict(args("deepseek_v32"), model_type="glm_moe_dsa",
                             rope_parameters=dict(args("deepseek_v32")["rope_scaling"], rope_theta=10000.0))),
        "solar_open": ("glm4_moe's", dict(args("glm4_moe"), model_type="solar_open")),
        "muse_spark": ("test_muse_spark.py's CONFIG", test_muse_spark.CONFIG),
    }


_MINISTRAL3 = dict(
    model_type="ministral3", hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=1000, max_position_embeddings=4096,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                     "original_max_position_embeddings": 4096},
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=WINDOW,
)
_MELLUM = dict(
    model_type="mellum", hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, rms_norm_eps=1e-5, vocab_size=1000,
    num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=1000,
    norm_topk_prob=True, sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={layer: {"rope_theta": 10000.0, "rope_type": "default"}
                     for layer in ("sliding_attention", "full_attention")},
)


def _shrunk(config: dict) -> dict:
    """``config`` with the generic rule applied at every level (nested
    ``text_config`` dicts included)."""
    config = copy.deepcopy(config)

    def visit(c: dict) -> None:
        for key in ("vocab_size", "padded_vocab_size"):
            if isinstance(c.get(key), int) and c[key] > 1000:
                c[key] = 1000
        for key in ("intermediate_size", "ffn_hidden_size", "n_inner", "dense_intermediate_size"):
            if isinstance(c.get(key), int) and c[key] > 256:
                c[key] = 256
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"):
            if isinstance(c.get(key), int) and c[key] > 128:
                c[key] = 128
        hidden = next((k for k in _HIDDEN if isinstance(c.get(k), int)), None)
        heads = next((k for k in _HEADS if isinstance(c.get(k), int)), None)
        if hidden and c[hidden] > 256:
            if heads:
                count = c[heads]
                head_dim = c.get("head_dim") or c[hidden] // count
                kv = next((k for k in _KV_HEADS if isinstance(c.get(k), int)), None)
                c[heads] = min(count, 4)
                if kv:
                    c[kv] = max(1, min(c[heads], c[heads] * c[kv] // count))
                if c.get("head_dim"):
                    c["head_dim"] = min(head_dim, 64)
                    c[hidden] = 128
                else:
                    c[hidden] = c[heads] * min(head_dim, 32)
            else:
                c[hidden] = 128
        for value in c.values():
            if isinstance(value, dict):
                visit(value)

    visit(config)
    return config


def _small_windows(config: dict) -> dict:
    config = copy.deepcopy(config)

    def visit(c: dict) -> None:
        for key in _WINDOWS:
            if isinstance(c.get(key), int) and c[key] > WINDOW:
                c[key] = WINDOW
        for value in c.values():
            if isinstance(value, dict):
                visit(value)

    visit(config)
    return config


def _parameters(family: str, config: dict) -> int:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict(config))
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def main(tests_dir: Path) -> None:
    captured = _captured(tests_dir)
    families = {}
    for family, (test, config) in sorted(captured.items()):
        source = f"mlx-lm 0.32.2 tests/test_models.py::{test}"
        if family not in AS_CAPTURED and _parameters(family, config) > TINY:
            config = {**_shrunk(config), **OVERRIDES.get(family, {})}
            source += " (made tiny)"
        families[family] = {"source": source, "args": _small_windows(config)}
    for family, (source, config) in _own(tests_dir, dict(families)).items():
        families[family] = {"source": f"ours: {source}", "args": _small_windows(config)}
    for family, entry in families.items():
        count = _parameters(family, entry["args"])
        assert family in AS_CAPTURED or count <= 4 * TINY, f"{family}: {count} parameters"
    OUT.write_text(json.dumps({
        "mlx_lm": mlx_lm.__version__,
        "made_by": "tests/extract_mlx_lm_configs.py",
        "families": families,
    }, indent=1, sort_keys=True) + "\n")
    print(f"{len(families)} families -> {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
