"""The tokenizer in a GGUF file's metadata, as the files Hugging Face's ``tokenizers`` and mlx-lm read.

llama.cpp writes two kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with its token list, its merges and a pre-tokenizer
  named in ``tokenizer.ggml.pre``. Each supported name maps to the
  pre-tokenizer of the Hugging Face ``tokenizer.json`` llama.cpp recognises by
  that name (``PRE_TOKENIZERS``); any other name is refused.
- ``llama``: a SentencePiece vocabulary with scores and token types. It
  becomes the BPE model Hugging Face's own converter makes of a SentencePiece
  model: the merges are every split of a piece into two pieces, ranked by the
  merged piece's score, and spaces become "▁" (with one prepended to the text
  when ``tokenizer.ggml.add_space_prefix`` says so, llama.cpp's default).

Control tokens become special added tokens (never split, never produced by
merges); user-defined ones added tokens. Both are found in the raw text first,
and the text between them is tokenized piece by piece: with a space prefix,
each piece gets one, as llama.cpp and Hugging Face's converted tokenizers do
(SentencePiece itself adds it once, at the start of the whole text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .gguf_file import GGUFFile, UnsupportedGGUF

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's "▁"

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's EOG tokens by their text (llama-vocab.cpp): generation stops at
# any of these that the vocabulary has as a control token.
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|eom_id|>", "<|end_of_text|>", "<EOT>")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": use_regex}


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


@dataclass(frozen=True)
class PreTokenizer:
    pre_tokenizers: tuple[dict, ...]
    normalizer: dict | None = None
    ignore_merges: bool = False  # a pre-token that is itself a token is not merged up (llama 3)
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token
    clean_spaces: bool = True  # llama.cpp's clean_spaces: decode drops the space before punctuation


_GPT2 = PreTokenizer((_byte_level(True),))
_DIGITS = {"type": "Digits", "individual_digits": True}
_LLAMA3 = PreTokenizer((_split(LLAMA3_PATTERN), _byte_level(False)), ignore_merges=True, add_bos=True)
_LLAMA3_LIKE = PreTokenizer((_split(LLAMA3_PATTERN), _byte_level(False)))
_QWEN2 = PreTokenizer((_split(QWEN2_PATTERN), _byte_level(False)), normalizer={"type": "NFC"},
                      clean_spaces=False)

PRE_TOKENIZERS = {
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": PreTokenizer((_DIGITS, _byte_level(True)), clean_spaces=False),
    "starcoder": PreTokenizer((_DIGITS, _byte_level(True))),
    "refact": PreTokenizer((_DIGITS, _byte_level(True))),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3_LIKE, "dbrx": _LLAMA3_LIKE,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


@dataclass
class GGUFTokenizer:
    files: dict[str, str]  # file name -> contents: tokenizer.json, tokenizer_config.json
    eos_token_ids: list[int]
    bos_token_id: int | None


def _token_id(f: GGUFFile, key: str, n_tokens: int) -> int | None:
    value = f.metadata.get(f"tokenizer.ggml.{key}")
    return value if value is not None and 0 <= value < n_tokens else None


def _added_token(token_id: int, content: str, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _template(bos: str | None, eos: str | None, token_ids: dict[str, int]) -> dict | None:
    """A post-processor adding BOS and/or EOS (or None if neither is added)."""
    if bos is None and eos is None:
        return None

    def seq(name):
        return [*([{"SpecialToken": {"id": bos, "type_id": 0}}] if bos else []),
                {"Sequence": {"id": name, "type_id": 0}},
                *([{"SpecialToken": {"id": eos, "type_id": 0}}] if eos else [])]

    specials = {t: {"id": t, "ids": [token_ids[t]], "tokens": [t]} for t in (bos, eos) if t}
    return {"type": "TemplateProcessing", "single": seq("A"), "pair": seq("A") + seq("B"), "special_tokens": specials}


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a normal piece into two normal pieces,
    ranked by the merged piece's score, highest first (as Hugging Face's converter ranks them)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    ranked = []
    for piece, merged_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[merged_id], merged_id, normal[left], normal[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def build_tokenizer(f: GGUFFile) -> GGUFTokenizer:
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise UnsupportedGGUF(f"{f.path.name}: no tokenizer in the metadata (tokenizer.ggml.model/tokens)")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    if len(types) != n:
        raise UnsupportedGGUF(f"{f.path.name}: tokenizer.ggml.token_type has {len(types)} entries "
                              f"for {n} tokens")
    if len(set(tokens)) != n:
        raise UnsupportedGGUF(f"{f.path.name}: tokenizer.ggml.tokens has duplicates")
    vocab = {t: i for i, t in enumerate(tokens)}

    if kind == "gpt2":
        pre_name = meta.get("tokenizer.ggml.pre", "default")
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise UnsupportedGGUF(f"{f.path.name}: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not "
                                  f"supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        merges = []
        for merge in meta.get("tokenizer.ggml.merges") or []:
            cut = merge.find(" ", 1)  # llama.cpp's split: the first space after the first character
            if cut < 0:
                raise UnsupportedGGUF(f"{f.path.name}: tokenizer.ggml.merges has {merge!r}, not two tokens")
            merges.append([merge[:cut], merge[cut + 1:]])
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges}
        normalizer, pre_tokenizer = pre.normalizer, {"type": "Sequence", "pretokenizers": list(pre.pre_tokenizers)}
        decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        add_bos_default, clean_spaces = pre.add_bos, pre.clean_spaces
        unk_id = _token_id(f, "unknown_token_id", n)
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != n:
            raise UnsupportedGGUF(f"{f.path.name}: a SentencePiece vocabulary needs tokenizer.ggml.scores, "
                                  "one per token")
        if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
            raise UnsupportedGGUF(f"{f.path.name}: tokenizer.ggml.remove_extra_whitespaces is not supported")
        if "tokenizer.ggml.precompiled_charsmap" in meta:
            raise UnsupportedGGUF(f"{f.path.name}: tokenizer.ggml.precompiled_charsmap (a SentencePiece "
                                  "normalization table) is not supported")
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        unk_id = _token_id(f, "unknown_token_id", n)
        if unk_id is None and "tokenizer.ggml.unknown_token_id" not in meta and UNKNOWN in types:
            unk_id = types.index(UNKNOWN)
        model = {"type": "BPE", "dropout": None, "unk_token": tokens[unk_id] if unk_id is not None else None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                 "byte_fallback": BYTE in types, "ignore_merges": False, "vocab": vocab,
                 "merges": spm_merges(tokens, scores, types)}
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
        normalizer = ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}
                      if add_space_prefix else replace)
        pre_tokenizer = None
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if add_space_prefix else [])]}
        add_bos_default, clean_spaces = True, False
    else:
        raise UnsupportedGGUF(f"{f.path.name}: tokenizer model {kind!r} (tokenizer.ggml.model) is not "
                              "supported (supported: gpt2, llama)")

    bos_id = _token_id(f, "bos_token_id", n)
    eos_id = _token_id(f, "eos_token_id", n)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    added = [_added_token(i, t, special=types[i] in (CONTROL, UNKNOWN))
             for i, t in enumerate(tokens) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED)]
    special_ids = {i for i, kind_ in enumerate(types) if kind_ in (CONTROL, UNKNOWN)}
    for token_id in (bos_id, eos_id, unk_id):
        if token_id is not None and token_id not in special_ids:
            added.append(_added_token(token_id, tokens[token_id], special=True))
            special_ids.add(token_id)
    added.sort(key=lambda token: token["id"])
    post = _template(tokens[bos_id] if add_bos else None, tokens[eos_id] if add_eos else None, vocab)
    if post is None and kind == "gpt2":
        post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

    tokenizer_json = json.dumps(
        {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
         "pre_tokenizer": pre_tokenizer, "post_processor": post, "decoder": decoder, "model": model},
        ensure_ascii=False)

    eos_ids = [i for i in (eos_id, _token_id(f, "eot_token_id", n), _token_id(f, "eom_token_id", n))
               if i is not None]
    eos_ids += [vocab[t] for t in END_OF_GENERATION_TEXTS if t in vocab and types[vocab[t]] == CONTROL]
    eos_ids = list(dict.fromkeys(eos_ids))

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": clean_spaces,
              "model_max_length": f.arch_key("context_length") or 1 << 30}
    for role, token_id in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id),
                           ("pad", _token_id(f, "padding_token_id", n))):
        if token_id is not None:
            config[f"{role}_token"] = tokens[token_id]
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    files = {"tokenizer.json": tokenizer_json,
             "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
    return GGUFTokenizer(files=files, eos_token_ids=eos_ids, bos_token_id=bos_id)
