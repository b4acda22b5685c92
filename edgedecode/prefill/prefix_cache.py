"""A bounded cache of prefill KV keyed by token-prefix hashes, so a conversation's next turn only
computes its new tokens.

Entries are whole prompts' KV (the prefill graph's own precision). Each entry is indexed by the
chained hash of every complete block of ``block_tokens`` tokens of its prompt, as vLLM's prefix
caching does: a lookup hashes the new prompt block by block and stops at the first block no entry
holds, so it finds the longest block-aligned prefix shared with any entry (a shared system prompt
included), in time linear in the prompt. Entries are evicted least recently used once their bytes
exceed the limit.

A hit saves time, never changes an answer: the prefill engine reuses cached KV so that every
position's KV, the importance and so the payload are bitwise what an empty cache gives
(``prefill.pipeline.prefill_observed``; tests/test_prefill_reproducible.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, block_chain
from edgedecode.kv.snapshot import KVSnapshot


@dataclass(frozen=True)
class PrefixHit:
    """The cached KV of the longest cached prefix of a prompt."""

    kv: KVSnapshot  # views into the cached entry: tokens [0, n_tokens) of the prompt
    n_tokens: int


class PrefixCache:
    """Prompt KV by chained block hashes of its tokens, at most ``max_bytes`` in all (LRU)."""

    def __init__(self, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if max_bytes < 0 or block_tokens < 1:
            raise ValueError("max_bytes must be >= 0 and block_tokens >= 1")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._entries: OrderedDict[bytes, KVSnapshot] = OrderedDict()  # by the hash of the entry's whole prompt
        self._chains: dict[bytes, frozenset[bytes]] = {}  # an entry's block-chain hashes
        self._blocks: dict[bytes, bytes] = {}  # block-chain hash -> the entry (key) that holds that prefix
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, token_ids: np.ndarray) -> list[bytes]:
        return block_chain(token_ids, self.block_tokens)

    def block_hashes(self) -> list[bytes]:
        """The block-chain hash of every prefix some entry holds (what a router in front of several
        prefill servers learns each one's cache from)."""
        return list(self._blocks)

    def held_blocks(self, chain: list[bytes]) -> int:
        """How many leading blocks of a prompt whose block chain is ``chain`` some entry holds (what ``lookup``
        would find of it, counted in blocks; membership tests only, safe beside the thread that stores)."""
        count = 0
        for block_hash in chain:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def lookup(self, token_ids: np.ndarray) -> PrefixHit | None:
        """The cached KV of the longest block-aligned prefix of ``token_ids`` held by any entry."""
        found, blocks = None, 0
        for i, block_hash in enumerate(self._chain(token_ids)):
            key = self._blocks.get(block_hash)
            if key is None:
                break
            found, blocks = key, i + 1
        if found is None:
            return None
        self._entries.move_to_end(found)
        n = blocks * self.block_tokens
        return PrefixHit(self._entries[found].slots(0, n), n)

    def store(self, kv: KVSnapshot) -> bool:
        """Keep (a copy of) the KV of a whole prompt, evicting the least recently used entries to fit;
        False when it is larger than the cache or holds no complete block (nothing is stored)."""
        if not np.array_equal(kv.positions, np.arange(kv.n_tokens)):
            raise ValueError("the prefix cache holds the KV of whole prompts (positions 0..n-1)")
        chain = self._chain(kv.token_ids)
        if not chain or kv.nbytes > self.max_bytes:
            return False
        key = chain[-1] + kv.n_tokens.to_bytes(8, "little")
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        while self._entries and self.nbytes + kv.nbytes > self.max_bytes:
            self._evict(next(iter(self._entries)))
        copied = kv.slots(0)
        copied = KVSnapshot(
            copied.contract,
            copied.token_ids.copy(),
            copied.positions.copy(),
            copied.keys.copy(),
            copied.values.copy(),
            copied.producer,
        )
        self._entries[key] = copied
        self._chains[key] = frozenset(chain)
        self.nbytes += copied.nbytes
        for block_hash in chain:  # newer entries take over shared prefixes: they are evicted later
            self._blocks[block_hash] = key
        return True

    def _evict(self, key: bytes) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
        for block_hash in self._chains.pop(key):
            if self._blocks.get(block_hash) == key:
                other = self._holder_of(block_hash)
                if other is None:
                    del self._blocks[block_hash]
                else:
                    self._blocks[block_hash] = other

    def _holder_of(self, block_hash: bytes) -> bytes | None:
        """Another entry whose prompt covers the prefix ``block_hash`` stands for (newest first)."""
        for key in reversed(self._entries):
            if block_hash in self._chains[key]:
                return key
        return None
