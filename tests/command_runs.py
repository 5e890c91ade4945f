"""What the command tests share: model directories as a user has them, and
running ``mlx-knorm`` and mlx-lm's own commands as subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlx_knorm.commands.memory import parse_kv_memory_lines
from mlx_knorm.quality import MODEL_DIR

# A random-weight float16 llama (so the cache stores exactly what KVCache
# stores, and tokens within the budget are mlx-lm's bit for bit), with the
# shipped model's byte-level tokenizer and a chat template. Its heads differ
# from the shipped model's (2 KV heads of 16), which the prompt-cache checks see.
TINY_LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=4,
    intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096,
)
TINY_KV_HEADS, TINY_HEAD_DIM = 4, 8
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
# One command's run may not take longer than this.
COMMAND_TIMEOUT_S = 120

_BIN = Path(sys.executable).parent / "mlx-knorm"
MLX_KNORM = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "mlx_knorm"]
MLX_LM = [sys.executable, "-m", "mlx_lm"]


def write_tiny_llama(directory: Path, **config) -> Path:
    """The tiny llama (``config`` over ``TINY_LLAMA``) as a model directory."""
    config = {**TINY_LLAMA, **config}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(MODEL_DIR / "tokenizer.json", directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))
    return directory


# The tiny llama with heads wide enough for --kv-bits (mx.quantize groups are 32 or more).
WIDE_HEAD_DIM = 64


def tiny_kv_bytes(budget: int, head_dim: int = TINY_HEAD_DIM, bits: int | None = None, group_size: int = 64) -> int:
    """What the tiny llama's caches hold while decoding past ``budget``:
    ``budget + 1`` slots a head of float16 keys and values (with ``bits``,
    their packed words and a float16 scale and bias a group), float32 norms
    and int32 positions, in every layer."""
    row = head_dim * 2 if bits is None else head_dim * bits // 8 + 4 * head_dim // group_size
    slot = 2 * row + 4 + 4
    return TINY_LLAMA["num_hidden_layers"] * TINY_KV_HEADS * (budget + 1) * slot


def command_env(home: Path) -> dict:
    """No network, an empty Hugging Face cache, unbuffered output."""
    hub = home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "PYTHONUNBUFFERED": "1"}


def run(command: list, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], input=stdin, capture_output=True, text=True,
                          env=env, timeout=COMMAND_TIMEOUT_S)


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def kv_lines(text: str) -> list[dict]:
    """Every KV memory line in ``text``: tokens, held_mb, allocated_mb, full_mb, kinds."""
    return parse_kv_memory_lines(text)


def mb(n: int) -> float:
    """Bytes in the memory line's MB, as it rounds them."""
    return round(n / 1e6, 3)


def evicting(line: dict, budget: int) -> bool:
    """Whether a memory line's caches are eviction caches of ``budget`` first."""
    return line["kinds"].startswith(f"eviction (budget {budget}")


def mlx_lm_stat(text: str, name: str) -> int:
    """A token count from mlx-lm's statistics: ``Prompt: 23 tokens`` or ``Generation: 100 tokens``."""
    return int(re.search(rf"^{name}: (\d+) tokens", text, re.M).group(1))
