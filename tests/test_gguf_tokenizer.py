"""The tokenizers llama.cpp writes into GGUF files, read back by ``mlx_knorm.models``.

Each test trains a real tokenizer here (byte-level BPE with ``tokenizers``, a
SentencePiece BPE model with ``sentencepiece``), writes its vocabulary into a
GGUF file as llama.cpp's converter does, and checks that the tokenizer read
from the file encodes held-out text to the same ids as the trained one and
decodes them back to the text.
"""

from __future__ import annotations

import io
import json
import unicodedata

import gguf
import pytest
from pydoc_data.topics import topics
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mlx_knorm.models import UnsupportedGGUF, load_tokenizer

CORPUS = [topics[k] for k in sorted(topics)[:60]]
HELD_OUT = [topics[k] for k in sorted(topics)[60:70]] + [
    "Numbers 1234567 and 3.14159; emoji 🙂, accents éàü, CJK 漢字, tabs\tand  double  spaces.\n\n  x",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's they'll we've I'm you'd",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _write_tokenizer(path, **fields):
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The Hugging Face pre-tokenizers of the models llama.cpp names so: the test trains with them.
HF_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                                   r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "qwen2": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
                                   r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


def _train_bpe(pre: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tokenizer.pre_tokenizer = HF_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tokenizer


def _bpe_fields(trained: Tokenizer, pre: str) -> dict:
    """What llama.cpp's converter writes for a byte-level BPE tokenizer."""
    vocab = trained.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(trained.to_str())["model"]["merges"]]
    return dict(tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens,
                token_types=[3 if t in SPECIALS else 1 for t in tokens], token_merges=merges,
                bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"], add_bos_token=False,
                chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                              "<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("pre", list(HF_PRE_TOKENIZERS))
def test_byte_level_bpe_round_trips(tmp_path, pre):
    trained = _train_bpe(pre)
    path = _write_tokenizer(tmp_path / "bpe.gguf", **_bpe_fields(trained, pre))
    tokenizer = load_tokenizer(path)
    for text in HELD_OUT:
        expected = trained.encode(text).ids
        if pre == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC first; this text is already NFC
            assert text == unicodedata.normalize("NFC", text)
        assert tokenizer.encode(text) == expected, text[:60]
        assert tokenizer.decode(expected) == text
    assert tokenizer.eos_token_ids == {trained.token_to_id("<|im_end|>"), trained.token_to_id("<|endoftext|>")}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n"
    # The control tokens are one token each in text, never merged or split.
    assert tokenizer.encode("<|im_start|>user")[0] == trained.token_to_id("<|im_start|>")


def test_digits_are_split_one_by_one_by_the_smollm_pre_tokenizer(tmp_path):
    trained = _train_bpe("smollm")
    tokenizer = load_tokenizer(_write_tokenizer(tmp_path / "bpe.gguf", **_bpe_fields(trained, "smollm")))
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]


def _train_sentencepiece():
    import sentencepiece as spm

    model = io.BytesIO()
    # Llama 2's trainer settings where they matter: BPE, byte fallback, identity normalization,
    # whitespace kept as is, digits split.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=700, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<table>", "</table>"], control_symbols=["<start_of_turn>", "<end_of_turn>"],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, character_coverage=1.0, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_fields(sp, user_defined) -> dict:
    """What llama.cpp's converter (``_create_vocab_sentencepiece``) writes for a SentencePiece model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 4 if piece in user_defined else 1)
    return dict(tokenizer_model="llama", token_list=tokens, token_scores=scores, token_types=types,
                bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(), unk_token_id=sp.unk_id(),
                add_space_prefix=True, add_bos_token=True)


def test_sentencepiece_vocabulary_round_trips(tmp_path):
    sp = _train_sentencepiece()
    path = _write_tokenizer(tmp_path / "spm.gguf", **_spm_fields(sp, {"<table>", "</table>"}))
    tokenizer = load_tokenizer(path)
    for text in HELD_OUT + ["  leading spaces", "trailing  ", "a\n\n\tb"]:
        expected = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text[:60]
        assert tokenizer.encode(text) == [sp.bos_id()] + expected  # add_bos_token
        assert tokenizer.decode(expected) == sp.decode(expected)
    # Byte fallback: a character the vocabulary lacks becomes its UTF-8 bytes.
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert [sp.id_to_piece(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    # Added tokens are one token each; the text between them is tokenized piece by piece, each
    # piece with its space prefix (llama.cpp's rule, and Hugging Face's converted tokenizers').
    table, end, turn = (sp.piece_to_id(t) for t in ("<table>", "</table>", "<start_of_turn>"))
    assert tokenizer.encode("a <table> b </table> c", add_special_tokens=False) == (
        sp.encode("a ") + [table] + sp.encode(" b ") + [end] + sp.encode(" c"))
    assert tokenizer.encode("<start_of_turn>user", add_special_tokens=False) == [turn] + sp.encode("user")


@pytest.mark.parametrize("fields,message", [
    (dict(tokenizer_pre="tekken"), "pre-tokenizer 'tekken'"),
    (dict(tokenizer_pre="default"), "pre-tokenizer 'default'"),
    (dict(tokenizer_model="bert"), "tokenizer model 'bert'"),
])
def test_tokenizers_that_cannot_be_reproduced_are_refused_by_name(tmp_path, fields, message):
    trained = _train_bpe("gpt-2")
    path = _write_tokenizer(tmp_path / "bad.gguf", **{**_bpe_fields(trained, "gpt-2"), **fields})
    with pytest.raises(UnsupportedGGUF, match=message):
        load_tokenizer(path)

