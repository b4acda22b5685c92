"""Conversations that outlive their slot, through the real daemon (issue 14): three conversations
take turns on one slot; each one's KV is kept compressed while another holds the slot and comes
back for its next turn, whose answer equals that of a daemon that kept every conversation resident.
A turn larger than the KV memory budget is a 503 naming the budget, and the daemon keeps serving."""

from __future__ import annotations

import pytest
from openai import APIStatusError, OpenAI
from serving_helpers import ServerProcess, metric_samples, server_config

TOKEN = "daemon-secret"
BUDGET_MB = 64  # 1456 tokens of float32 KV for SmolLM2 (46,080 bytes a token)
TOPICS = ("the sea", "a mountain", "the city at night")


def _daemon(workdir, name: str, **daemon) -> ServerProcess:
    config = server_config(workdir, name, prefill_token="", budget=0.3, local_prefill_only=True, **daemon)
    return ServerProcess(
        ["serve", "--config", config], workdir / f"{name}.log", env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN}
    )


@pytest.fixture(scope="module")
def daemons(smollm2_model, tmp_path_factory):
    """(one slot under a 64 MiB KV budget, three slots: every conversation stays resident)."""
    workdir = tmp_path_factory.mktemp("conversations")
    tight = _daemon(workdir, "tight", slots=1, kv_memory_mb=BUDGET_MB)
    try:
        roomy = _daemon(workdir, "roomy", slots=3)
        try:
            yield tight, roomy
        finally:
            roomy.stop()
    finally:
        tight.stop()


def _chat(daemon, session: str, messages: list[dict]) -> tuple[str, dict]:
    client = OpenAI(base_url=daemon.url + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        temperature=0,
        max_tokens=12,
        extra_body={"session_id": session},
    )
    return completion.choices[0].message.content, completion.model_extra["edgedecode"]


def _conversations(daemon) -> tuple[dict[str, str], dict[str, dict]]:
    """Two turns of each conversation, interleaved (a1 b1 c1 a2 b2 c2): the second answers and reports."""
    history = {topic: [{"role": "user", "content": f"Write one sentence about {topic}."}] for topic in TOPICS}
    for topic, messages in history.items():
        answer, _ = _chat(daemon, topic, messages)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
    answers, reports = {}, {}
    for topic, messages in history.items():
        answers[topic], reports[topic] = _chat(daemon, topic, messages)
    return answers, reports


def test_conversations_sharing_one_slot_come_back_from_the_store_with_the_same_answers(daemons):
    tight, roomy = daemons
    answers, reports = _conversations(tight)
    resident_answers, resident_reports = _conversations(roomy)
    for topic in TOPICS:
        kv = reports[topic]["kv"]
        assert kv["restored_tokens"] > 0 and set(kv["restored_tiers"]) == {"INT8"}, kv
        assert kv["restored_tiers"]["INT8"] >= kv["restored_tokens"]  # kept: the whole turn; used: what matches
        assert kv["reused_tokens"] == resident_reports[topic]["kv"]["reused_tokens"]  # nothing re-prefilled
        assert resident_reports[topic]["kv"]["restored_tokens"] == 0
    assert answers == resident_answers  # INT8 per-token KV: the answers of conversations that never left
    samples = metric_samples(tight.url, TOKEN)
    assert samples["edgedecode_sessions{state=compressed}"] == len(TOPICS) - 1
    held = sum(
        samples[f"edgedecode_kv_memory_bytes{{state={state}}}"] for state in ("active", "resident", "compressed")
    )
    assert 0 < held <= BUDGET_MB << 20


def test_a_turn_larger_than_the_kv_budget_is_a_503_naming_it_and_the_daemon_keeps_serving(daemons):
    tight, _ = daemons
    long = " ".join(["The keeper logged the weather before dawn."] * 210)  # ~1700 tokens: past 64 MiB
    with pytest.raises(APIStatusError) as refused:
        _chat(tight, "long", [{"role": "user", "content": long}])
    error = refused.value.response.json()["error"]
    assert refused.value.status_code == 503 and error["code"] == "insufficient_memory"
    assert "daemon.kv_memory_mb" in error["message"] and "64" in error["message"]
    answer, _ = _chat(tight, "short", [{"role": "user", "content": "Say hello."}])
    assert answer
