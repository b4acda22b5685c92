"""Log-probabilities in the daemon's responses without the model: how TokenText lines tokens' entries
up with the text a stream sends (UTF-8 held back, stop strings), and ResponseShape's objects checked
against the ``openai`` package's own response models. Runs in well under a second."""

from __future__ import annotations

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from edgedecode.daemon.openai_responses import ChoiceResult, ResponseShape, TokenText
from edgedecode.model.tokenizer import StreamDecoder
from edgedecode.runtime.logprobs import LogprobScorer, ScoredToken

# a vocabulary of byte strings: "é" is 0xC3 0xA9, split over tokens 5 and 6; 9 is a special token
VOCAB = [b"Hel", b"lo", b" wor", b"ld", b".", b"\xc3", b"\xa9", b" END", b" caf", b"<|im_end|>"]
SPECIAL = 9
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


class _Tokenizer:
    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        return b"" if skip_special and token_id == SPECIAL else VOCAB[token_id]


def _scored(token: int) -> ScoredToken:
    return ScoredToken(token, -0.5, np.array([token, 4]), np.array([-0.5, -2.0]))


def _run(tokens: list[int], stops: tuple[str, ...] = (), base: int = 0) -> list[tuple[str, list]]:
    """Each feed's (text, [(offset, token)]) then the finish's."""
    text = TokenText(StreamDecoder(_Tokenizer()), stops, base=base, tracked=True)  # type: ignore[arg-type]
    out = []
    for token in tokens:
        piece, entries = text.feed(token, _scored(token))
        out.append((piece, [(offset, scored.token) for offset, scored in entries]))
    piece, entries = text.finish()
    out.append((piece, [(offset, scored.token) for offset, scored in entries]))
    return out


def test_each_entry_goes_with_the_text_of_its_token():
    assert _run([0, 1, 2, 3]) == [("Hel", [(0, 0)]), ("lo", [(3, 1)]), (" wor", [(5, 2)]), ("ld", [(9, 3)]), ("", [])]


def test_a_token_that_starts_a_character_goes_with_the_token_that_ends_it():
    # " caf" then "é" in two tokens: the first byte's token waits for the second
    assert _run([8, 5, 6, 4]) == [(" caf", [(0, 8)]), ("", []), ("é", [(4, 5), (4, 6)]), (".", [(5, 4)]), ("", [])]


def test_a_cut_character_goes_out_at_the_end_as_the_replacement_character():
    assert _run([8, 5]) == [(" caf", [(0, 8)]), ("", []), ("\ufffd", [(4, 5)])]


def test_text_held_back_for_a_stop_string_holds_its_entries_back():
    # " END" could start at any of the last three characters: they wait, and their tokens with them
    assert _run([0, 1, 2, 3], stops=(" END",)) == [
        ("", []),
        ("He", []),
        ("llo ", [(0, 0), (3, 1)]),
        ("wo", []),
        ("rld", [(5, 2), (9, 3)]),
    ]


def test_a_stop_string_cuts_its_tokens_and_keeps_the_one_running_into_it():
    # "Hello world" with stop "o w": the text stops at "Hell"; "lo" starts before the cut (kept), " wor" after it
    out = _run([0, 1, 2, 3], stops=("o w",))
    texts = "".join(piece for piece, _ in out)
    entries = [entry for _, got in out for entry in got]
    assert texts == "Hell"
    assert entries == [(0, 0), (3, 1)]
    assert _run([0, 1, 7, 2], stops=(" END",))[-1] == ("", [])  # nothing after the stop
    assert [e for _, got in _run([0, 1, 7, 2], stops=(" END",)) for e in got] == [(0, 0), (3, 1)]


def test_a_special_token_has_no_text_and_goes_at_once():
    assert _run([0, SPECIAL, 1]) == [("Hel", [(0, 0)]), ("", [(3, SPECIAL)]), ("lo", [(3, 1)]), ("", [])]


def test_offsets_count_from_the_base():
    assert _run([0, 1], base=10)[:2] == [("Hel", [(10, 0)]), ("lo", [(13, 1)])]


def _entries(tokens: list[int]):
    return [(offset, _scored(t)) for offset, t in zip([0, 3, 5, 9], tokens)]


def test_chat_shapes_validate_as_openai_models():
    shape = ResponseShape("chat", "tiny", _Tokenizer())
    whole = shape.whole([ChoiceResult("Hello", "stop", _entries([0, 1])), ChoiceResult("Hello", "length", [])], USAGE)
    parsed = ChatCompletion.model_validate(whole)
    assert [c.index for c in parsed.choices] == [0, 1]
    content = parsed.choices[0].logprobs.content
    assert [(e.token, e.bytes, e.logprob) for e in content] == [("Hel", list(b"Hel"), -0.5), ("lo", list(b"lo"), -0.5)]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hel", -0.5), (".", -2.0)]
    assert parsed.choices[0].logprobs.refusal is None and parsed.choices[1].logprobs.content == []
    chunk = ChatCompletionChunk.model_validate(shape.chunk("Hel", index=1, entries=_entries([0])))
    assert chunk.choices[0].index == 1 and chunk.choices[0].logprobs.content[0].token == "Hel"
    assert ChatCompletionChunk.model_validate(shape.chunk("x")).choices[0].logprobs is None


def test_completion_shapes_validate_as_openai_models():
    shape = ResponseShape("text", "tiny", _Tokenizer())
    entries = [(0, 8), (4, _scored(5)), (4, ScoredToken(6, -1.0, np.array([4]), np.array([-0.25])))]
    body = shape.whole([ChoiceResult(" café", "length", entries)], USAGE)
    logprobs = body["choices"][0]["logprobs"]
    # the echoed prompt's first token has neither; a token that is part of a character is spelled in bytes
    assert logprobs["tokens"] == [" caf", "bytes:\\xc3", "bytes:\\xa9"]
    assert logprobs["token_logprobs"] == [None, -0.5, -1.0]
    assert logprobs["top_logprobs"] == [None, {"bytes:\\xc3": -0.5, ".": -2.0}, {".": -0.25, "bytes:\\xa9": -1.0}]
    assert logprobs["text_offset"] == [0, 4, 4]
    # the openai package types these lists without the nulls OpenAI's echo sends: checked after them
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        logprobs[key] = logprobs[key][1:]
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].logprobs.top_logprobs[1] == {".": -0.25, "bytes:\\xa9": -1.0}
    chunk = shape.chunk(" caf", index=2, entries=[(0, _scored(8))])
    assert chunk["choices"][0]["finish_reason"] is None  # as OpenAI streams it; the package types it non-null
    chunk["choices"][0]["finish_reason"] = "length"
    parsed_chunk = Completion.model_validate(chunk)
    assert parsed_chunk.choices[0].index == 2 and parsed_chunk.choices[0].logprobs.tokens == [" caf"]


def test_the_scorer_is_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((70, 300)) * 4).astype(np.float32)
    logits[3, [10, 20]] = logits[3].max() + 1  # a tie at the top: the lower id first
    reference = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    targets = rng.integers(0, 300, 70)
    scorer = LogprobScorer(5, 300)
    run = scorer.run(logits, targets, first=1)
    np.testing.assert_allclose(run.logprobs, reference[np.arange(70), targets], atol=1e-9)
    expected_top = np.argsort(-reference, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(run.top_ids, expected_top)
    np.testing.assert_allclose(run.top_logprobs, np.take_along_axis(reference, expected_top, 1), atol=1e-9)
    one = scorer.token(logits[3], 20)
    assert list(one.top_ids[:2]) == [10, 20] and one.logprob == pytest.approx(reference[3, 20], abs=1e-9)
    assert LogprobScorer(0, 300).token(logits[0], 1).top_ids.shape == (0,)
