"""Generation after a processed prompt: the per-token decode loop and what a generation reports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edgedecode.runtime.logprobs import ScoredToken
from edgedecode.runtime.runner import ModelRunner
from edgedecode.runtime.sampler import Sampler, SamplingParams

if TYPE_CHECKING:  # the type only: llguidance is imported where grammars are made
    from edgedecode.runtime.constraint import TokenMask

Score = Callable[[np.ndarray, int], ScoredToken] | None
"""How a generation yields a token picked from a logits row: None, the bare id; else what it makes of both."""


@dataclass
class GenerationStats:
    """What the last generate() call did and how long it took."""

    prompt_tokens: int = 0
    injected_tokens: int = 0  # prompt tokens whose KV came from elsewhere
    reused_tokens: int = 0  # leading prompt positions whose KV this engine still held from its last use
    computed_tokens: int = 0  # prompt positions run through the graph (the rest were reused or injected)
    generated_tokens: int = 0
    decode_steps: int = 0  # single-token graph runs after the prompt
    prefill_seconds: float = 0.0  # prompt processing up to the first token's logits
    decode_seconds: float = 0.0  # from the first token's logits to the end of generation
    finish_reason: str = ""  # "stop", "length" or "context"

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.injected_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


def decode(
    runner: ModelRunner,
    logits: np.ndarray,
    params: SamplingParams,
    stops: frozenset[int],
    stats: GenerationStats,
    score: Score,
    constraint: TokenMask | None = None,
) -> Iterator[Any]:
    """Pick a token from ``logits`` (the prompt's last), yield it, run it through ``runner`` for the
    next logits, and so on until a token in ``stops`` (not yielded), ``params.max_tokens`` or a full
    context; ``stats`` counts the tokens and steps and says which ended it.

    ``score`` None yields bare token ids (nothing computed beyond sampling); otherwise each token as
    ``score`` makes it of its logits.

    ``constraint`` (a grammar's ``TokenMask``) masks each row before the pick (``score`` sees the raw
    row: log-probabilities under the model's own distribution) and takes each token picked; the
    generation ends ("stop") as soon as the grammar admits nothing more.
    """
    sequence = runner.sequence
    sampler = Sampler(params)
    first_token_at = time.perf_counter()
    stats.finish_reason = "length"
    for _ in range(params.max_tokens):
        token = sampler.pick(logits if constraint is None else constraint.apply(logits))
        if token in stops:
            stats.finish_reason = "stop"
            break
        if constraint is not None:
            constraint.accept(token)
        stats.generated_tokens += 1
        yield token if score is None else score(logits, token)
        if constraint is not None and constraint.finished:  # complete, even on the last token allowed
            stats.finish_reason = "stop"
            break
        if stats.generated_tokens == params.max_tokens:
            break
        if sequence.full:
            stats.finish_reason = "context"
            break
        logits = runner.step(token)  # room checked just above
        stats.decode_steps += 1
    stats.decode_seconds = time.perf_counter() - first_token_at
