"""The adaptive benchmark's KV sources: a turn's report named as what its KV came from (a budget, local prefill,
or a split / re-planned / cut composite), and each composite's KV built the way the server and the daemon made it."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.kv.policy import TierProfile
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.model.spec import KVContract, KVLayout
from edgedecode.prefill.pipeline import ScoredPrefill, through_wire
from tools.study.adaptive_quality import KVOrigin, kv_used

CONTRACT = KVContract("llama", 2, 2, 64, 10000.0, KVLayout(), "tok")
N_TOKENS = 200


@pytest.fixture(scope="module")
def scored() -> ScoredPrefill:
    rng = np.random.default_rng(7)
    keys, values = (rng.standard_normal((2, 2, N_TOKENS, 64)).astype(np.float32) for _ in range(2))
    snapshot = KVSnapshot(
        CONTRACT, np.arange(N_TOKENS), np.arange(N_TOKENS), keys, values, KVProducer("m", "ab", "f32")
    )
    return ScoredPrefill(snapshot, rng.random(N_TOKENS).astype(np.float32))


def _report(source: str = "prefill_server", head: int = 0, segments: tuple = (), **kv: object) -> dict:
    return {"kv": {"source": source, "head_tokens": head, "segments": list(segments), **kv}}


def _segment(budget: float, tokens: int, ended: str = "complete") -> dict:
    return {"budget": budget, "tokens": tokens, "wire_bytes": 1, "fetch_ms": 1.0, "ended": ended}


@pytest.mark.parametrize(
    ("source", "label"),
    [
        (KVOrigin(0, ()), "local"),
        (KVOrigin(0, ((0.3, None),)), "b0.3"),
        (KVOrigin(1024, ((0.25, None),)), "h1024 b0.25"),
        (KVOrigin(0, ((0.3, 1800), (0.15, 2296))), "b0.3x1800 b0.15x2296"),
        (KVOrigin(0, ((0.3, 1800),)), "b0.3x1800"),
    ],
)
def test_a_source_is_named_by_a_label_that_parses_back_to_it(source: KVOrigin, label: str) -> None:
    assert source.label == label
    assert KVOrigin.parse(label) == source


def test_a_turn_report_names_the_kv_it_used() -> None:
    assert kv_used(None) is None
    assert kv_used(_report("local")) == "local"
    assert kv_used(_report(segments=[_segment(0.30000000001, 4095)])) == "b0.3"  # budgets as the table rounds them
    assert kv_used(_report(head=1024, segments=[_segment(0.25, 3072)])) == "h1024 b0.25"
    cut_then_resumed = [_segment(0.3, 1800, "cut"), _segment(0.15, 2296)]
    assert kv_used(_report(segments=cut_then_resumed)) == "b0.3x1800 b0.15x2296"
    assert kv_used(_report(segments=[_segment(0.3, 1800, "cut")])) == "b0.3x1800"  # the rest computed here
    assert kv_used(_report(segments=[_segment(0.3, 900, "connection")])) == "b0.3x900"  # a failure cuts it too
    assert kv_used(_report(segments=[_segment(0.3, 10)], restored_tokens=100)) is None  # a conversation's KV
    assert kv_used(_report(segments=[])) is None


def test_a_whole_pull_scores_the_payload_at_its_budget(scored: ScoredPrefill) -> None:
    fp16 = through_wire(scored, 1.0, "ours", CONTRACT)[0]
    kv = KVOrigin(0, ((0.3, None),)).kv(scored, fp16, CONTRACT, TierProfile())
    pulled = through_wire(scored, 0.3, "ours", CONTRACT, profile=TierProfile())[0]
    assert kv is not None
    np.testing.assert_array_equal(kv.positions, pulled.positions)
    np.testing.assert_array_equal(kv.keys, pulled.keys)
    np.testing.assert_array_equal(kv.values, pulled.values)
    assert KVOrigin(0, ()).kv(scored, fp16, CONTRACT, TierProfile()) is None  # local: the scorer's own prefill


def test_a_composite_joins_the_head_each_segment_as_the_server_encoded_it_and_the_rest(scored: ScoredPrefill) -> None:
    fp16 = through_wire(scored, 1.0, "ours", CONTRACT)[0]
    kv = KVOrigin(50, ((0.2, 80), (0.5, 30))).kv(scored, fp16, CONTRACT, TierProfile())
    assert kv is not None
    assert np.all(np.diff(kv.positions) > 0) and kv.positions[-1] == N_TOKENS - 1
    first = through_wire(scored.from_position(50), 0.2, "ours", CONTRACT, profile=TierProfile())[0]
    second = through_wire(scored.from_position(130), 0.5, "ours", CONTRACT, profile=TierProfile())[0]
    assert len(first.positions) < N_TOKENS - 50  # b 0.2 drops tokens: the composite keeps the payload's choice
    parts = [
        (kv.positions < 50, fp16.slots(0, 50)),
        ((kv.positions >= 50) & (kv.positions < 130), first.slots(0, int(np.searchsorted(first.positions, 130)))),
        ((kv.positions >= 130) & (kv.positions < 160), second.slots(0, int(np.searchsorted(second.positions, 160)))),
        (kv.positions >= 160, fp16.slots(160)),
    ]
    for mask, expected in parts:
        np.testing.assert_array_equal(kv.positions[mask], expected.positions)
        np.testing.assert_array_equal(kv.keys[:, :, mask], expected.keys)
        np.testing.assert_array_equal(kv.values[:, :, mask], expected.values)
