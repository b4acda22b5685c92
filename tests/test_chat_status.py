"""`edgedecode chat`'s status line says which plan each turn took and why (issue 29)."""

from __future__ import annotations

from edgedecode.client.chat import TurnResult, status_line


def _line(kv: dict) -> str:
    return status_line(TurnResult("ok", {"ttft_ms": 812.0, "decode_tokens_per_second": 40.0, "kv": kv}, 3, 1.0))


def test_a_turn_computed_here_by_plan_says_so_and_why():
    why = "local prefill: the fastest of the best quality (Δ PPL +0.01 %) that is within 1.1x of the fastest"
    line = _line({"source": "local", "decision": "local", "fallback_reason": None, "why": why})
    assert "KV computed locally (by plan)" in line and f"plan local: {why}" in line


def test_a_pulled_turn_names_its_plan_and_a_fallback_still_names_its_reason():
    pulled = _line(
        {"source": "prefill_server", "decision": "remote", "why": "b 0.5: ...", "wire_bytes": 2048, "tiers": {}}
    )
    assert "KV pulled 2.0 KiB" in pulled and "plan remote: b 0.5: ..." in pulled
    fell_back = _line({"source": "local", "decision": "remote", "fallback_reason": "unreachable", "why": "b 0.3"})
    assert "KV computed locally (unreachable)" in fell_back and "plan remote: b 0.3" in fell_back
    assert "plan" not in _line({"source": "local", "decision": None, "fallback_reason": None})
