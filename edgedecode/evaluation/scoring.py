"""Teacher-forced scoring of a continuation after a context whose KV was handed over."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.runtime.engine import Engine


@dataclass(frozen=True)
class ContinuationScore:
    """Next-token log-probabilities over a continuation and the targets' negative log-likelihood."""

    log_probs: np.ndarray  # float32 [T, vocab]
    nll: np.ndarray  # float64 [T]

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities over the last axis."""
    shifted = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_per_token(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(reference ‖ other) in nats for each row of two log-probability arrays [T, vocab]."""
    return np.maximum((np.exp(reference) * (reference - other)).sum(axis=-1), 0.0)


def score_continuation(
    engine: Engine, context_ids: np.ndarray, continuation_ids: np.ndarray, kv: KVSnapshot | None
) -> ContinuationScore:
    """Inject ``kv`` for the context (its last token runs locally), then run continuation[:-1] in one
    teacher-forced pass; the targets are continuation[1:]."""
    engine.prefill(context_ids, kv=kv)
    logits = engine.forward(continuation_ids[:-1], all_logits=True)
    log_probs = log_softmax(logits)
    targets = np.asarray(continuation_ids[1:])
    nll = -log_probs[np.arange(len(targets)), targets].astype(np.float64)
    return ContinuationScore(log_probs, nll)


def mean_kl(reference: ContinuationScore, other: ContinuationScore) -> float:
    """Mean over steps of KL(reference ‖ other) of the next-token distributions, in nats."""
    return float(kl_per_token(reference.log_probs, other.log_probs).mean())


def top1_agreement(reference: ContinuationScore, other: ContinuationScore) -> float:
    return float((reference.log_probs.argmax(-1) == other.log_probs.argmax(-1)).mean())
