"""What the daemon knows of each prefill server's prefix cache, learned from its answers.

The prefill server keeps every prompt it prefilled in its prefix cache (``prefill.prefix_cache``,
keyed by the block-chain hashes of ``kv.prefix``) and says, in each answer's
``X-Prefix-Reused-Tokens``, how many of the prompt's tokens it found there. The daemon remembers the
block hashes of the prompts it pulled from each endpoint, so that before the next pull it can tell how
much of a prompt the server will not compute again (a shared system prompt, a RAG document): the
planner then prices only the rest of the server's prefill. The memory is a guess about another
cache and is corrected by every answer: blocks the server said it no longer had are forgotten, and a
server that missed is not believed again until it reports a hit.
It is bounded (least recently used hashes go first) and costs one hash per 64 tokens of a prompt.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, block_chain

MAX_BLOCKS = 1 << 16  # hashes remembered per endpoint (~4M tokens of prompts at 64 tokens a block)


class ServerPrefixes:
    """The block hashes each endpoint's prefix cache is believed to hold (see the module docstring)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.max_blocks = max_blocks
        self.block_tokens = block_tokens
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self._doubted: set[str] = set()  # endpoints that missed what was believed held, and found nothing since

    def held_tokens(self, endpoint: str, token_ids: np.ndarray) -> int:
        """How many leading tokens of ``token_ids`` the server at ``endpoint`` is believed to hold."""
        held = self._held.get(endpoint.rstrip("/"))
        if not held:
            return 0
        blocks = 0
        for block_hash in block_chain(token_ids, self.block_tokens):
            if block_hash not in held:
                break
            blocks += 1
        return blocks * self.block_tokens

    def learn(self, endpoint: str, token_ids: np.ndarray, believed_tokens: int, reused_tokens: int | None) -> None:
        """The server at ``endpoint`` prefilled ``token_ids``, where ``believed_tokens`` were believed
        held and it found ``reused_tokens`` in its cache (None: it did not say; nothing is learned).
        Found fewer than believed: the blocks past those it found are forgotten, and no prompt is
        remembered for that endpoint again until it reports a hit (a server whose cache is off or too
        small is not believed to hold anything). Otherwise the whole prompt is remembered."""
        if reused_tokens is None:
            return
        endpoint = endpoint.rstrip("/")
        held = self._held.setdefault(endpoint, OrderedDict())
        chain = block_chain(token_ids, self.block_tokens)
        if reused_tokens < believed_tokens:
            for block_hash in chain[reused_tokens // self.block_tokens :]:
                held.pop(block_hash, None)
            self._doubted.add(endpoint)
            return
        if reused_tokens > 0:
            self._doubted.discard(endpoint)
        if endpoint in self._doubted:
            return
        for block_hash in chain:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
