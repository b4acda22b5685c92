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
BLOCK_HASH_BYTES = 16
HELD_PATH = "/v1/prefill/held"  # the prefill server's held query: what its cache holds of a chain (chain_to_hex)


def block_chain(token_ids: np.ndarray, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[bytes]:
    """Hash of each complete block's prefix: h[i] covers tokens [0, (i + 1) * block_tokens)."""
    tokens = np.ascontiguousarray(token_ids, "<i8")
    hashes, previous = [], b""
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        block = tokens[end - block_tokens : end].tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=BLOCK_HASH_BYTES).digest()
        hashes.append(previous)
    return hashes


def chain_to_hex(hashes: list[bytes]) -> list[str]:
    """A block chain as JSON can carry it (the held query, ``POST /v1/prefill/held``): lowercase hex."""
    return [block_hash.hex() for block_hash in hashes]


def chain_from_hex(values: object, max_blocks: int) -> list[bytes]:
    """The block chain ``chain_to_hex`` wrote; ValueError (saying what is wrong) for anything else or longer than
    ``max_blocks``."""
    if not isinstance(values, list):
        raise ValueError("blocks must be a list of block-chain hashes (hex strings)")
    if len(values) > max_blocks:
        raise ValueError(f"blocks has {len(values)} hashes; a prompt this server takes has at most {max_blocks}")
    hashes = []
    for value in values:
        if not isinstance(value, str) or len(value) != 2 * BLOCK_HASH_BYTES:
            raise ValueError(f"each block hash is {2 * BLOCK_HASH_BYTES} hex digits")
        try:
            hashes.append(bytes.fromhex(value))
        except ValueError:
            raise ValueError(f"each block hash is {2 * BLOCK_HASH_BYTES} hex digits") from None
    return hashes
