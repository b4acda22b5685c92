"""Where a fuzz case's choices come from: the mutations ask a ``Draw`` for integers, so the same code runs from a
seeded numpy generator (``tools/adversarial/fuzz_kv.py``: fast, every case replayable from its seed and index) or from
hypothesis (``tests/test_kv_fuzz.py``: derandomized, and a failure shrinks to its simplest choices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np
from hypothesis import strategies as st

T = TypeVar("T")


class Draw(Protocol):
    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high], both included."""
        ...


class RandomDraw:
    """Choices from numpy's generator seeded with ``(seed, case)``: case k of a run is replayable on its own."""

    def __init__(self, seed: int, case: int) -> None:
        self._rng = np.random.default_rng([seed, case])

    def integer(self, low: int, high: int) -> int:
        span = high - low + 1
        if span <= 2**63:
            return low + int(self._rng.integers(0, span))
        return low + int.from_bytes(self._rng.bytes(span.bit_length() // 8 + 8)) % span  # beyond int64: near uniform


class HypothesisDraw:
    """Choices from hypothesis's ``st.data()``."""

    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def integer(self, low: int, high: int) -> int:
        return self._data.draw(st.integers(low, high))


def pick(draw: Draw, options: Sequence[T]) -> T:
    """One of ``options`` (hypothesis favours the first)."""
    return options[draw.integer(0, len(options) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    """True ``percent`` times in a hundred (for the high draws: hypothesis favours and shrinks to low ones, so the
    plain case, False, is what it tries first)."""
    return draw.integer(0, 99) >= 100 - percent


def random_bytes(draw: Draw, n: int) -> bytes:
    """``n`` arbitrary bytes, from one draw however many (a chunk's worth would overrun hypothesis's buffer)."""
    return np.random.default_rng(draw.integer(0, 2**64 - 1)).bytes(n)
