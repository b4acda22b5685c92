"""A fuzz case: a seed payload, one mutation of it (sometimes cut short after), and the slices it is fed in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from test_kv_format import split_frames

from edgedecode.kv.wire.frames import CHUNK_PREFIX
from kvfuzz.chunk_edits import recode_chunk, reorder_chunks
from kvfuzz.draw import Draw, chance, pick
from kvfuzz.frames import TRANSPORT, boundaries
from kvfuzz.header_edits import edit_header
from kvfuzz.mutant import Mutant
from kvfuzz.seeds import Alternate, Seed

MAX_BYTE_RUN = 256  # bytes fed one at a time around a boundary, at most (each feed is a call)


@dataclass(frozen=True)
class Case:
    seed: Seed
    mutant: Mutant
    cuts: tuple[int, ...]  # the payload is fed as payload[cuts[i]:cuts[i + 1]]; 0 and its length included


def _unchanged(seed: Seed, draw: Draw) -> Mutant:
    return Mutant(seed.payload, "none")


def resume_offset(seed: Seed, draw: Draw) -> Mutant:
    """A resume answered from another position than the one asked (a seed's ``alternates``): a genuine payload,
    so what a receiver accepts of it must be what it declares."""
    alternate = pick(draw, seed.alternates)
    return Mutant(alternate.payload, alternate.name, tuple(chunk[CHUNK_PREFIX.size :] for chunk in frames(alternate)))


def frames(alternate: Alternate) -> list[bytes]:
    """The chunk frames of an alternate payload."""
    return split_frames(alternate.payload)[1]


def mutations(seeds: Sequence[Seed]) -> list[Callable[[Seed, Draw], Mutant]]:
    """Every mutation, repeated by weight: header edits have the most to explore."""
    return [
        *TRANSPORT,
        *[edit_header] * 4,
        *[recode_chunk] * 2,
        functools.partial(reorder_chunks, donors=seeds),
        _unchanged,
    ]


def make_case(seeds: Sequence[Seed], draw: Draw) -> Case:
    """One case: a seed (small payloads more often), a mutation, in 1 of 8 cases cut short after it, and feeds."""
    seed = pick(draw, [s for s in seeds for _ in range(s.weight)])
    mutant = pick(draw, mutations(seeds) + [resume_offset] * (2 * bool(seed.alternates)))(seed, draw)
    if chance(draw, 12) and mutant.payload:
        at = draw.integer(0, len(mutant.payload) - 1)
        mutant = Mutant(mutant.payload[:at], f"{mutant.label}, then cut", mutant.bodies)
    return Case(seed, mutant, feed_cuts(draw, len(mutant.payload), boundaries(seed)))


def feed_cuts(draw: Draw, length: int, marks: list[int]) -> tuple[int, ...]:
    """Where to cut ``length`` bytes into feeds: whole, at random places, or a byte at a time around a mark."""
    cuts = {0, length}
    mode = pick(draw, ["whole", "random", "bytes"])
    if mode == "random":
        cuts |= {draw.integer(0, length) for _ in range(draw.integer(1, 32))}
    elif mode == "bytes":
        mark = min(pick(draw, marks), length)
        run = draw.integer(1, MAX_BYTE_RUN)
        cuts |= set(range(max(mark - run // 2, 0), min(mark + run // 2, length)))
    return tuple(sorted(cuts))
