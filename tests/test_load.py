"""tools/adversarial/load_test.py's fast subset (issue 15): eight streamed two-turn chats at once against one real
daemon on two slots, every turn's KV pulled from a real prefill server on 127.0.0.1: conversations leave their
slots between turns (compressed), under a KV memory budget large enough that none loses tokens. Every turn
completes, every answer is the one the conversation gets alone (exactly, or up to a near-tie: no KV crosses between
conversations), and the KV memory stays within the budget."""

from __future__ import annotations

import argparse

import pytest
from tool_modules import import_tools


@pytest.fixture(scope="module")
def load_test():
    return import_tools("adversarial.load_test")[0]


def test_eight_concurrent_conversations_each_get_their_own_answers(load_test, smollm2_model):
    settings = argparse.Namespace(
        clients=[8],
        turns=2,
        max_tokens=12,
        slots=2,
        kv_memory_mb=24,
        sequential=0,
        threads=2,
        near_tie=1.0,
        prefill="remote",
        budget=0.5,
        json=None,
    )
    results = load_test.run(settings)
    (load,) = results["loads"]
    assert load["turns"] == 16 and load["failed"] == [], load["failed"]
    answers = load["answers"]
    assert answers["different"] == 0 and answers["lossy"] == 0, load
    assert answers["exact"] + answers["near_tie"] == 16, load
    assert load["kv_sources"]["loaded"].get("prefill_server", 0) > 0, load  # pulled, not computed
    assert load["resumes"].get("compressed", 0) + load["resumes"].get("evicted", 0) > 0  # they left their slots
    assert 0 < results["kv_memory_peak_bytes"] <= 24 << 20
