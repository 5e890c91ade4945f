"""Write a random-weight mlx-lm llama with a real model's shapes, for timing
the commands where the real weights are not at hand.

    python bench/random_llama.py build/smollm2-135m-random --like smollm2-135m

The directory loads with ``mlx_lm.load`` (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json). Its tokenizer is the shipped model's
byte-level one with its vocabulary padded to the model's size by tokens
``<tN>`` that decode to their own text, so any sampled id decodes. Speed
and memory depend on the shapes only; the text it writes is noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlx_knorm.quality import MODEL_DIR

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): the real-model issue's model.
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
        intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def write(directory: Path, like: str, dtype: str) -> Path:
    config = SHAPES[like]
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(DTYPES[dtype])
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"<t{i}>": i for i in range(len(vocab), config["vocab_size"])})
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(
        (MODEL_DIR / "tokenizer_config.json").read_text())
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/random_llama.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="where to write the model (must not exist)")
    parser.add_argument("--like", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weight dtype (default float32: the fast one on a CPU with OpenBLAS)")
    args = parser.parse_args(argv)
    if args.directory.exists():
        parser.error(f"{args.directory} exists")
    print(write(args.directory, args.like, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
