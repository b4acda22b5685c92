"""The prefill tier on Ray Serve (edgedecode.prefill.fleet): two replicas of the real prefill server
behind Serve's HTTP proxy on 127.0.0.1, serving a real decode daemon through the project's link
shaper. One deployment for the module: the daemon's answers, where a conversation's turns land, and
losing a replica while it prefills a request and while the daemon is still receiving its payload.

Ray is the optional [scale] extra: without it these tests are skipped, except in CI (CI set),
which installs it, where its absence fails them.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from openai import OpenAI
from serving_helpers import ServerProcess, lighthouse_chat, metric_samples, server_config

if os.environ.get("CI"):
    import ray  # CI installs the [scale] extra: a missing Ray fails here instead of skipping
else:
    ray = pytest.importorskip("ray", reason="the [scale] extra (Ray Serve) is not installed")
from ray import serve

from edgedecode.config import load_config
from edgedecode.kv.policy import TierProfile, profile_path
from edgedecode.kv.prefix import block_chain, chain_to_hex
from edgedecode.model.graph import GraphOptions
from edgedecode.prefill.fleet.app import APP_NAME, build_app, replica_actor, replica_names, start_fleet, stop_fleet
from edgedecode.prefill.fleet.faults import FAULT_FILE_ENV
from edgedecode.prefill.fleet.ingress import REPLICA_HEADER
from edgedecode.prefill.pipeline import prefill_and_score, through_wire
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.testing.agreement import divergence_gap
from edgedecode.testing.link_shaper import LinkShaper

TOKEN, PREFILL_TOKEN = "daemon-secret", "fleet-secret"
BUDGET = 0.3
MAX_TOKENS = 24
RESTART_WAIT_S = 300  # a bound on waiting for Serve to replace a lost replica (loading the model), not a timing claim
ANSWER_WAIT_S = 120  # a bound on a chat answer, however its pull went: nothing may hang (not a timing claim)
DRAIN_WAIT_S = 900  # a bound on the redeploy test's prefills, drained in turn on a loaded box (not a timing claim)
FAST_LINK_BPS = 200e6  # the shaped link between the daemon and the tier, as good as loopback for these payloads
SENT_BYTES = "edgedecode_prefill_sent_bytes_total{}"  # EDKV bytes a replica's server sent (to its relay)
# a ~2 MB payload takes ~8 s to cross it: the daemon is still receiving when its replica dies, even on a loaded box
# whose metrics scrapes through Serve (several before the kill) take up to a second each; at 1 MB/s one run beside
# stress-ng saw the whole payload cross first
SLOW_LINK_BPS = 0.25e6
CUT_AT = 0.4  # of a payload: where the cut-stream test's replica stops relaying before it is killed
NEAR_TIE = 0.5  # logits: how close the two tokens at a first difference may be (KV partly computed locally)
FLEET_CONFIG = f"""
[model]
threads = 2
[prefill]
port = 0  # a free port: the default 8089 clashed with another suite's fleet on the same box
auth_token = "{PREFILL_TOKEN}"
prefix_cache_mb = 64
max_prompt_tokens = 2048
[fleet]
replicas = 2
replica_cpus = 1
health_check_period_s = 2
# a draining replica finishes its prefills (the redeploy test): beside stress-ng a 2,000-token prefill took up to
# 160 s on a replica's one CPU, and at 60 s Serve killed the draining ingress (its requests answered 500)
graceful_shutdown_s = 600
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fleet")


@pytest.fixture(scope="module")
def fault_file(workdir) -> Path:
    """Where a test writes the byte count after which the replicas stall a prefill answer (faults.py); absent:
    no fault."""
    return workdir / "relay-stall-bytes"


@pytest.fixture(scope="module")
def fleet(smollm2_model, workdir, fault_file):
    """The tier's URL: two replicas on a Ray instance of this process (2 CPUs, a small object store), started
    with ``fault_file`` named to them."""
    smollm2_model.graph(GraphOptions.for_device("prefill", "cpu"))  # built once here, not by each replica
    path = workdir / "fleet.toml"
    path.write_text(FLEET_CONFIG)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAULT_FILE_ENV, str(fault_file))  # Ray's processes inherit this process's environment
        # Serve kills a proxy not ready in 5 s or silent to 3 health checks of 10 s: beside stress-ng --cpu 2 its
        # process took longer to start, and the tier never came up (these tests are not about a proxy's speed)
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        env.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
        url = start_fleet(load_config(path, env={}), num_cpus=2, object_store_memory=128 << 20)
    yield url
    stop_fleet()


@pytest.fixture(scope="module")
def fleet_config(fleet, workdir):
    """The configuration the tier was started with."""
    return load_config(workdir / "fleet.toml", env={})


@pytest.fixture(scope="module")
def link(fleet):
    """The daemon's link to the tier: the loopback shaper in front of Serve's proxy."""
    address = urlsplit(fleet)
    shaper = LinkShaper(address.hostname, address.port, rate_bytes_per_s=FAST_LINK_BPS)
    yield shaper
    shaper.stop()


@pytest.fixture(scope="module")
def daemon(link, workdir):
    # a loaded box's replica may be silent for over the default 10 s while it prefills and scores a prompt:
    # generous bounds, so that the pulls these tests watch are not given up for the box's speed
    config = server_config(
        workdir, "daemon", prefill_token=PREFILL_TOKEN, budget=BUDGET, idle_read_timeout_s=90.0, fetch_timeout_s=110.0
    )
    server = ServerProcess(
        ["serve", "--config", config, "--prefill-url", link.url],
        workdir / "daemon.log",
        env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
    )
    yield server
    server.stop()


def _chat(daemon, messages, session: str):
    client = OpenAI(base_url=daemon.url + "/v1", api_key=TOKEN, timeout=300, max_retries=0)
    completion = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"session_id": session},
    )
    return completion, completion.model_extra["edgedecode"]


def _replica_tokens(fleet: str) -> dict[str, dict[str, float]]:
    """Each serving replica's prompt tokens by source (its prefix cache, or computed), from its own
    metrics (a replica starting, or one lost whose actor is not gone yet, answers 404: left out)."""
    tokens = {}
    for name in replica_names():
        try:
            samples = metric_samples(fleet, PREFILL_TOKEN, f"/metrics?replica={name}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            continue
        tokens[name] = {
            source: samples.get(f"edgedecode_prefill_tokens_total{{source={source}}}", 0.0)
            for source in ("prefix_cache", "computed")
        }
    return tokens


def _changed(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """The replicas whose counts changed, by how much (one serving since ``before`` from 0)."""
    unseen = dict.fromkeys(("prefix_cache", "computed"), 0.0)
    return {
        name: {source: after[name][source] - before.get(name, unseen)[source] for source in after[name]}
        for name in after
        if after[name] != before.get(name, unseen)
    }


def _single_server_answer(model, prefiller, decoder, messages) -> tuple[str, dict[str, int], int]:
    """The single-server path, in process: prefill, score and encode at the budget, decode greedily.
    Returns the answer, the payload's tokens per tier and its bytes."""
    prompt = model.tokenizer.encode_chat(messages)
    scored = prefill_and_score(prefiller, np.asarray(prompt, np.int64))
    profile = TierProfile.load(profile_path(model))
    kv, encoded = through_wire(scored, BUDGET, "ours", model.spec.kv_contract, profile=profile)
    tokens = list(decoder.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), kv=kv))
    tiers = {name: n for name, n in encoded.tier_counts().items() if n}
    return model.tokenizer.decode(tokens), tiers, sum(len(frame) for frame in encoded.frames)


def test_the_daemon_gets_the_single_server_greedy_answer_through_two_replicas(
    daemon, smollm2_model, prefiller, decoder
):
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    completion, report = _chat(daemon, messages, "rivers")
    assert report["kv"]["source"] == "prefill_server"
    answer, tiers, _ = _single_server_answer(smollm2_model, prefiller, decoder, messages)
    assert completion.choices[0].message.content == answer
    assert report["kv"]["tiers"] == tiers


def _held_by_the_tier(fleet: str, token_ids: list[int]) -> tuple[int, str]:
    """(what the replica a held query reaches holds of the prompt, that replica's name)."""
    body = json.dumps({"blocks": chain_to_hex(block_chain(np.asarray(token_ids, np.int64)))}).encode()
    request = urllib.request.Request(
        fleet + "/v1/prefill/held",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {PREFILL_TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["held_tokens"], response.headers[REPLICA_HEADER]


def test_a_conversations_second_turn_lands_on_the_replica_holding_its_prefix(daemon, fleet, smollm2_model):
    turn1 = lighthouse_chat(12)  # ~170 tokens: two whole 64-token blocks for the prefix cache
    before = _replica_tokens(fleet)
    first, _ = _chat(daemon, turn1, "lighthouse")
    after_first = _replica_tokens(fleet)
    served_first = _changed(before, after_first)
    assert len(served_first) == 1  # one replica computed the first turn
    (holder,) = served_first
    # a held query reaches the replica the prompt would (the holder), which answers what it holds
    assert _held_by_the_tier(fleet, smollm2_model.tokenizer.encode_chat(turn1)) == (128, holder)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Who wrote it down?"},
    ]
    _chat(daemon, turn2, "lighthouse")
    served_second = _changed(after_first, _replica_tokens(fleet))
    assert list(served_second) == [holder]  # the same replica, and no other, served the second turn
    assert served_second[holder]["prefix_cache"] >= 128  # the first turn's blocks came from its prefix cache


def test_losing_the_replica_serving_a_request_still_answers_and_the_tier_recovers(daemon, fleet):
    names = replica_names()
    assert len(names) == 2
    messages = lighthouse_chat(60)  # ~800 tokens: the replica is busy with it for a while
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(answer=_chat(daemon, messages, "lost")))
    request.start()
    victim = None
    while victim is None and request.is_alive():
        for name in names:
            depth = metric_samples(fleet, PREFILL_TOKEN, f"/metrics?replica={name}")["edgedecode_prefill_queue_depth{}"]
            if depth:
                victim = name
                break
        time.sleep(0.05)
    assert victim is not None, "the request ended before a replica was seen serving it"
    ray.kill(replica_actor(victim), no_restart=True)
    request.join()
    completion, report = result["answer"]
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == MAX_TOKENS
    kv = report["kv"]
    assert kv["reused_tokens"] + kv["pulled_tokens"] + kv["computed_tokens"] == completion.usage.prompt_tokens
    # the next request is served, by a live replica
    completion, report = _chat(daemon, [{"role": "user", "content": "Say hello."}], "next")
    assert completion.choices[0].message.content and report["kv"]["source"] == "prefill_server"
    _wait_replaced(fleet, victim)


def test_losing_the_replica_whose_payload_the_daemon_is_receiving_still_answers_in_full(
    daemon, fleet, link, smollm2_model, prefiller, decoder
):
    """The replica dies while its payload is still crossing the daemon's (slow) link: Serve holds
    what the replica handed over, so the daemon gets the whole payload and the undisturbed answer."""
    messages = lighthouse_chat(24)  # ~320 tokens: ~2 MB at b 0.3, ~8 s on the slow link
    before = _replica_tokens(fleet)
    sent_before = {name: _replica_metric(fleet, name, SENT_BYTES) for name in before}
    link.set_rate(SLOW_LINK_BPS)
    down_before = link.bytes_down
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(answer=_chat(daemon, messages, "received")))
    try:
        request.start()
        # the serving replica is the one whose server counted the prompt; by the time half its
        # payload has crossed the link (a second or more), it has handed all of it to Serve
        deadline = time.monotonic() + ANSWER_WAIT_S
        victim = _serving_replica(fleet, before, deadline)
        while _replica_metric(fleet, victim, "edgedecode_prefill_queue_depth{}") and time.monotonic() < deadline:
            time.sleep(0.02)  # its server is done writing the payload (to the replica's relay)
        payload = _replica_metric(fleet, victim, SENT_BYTES) - sent_before[victim]
        while link.bytes_down - down_before < payload // 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        crossed = link.bytes_down - down_before
        ray.kill(replica_actor(victim), no_restart=True)
        assert payload // 2 <= crossed < payload  # killed while the daemon was still receiving its payload
        request.join(ANSWER_WAIT_S)
        assert not request.is_alive(), "the daemon did not answer in time"
    finally:
        link.set_rate(FAST_LINK_BPS)
        request.join(ANSWER_WAIT_S)
    completion, report = result["answer"]
    kv = report["kv"]
    assert kv["source"] == "prefill_server" and [s["ended"] for s in kv["segments"]] == ["complete"]
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == MAX_TOKENS
    answer, tiers, _ = _single_server_answer(smollm2_model, prefiller, decoder, messages)
    assert completion.choices[0].message.content == answer and kv["tiers"] == tiers
    # the next request is served, by a live replica (not the lost one)
    before_next = _replica_tokens(fleet)
    completion, report = _chat(daemon, [{"role": "user", "content": "Say goodbye."}], "after")
    assert completion.choices[0].message.content and report["kv"]["source"] == "prefill_server"
    assert len(_changed(before_next, _replica_tokens(fleet))) == 1
    _wait_replaced(fleet, victim)


def test_a_replica_killed_with_its_stream_cut_short_leaves_the_verified_prefix_and_the_answer(
    daemon, fleet, link, fault_file, smollm2_model, prefiller, decoder
):
    """A replica dies with its payload part way across the wire (it stalls its relay at CUT_AT of the
    payload, faults.py, and is killed once that much has crossed the daemon's link): the daemon keeps the
    KV it verified, gets or computes the rest, and answers as the single server does, up to a near-tie;
    the next request is served by the live replica."""
    sentence = "The harbour master counted the boats that came in after the storm."  # no other test's prompt
    messages = [{"role": "user", "content": "Summarize: " + " ".join([sentence] * 30)}]  # ~400 tokens, ~2.7 MB
    answer, _, payload = _single_server_answer(smollm2_model, prefiller, decoder, messages)
    stall = int(CUT_AT * payload)
    before = _replica_tokens(fleet)
    down_before = link.bytes_down
    fault_file.write_text(str(stall))
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(answer=_chat(daemon, messages, "cut")))
    try:
        request.start()
        deadline = time.monotonic() + ANSWER_WAIT_S
        victim = _serving_replica(fleet, before, deadline)
        while link.bytes_down - down_before < stall and time.monotonic() < deadline:
            time.sleep(0.02)
        fault_file.unlink()  # the requests that follow (the daemon's resume among them) are not stalled
        crossed = link.bytes_down - down_before
        ray.kill(replica_actor(victim), no_restart=True)
        request.join(ANSWER_WAIT_S)
        assert not request.is_alive(), "the daemon did not answer in time"
    finally:
        fault_file.unlink(missing_ok=True)
        request.join(ANSWER_WAIT_S)
    assert payload // 4 <= crossed < payload, (
        crossed,
        payload,
        result["answer"][1]["kv"],
    )  # the proxy's count: cut between 25 % and all
    completion, report = result["answer"]
    kv = report["kv"]
    assert kv["segments"][0]["ended"] != "complete" and kv["segments"][0]["tokens"] > 0, kv  # the cut, kept
    assert kv["reused_tokens"] + kv["pulled_tokens"] + kv["computed_tokens"] == completion.usage.prompt_tokens, kv
    # the verified prefix was used, not recomputed (a position the payload dropped is computed here too)
    assert 0 < kv["pulled_tokens"] <= kv["segments"][0]["tokens"] and kv["fallback_reason"] in (None, "truncated"), kv
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == MAX_TOKENS
    prompt = smollm2_model.tokenizer.encode_chat(messages)
    tokens = [
        smollm2_model.tokenizer.encode(text, add_bos=False) for text in (answer, completion.choices[0].message.content)
    ]
    gap = divergence_gap(prefiller, np.asarray(prompt, np.int64), *tokens)
    assert gap <= NEAR_TIE, (gap, answer, completion.choices[0].message.content)
    completion, report = _chat(daemon, [{"role": "user", "content": "Say goodbye."}], "after-cut")
    assert completion.choices[0].message.content and report["kv"]["source"] == "prefill_server"
    _wait_replaced(fleet, victim)


def test_a_redeploy_drains_each_replica_after_its_request_in_flight(fleet, fleet_config):
    """A redeploy replaces every replica, stopping each gracefully: with both replicas prefilling
    (and the 2 CPUs of this Ray instance taken, so Serve must stop an old replica at once, before it
    can start a new one), every request is answered in full, both old replicas answer requests
    after the redeploy began (a replica killed instead of drained would have its requests retried
    on another), and the tier then runs two new replicas. The last test of the module."""
    old = replica_names()
    assert len(old) == 2
    rng = np.random.default_rng(7)
    results: list[tuple[float, tuple[int, str, int, int]]] = []  # (when it ended, the answer)
    threads: list[threading.Thread] = []

    def send() -> None:
        token_ids = rng.integers(100, 40000, 2000).tolist()  # a second or more of prefill on one thread
        threads.append(threading.Thread(target=_prefill_into, args=(fleet, token_ids, results)))
        threads[-1].start()

    # long prompts, each sent once every one before it is in a replica's hands (however long that takes on a loaded
    # box), until both replicas have one: one more only where two landed on the same replica (or one was done first)
    for sent in range(1, 7):
        send()
        deadline = time.monotonic() + DRAIN_WAIT_S
        while _held(fleet, old) < sent - len(results) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _busy(fleet, old) == 2:
            break
    assert _busy(fleet, old) == 2, "both replicas should be prefilling"
    redeployed = time.monotonic()
    serve.run(build_app(fleet_config), name=APP_NAME, route_prefix="/")  # a new version: a rolling update
    for thread in threads:
        thread.join(DRAIN_WAIT_S)
        assert not thread.is_alive(), "a request in flight did not end"
    for _, (status, replica, received, announced) in results:
        assert status == 200 and received == announced, (status, replica)  # the whole payload
    assert {replica for ended, (_, replica, _, _) in results if ended > redeployed} == set(old)
    _wait_replaced(fleet, old[0])
    assert not set(old) & set(replica_names())


def _serving_replica(fleet: str, before: dict, deadline: float) -> str:
    """The one replica whose prompt-token counts moved since ``before`` (the one serving the request just
    sent), waited for until ``deadline`` (monotonic seconds)."""
    serving: dict = {}
    while not serving and time.monotonic() < deadline:
        serving = _changed(before, _replica_tokens(fleet))
        time.sleep(0.05)
    assert len(serving) == 1, f"no single replica was seen serving the request: {serving}"
    (victim,) = serving
    return victim


def _prefill_into(fleet: str, token_ids: list[int], results: list) -> None:
    """``_prefill``, its answer (or the error that ended it: status 0 or the HTTP error's, and its text in place of
    the replica) appended to ``results`` with when it ended (time.monotonic)."""
    try:
        answer = _prefill(fleet, token_ids)
    except urllib.error.HTTPError as exc:
        answer = (exc.code, repr(exc), 0, -1)
    except OSError as exc:  # refused, reset or timed out
        answer = (0, repr(exc), 0, -1)
    results.append((time.monotonic(), answer))


def _prefill(fleet: str, token_ids: list[int]) -> tuple[int, str, int, int]:
    """A prefill request to the tier: (status, the replica that answered, body bytes received, bytes announced)."""
    body = json.dumps({"token_ids": token_ids, "budget": BUDGET}).encode()
    headers = {"Authorization": f"Bearer {PREFILL_TOKEN}", "Content-Type": "application/json"}
    request = urllib.request.Request(fleet + "/v1/prefill", body, headers)
    with urllib.request.urlopen(request, timeout=DRAIN_WAIT_S) as response:
        received = len(response.read())
        replica, announced = response.headers["X-Prefill-Replica"], int(response.headers["X-EDKV-Wire-Bytes"])
        return response.status, replica, received, announced


def _held(fleet: str, names: list[str]) -> int:
    """The prefill requests the replicas ``names`` hold, waiting or running (their servers' queue depths)."""
    return int(sum(_replica_metric(fleet, name, "edgedecode_prefill_queue_depth{}") for name in names))


def _busy(fleet: str, names: list[str]) -> int:
    """How many of the replicas ``names`` have a prefill request in hand."""
    return sum(_replica_metric(fleet, name, "edgedecode_prefill_queue_depth{}") > 0 for name in names)


def _replica_metric(fleet: str, name: str, sample: str) -> float:
    """One sample of the replica's own metrics."""
    return metric_samples(fleet, PREFILL_TOKEN, f"/metrics?replica={name}")[sample]


def _wait_replaced(fleet: str, lost: str) -> None:
    """Serve replaces the lost replica: two replicas again, each serving (answering its own metrics)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while not _replaced(fleet, lost) and time.monotonic() < deadline:
        time.sleep(1)
    assert _replaced(fleet, lost)


def _replaced(fleet: str, lost: str) -> bool:
    names = replica_names()
    return len(names) == 2 and lost not in names and set(_replica_tokens(fleet)) == set(names)
