"""Whether two greedy answers to one prompt differ only at a near-tie: the check behind "the same
answer, up to a near-tie" wherever KV took two different paths (compressed and resident, pulled
and computed, alone and under load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Prefiller(Protocol):
    """What the check needs of an engine: the logits after a prompt (``runtime.engine.Engine``)."""

    def prefill(self, prompt_ids: np.ndarray) -> np.ndarray: ...


def divergence_gap(engine: Prefiller, prompt_ids: np.ndarray, answer: Sequence[int], other: Sequence[int]) -> float:
    """The logit gap, under ``engine``, between the tokens of ``answer`` and ``other`` at the first
    position where they differ, ``answer``'s tokens before it teacher-forced after the prompt; 0.0
    when one is a prefix of the other (the end of the turn competed with the next token, or one was
    cut by max_tokens)."""
    common = next((i for i, (a, b) in enumerate(zip(answer, other)) if a != b), min(len(answer), len(other)))
    if common >= min(len(answer), len(other)):
        return 0.0
    context = np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(answer[:common], np.int64)])
    logits = engine.prefill(context)
    return float(abs(logits[answer[common]] - logits[other[common]]))
