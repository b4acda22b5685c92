"""The GGUF-built tokenizer against llama.cpp's ids, plus decoding, streaming and chat templates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from edgedecode.model.tokenizer import Tokenizer, TokenizerError

# Read at collection time only to name the parametrized cases; the tests take the values from the
# tokenization_vectors fixture.
_CASES = json.loads((Path(__file__).parent / "vectors" / "smollm2-135m-instruct" / "tokenization.json").read_text())
_CASE_IDS = [f"{i:02d}-{'special' if c['parse_special'] else 'plain'}-{json.dumps(c['text'], ensure_ascii=False)[:40]}"
             for i, c in enumerate(_CASES)]
_PROMPTS = ("prose", "code", "chat")
_CHAT_QUESTION = "What is the capital of France, and what river runs through it?"
_MULTIBYTE = "naïve café — 東京 🎉 Ünïcödé 日本語 한국어 🙂🚀🔥 ∑∫√∞"


@pytest.fixture(scope="module")
def tok(smollm2_reader, smollm2_spec) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_reader, smollm2_spec)


def test_vocab_size(tok, smollm2_spec):
    assert tok.vocab_size == smollm2_spec.vocab_size == 49152


@pytest.mark.parametrize("index", range(len(_CASES)), ids=_CASE_IDS)
def test_matches_llama_cpp(tok, tokenization_vectors, index):
    case = tokenization_vectors[index]
    ids = tok.encode(case["text"], parse_special=case["parse_special"], add_bos=case["add_bos"])
    assert ids == case["ids"]


def test_default_add_bos_follows_spec(tok, smollm2_spec):
    assert smollm2_spec.add_bos is False
    assert tok.encode("Hello") == tok.encode("Hello", add_bos=False)
    assert tok.encode("Hello", add_bos=True) == [smollm2_spec.bos_token_id, *tok.encode("Hello")]


@pytest.mark.parametrize("prompt", _PROMPTS)
def test_logit_prompts_encode_to_llama_cpp_ids(tok, prompt, logit_vectors, vector_meta):
    text = vector_meta["prompts"][prompt]["text"]
    assert tok.encode(text) == logit_vectors[f"{prompt}_ids"].tolist()


def test_chat_template_renders_the_chat_prompt(tok, logit_vectors, vector_meta):
    messages = [{"role": "user", "content": _CHAT_QUESTION}]
    assert tok.render_chat(messages) == vector_meta["prompts"]["chat"]["text"]
    assert tok.encode_chat(messages) == logit_vectors["chat_ids"].tolist()


def test_chat_template_without_generation_prompt(tok):
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                           add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_no_chat_template_is_an_error(smollm2_reader, smollm2_spec):
    tok = Tokenizer.from_gguf(smollm2_reader, dataclasses.replace(smollm2_spec, chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "Hi"}])


def test_template_raise_exception_becomes_tokenizer_error(smollm2_reader, smollm2_spec):
    spec = dataclasses.replace(smollm2_spec, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        Tokenizer.from_gguf(smollm2_reader, spec).render_chat([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("index", [i for i, c in enumerate(_CASES) if not c["parse_special"]],
                         ids=[n for n, c in zip(_CASE_IDS, _CASES) if not c["parse_special"]])
def test_decode_roundtrip(tok, tokenization_vectors, index):
    text = tokenization_vectors[index]["text"]
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nHi<|im_end|>"


@pytest.mark.parametrize("prompt", _PROMPTS)
def test_greedy_ids_decode_to_llama_cpp_text(tok, prompt, logit_vectors, vector_meta):
    ids = logit_vectors[f"{prompt}_greedy32"].tolist()
    assert tok.decode(ids) == vector_meta["prompts"][prompt]["greedy_text"]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", ["naïve café — 東京 🎉", _MULTIBYTE])
def test_stream_decoder_matches_decode(tok, text):
    ids = tok.encode(text)
    assert not all(_is_utf8(tok.token_bytes(i)) for i in ids), "the case must split a character over tokens"
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_skips_special_tokens(tok, logit_vectors):
    ids = logit_vectors["chat_ids"].tolist()
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    assert "<|im_start|>" not in "".join(_stream(tok, ids))


def test_stream_decoder_flush_reports_a_cut_character(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1
    decoder = tok.stream_decoder()
    assert decoder.feed(ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_unknown_token_id_is_an_error(tok):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@pytest.mark.parametrize("field,value", [("tokenizer_pre", "bogus"), ("tokenizer_pre", "default"), ("tokenizer_model", "llama")])
def test_unsupported_tokenizer_is_an_error(smollm2_reader, smollm2_spec, field, value):
    spec = dataclasses.replace(smollm2_spec, **{field: value})
    with pytest.raises(TokenizerError, match=value) as info:
        Tokenizer.from_gguf(smollm2_reader, spec)
    assert "smollm" in str(info.value) and "gpt-2" in str(info.value)
