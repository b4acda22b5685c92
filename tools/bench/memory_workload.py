"""The workload of tools/bench/memory.py: conversations and their turns, the shuffled order they take
turns in, and the KV memory budget a cell gets (a fraction of what the conversations' FP16 KV would
need).

A conversation is a distinct pydoc prose window. Turn k's prompt is the window up to its k-th cut,
so each turn adds the next part of the text (the previous completion is not carried: the turns keep
their sizes, and the text after a resumed turn's KV is known, to teacher-force its quality). The
last cut leaves room for the completion: a conversation's final length, its last prompt plus
``max_tokens``, is ``tokens``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import numpy as np

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.model.tokenizer import Tokenizer

MIB = 1 << 20


@dataclass(frozen=True)
class Conversation:
    """One conversation's text and where its turns' prompts end."""

    index: int
    ids: np.ndarray  # int64 [cuts[-1]]: the whole text
    cuts: tuple[int, ...]  # prompt length of each turn, increasing

    @property
    def session(self) -> str:
        return f"conversation-{self.index}"

    def prompt(self, turn: int) -> np.ndarray:
        return self.ids[: self.cuts[turn]]

    def new_tokens(self, turn: int) -> int:
        """Prompt tokens turn ``turn`` adds to the conversation."""
        return self.cuts[turn] - (self.cuts[turn - 1] if turn else 0)


def turn_cuts(prompt_tokens: int, turns: int) -> tuple[int, ...]:
    """``turns`` prompt lengths splitting ``prompt_tokens`` into near-equal parts."""
    if turns < 1 or prompt_tokens < 2 * turns:
        raise ValueError(f"{turns} turns need at least {2 * turns} prompt tokens, not {prompt_tokens}")
    return tuple(round((k + 1) * prompt_tokens / turns) for k in range(turns))


def conversations(tokenizer: Tokenizer, count: int, tokens: int, turns: int, max_tokens: int) -> list[Conversation]:
    """``count`` conversations of ``tokens`` tokens each (last prompt + ``max_tokens``), distinct texts."""
    cuts = turn_cuts(tokens - max_tokens, turns)
    windows = token_windows(tokenizer, pydoc_corpus(), cuts[-1], count)
    return [Conversation(i, ids, cuts) for i, ids in enumerate(windows)]


def schedule(count: int, turns: int, seed: int) -> list[tuple[int, int]]:
    """Every (conversation, turn) once, conversations shuffled together (seeded), each one's turns in order."""
    order = [c for c in range(count) for _ in range(turns)]
    random.Random(seed).shuffle(order)
    taken: Counter[int] = Counter()
    steps = []
    for c in order:
        steps.append((c, taken[c]))
        taken[c] += 1
    return steps


@dataclass(frozen=True)
class Budget:
    """A cell's KV memory budget: ``fraction`` of the conversations' FP16 KV, in whole MiB
    (``daemon.kv_memory_mb``, rounded down), against the largest turn's reservation."""

    fraction: float
    fp16_need_bytes: int  # sum over conversations of final length x FP16 bytes per token
    exact_bytes: float  # fraction x fp16_need_bytes
    mb: int  # daemon.kv_memory_mb
    largest_turn_bytes: int  # the largest turn's reservation: (prompt + max_tokens) x the slots' bytes per token

    @property
    def nbytes(self) -> int:
        return self.mb * MIB

    @property
    def feasible(self) -> bool:
        """Whether the largest turn fits the budget with every other conversation evicted."""
        return self.largest_turn_bytes <= self.nbytes


def budget(
    convs: list[Conversation], max_tokens: int, fraction: float, fp16_bytes_per_token: int, slot_bytes_per_token: int
) -> Budget:
    """The budget at ``fraction`` of what ``convs``' FP16 KV would need."""
    final = [c.cuts[-1] + max_tokens for c in convs]
    need = sum(final) * fp16_bytes_per_token
    exact = fraction * need
    return Budget(fraction, need, exact, int(exact // MIB), max(final) * slot_bytes_per_token)
