"""The block-chain hashes that name a prompt's prefixes, shared by the prefill server's prefix cache
(``prefill.prefix_cache``) and the daemon's memory of what that cache holds (``daemon.pull.server_prefixes``).

A prompt's i-th hash covers its tokens [0, (i + 1) * block_tokens): the hash of the previous one and
the block's tokens, as vLLM's prefix caching keys blocks, so two prompts share a hash exactly when
they share that whole prefix.
"""

from __future__ import annotations

import hashlib

import numpy as np

DEFAULT_BLOCK_TOKENS = 64


def block_chain(token_ids: np.ndarray, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[bytes]:
    """Hash of each complete block's prefix: h[i] covers tokens [0, (i + 1) * block_tokens)."""
    tokens = np.ascontiguousarray(token_ids, "<i8")
    hashes, previous = [], b""
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        block = tokens[end - block_tokens : end].tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes
