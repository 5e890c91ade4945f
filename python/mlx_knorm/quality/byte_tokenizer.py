"""A Hugging Face tokenizer whose token ids are the UTF-8 bytes of the text.

Written next to the shipped byte-level model so that ``mlx_lm.load`` loads it
like any other model: token ``b`` is byte ``b``, through the GPT-2 byte to
character table of the ``ByteLevel`` pre-tokenizer, with no merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def _byte_characters() -> list[str]:
    """The ``ByteLevel`` character of each byte 0..255 (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + shifted)
            shifted += 1
    return [characters[b] for b in range(256)]


def byte_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_characters())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def write_byte_tokenizer(directory: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``directory``."""
    directory = Path(directory)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
