"""KV arriving for one prompt: where an engine's prompt processing may take its KV from.

A prompt's KV comes from one of three sources, the ``kv`` argument of ``Engine.prefill`` and
``Engine.generate`` (``KVSource``):

* ``None``: computed locally, by running the prompt through the engine's graph;
* a ``KVSnapshot``: KV held in process (exported by another engine, or decoded from a payload);
* a ``StreamedKV``: EDKV streams written straight into the engine's KV buffers as they arrive.

A ``StreamedKV`` is made by ``Engine.open_kv_stream(prompt_ids, keep)`` for that prompt and the
``keep`` leading positions the engine keeps from its previous use. It takes one or more
**segments**, each an EDKV stream of the positions after those already covered: the first starts
after the kept positions; a segment may end complete (``finish``) or be cut short (``cut``: the
receiver stopped reading, or the connection broke), keeping the tokens of its verified chunks;
``resume`` then opens the next segment after what is covered (the rest at another budget, from
the same prefill server). Whoever receives the streams feeds them (``feed``) and ends them on any
one thread at a time; the engine then adopts what every ended segment wrote, computes the
positions no segment covered itself, and runs the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.window import window_covers
from edgedecode.kv.wire import EDKVHeader, EDKVReader, ReadProgress
from edgedecode.runtime.kvcache import KVInjectionError

SegmentReader = Callable[[int, int], EDKVReader]
"""Opens the reader of a segment whose tokens start at a position and land from a cache slot on."""


@dataclass(frozen=True)
class Segment:
    """What an ended segment brought: its header (None when it was cut before its header arrived),
    how many of its tokens are kept (verified, kept or dropped) and the slots they fill."""

    header: EDKVHeader | None
    tokens: int  # leading tokens of the header that count (all of a complete segment)
    first_slot: int
    slots: int  # kept tokens among them (their KV fills slots [first_slot, first_slot + slots))
    complete: bool

    @property
    def token_ids(self) -> np.ndarray:
        """Ids of the kept tokens that count."""
        if self.header is None:
            return np.zeros(0, np.int64)
        return self.header.token_ids[: self.tokens][self.header.kept[: self.tokens]]

    @property
    def positions(self) -> np.ndarray:
        """Positions of the kept tokens that count."""
        if self.header is None:
            return np.zeros(0, np.int64)
        return self.header.positions[: self.tokens][self.header.kept[: self.tokens]]

    @property
    def importance(self) -> np.ndarray:
        """float32 importance of the kept tokens that count (EDKV 1.2 ``importance``; NaN where none came)."""
        if self.header is None or self.header.importance is None:
            return np.full(len(self.positions), np.nan, np.float32)
        return self.header.importance[: self.tokens][self.header.kept[: self.tokens]].astype(np.float32)


class StreamedKV:
    """EDKV segments of (part of) one prompt's KV, written into one engine's buffers as they arrive.

    ``open_reader(position, slot)`` makes a segment's reader (its tokens must start at ``position``
    or later and land from cache slot ``slot`` on); ``prompt_ids``: the prompt the KV is for;
    ``keep``: leading positions the engine keeps from its previous use; ``kept_slots``: the cache
    slots those occupy; ``head``: positions after them that the engine computes itself, while the
    segments arrive (a split prefill: the segments start after them); ``owner``: the engine writing
    it (only that one may adopt it).
    """

    def __init__(
        self,
        open_reader: SegmentReader,
        prompt_ids: np.ndarray,
        keep: int,
        kept_slots: int,
        owner: object = None,
        head: int = 0,
    ) -> None:
        self._open_reader = open_reader
        self.prompt_ids = prompt_ids
        self.keep = keep
        self.kept_slots = kept_slots
        self.head = head
        self.owner = owner
        self.segments: list[Segment] = []  # ended segments, in order
        self.covered = keep + head  # positions before this one are kept, computed here or in ended segments
        self.slots = kept_slots + head  # cache slots filled by those
        self.reader = open_reader(self.covered, self.slots)
        self._ended = False  # the current segment (self.reader) ended

    def check_opened(self, owner: object, prompt_ids: np.ndarray | None = None, keep: int = 0) -> None:
        """Raise KVInjectionError unless ``owner`` opened this stream (and, where given, for ``prompt_ids``,
        keeping ``keep`` positions: 0 stands for the stream's own)."""
        if self.owner is not owner:
            raise KVInjectionError("the KV stream was opened by another engine")
        if keep not in (0, self.keep):
            raise KVInjectionError(f"the KV stream was opened keeping {self.keep} positions, not {keep}")
        if prompt_ids is not None and not np.array_equal(prompt_ids, self.prompt_ids):
            raise KVInjectionError("the KV stream was opened for another prompt")

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the current segment: verified and written into the engine's buffers
        (no copy kept)."""
        self.reader.feed(data)

    def finish(self) -> EDKVHeader:
        """Confirm the current segment is complete (trailer verified, every chunk written); returns
        its header. Calling it again returns that header.

        Raises:
            KVFormatError: the segment is cut short (KVTruncatedError) or failed earlier.
        """
        if self._ended:
            last = self.segments[-1]
            if not last.complete or last.header is None:
                raise RuntimeError("the current segment was cut, not finished")
            return last.header
        header = self.reader.finish()
        self._end(header, header.n_tokens, complete=True)
        return header

    def cut(self) -> int:
        """End the current segment where it stands, keeping the tokens of its verified chunks (all
        of them if it was complete); returns the first position not covered. Idempotent."""
        if not self._ended:
            header = self.reader.header
            verified = self.reader.cut()
            self._end(header, verified, complete=header is not None and verified == header.n_tokens)
        return self.covered

    def resume(self) -> None:
        """Open the next segment: its tokens start at ``covered`` or later, in the slots after the
        ones filled. The current segment must have ended."""
        if not self._ended:
            raise RuntimeError("end the current segment (finish or cut) before opening the next")
        self.reader = self._open_reader(self.covered, self.slots)
        self._ended = False

    def _end(self, header: EDKVHeader | None, tokens: int, *, complete: bool) -> None:
        slots = int(header.slots_before[tokens]) if header is not None else 0
        self.segments.append(Segment(header, tokens, self.slots, slots, complete))
        if header is not None and tokens:
            self.covered = int(header.positions[tokens - 1]) + 1
        self.slots += slots
        self._ended = True

    @property
    def ended(self) -> bool:
        """Whether the current segment has ended (finished or cut)."""
        return self._ended

    @property
    def finished(self) -> bool:
        """Whether the current segment ended complete."""
        return self._ended and self.segments[-1].complete

    @property
    def header(self) -> EDKVHeader | None:
        """The current segment's validated header once it has arrived (before it is complete too)."""
        return self.reader.header

    @property
    def progress(self) -> ReadProgress:
        """The current segment's reader's progress."""
        return self.reader.progress

    @property
    def window_from(self) -> int:
        """The first cache slot from which the ended segments' windowed (sliding-window) layers hold KV: where the
        last segment with an EDKV window starts it (0: no segment left any windowed cell out)."""
        first = 0
        for segment in self.segments:
            windowed = 0 if segment.header is None else segment.header.windowed_slot(segment.tokens)
            if windowed:
                first = segment.first_slot + windowed
        return first

    @property
    def local_from(self) -> int:
        """The first position this box could compute the rest of the prompt from: ``covered``, unless a segment
        cut before its window leaves the windowed layers without the KV the next token attends to — then the
        segments cannot be continued here, and everything after the kept and head positions is computed."""
        contract = next((s.header.contract for s in self.segments if s.header is not None), None)
        if contract is None or window_covers(self.window_from, self.slots, contract):
            return self.covered
        return self.keep + self.head

    def adopted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, positions, importance) of the kept tokens of every ended segment, in slot order."""
        if not self.segments:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return (
            np.concatenate([segment.token_ids for segment in self.segments]),
            np.concatenate([segment.positions for segment in self.segments]),
            np.concatenate([segment.importance for segment in self.segments]),
        )


KVSource = KVSnapshot | StreamedKV | None
"""Where a prompt's KV comes from: None (computed locally), a snapshot, or EDKV streams."""
