"""KV arriving for one prompt: where an engine's prompt processing may take its KV from.

A prompt's KV comes from one of three sources, the ``kv`` argument of ``Engine.prefill`` and
``Engine.generate`` (``KVSource``):

* ``None``: computed locally, by running the prompt through the engine's graph;
* a ``KVSnapshot``: KV held in process (exported by another engine, or decoded from a payload);
* a ``StreamedKV``: an EDKV stream written straight into the engine's KV buffers as it arrives.

A ``StreamedKV`` is made by ``Engine.open_kv_stream(prompt_ids, keep)`` for that prompt and the
``keep`` leading positions the engine keeps from its previous use. Whoever receives the stream
feeds it (``feed``) and may confirm its end (``finish``) on any one thread at a time; the engine
then adopts what was written when it processes the prompt with it. ``finish`` verifies the stream
once and keeps its header: calling it again returns that header.
"""

from __future__ import annotations

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire import EDKVHeader, EDKVReader, ReadProgress


class StreamedKV:
    """An EDKV stream of (part of) one prompt's KV, written into one engine's buffers as it arrives.

    ``prompt_ids``: the prompt the KV is for; ``keep``: leading positions the engine keeps from its
    previous use (the stream holds KV of positions after them); ``kept_slots``: the cache slots
    those positions occupy (the stream's tokens land after them); ``owner``: the engine writing it
    (only that one may adopt it).
    """

    def __init__(
        self, reader: EDKVReader, prompt_ids: np.ndarray, keep: int, kept_slots: int, owner: object = None
    ) -> None:
        self.reader = reader
        self.prompt_ids = prompt_ids
        self.keep = keep
        self.kept_slots = kept_slots
        self.owner = owner
        self._finished: EDKVHeader | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the stream: verified and written into the engine's buffers (no copy kept)."""
        self.reader.feed(data)

    def finish(self) -> EDKVHeader:
        """Confirm the stream is complete (trailer verified, every chunk written); returns its header.

        The reader is asked once; later calls return the header it gave.

        Raises:
            KVFormatError: the stream is cut short (KVTruncatedError) or failed earlier.
        """
        if self._finished is None:
            self._finished = self.reader.finish()
        return self._finished

    @property
    def finished(self) -> bool:
        return self._finished is not None

    @property
    def header(self) -> EDKVHeader | None:
        """The stream's validated header once it has arrived (before the stream is complete too)."""
        return self.reader.header

    @property
    def progress(self) -> ReadProgress:
        return self.reader.progress


KVSource = KVSnapshot | StreamedKV | None
"""Where a prompt's KV comes from: None (computed locally), a snapshot, or a stream."""
