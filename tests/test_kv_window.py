"""EDKV 2.0 windows: the windowed layers carry only the tail a receiver attends to; everything else reads as 1.2."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_kv_format import encode, read, rewrite_header, snapshot

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import tail_mask, tail_tokens, window_start, windowed_cost_scale
from edgedecode.kv.wire import KVMalformedError, decode_snapshot
from edgedecode.kv.wire.frames import HEADER_PREFIX

WINDOW = 4  # keys a windowed layer's query sees, itself included
N = 12


def windowed(n: int = N, seed: int = 0) -> KVSnapshot:
    """A 3-layer snapshot whose layers 0 and 2 are windowed (layer 1 is global)."""
    snap = snapshot(n, seed=seed)
    contract = dataclasses.replace(snap.contract, sliding_window=WINDOW, sliding_layers=(0, 2), rope_local_theta=1e4)
    return dataclasses.replace(snap, contract=contract)


def tiers_with_drops() -> np.ndarray:
    tiers = np.array([Tier.FP16, Tier.INT8, Tier.DROP, Tier.INT4, Tier.DROP, Tier.INT8] + [Tier.FP16] * 6, np.uint8)
    assert len(tiers) == N
    return tiers


def test_windowed_layers_carry_only_the_tail_and_the_rest_reads_as_without_a_window() -> None:
    snap, tiers = windowed(), tiers_with_drops()
    start = 8
    full, cut = encode(snap, tiers), encode(snap, tiers, window_start=start)
    assert HEADER_PREFIX.unpack_from(cut)[1:3] == (2, 0) and HEADER_PREFIX.unpack_from(full)[1:3] == (1, 2)
    assert len(cut) < len(full)
    reader, got = read(cut, snap.contract, N)
    header = reader.finish()
    _, expected = read(full, snap.contract, N)
    assert header.window is not None and header.window.layers == (0, 2) and header.window.start == start
    first = int(header.slots_before[start])  # slot of the window's first token
    np.testing.assert_array_equal(got[1], expected[1])  # the global layer: every kept token
    for layer in (0, 2):
        np.testing.assert_array_equal(
            got[layer, :, :, first : header.n_kept], expected[layer, :, :, first : header.n_kept]
        )
        assert np.isnan(got[layer, :, :, :first]).all()  # never written: a receiver never attends to them
    zeros = decode_snapshot(cut, snap.contract)
    assert not zeros.keys[0, :, :first].any() and np.array_equal(
        zeros.keys[1], decode_snapshot(full, snap.contract).keys[1]
    )


def test_a_window_that_leaves_the_next_query_short_of_its_keys_is_refused() -> None:
    snap, tiers = windowed(), tiers_with_drops()
    with pytest.raises(KVMalformedError) as err:  # tokens 10 and 11: 2 kept, the next query needs WINDOW - 1 = 3
        encode(snap, tiers, window_start=10)
    assert err.value.field == "window.start"
    payload = encode(snap, tiers, window_start=8)
    for change, field in (
        (lambda doc: doc["window"].update(start=10), "window.start"),
        (lambda doc: doc["window"].update(start=N + 1), "window.start"),
        (lambda doc: doc["window"].update(layers=[0, 1]), "window.layers"),  # layer 1 is global
        (lambda doc: doc["window"].update(layers=[2, 0]), "window.layers"),
        (lambda doc: doc["window"].update(layers=[0] * 4), "window.layers"),
        (lambda doc: doc["window"].update(layers="0,2"), "window.layers"),
    ):
        with pytest.raises(KVMalformedError) as err:
            read(rewrite_header(payload, change, major=2), snap.contract, N)
        assert err.value.field == field


def test_a_1_x_stream_ignores_a_window_field_so_its_chunks_must_hold_every_cell() -> None:
    snap, tiers = windowed(), tiers_with_drops()
    as_1_2 = rewrite_header(encode(snap, tiers, window_start=8), lambda doc: None, major=1, minor=2)
    with pytest.raises(KVMalformedError) as err:
        read(as_1_2, snap.contract, N)
    assert err.value.field == "chunks" and "raw bytes" in str(err.value)


def test_a_cut_windowed_stream_keeps_its_verified_prefix() -> None:
    snap = windowed(n=64)
    tiers = np.full(64, Tier.INT8, np.uint8)
    payload = encode(snap, tiers, window_start=40, chunk_tokens=16)
    reader, target = read(payload[: len(payload) // 2], snap.contract, 64)
    verified = reader.cut()
    _, whole = read(payload, snap.contract, 64)
    assert 0 < verified < 64 and reader.header is not None
    np.testing.assert_array_equal(target[1, :, :, :verified], whole[1, :, :, :verified])


def test_the_tail_rule_follows_the_contract() -> None:
    contract = windowed().contract
    assert tail_tokens(contract) > WINDOW and tail_tokens(snapshot(4).contract) == 0
    tail = tail_tokens(contract)
    mask = tail_mask(tail + 5, contract)
    assert not mask[:5].any() and mask[5:].all() and tail_mask(3, contract).all()
    scale = windowed_cost_scale(tail + 5, contract)
    np.testing.assert_allclose(scale[:5], 1 / 3) and np.testing.assert_array_equal(scale[5:], 1.0)
    kept = np.array([1, 0, 1, 1, 0, 1, 1], bool)
    assert window_start(kept, 3) == 3 and window_start(kept, 5) == 0 and window_start(kept, 9) == 0
