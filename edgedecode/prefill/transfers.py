"""Prefills kept for a short while after their payload is sent, so a receiver can ask for the rest.

A receiver that cut a pull short (its link slowed down, or the connection broke) keeps the tokens
it verified and may ask for the KV of the positions after them, at a budget of its choice, under
the ``transfer`` reference the payload's header carried (EDKV 1.1, docs/kv-format.md §2): the
prompt is not processed again. A transfer lives ``ttl_s`` seconds after it was last sent from;
the store holds at most ``max_bytes`` of KV and importance, evicting the least recently used.
Ids are random (96 bits, URL-safe): knowing one is what lets a client resume it, after the
server's bearer token.

Not thread-safe: the prefill service uses it on its one worker thread.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from edgedecode.errors import RequestError
from edgedecode.kv.wire import TransferRef
from edgedecode.prefill.pipeline import ScoredPrefill

ID_BYTES = 12  # random bytes of an id
ID_CHARS = 16  # its URL-safe base64 characters
ID_PREFIX_END = "_"  # ends a store's id prefix
MAX_ID_CHARS = 64  # EDKV's limit on a transfer id


class TransferNotFoundError(RequestError):
    """No transfer under that id: it expired, was evicted, or never existed (answered with 404)."""

    http_status = 404
    http_code = "transfer_not_found"


@dataclass
class _Entry:
    scored: ScoredPrefill
    nbytes: int
    expires: float


class TransferStore:
    """Scored prefills by transfer id, for ``ttl_s`` seconds after their last use, ``max_bytes`` in all."""

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic, id_prefix: str = ""
    ) -> None:
        """``id_prefix`` starts every id (letters and digits): a prefill tier of several servers
        routes a resume to the one that keeps the transfer by it (``prefill.fleet``)."""
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError("need max_bytes >= 0 and ttl_s > 0")
        if id_prefix and not (id_prefix.isascii() and id_prefix.isalnum() and len(id_prefix) < MAX_ID_CHARS - ID_CHARS):
            raise ValueError(f"a transfer id prefix is 1 to {MAX_ID_CHARS - ID_CHARS - 1} letters and digits")
        self.id_prefix = f"{id_prefix}{ID_PREFIX_END}" if id_prefix else ""
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, scored: ScoredPrefill) -> TransferRef | None:
        """Keep ``scored`` under a new id; None when it alone exceeds ``max_bytes`` (not kept)."""
        snapshot = scored.snapshot
        nbytes = snapshot.keys.nbytes + snapshot.values.nbytes + scored.importance.nbytes
        self._expire()
        if nbytes > self.max_bytes:
            return None
        while self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        transfer_id = self.id_prefix + secrets.token_urlsafe(ID_BYTES)
        self._entries[transfer_id] = _Entry(scored, nbytes, self.clock() + self.ttl_s)
        self.nbytes += nbytes
        return TransferRef(transfer_id, self.ttl_s)

    def placeholder(self) -> TransferRef | None:
        """A reference the size of those ``put`` makes (None when the store keeps nothing): what a
        payload's header will carry, for sizing it before the prefill."""
        return TransferRef("x" * (len(self.id_prefix) + ID_CHARS), self.ttl_s) if self.max_bytes else None

    def get(self, transfer_id: str) -> tuple[ScoredPrefill, TransferRef]:
        """The prefill kept under ``transfer_id``, whose life starts again now, and its reference.

        Raises:
            TransferNotFoundError: expired, evicted or unknown.
        """
        self._expire()
        entry = self._entries.get(transfer_id)
        if entry is None:
            raise TransferNotFoundError(
                f"no transfer {transfer_id[:64]!r} here: it expired (transfers live {self.ttl_s:g} s after "
                "their last payload), was evicted for room, or never existed; ask for the prompt again",
                "transfer_id",
            )
        entry.expires = self.clock() + self.ttl_s
        self._entries.move_to_end(transfer_id)
        return entry.scored, TransferRef(transfer_id, self.ttl_s)

    def _expire(self) -> None:
        now = self.clock()
        for transfer_id in [key for key, entry in self._entries.items() if entry.expires <= now]:
            self._drop(transfer_id)

    def _drop(self, transfer_id: str) -> None:
        self.nbytes -= self._entries.pop(transfer_id).nbytes
