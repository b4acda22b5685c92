"""A turn's steps on the worker thread: the prompt's KV, then each choice's tokens.

``turn_steps`` is the iterator a turn hands ``DecodeWorker.submit``; the event loop reads what it
yields (tokens, the prompt's scores, the end of each choice) and cuts choices a stop string ended.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.slots import DecodeEngine
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.handoff import StreamedKV


@dataclass(frozen=True)
class ChoiceEnd:
    """The worker's item after one choice's tokens: the engine's stats of it (None: nothing was
    generated, max_tokens 0)."""

    index: int
    stats: GenerationStats | None


class ChoiceCuts:
    """The choices the event loop ended (a stop string in their text): the worker stops generating
    them at their next token. Written on the event loop, read on the worker (one int)."""

    def __init__(self) -> None:
        self.last = -1  # choices up to this index are ended

    def cut(self, index: int) -> None:
        self.last = max(self.last, index)

    def __contains__(self, index: int) -> bool:
        return index <= self.last


def turn_steps(
    engine: DecodeEngine,
    request: CompletionRequest,
    stream: StreamedKV | None,
    keep: int,
    cuts: ChoiceCuts,
    arrived: threading.Event | None = None,
) -> Iterator[object]:
    """A turn on the worker: the prompt's KV (a split's head computed while its tail arrives: None
    while waiting, the worker serves the others meanwhile; an echo with logprobs computes and scores
    the whole prompt here, yielding its ScoredRuns), then each choice's tokens (ints, or ScoredTokens
    with logprobs) and its ChoiceEnd. Choices after the first keep the prompt's KV the engine holds
    and run its last token again. A request with a grammar starts each choice at the grammar's start."""
    prompt = request.prompt_ids
    if arrived is not None:
        assert stream is not None
        engine.compute_head(stream)
        while not arrived.is_set():
            yield None
    if request.prompt_logprobs:
        yield from engine.score_prompt(prompt, request.logprobs or 0)
        keep = engine.reusable_prefix(prompt)
    for index in range(request.n):
        params = request.choice_params(index)
        if params.max_tokens == 0:  # echo only
            yield ChoiceEnd(index, None)
            continue
        if index:
            stream, keep = None, engine.reusable_prefix(prompt)
        constraint = None if request.grammar is None else request.grammar.start()
        steps = (
            engine.generate(prompt, params, kv=stream, keep=keep, constraint=constraint)
            if request.logprobs is None
            else engine.generate_scored(
                prompt, params, kv=stream, keep=keep, top=request.logprobs, constraint=constraint
            )
        )
        for item in steps:
            yield item
            if index in cuts:
                break
        yield ChoiceEnd(index, dataclasses.replace(engine.stats))
