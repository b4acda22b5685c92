"""The engine's log-probabilities on the real decode graph: a prompt scored run by run equals the
log-softmax of its logits computed in one go, and scored generation picks the tokens plain
generation does."""

from __future__ import annotations

import numpy as np

from edgedecode.runtime.engine import chunk_sizes
from edgedecode.runtime.sampler import SamplingParams

SENTENCE = "The lighthouse keeper wrote down the weather every morning before dawn. "


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_a_prompt_scored_run_by_run_equals_its_teacher_forced_log_softmax(decoder, smollm2_model):
    ids = np.asarray(smollm2_model.tokenizer.encode(SENTENCE * 30)[:300])
    runs = list(decoder.score_prompt(ids, top=3))
    sizes = chunk_sizes(len(ids) - 1)
    assert len(sizes) == 2 and [run.first for run in runs] == [1, 1 + sizes[0]]  # two graph runs, each reduced
    assert decoder.next_position == len(ids) - 1 and decoder.reusable_prefix(ids) == len(ids) - 1
    logprobs = np.concatenate([run.logprobs for run in runs])
    top_ids = np.concatenate([run.top_ids for run in runs])
    np.testing.assert_array_equal(np.concatenate([run.token_ids for run in runs]), ids[1:])

    decoder.reset()
    reference = _log_softmax(decoder.forward(ids, all_logits=True))[:-1]
    np.testing.assert_allclose(logprobs, reference[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    np.testing.assert_array_equal(top_ids[:, 0], reference.argmax(axis=1))
    top = np.concatenate([run.top_logprobs for run in runs])
    assert (np.diff(top, axis=1) <= 0).all()


def test_scored_generation_picks_what_plain_generation_picks(decoder, smollm2_model):
    ids = np.asarray(smollm2_model.tokenizer.encode(SENTENCE))
    greedy = SamplingParams(max_tokens=6, stop_token_ids=())
    plain = list(decoder.generate(ids, greedy))
    list(decoder.score_prompt(ids))  # then the prompt's last token and on, as after a prefill
    scored = list(decoder.generate_scored(ids, greedy, keep=decoder.reusable_prefix(ids), top=2))
    assert [s.token for s in scored] == plain
    for s in scored:
        assert s.logprob == s.top_logprobs[0] and s.token == s.top_ids[0] and s.logprob < 0
    assert decoder.stats.computed_tokens == 1  # only the last prompt token ran after the scoring
