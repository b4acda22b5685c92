"""The daemon under a time-to-first-token target over a shaped link (issue 13): the link shaper on
its own, then one prefill server and two daemons, one pulling through a 10 Mbit/s shaper, the other
straight: the shaped one asks a lower budget predicted to meet a target b 1.0 misses (whether it is met
is the box's speed: the benchmark's, not these tests'); over a link too slow
for any budget it prefills locally without asking the prefill server; a daemon restarted with its
state directory plans from the link it learned before."""

from __future__ import annotations

import socket
import time

import pytest
from openai import OpenAI
from serving_helpers import ByteUpstream, ServerProcess, lighthouse_chat, metric_samples, receive, server_config

from edgedecode.daemon.pull.calibration import shipped
from edgedecode.testing.link_shaper import LinkShaper

TOKEN, PREFILL_TOKEN = "daemon-secret", "prefill-secret"
BUDGET = 0.3
RATE = 1.25e6  # 10 Mbit/s
DELAY_S = 0.010
PROMPT = lighthouse_chat(34)
# as long as PROMPT (412 tokens), and not believed held by a server that prefilled PROMPT (its first block differs):
# a daemon prices a prompt it believes held as the server's cache hit, whether or not the cache is on
UNSEEN = [{"role": "user", "content": PROMPT[0]["content"].replace("Summarize:", "Summarise:", 1)}]
# this box's prefill speed as the adaptive daemons assume it (2 cores: ~0.3-1 s for PROMPT), pinned
LOCAL_SPEED = {"local_prefill_tokens_per_s": 1000.0}
# the prefill server shares the box: loaded (a compiler, stress-ng), it may take longer than the default 3 s to
# accept and 10 s to answer; these tests are about plans, not about giving up on a slow server
PATIENT = {"connect_timeout_s": 30.0, "idle_read_timeout_s": 60.0}


# --- the shaper on its own ----------------------------------------------------------------------


@pytest.fixture
def upstream():
    with ByteUpstream() as server:
        yield server


def test_the_shaper_paces_the_download_at_its_rate(upstream):
    size, rate = 1_000_000, 2e6
    with LinkShaper("127.0.0.1", upstream.port, rate_bytes_per_s=rate, delay_s=0.0) as shaper:
        data, seconds = receive(shaper.port, f"send {size}\n".encode(), size)
        assert data == b"x" * size
        assert 0.7 * size / rate <= seconds <= 1.3 * size / rate, seconds
        assert shaper.connections == 1 and shaper.bytes_down == size

        shaper.set_rate(8e6)  # a new rate takes effect on the next transfer
        _, faster = receive(shaper.port, f"send {size}\n".encode(), size)
        assert faster < seconds / 2, (faster, seconds)


def test_the_shaper_delays_each_way(upstream):
    """A round trip through the shaper takes at least the delay each way, and not a second delay on either (a
    delay's worth of room above, for a loaded box's late wake-ups). The floor is the round trip itself: less the
    unshaped one, measured apart, it failed beside stress-ng (201.4 ms less a direct round trip that took 3.6 ms)."""
    delay = 0.5
    _, direct = receive(upstream.port, b"ping\n", 5)
    with LinkShaper("127.0.0.1", upstream.port, rate_bytes_per_s=1e6, delay_s=delay) as shaper:
        data, seconds = receive(shaper.port, b"ping\n", 5)
    assert data == b"ping\n"
    assert seconds >= 2 * delay and seconds - direct < 3 * delay, (seconds, direct)  # one delay each way


def test_the_shaper_rate_can_change_mid_transfer(upstream):
    size, switch_at = 600_000, 200_000
    with (
        LinkShaper("127.0.0.1", upstream.port, rate_bytes_per_s=4e6) as shaper,
        socket.create_connection(("127.0.0.1", shaper.port), timeout=10) as conn,
    ):
        conn.sendall(f"send {size}\n".encode())
        got, switched = 0, None
        while got < size:
            piece = conn.recv(1 << 16)
            if not piece:
                break
            got += len(piece)
            if switched is None and got >= switch_at:
                shaper.set_rate(1e6)
                switched = time.perf_counter()
        assert got == size and switched is not None
        after = time.perf_counter() - switched
    assert 0.7 * 0.4 <= after <= 1.5 * 0.4, after  # the last 400 KB at 1 MB/s (0.1 s at 4 MB/s)


# --- a prefill server and two daemons, one behind the shaper ------------------------------------


def _config(tmp_path, name: str, prefill: dict | None = None, **daemon) -> str:
    return server_config(
        tmp_path, name, prefill_token=PREFILL_TOKEN, prefill=prefill, **{"budget": BUDGET, **PATIENT, **daemon}
    )


@pytest.fixture(scope="module")
def tier(smollm2_model, tmp_path_factory):
    """(prefill server, the 10 Mbit/s shaper in front of it). The server keeps no prefixes: every turn's server time
    is its whole prompt's, as in the turn that taught a daemon the link (a daemon learns the server's time per token
    it computed, and a turn that found most of its prompt cached would teach an encode's cost per computed token)."""
    workdir = tmp_path_factory.mktemp("adaptive_tier")
    prefill = ServerProcess(
        ["prefill-server", "--config", _config(workdir, "prefill", prefill={"prefix_cache_mb": 0})],
        workdir / "prefill.log",
        env={"EDGEDECODE_PREFILL_AUTH_TOKEN": PREFILL_TOKEN},
    )
    try:
        with LinkShaper(
            "127.0.0.1", int(prefill.url.rsplit(":", 1)[1]), rate_bytes_per_s=RATE, delay_s=DELAY_S
        ) as shaper:
            yield prefill, shaper
    finally:
        prefill.stop()


def _daemon(workdir, name: str, url: str, **settings) -> ServerProcess:
    return ServerProcess(
        ["serve", "--config", _config(workdir, name, **settings), "--prefill-url", url],
        workdir / f"{name}.log",
        env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
    )


@pytest.fixture(scope="module")
def servers(tier, tmp_path_factory):
    """(prefill server, shaper, shaped daemon, unshaped daemon, shaped daemon at a fixed b 1.0).

    The adaptive daemons count local prefill as costly (``local_dppl_pct``), as for a model whose
    edge graph is worse than the server's: these tests are about the budget the link allows. Their
    prefill speed is pinned (``LOCAL_SPEED``), so that what they plan does not depend on how fast or
    loaded the box is."""
    prefill, shaper = tier
    workdir = tmp_path_factory.mktemp("adaptive_link")
    started: list = []
    try:
        for name, url, settings in (
            ("shaped", shaper.url, {"local_dppl_pct": 5.0, **LOCAL_SPEED}),
            ("direct", prefill.url, {"local_dppl_pct": 5.0, **LOCAL_SPEED}),
            ("fixed", shaper.url, {"budget": 1.0}),
        ):
            started.append(_daemon(workdir, name, url, **settings))
        yield prefill, shaper, *started
    finally:
        for server in reversed(started):
            server.stop()


def _metrics(server, token: str = TOKEN) -> dict[str, float]:
    return metric_samples(server.url, token)


def _link_sample(samples: dict[str, float], name: str) -> float:
    """A daemon's one ``edgedecode_link_<name>{endpoint}`` sample (it pulls from one endpoint)."""
    (value,) = [v for k, v in samples.items() if k.startswith(f"edgedecode_link_{name}{{")]
    return value


def _prefill_requests(prefill) -> float:
    samples = _metrics(prefill, PREFILL_TOKEN)
    return sum(v for k, v in samples.items() if k.startswith("edgedecode_prefill_requests_total{"))


def _turn(server, messages=PROMPT, **extra) -> dict:
    client = OpenAI(base_url=server.url + "/v1", api_key=TOKEN, timeout=60, max_retries=0)
    completion = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, temperature=0, max_tokens=4, extra_body=extra or None
    )
    assert completion.choices[0].message.content
    return completion.model_extra["edgedecode"]


def _reported_truly(report: dict, target_ms: float) -> None:
    """What holds whatever the box's speed for a turn planned to pull: whether it met ``target_ms`` is said
    truly, and a segment given up (cut by its watch, or its wait timed out) had its rest computed here. Whether
    the target was met is the box's speed (the prefill server shares it): a goal for tools/bench_adaptive.py,
    not a test's assertion (under stress-ng --cpu 2 the server's prefill outgrew what the link had taught)."""
    assert report["ttft_target_met"] == (report["ttft_ms"] <= target_ms), report
    segments = report["kv"]["segments"]
    if segments[0]["ended"] in ("cut", "timeout"):  # the rest re-planned (a lower budget pulled whole) or computed
        assert report["kv"]["computed_tokens"] > 1 or (len(segments) > 1 and segments[-1]["ended"] == "complete")
    else:
        assert report["kv"]["source"] == "prefill_server", report


def test_over_a_slow_link_the_daemon_asks_a_lower_budget_predicted_to_meet_the_target(servers):
    _, shaper, shaped, direct, fixed_daemon = servers
    # Teach each link model with a turn without a target (the configured budget, 0.3).
    first_direct = _turn(direct)
    first_shaped = _turn(shaped)
    for report in (first_direct, first_shaped):
        assert report["kv"]["source"] == "prefill_server" and report["kv"]["budget"] == BUDGET, report
    assert first_shaped["kv"]["fetch_ms"] > 1e3 * 0.9 * first_shaped["kv"]["wire_bytes"] / RATE, first_shaped
    assert shaper.bytes_down >= first_shaped["kv"]["wire_bytes"]  # the shaped daemon pulls through the shaper

    # b 1.0 takes > 7 s over 10 Mbit/s, b 0.5 ~4 s, b 0.3 ~2 s, plus the server's compute time. The target is
    # what the shaped daemon learned (round trip, the server's time, goodput) predicts for b 0.4 of a prompt of
    # PROMPT's length that the server does not hold, so that b 0.5 is predicted ~0.8 s too slow and b 1.0 seconds
    # too slow, however fast the box's server was
    before = {"shaped": _metrics(shaped), "direct": _metrics(direct)}
    goodput, rtt_s = (_link_sample(before["shaped"], name) for name in ("goodput_bytes_per_second", "rtt_seconds"))
    server_ms = first_shaped["kv"]["prefill_server_ms"]
    target_ms = 1e3 * rtt_s + server_ms + 1e3 * 0.4 * first_shaped["kv"]["fp16_bytes"] / goodput + 150
    slow = _turn(shaped, messages=UNSEEN, ttft_target_ms=target_ms)
    fast = _turn(direct, messages=UNSEEN, ttft_target_ms=target_ms)

    def prompt_tokens(report: dict) -> int:
        return report["kv"]["pulled_tokens"] + report["kv"]["computed_tokens"]

    assert prompt_tokens(slow) == prompt_tokens(first_shaped) == prompt_tokens(fast)  # UNSEEN is as long as PROMPT
    # the plan, from what the link taught: a lower budget predicted within the target
    assert slow["kv"]["decision"] == "remote" and 0.2 <= slow["kv"]["budget"] < 1.0, slow
    assert slow["kv"]["predicted_ms"] <= target_ms, slow
    _reported_truly(slow, target_ms)
    # unshaped, the fastest lossless budget: b 0.5 costs no more perplexity than b 1.0 (kv-quality.md)
    assert fast["kv"]["decision"] == "remote" and fast["kv"]["budget"] == 0.5, fast
    _reported_truly(fast, target_ms)
    assert slow["kv"]["budget"] < fast["kv"]["budget"]

    shaped_metrics, direct_metrics = _metrics(shaped), _metrics(direct)
    for name, samples, report in (("shaped", shaped_metrics, slow), ("direct", direct_metrics, fast)):
        met = report["ttft_target_met"]
        for key, added in (
            ("edgedecode_kv_decisions_total{decision=remote}", 1),
            ("edgedecode_kv_decisions_total{decision=local}", 0),
            ("edgedecode_ttft_target_total{met=true}", int(met)),
            ("edgedecode_ttft_target_total{met=false}", int(not met)),
        ):
            assert samples[key] - before[name][key] == added, (name, key)

    shaped_goodput, direct_goodput = (
        _link_sample(m, "goodput_bytes_per_second") for m in (shaped_metrics, direct_metrics)
    )
    assert 0.5 * RATE <= shaped_goodput <= 1.5 * RATE, shaped_goodput
    assert direct_goodput > 5 * shaped_goodput

    # Fixed b 1.0 over the same link misses that target: beyond the server's time, it takes more than the target
    # leaves beyond it (the server's time of this turn and of those the target was set by may differ on a loaded box)
    fixed = _turn(fixed_daemon)
    assert fixed["kv"]["budget"] == 1.0, fixed
    assert fixed["ttft_ms"] - fixed["kv"]["prefill_server_ms"] > target_ms - server_ms, fixed


def test_over_a_link_too_slow_for_any_budget_the_daemon_prefills_locally_without_a_pull(servers):
    prefill, shaper, shaped, _, _ = servers
    # 0.2 Mbit/s: b 0.2 of the prompt (~2 MB) takes ~80 s, and even an eighth of it (a split's
    # smallest tail) ~10 s
    shaper.set_rate(25e3)
    try:
        teach = _turn(shaped, messages=[{"role": "user", "content": "Hi"}])  # a short pull teaches the link
        assert teach["kv"]["source"] == "prefill_server", teach
        requests = _prefill_requests(prefill)
        decided = _metrics(shaped)["edgedecode_kv_decisions_total{decision=local}"]
        forwarded = (shaper.bytes_down, shaper.bytes_up)
        target_ms = 4000  # local prefill of the prompt: ~0.3-1 s on 2 cores; no pull now predicted in time
        report = _turn(shaped, ttft_target_ms=target_ms)
    finally:
        shaper.set_rate(RATE)
    assert report["kv"]["decision"] == "local" and report["kv"]["source"] == "local", report
    assert report["kv"]["budget"] is None and report["kv"]["pulled_tokens"] == 0, report
    assert report["kv"]["predicted_ms"] <= target_ms, report  # (met or not: the box's speed, LOCAL_SPEED pinned)
    assert report["ttft_target_met"] == (report["ttft_ms"] <= target_ms), report
    assert _prefill_requests(prefill) == requests  # no pull was asked
    assert (shaper.bytes_down, shaper.bytes_up) == forwarded  # nothing went over the link
    assert _metrics(shaped)["edgedecode_kv_decisions_total{decision=local}"] - decided == 1


def test_a_restarted_daemon_plans_from_the_link_it_remembers(tier, tmp_path):
    """The link estimate is kept in daemon.state_dir: after a restart (the estimate as stale as after
    a long idle time) the first turn under a target plans from the remembered 10 Mbit/s link —
    local prefill, nothing asked of the server — where a daemon that knew nothing would pull at the
    configured budget."""
    prefill, shaper = tier
    state = tmp_path / "state"
    state.mkdir()
    first = _daemon(tmp_path, "before", shaper.url, state_dir=str(state), **LOCAL_SPEED)
    try:
        taught = _turn(first)  # no target: the configured budget, which teaches the link model
    finally:
        first.stop()
    assert taught["kv"]["source"] == "prefill_server" and taught["kv"]["budget"] == BUDGET, taught
    assert len(list(state.glob("link-*.json"))) == 1

    restarted = _daemon(tmp_path, "after", shaper.url, state_dir=str(state), **LOCAL_SPEED)
    try:
        requests, forwarded = _prefill_requests(prefill), shaper.bytes_down
        # b 0.3 of this prompt takes ~2 s at 10 Mbit/s (3 s with the stale margin); local ~0.3-1 s
        report = _turn(restarted, ttft_target_ms=2000)
    finally:
        restarted.stop()
    assert report["kv"]["decision"] == "local" and report["kv"]["pulled_tokens"] == 0, report
    assert report["kv"]["predicted_ms"] is not None, report  # planned, not the unknown link's configured budget
    # no pull asked: at most a held query's answer (a few hundred bytes, no payload) crossed the link
    assert _prefill_requests(prefill) == requests and shaper.bytes_down - forwarded < 1024


def test_with_no_adaptive_key_every_turn_is_planned_and_a_slow_link_falls_back_to_local(tier, tmp_path):
    """A daemon with no budget and no target (a new user's): its first turn to an endpoint pulls at
    the model's default budget (from its calibration) under a watch, and every later turn is planned
    — never an option predicted slower than 1.1x local prefill. Behind a link too slow for any pull
    the first pull is cut and the rest computed here, and the next turn computes here outright."""
    prefill, shaper = tier
    default_budget = shipped()["smollm2-135m-instruct"].default_budget
    started = []
    try:
        for name, url in (("new-direct", prefill.url), ("new-shaped", shaper.url)):
            # budget 0 is the default (not pinned): as if no key were set
            config = server_config(tmp_path, name, prefill_token=PREFILL_TOKEN, budget=0, **LOCAL_SPEED, **PATIENT)
            started.append(
                ServerProcess(
                    ["serve", "--config", config, "--prefill-url", url],
                    tmp_path / f"{name}.log",
                    env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
                )
            )
        direct, shaped = started
        first = _turn(direct)
        assert (first["kv"]["decision"], first["kv"]["budget"]) == ("remote", default_budget), first
        assert first["kv"]["predicted_ms"] is None and first["ttft_target_ms"] is None, first
        second = _turn(direct, messages=lighthouse_chat(20))
        tokens = second["kv"]["pulled_tokens"] + second["kv"]["computed_tokens"]  # those the plan got
        local_ms = 1e3 * tokens / LOCAL_SPEED["local_prefill_tokens_per_s"]  # as the daemon predicts them
        assert second["kv"]["predicted_ms"] is not None, second  # planned: the link is known now
        assert second["kv"]["predicted_ms"] <= 1.1 * local_ms + 1.0, second

        shaper.set_rate(25e3)  # 0.2 Mbit/s: b 0.3 of the prompt takes over a minute, local ~0.3 s
        try:
            probe = _turn(shaped)
            # given up at its deadline (cut by the watch, or its wait timed out) and computed here
            assert probe["kv"]["segments"][0]["ended"] in ("cut", "timeout"), probe
            assert probe["kv"]["computed_tokens"] > 1, probe
            forwarded = shaper.bytes_down
            after = _turn(shaped, messages=lighthouse_chat(20))
        finally:
            shaper.set_rate(RATE)
        assert after["kv"]["decision"] == "local" and after["kv"]["pulled_tokens"] == 0, after
        assert shaper.bytes_down == forwarded  # nothing went over the link
    finally:
        for server in reversed(started):
            server.stop()


def test_a_probe_of_an_unknown_link_waits_out_first_contact_even_when_local_prefill_is_quicker(tier, tmp_path):
    """A new user's first turn probes the endpoint under a deadline of local prefill's predicted time with slack:
    here ~0.2 s for a short question (local speed pinned at 400 tokens a second). First contact takes longer (a
    0.2 s round trip in the shaper, then the server's prefill), so at its bare deadline the probe had no byte and
    was given up with nothing learned, and every later turn computed here until the re-probe. It is waited on for
    PROBE_MIN_WAIT_S: it pulls, and the next turn is planned from the link it taught."""
    prefill, _ = tier
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    with LinkShaper("127.0.0.1", int(prefill.url.rsplit(":", 1)[1]), rate_bytes_per_s=1e9, delay_s=0.1) as far:
        config = server_config(
            tmp_path, "quick-local", prefill_token=PREFILL_TOKEN, budget=0, local_prefill_tokens_per_s=400.0, **PATIENT
        )
        daemon = ServerProcess(
            ["serve", "--config", config, "--prefill-url", far.url],
            tmp_path / "quick-local.log",
            env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
        )
        try:
            first = _turn(daemon, messages=question)
            assert first["kv"]["decision"] == "remote" and first["kv"]["predicted_ms"] is None, first
            assert first["kv"]["segments"][0]["ended"] == "complete" and first["kv"]["pulled_tokens"] > 0, first
            second = _turn(daemon, messages=question)
            assert second["kv"]["predicted_ms"] is not None, second  # planned from the link the probe taught
        finally:
            daemon.stop()
