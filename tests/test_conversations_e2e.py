"""Conversations that outlive their slot, through the real daemon (issue 14): three conversations
take turns on one slot; each one's KV is kept compressed while another holds the slot and comes
back for its next turn, whose answer equals that of a daemon that kept every conversation resident,
up to the first near-tie (INT8 KV is a lossy path: each margin is read from the answer's own
log-probabilities). The first turn's reply in the history is scripted, the same on both daemons: the
second turns then read the same tokens, and differ only by the KV's path (a model-written reply could
itself differ between the daemons on other arithmetic, and the second answers would then answer other
prompts). A turn larger than the KV memory budget is a 503 naming the budget, and the
daemon keeps serving."""

from __future__ import annotations

import pytest
from greedy_helpers import assert_same_answer_up_to_a_near_tie
from openai import APIStatusError, OpenAI
from serving_helpers import ServerProcess, metric_samples, server_config, slot_kv_bytes_per_token

TOKEN = "daemon-secret"
BUDGET_TOKENS = 1456  # of a slot's KV: room for the three conversations, not for the ~1700-token turn below
TOPICS = ("the sea", "a mountain", "the city at night")
NEAR_TIE = 0.5  # logits: how close the two tokens at a first difference may be


def _daemon(workdir, name: str, **daemon) -> ServerProcess:
    config = server_config(workdir, name, prefill_token="", budget=0.3, local_prefill_only=True, **daemon)
    return ServerProcess(
        ["serve", "--config", config], workdir / f"{name}.log", env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN}
    )


@pytest.fixture(scope="module")
def budget_mb(smollm2_model) -> int:
    """The tight daemon's KV budget: BUDGET_TOKENS of SmolLM2's KV as a slot holds it on this host."""
    return BUDGET_TOKENS * slot_kv_bytes_per_token(smollm2_model.spec) >> 20


@pytest.fixture(scope="module")
def daemons(budget_mb, tmp_path_factory):
    """(one slot under a KV budget of ~BUDGET_TOKENS tokens, three slots: every conversation stays resident)."""
    workdir = tmp_path_factory.mktemp("conversations")
    tight = _daemon(workdir, "tight", slots=1, kv_memory_mb=budget_mb)
    try:
        roomy = _daemon(workdir, "roomy", slots=3)
        try:
            yield tight, roomy
        finally:
            roomy.stop()
    finally:
        tight.stop()


def _chat(daemon, session: str, messages: list[dict]) -> tuple[str, dict, list]:
    """(answer, the turn's report, the answer's tokens with their top-5 log-probabilities)."""
    client = OpenAI(base_url=daemon.url + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=5,
        extra_body={"session_id": session},
    )
    choice = completion.choices[0]
    return choice.message.content, completion.model_extra["edgedecode"], choice.logprobs.content


def _scripted_reply(topic: str) -> str:
    """The first turn's reply as both daemons' histories give it (an opening no greedy answer starts with, so
    what each slot reuses of the first turn is its prompt, whatever the model answered there)."""
    return f"(A reply written for the test.) {topic.capitalize()} deserves a sentence."


def _conversations(daemon) -> tuple[dict[str, list], dict[str, dict]]:
    """Two turns of each conversation, interleaved (a1 b1 c1 a2 b2 c2): the second answers' tokens and reports."""
    history = {topic: [{"role": "user", "content": f"Write one sentence about {topic}."}] for topic in TOPICS}
    for topic, messages in history.items():
        _chat(daemon, topic, messages)  # the turn whose KV the conversation keeps (in its slot or compressed)
        messages += [
            {"role": "assistant", "content": _scripted_reply(topic)},
            {"role": "user", "content": "And another one?"},
        ]
    answers, reports = {}, {}
    for topic, messages in history.items():
        _, reports[topic], answers[topic] = _chat(daemon, topic, messages)
    return answers, reports


def test_conversations_sharing_one_slot_come_back_from_the_store_with_the_same_answers(daemons, budget_mb):
    tight, roomy = daemons
    answers, reports = _conversations(tight)
    resident_answers, resident_reports = _conversations(roomy)
    for topic in TOPICS:
        kv = reports[topic]["kv"]
        assert kv["restored_tokens"] > 0 and set(kv["restored_tiers"]) == {"INT8"}, kv
        assert kv["restored_tiers"]["INT8"] >= kv["restored_tokens"]  # kept: the whole turn; used: what matches
        assert kv["reused_tokens"] == resident_reports[topic]["kv"]["reused_tokens"]  # nothing re-prefilled
        assert resident_reports[topic]["kv"]["restored_tokens"] == 0
    for topic in TOPICS:  # INT8 per-token KV: the answers of conversations that never left
        assert_same_answer_up_to_a_near_tie(answers[topic], resident_answers[topic], topic, NEAR_TIE)
    samples = metric_samples(tight.url, TOKEN)
    assert samples["edgedecode_sessions{state=compressed}"] == len(TOPICS) - 1
    held = sum(
        samples[f"edgedecode_kv_memory_bytes{{state={state}}}"] for state in ("active", "resident", "compressed")
    )
    assert 0 < held <= budget_mb << 20


def test_a_turn_larger_than_the_kv_budget_is_a_503_naming_it_and_the_daemon_keeps_serving(daemons, budget_mb):
    tight, _ = daemons
    long = " ".join(["The keeper logged the weather before dawn."] * 210)  # ~1700 tokens: past BUDGET_TOKENS
    with pytest.raises(APIStatusError) as refused:
        _chat(tight, "long", [{"role": "user", "content": long}])
    error = refused.value.response.json()["error"]
    assert refused.value.status_code == 503 and error["code"] == "insufficient_memory"
    assert "daemon.kv_memory_mb" in error["message"] and str(budget_mb) in error["message"]
    answer, _, _ = _chat(tight, "short", [{"role": "user", "content": "Say hello."}])
    assert answer
