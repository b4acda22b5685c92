"""Where a request to the prefill tier should go, read from the request alone.

A prompt's route is the chain of hashes of its leading blocks, the same hashes the prefix cache
indexes its entries by (``kv.prefix.block_chain``: 64-token blocks of token ids), so the router
can match it against what each replica holds. Prompts given as ``messages`` or ``text`` (the tier
does not tokenize) chain their messages, or 4 KiB blocks of their text, instead: requests sharing
a system prompt or a conversation's earlier turns still share the head of their chain.

A held query (``/v1/prefill/held``, a prompt's chain as hex) routes as its prompt would, so that the replica
asked is the one the prefill would reach; the router does not count it as sent there.

A resume (``/v1/prefill/transfers/{id}``) must reach the replica that keeps the transfer: each
replica starts its transfer ids with its own name (``transfers.TransferStore.id_prefix``). So does
``/metrics?replica=NAME``, a replica's own metrics.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.prefix import HELD_PATH, block_chain, chain_from_hex
from edgedecode.prefill.transfers import ID_PREFIX_END
from edgedecode.serving.json_body import parse_json_object

TEXT_BLOCK_CHARS = 4096
TRANSFERS_PATH = "/v1/prefill/transfers/"
HELD_MAX_BLOCKS = 1 << 14  # a held query routes by at most this many blocks (~1M tokens); the replica checks its own


@dataclass(frozen=True)
class Route:
    """What the router needs to know of one request."""

    blocks: tuple[bytes, ...] = ()  # the prompt's prefix chain, block by block (empty: any replica)
    replica: str = ""  # the replica the request must reach, if any (a transfer it keeps, its metrics)
    query_only: bool = False  # a held query: routed as its prompt would be, the replica not told to hold it


def route_for(method: str, path: str, query: Mapping[str, str], body: bytes) -> Route:
    """The route of an HTTP request to the tier; a body that is not a valid prefill request routes
    anywhere (the replica answers it with the usual error)."""
    if path.startswith(TRANSFERS_PATH):
        transfer_id = path[len(TRANSFERS_PATH) :]
        replica, found, _ = transfer_id.partition(ID_PREFIX_END)
        return Route(replica=replica if found else "")
    if path == "/metrics":
        return Route(replica=query.get("replica", ""))
    if method != "POST" or path not in ("/v1/prefill", HELD_PATH):
        return Route()
    try:
        request = parse_json_object(body)
    except EdgeDecodeError:
        return Route()
    if path == HELD_PATH:  # to the replica its prompt would reach, which answers what it holds
        try:
            return Route(blocks=tuple(chain_from_hex(request.get("blocks"), HELD_MAX_BLOCKS)), query_only=True)
        except ValueError:
            return Route()
    return Route(blocks=tuple(prompt_chain(request)))


def prompt_chain(request: dict) -> list[bytes]:
    """The prefix chain of a prefill request's prompt (empty when it names none this can read)."""
    token_ids = request.get("token_ids")
    if isinstance(token_ids, list):
        if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in token_ids):
            return block_chain(np.asarray(token_ids, np.int64))
        return []
    messages = request.get("messages")
    if isinstance(messages, list):
        return _chain(json.dumps(message, sort_keys=True).encode() for message in messages)
    text = request.get("text")
    if isinstance(text, str):
        data = text.encode()
        return _chain(
            data[end - TEXT_BLOCK_CHARS : end] for end in range(TEXT_BLOCK_CHARS, len(data) + 1, TEXT_BLOCK_CHARS)
        )
    return []


def _chain(pieces) -> list[bytes]:
    hashes, previous = [], b"text"
    for piece in pieces:
        previous = hashlib.blake2b(previous + piece, digest_size=16).digest()
        hashes.append(previous)
    return hashes
