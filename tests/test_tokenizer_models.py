"""The tokenizer's model parts on tiny synthetic GGUF vocabularies: the BPE pre-tokenizer regexes
(gpt-2, smollm, llama-bpe, qwen2) and SentencePiece's score-ranked merges, byte fallback and space prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.spec import TokenizerSpec
from edgedecode.model.tokenizer import Tokenizer, TokenizerError
from edgedecode.model.tokenizer_models import BYTE, CONTROL, NORMAL, USER_DEFINED, ByteLevelBpe

# Splits worked out by hand from each regex, on text where they differ from GPT-2's: contractions in
# any case, digits in ones or threes, punctuation absorbing the newlines after it, newline runs apart
# from the spaces after them, and one non-letter joining the letters after it.
_SPLITS = {
    "I'VE got 12345 apples\n\n  ok": {
        "gpt-2": ["I", "'", "VE", " got", " 12345", " apples", "\n\n ", " ok"],
        "smollm": ["I", "'", "VE", " got", " ", "1", "2", "3", "4", "5", " apples", "\n\n ", " ok"],
        "llama-bpe": ["I", "'VE", " got", " ", "123", "45", " apples", "\n\n", " ", " ok"],
        "qwen2": ["I", "'VE", " got", " ", "1", "2", "3", "4", "5", " apples", "\n\n", " ", " ok"],
    },
    "x.\n\ny $hello": {
        "gpt-2": ["x", ".", "\n", "\n", "y", " $", "hello"],
        "smollm": ["x", ".", "\n", "\n", "y", " $", "hello"],
        "llama-bpe": ["x", ".\n\n", "y", " $", "hello"],
        "qwen2": ["x", ".\n\n", "y", " $", "hello"],
    },
    "HE'S a_b don't": {
        "gpt-2": ["HE", "'", "S", " a", "_", "b", " don", "'t"],
        "smollm": ["HE", "'", "S", " a", "_", "b", " don", "'t"],
        "llama-bpe": ["HE", "'S", " a", "_b", " don", "'t"],
        "qwen2": ["HE", "'S", " a", "_b", " don", "'t"],
    },
}


def _write_vocab(path: Path, model: str, tokens: list[str], **fields) -> Path:
    """A GGUF with only tokenizer metadata: `fields` are types, scores, merges, pre, add_space_prefix."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(fields.get("types", [NORMAL] * len(tokens)))
    writer.add_eos_token_id(0)
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    if "merges" in fields:
        writer.add_token_merges(fields["merges"])
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    if "add_space_prefix" in fields:
        writer.add_add_space_prefix(fields["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    return Tokenizer.from_gguf(reader, TokenizerSpec.from_gguf(reader, path.stem))


def _texts(tok: Tokenizer, text: str, **kwargs) -> list[str]:
    return [tok.token_text(i) for i in tok.encode(text, add_bos=False, **kwargs)]


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
@pytest.mark.parametrize("text", list(_SPLITS))
def test_pre_tokenizer_splits_as_its_regex(text, pre):
    model = ByteLevelBpe(pre)
    pieces = model.pre_tokenizer().pre_tokenize_str(text)
    assert [model.normal_bytes(piece).decode() for piece, _ in pieces] == _SPLITS[text][pre]


# A byte-level vocabulary ("Ġ" is GPT-2's stand-in for a space) whose merges could build " 123" whole.
_BPE_TOKENS = ["<|endoftext|>", "a", "b", "c", "1", "2", "3", "'", "S", "Ġ", "ab", "abc", "12", "123", "'S"]
_BPE_TOKENS += ["Ġ1", "Ġ12", "Ġ123"]
_BPE_MERGES = ["a b", "ab c", "Ġ 1", "Ġ1 2", "Ġ12 3", "1 2", "12 3", "' S"]


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt-2", ["abc", "Ġ123", "'", "S"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "'", "S"]),
        ("llama-bpe", ["abc", "Ġ", "123", "'S"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "'S"]),
    ],
)
def test_bpe_vocabulary_tokenizes_per_pre_tokenizer(tmp_path, pre, pieces):
    types = [CONTROL] + [NORMAL] * (len(_BPE_TOKENS) - 1)
    path = _write_vocab(tmp_path / "bpe.gguf", "gpt2", _BPE_TOKENS, types=types, merges=_BPE_MERGES, pre=pre)
    tok = _tokenizer(path)
    assert _texts(tok, "abc 123'S") == pieces
    assert tok.decode(tok.encode("abc 123'S", add_bos=False)) == "abc 123'S"


@pytest.mark.parametrize(
    "model, pre, named",
    [("bert", "default", "'bert'"), ("gpt2", "default", "'default'"), ("gpt2", "qwen35", "'qwen35'")],
)
def test_unknown_tokenizer_is_refused_by_name(tmp_path, model, pre, named):
    path = _write_vocab(tmp_path / "odd.gguf", model, _BPE_TOKENS, merges=_BPE_MERGES, pre=pre)
    with pytest.raises(TokenizerError, match=named) as refused:
        _tokenizer(path)
    assert "llama-bpe" in str(refused.value) and "qwen2" in str(refused.value)


# A SentencePiece vocabulary: three control tokens, the 256 byte tokens, pieces, one user-defined token.
_SPM_PIECES = {"▁": -1.0, "a": -2.0, "b": -3.0, "ab": -10.0, "ba": -5.0, "▁a": -4.0}
_SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES, "xx"]
_SPM_TYPES = [CONTROL] * 3 + [BYTE] * 256 + [NORMAL] * len(_SPM_PIECES) + [USER_DEFINED]


def _spm(tmp_path: Path, name: str = "spm", pieces: dict[str, float] = _SPM_PIECES, **fields) -> Path:
    scores = [0.0] * 259 + list(pieces.values()) + [0.0]
    return _write_vocab(tmp_path / f"{name}.gguf", "llama", _SPM_TOKENS, types=_SPM_TYPES, scores=scores, **fields)


def test_spm_merges_the_highest_scoring_pair_first(tmp_path):
    tok = _tokenizer(_spm(tmp_path, add_space_prefix=False))
    assert _texts(tok, "aba") == ["a", "ba"]  # "ba" (-5) outranks "ab" (-10)
    swapped = _tokenizer(_spm(tmp_path, "swapped", {**_SPM_PIECES, "ab": -4.5}, add_space_prefix=False))
    assert _texts(swapped, "aba") == ["ab", "a"]


def test_spm_spaces_become_the_meta_symbol_and_decode_back(tmp_path):
    tok = _tokenizer(_spm(tmp_path, add_space_prefix=False))
    assert _texts(tok, "b a") == ["b", "▁a"]
    assert tok.decode(tok.encode("b a", add_bos=False)) == "b a"


def test_spm_falls_back_to_bytes(tmp_path):
    tok = _tokenizer(_spm(tmp_path, add_space_prefix=False))
    assert _texts(tok, "aé") == ["a", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("aé", add_bos=False)) == "aé"


def test_spm_space_prefix_starts_every_stretch_of_text(tmp_path):
    tok = _tokenizer(_spm(tmp_path, add_space_prefix=True))
    assert _texts(tok, "a") == ["▁a"]
    # llama.cpp prefixes the text after a user-defined token (always split out) as well
    assert _texts(tok, "axxb", parse_special=False) == ["▁a", "xx", "▁", "b"]
    assert _texts(tok, "</s>a") == ["</s>", "▁a"]


def test_spm_space_prefix_defaults_on_as_in_llama_cpp(tmp_path):
    assert TokenizerSpec.from_gguf(open_gguf(_spm(tmp_path)), "spm").add_space_prefix is True
    bpe = _write_vocab(tmp_path / "bpe.gguf", "gpt2", _BPE_TOKENS, merges=_BPE_MERGES, pre="gpt-2")
    assert TokenizerSpec.from_gguf(open_gguf(bpe), "bpe").add_space_prefix is False


def test_spm_hash_covers_scores_types_and_space_prefix(tmp_path):
    def tokenizer_hash(path: Path) -> str:
        return TokenizerSpec.from_gguf(open_gguf(path), "spm").tokenizer_hash

    base = tokenizer_hash(_spm(tmp_path, "base", add_space_prefix=False))
    assert base == tokenizer_hash(_spm(tmp_path, "same", add_space_prefix=False))
    assert base != tokenizer_hash(_spm(tmp_path, "scores", {**_SPM_PIECES, "ab": -4.5}, add_space_prefix=False))
    assert base != tokenizer_hash(_spm(tmp_path, "prefix", add_space_prefix=True))
    retyped = _write_vocab(
        tmp_path / "types.gguf",
        "llama",
        _SPM_TOKENS,
        types=[*_SPM_TYPES[:-1], NORMAL],
        scores=[0.0] * 259 + list(_SPM_PIECES.values()) + [0.0],
        add_space_prefix=False,
    )
    assert base != tokenizer_hash(retyped)
