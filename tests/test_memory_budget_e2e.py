"""Issue 14's acceptance, through the real daemon: 8 conversations take turns in alternation under a KV
memory budget that holds two conversations' FP16 KV. Every turn completes, the KV memory sampled at
10 Hz never exceeds the budget, a conversation resumed from compressed KV answers as one that stayed
resident (up to a near-tie), and one whose KV was evicted answers correctly on its next turn and is
counted. A conversation that outgrows the budget goes on, losing its oldest tokens' KV."""

from __future__ import annotations

import math
import threading

import pytest
from openai import OpenAI
from serving_helpers import ServerProcess, metric_samples, server_config, slot_kv_bytes_per_token

from edgedecode.daemon.openai_api import parse_request
from edgedecode.testing.agreement import divergence_gap

TOKEN = "daemon-secret"
MODEL = "smollm2-135m-instruct"
FP16_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M: 2 (K, V) x 30 layers x 3 kv heads x 64 x 2 bytes
MAX_TOKENS = 12
MAX_SESSIONS = 6  # of the 8 conversations: each round evicts some (counted) besides what the budget does
NEAR_TIE = 1.0  # logits: the two tokens at the first difference are this close in an uncompressed resume
SUBJECTS = ("the sea", "a mountain", "the city at night", "a forest", "the desert", "a river", "snow", "a market")
FOLLOW_UPS = ("And another one, shorter?", "Now one about its colours.")


def _daemon(workdir, name: str, **daemon) -> ServerProcess:
    config = server_config(workdir, name, prefill_token="", budget=0.3, local_prefill_only=True, **daemon)
    return ServerProcess(
        ["serve", "--config", config], workdir / f"{name}.log", env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN}
    )


def _chat(daemon, session: str, messages: list[dict]) -> tuple[str, dict]:
    client = OpenAI(base_url=daemon.url + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body={"session_id": session}
    )
    return completion.choices[0].message.content, completion.model_extra["edgedecode"]


def _alternating_turns(daemon, answers_from: dict | None = None):
    """Every conversation's turns in alternation (a1 b1 ... h1 h2 g2 ... a2 a3 b3 ...); each turn's messages carry
    the answers ``answers_from`` gave (so both daemons see the same prompts), else this daemon's.
    Returns {(subject, turn): (messages, answer, report)}."""
    history = {subject: [{"role": "user", "content": f"Write one sentence about {subject}."}] for subject in SUBJECTS}
    turns = {}
    for turn in range(len(FOLLOW_UPS) + 1):
        order = list(history.items()) if turn % 2 == 0 else list(history.items())[::-1]  # not a cycle LRU misses
        for subject, messages in order:
            answer, report = _chat(daemon, subject, messages)
            turns[subject, turn] = (list(messages), answer, report)
            said = answer if answers_from is None else answers_from[subject, turn][1]
            if turn < len(FOLLOW_UPS):
                messages += [{"role": "assistant", "content": said}, {"role": "user", "content": FOLLOW_UPS[turn]}]
    return turns


class KVMemorySampler:
    """Samples the daemon's KV memory (every state's bytes, summed) at 10 Hz until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            samples = metric_samples(self.url, TOKEN)
            self.samples.append(sum(v for k, v in samples.items() if k.startswith("edgedecode_kv_memory_bytes{")))

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _near_tie(model, engine, messages: list[dict], answer: str, other: str) -> tuple[bool, float]:
    """Whether ``other`` departs from ``answer`` only at a near-tie for the model given the
    uncompressed context: (near, the logit gap between the two tokens there)."""
    request = parse_request({"messages": messages}, "chat", model, default_max_tokens=MAX_TOKENS, session_header=None)
    gap = divergence_gap(
        engine,
        request.prompt_ids,
        model.tokenizer.encode(answer, add_bos=False),
        model.tokenizer.encode(other, add_bos=False),
    )
    return gap <= NEAR_TIE, gap


@pytest.fixture(scope="module")
def resident_turns(smollm2_model, tmp_path_factory):
    """The conversations on a daemon with a slot each and room for all: nothing leaves its slot."""
    workdir = tmp_path_factory.mktemp("resident")
    roomy = _daemon(workdir, "roomy", slots=len(SUBJECTS), max_sessions=len(SUBJECTS), kv_memory_mb=512)
    try:
        yield _alternating_turns(roomy)
    finally:
        roomy.stop()


def _prompt_tokens(model, messages: list[dict]) -> int:
    request = parse_request({"messages": messages}, "chat", model, default_max_tokens=1, session_header=None)
    return len(request.prompt_ids)


@pytest.mark.parametrize("bytes_per_token", [FP16_BYTES_PER_TOKEN, 2 * FP16_BYTES_PER_TOKEN], ids=["fp16", "twice"])
def test_eight_conversations_under_a_budget_of_two_conversations(
    resident_turns, smollm2_model, decoder, tmp_path, bytes_per_token
):
    """The budget holds two conversations' KV at FP16 (the issue's figure), or twice that (what float32
    slots need; float16 slots have room to spare). At FP16 a turn's own slot takes about all of it (float32
    slots) or half: resumed conversations may have lost tokens to the drop rung, and their answers may
    differ. With twice the room they come back re-tiered only, and answer as if they had stayed resident,
    up to a near-tie."""
    longest = max(_prompt_tokens(smollm2_model, messages) + MAX_TOKENS for messages, _, _ in resident_turns.values())
    budget_mb = math.ceil(2 * longest * bytes_per_token / (1 << 20))
    tight = _daemon(tmp_path, "tight", slots=2, max_sessions=MAX_SESSIONS, kv_memory_mb=budget_mb)
    try:
        sampler = KVMemorySampler(tight.url)
        try:
            turns = _alternating_turns(tight, answers_from=resident_turns)  # raises if a turn fails
        finally:
            sampled = sampler.stop()
        samples = metric_samples(tight.url, TOKEN)
    finally:
        tight.stop()
    budget = budget_mb << 20
    assert len(sampled) > 10 and max(sampled) <= budget
    assert 0 < samples["edgedecode_kv_memory_peak_bytes{}"] <= budget

    resumes: dict[str, int] = {}
    for key, (messages, answer, report) in turns.items():
        kv = report["kv"]
        dropped = kv["restored_tiers"].get("DROP", 0)
        kind = kv["resume"] + (" with dropped tokens" if dropped else "")
        resumes[kind] = resumes.get(kind, 0) + 1
        if kv["resume"] == "compressed":
            assert kv["restored_tokens"] > 0 and kv["restored_tiers"], report
        if kv["resume"] == "evicted":
            assert kv["reused_tokens"] == 0, report  # prefilled again, from the start
        resident_answer = resident_turns[key][1]
        if answer != resident_answer and not dropped:  # dropping tokens changes what the model sees
            near, gap = _near_tie(smollm2_model, decoder, messages, resident_answer, answer)
            assert near, (key, kv, answer, resident_answer, gap)
    compressed = resumes.get("compressed", 0) + resumes.get("compressed with dropped tokens", 0)
    assert compressed >= 1 and resumes.get("evicted", 0) >= 1, resumes
    if bytes_per_token > FP16_BYTES_PER_TOKEN:
        assert resumes.get("compressed", 0) >= 1, resumes  # some came back whole: the near-tie check ran
    assert resumes.get("new", 0) == len(SUBJECTS), resumes  # only first turns: nothing evicted went unreported
    evictions = sum(
        samples[f"edgedecode_session_evictions_total{{reason={why}}}"] for why in ("memory", "max_sessions")
    )
    assert evictions >= resumes["evicted"]


def test_a_conversation_longer_than_the_budget_goes_on_without_its_oldest_tokens(smollm2_model, tmp_path):
    slot_bytes = slot_kv_bytes_per_token(smollm2_model.spec)
    budget_mb = math.ceil(136 * slot_bytes / (1 << 20))  # ~136 tokens of a slot: outgrown on the third turn
    daemon = _daemon(tmp_path, "window", slots=1, max_sessions=1, kv_memory_mb=budget_mb)
    try:
        sampler = KVMemorySampler(daemon.url)
        try:
            messages = [{"role": "user", "content": "Write one sentence about the sea."}]
            reports = []
            for follow_up in ("Its waves?", "Its colour?", "Its sound?", "Its smell?", "Its birds?", "Its depth?"):
                answer, report = _chat(daemon, "window", messages)
                assert answer
                reports.append(report)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
        finally:
            sampled = sampler.stop()
        samples = metric_samples(daemon.url, TOKEN)
    finally:
        daemon.stop()
    assert max(sampled) <= budget_mb << 20
    evicted = [report["kv"]["evicted_tokens"] for report in reports]
    assert evicted[0] == 0 and sum(evicted) > 0, evicted
    assert all(report["kv"]["resume"] == "resident" for report in reports[1:])  # kept its slot, minus old tokens
    assert samples["edgedecode_active_kv_evicted_tokens_total{}"] == sum(evicted)
    final = _prompt_tokens(smollm2_model, messages[:-2]) + MAX_TOKENS
    assert final * slot_bytes > budget_mb << 20  # the conversation did outgrow the budget
