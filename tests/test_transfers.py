"""The prefill server's transfer store: kept prefills by random id, for a while, within a byte limit."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.model.spec import KVContract, KVLayout
from edgedecode.prefill.pipeline import ScoredPrefill
from edgedecode.prefill.transfers import TransferNotFoundError, TransferStore

CONTRACT = KVContract("llama", 2, 1, 4, 10000.0, KVLayout(), "tok")


def scored(n: int) -> ScoredPrefill:
    kv = np.zeros((2, 1, n, 4), np.float32)
    snapshot = KVSnapshot(CONTRACT, np.arange(n), np.arange(n), kv, kv.copy(), KVProducer("m", "ab", "f32"))
    return ScoredPrefill(snapshot, np.ones(n, np.float32))


def nbytes(n: int) -> int:
    return 2 * (2 * n * 4 * 4) + 4 * n  # keys, values and importance


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_kept_prefill_is_found_by_its_id_until_it_expires_and_each_use_extends_it() -> None:
    clock = Clock()
    store = TransferStore(1 << 20, ttl_s=10.0, clock=clock)
    kept = scored(8)
    ref = store.put(kept)
    assert ref is not None and ref.ttl_s == 10.0 and len(ref.id) == 16
    clock.now = 9.0
    found, again = store.get(ref.id)
    assert found is kept and again == ref
    clock.now = 18.0  # 9 s after the last use
    assert store.get(ref.id)[0] is kept
    clock.now = 28.0
    with pytest.raises(TransferNotFoundError) as missing:
        store.get(ref.id)
    assert missing.value.http_status == 404 and missing.value.param == "transfer_id"
    assert len(store) == 0 and store.nbytes == 0


def test_the_store_evicts_the_least_recently_used_to_stay_within_its_bytes() -> None:
    store = TransferStore(2 * nbytes(8), ttl_s=60.0)
    a, b = store.put(scored(8)), store.put(scored(8))
    assert a is not None and b is not None
    store.get(a.id)  # b is now the least recently used
    c = store.put(scored(8))
    assert c is not None and store.nbytes == 2 * nbytes(8)
    store.get(a.id)
    store.get(c.id)
    with pytest.raises(TransferNotFoundError):
        store.get(b.id)
    assert store.put(scored(100)) is None  # alone larger than the store: not kept, nothing evicted
    assert len(store) == 2


def test_ids_are_distinct_and_url_safe() -> None:
    store = TransferStore(1 << 20, ttl_s=60.0)
    ids = {ref.id for ref in (store.put(scored(1)) for _ in range(50)) if ref is not None}
    assert len(ids) == 50 and all(ref.replace("-", "").replace("_", "").isalnum() for ref in ids)
