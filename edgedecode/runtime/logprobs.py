"""Log-probabilities of tokens under the model's own distribution: log-softmax of the raw logits
(before temperature, top-k or top-p shape the sampling distribution), as vLLM reports them by default.

Only a turn that asks for log-probabilities pays for them: ``Engine.generate_scored`` scores each
generated token from its logits row, ``Engine.score_prompt`` every prompt token, a graph run at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per position at most (OpenAI's top_logprobs bound)
_ROW_BLOCK = 32  # rows whose float64 exponentials are held at once when scoring a run (~12 MiB at a 49k vocab)


@dataclass(frozen=True)
class ScoredToken:
    """A generated token with its log-probability and the most likely tokens at its position."""

    token: int
    logprob: float
    top_ids: np.ndarray  # int64 [k], most likely first (ties: lower id first)
    top_logprobs: np.ndarray  # float64 [k]


@dataclass(frozen=True)
class ScoredRun:
    """Log-probabilities of consecutive prompt tokens, each given the tokens before it."""

    first: int  # the prompt position of the first token scored
    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float64 [n]
    top_ids: np.ndarray  # int64 [n, k]
    top_logprobs: np.ndarray  # float64 [n, k]


class LogprobScorer:
    """Scores logits rows: the chosen token's log-probability and the ``top`` most likely tokens'."""

    def __init__(self, top: int, vocab_size: int) -> None:
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top must be in [0, {MAX_TOP}], not {top}")
        self.top = top
        self._scratch = np.empty(vocab_size, np.float64)  # one row's shifted logits, then their exponentials

    def token(self, logits: np.ndarray, token: int) -> ScoredToken:
        """Score ``token`` chosen from the [vocab] ``logits`` row (float32 or float16)."""
        scratch = self._scratch
        scratch[:] = logits  # float64: exact for float32 and float16 logits
        peak = scratch.max()
        np.subtract(scratch, peak, out=scratch)
        logsumexp = float(peak) + math.log(float(np.exp(scratch, out=scratch).sum()))
        top_ids = _top_ids(logits[None], self.top)[0]
        return ScoredToken(
            token,
            float(logits[token]) - logsumexp,
            top_ids,
            logits[top_ids].astype(np.float64) - logsumexp,
        )

    def run(self, logits: np.ndarray, targets: np.ndarray, first: int) -> ScoredRun:
        """Score ``targets`` [n], row i of the [n, vocab] ``logits`` being the distribution of target i,
        a block of rows at a time (never a float64 copy, or an index array, of the whole run)."""
        n = len(targets)
        logsumexp = np.empty(n, np.float64)
        top_ids = np.empty((n, self.top), np.int64)
        for start in range(0, n, _ROW_BLOCK):
            rows = logits[start : start + _ROW_BLOCK]
            block = rows.astype(np.float64)
            peak = block.max(axis=1)
            np.subtract(block, peak[:, None], out=block)
            logsumexp[start : start + len(block)] = peak + np.log(np.exp(block, out=block).sum(axis=1))
            top_ids[start : start + len(block)] = _top_ids(rows, self.top)
        return ScoredRun(
            first,
            np.asarray(targets, np.int64).copy(),
            logits[np.arange(n), targets].astype(np.float64) - logsumexp,
            top_ids,
            np.take_along_axis(logits, top_ids, axis=1).astype(np.float64) - logsumexp[:, None],
        )


def _top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """int64 [n, k]: each row's k largest logits' ids, largest first, lower id first on ties."""
    n, vocab = logits.shape
    if k == 0:
        return np.zeros((n, 0), np.int64)
    candidates = np.argpartition(logits, vocab - k, axis=1)[:, vocab - k :]
    values = np.take_along_axis(logits, candidates, axis=1)
    order = np.lexsort((candidates, -values.astype(np.float64)), axis=-1)
    return np.take_along_axis(candidates, order, axis=1).astype(np.int64)
