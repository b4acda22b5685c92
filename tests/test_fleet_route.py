"""What the prefill tier's router is told about a request (edgedecode.prefill.fleet.route): no Ray
needed, these run everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_transfers import scored

from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, block_chain, chain_to_hex
from edgedecode.kv.wire import TransferRef
from edgedecode.prefill.fleet.route import Route, route_for
from edgedecode.prefill.prefix_cache import PrefixCache
from edgedecode.prefill.transfers import TransferStore


def _prefill(body: dict) -> Route:
    return route_for("POST", "/v1/prefill", {}, json.dumps(body).encode())


def test_a_token_prompt_routes_by_the_prefix_caches_own_block_hashes():
    first = list(range(1000, 1000 + 3 * DEFAULT_BLOCK_TOKENS + 10))
    second = first + list(range(5000, 5000 + DEFAULT_BLOCK_TOKENS))  # the next turn of the conversation
    route1, route2 = _prefill({"token_ids": first}), _prefill({"token_ids": second, "held_tokens": 100})
    assert list(route1.blocks) == block_chain(np.asarray(first, np.int64))
    assert len(route1.blocks) == 3 and route2.blocks[:3] == route1.blocks and len(route2.blocks) == 4
    assert not route1.replica


def test_chat_prompts_sharing_a_system_message_share_the_head_of_their_route():
    system = {"role": "system", "content": "You are terse."}
    one = _prefill({"messages": [system, {"role": "user", "content": "Hi"}]})
    two = _prefill({"messages": [system, {"role": "user", "content": "Bye"}]})
    assert one.blocks[0] == two.blocks[0] and one.blocks[1] != two.blocks[1]


def test_what_no_replica_can_read_routes_anywhere():
    assert _prefill({"token_ids": [1, 2, "x"]}) == Route()
    assert route_for("POST", "/v1/prefill", {}, b"{not json") == Route()
    assert route_for("GET", "/v1/models", {}, b"") == Route()


def test_a_held_query_routes_as_its_prompt_would_and_is_not_counted_as_sent():
    prompt = list(range(1000, 1000 + 3 * DEFAULT_BLOCK_TOKENS + 10))
    blocks = chain_to_hex(block_chain(np.asarray(prompt, np.int64)))
    held = route_for("POST", "/v1/prefill/held", {}, json.dumps({"blocks": blocks}).encode())
    prefill = _prefill({"token_ids": prompt})
    assert held.blocks == prefill.blocks and held.query_only and not prefill.query_only
    assert route_for("POST", "/v1/prefill/held", {}, json.dumps({"blocks": ["not hex"]}).encode()) == Route()


def test_a_resume_routes_to_the_replica_whose_name_starts_its_transfer_id():
    store = TransferStore(1 << 20, ttl_s=30.0, id_prefix="r8x2k0pq")
    ref, placeholder = store.put(scored(4)), store.placeholder()
    assert isinstance(ref, TransferRef) and isinstance(placeholder, TransferRef)
    transfer_id = ref.id
    assert transfer_id.startswith("r8x2k0pq_") and store.get(transfer_id)[1] == ref
    assert len(placeholder.id) == len(transfer_id)  # payloads are sized for the ids they will carry
    assert route_for("POST", f"/v1/prefill/transfers/{transfer_id}", {}, b"{}") == Route(replica="r8x2k0pq")
    assert route_for("POST", "/v1/prefill/transfers/unprefixed", {}, b"{}") == Route()
    assert route_for("GET", "/metrics", {"replica": "r8x2k0pq"}, b"") == Route(replica="r8x2k0pq")


def test_a_transfer_id_prefix_is_letters_and_digits_within_edkvs_limit():
    for bad in ("a_b", "é", "x" * 48):
        with pytest.raises(ValueError):
            TransferStore(1 << 20, ttl_s=30.0, id_prefix=bad)
    TransferStore(1 << 20, ttl_s=30.0, id_prefix="x" * 47).put(scored(2))  # 47 + "_" + 16 = 64 characters


def test_a_prefix_cache_reports_the_block_hashes_a_route_is_matched_against():
    cache = PrefixCache(1 << 20)
    kv = scored(2 * DEFAULT_BLOCK_TOKENS + 5).snapshot
    assert cache.store(kv)
    assert set(cache.block_hashes()) == set(_prefill({"token_ids": kv.token_ids.tolist()}).blocks)
