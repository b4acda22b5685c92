"""Hostile HTTP against both real servers (issue 15 item 2): every hostile request of the shared
catalogue (``evaluation.hostile_http``) gets its precise 4xx in OpenAI's error shape, never a 5xx or
a hang; slow clients, clients that leave and floods are bounded as configured; and the servers go on
serving everyone else. ``tools/adversarial/abuse.py`` runs the same catalogue and behaviours.

The daemon (one slot, a queue of 2) pulls through a relaying peer in front of the session's prefill
server (conftest.py). test_serving.py already covers the daemon's slow headers, slow body, 401/413.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from serving_helpers import PREFILL_SETTINGS, PREFILL_TOKEN, metric_samples

from edgedecode.testing import hostile_clients, hostile_http
from edgedecode.testing.hostile_http import Target

BOUND_S = 60.0  # no single hostile request may take longer (a hang)


def _targets(hostile_daemon, prefill_server) -> tuple[Target, Target]:
    return Target("daemon", hostile_daemon.url, hostile_daemon.token), Target(
        "prefill", prefill_server.url, PREFILL_TOKEN
    )


def _run(work):
    """Run ``work(http)`` on a fresh event loop with an aiohttp client session."""

    async def main():
        async with aiohttp.ClientSession() as http:
            return await work(http)

    return asyncio.run(main())


@pytest.mark.parametrize("server", ["daemon", "prefill"])
def test_every_hostile_request_gets_its_precise_answer_and_the_server_serves_on(hostile_daemon, prefill_server, server):
    daemon, prefill = _targets(hostile_daemon, prefill_server)
    model = "smollm2-135m-instruct"
    if server == "daemon":
        target, cases = daemon, hostile_http.daemon_cases(hostile_daemon.config, model)
    else:
        target, cases = prefill, hostile_http.prefill_cases(prefill_server.config, model)

    async def work(http):
        results = [await hostile_http.send(http, target, case, BOUND_S) for case in cases]
        return results, await hostile_clients.healthy(http, target)

    results, (served, _) = _run(work)
    wrong = [f"{r.case.name}: {'; '.join(r.problems)}" for r in results if r.problems]
    assert not wrong, "\n".join(wrong)
    assert not [r for r in results if r.status is not None and r.status >= 500]
    assert {r.status for r in results} >= {200, 400, 401, 404, 405, 413}
    assert served  # a plain request afterwards


def test_slow_headers_and_bodies_on_the_prefill_server_are_cut_as_configured(prefill_server):
    prefill = Target("prefill", prefill_server.url, PREFILL_TOKEN)

    async def work(http):
        return (
            await hostile_clients.slow_headers(http, prefill, PREFILL_SETTINGS["header_timeout_s"]),
            await hostile_clients.slow_body(prefill, PREFILL_SETTINGS["client_timeout_s"]),
        )

    for finding in _run(work):
        assert finding.ok, finding.detail


def test_a_client_that_disconnects_mid_stream_frees_its_slot_at_once(hostile_daemon):
    """One slot: a stream holds it, a second request waits for it; the streaming client drops its
    connection mid-stream, and the waiting request gets the slot at once (not after the stream's
    2000 tokens)."""
    daemon = Target("daemon", hostile_daemon.url, hostile_daemon.token)
    left = "edgedecode_requests_total{endpoint=completions,status=499}"
    before = metric_samples(daemon.url, daemon.token).get(left, 0)

    async def work(http):
        host, port = daemon.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 1, "stream": True})
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {daemon.token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        got = b""
        while got.count(b"data:") < 3:  # it is streaming
            got += await asyncio.wait_for(reader.read(4096), 120)
        waiting = asyncio.create_task(hostile_clients.healthy(http, daemon))
        while (await hostile_clients.slots(http, daemon))["queued"] == 0:
            await asyncio.sleep(0.02)
        held = await hostile_clients.slots(http, daemon)
        writer.transport.abort()  # the streaming client is gone
        left_at = time.perf_counter()
        while (await hostile_clients.slots(http, daemon))["queued"]:
            await asyncio.sleep(0.01)
        handed_over = time.perf_counter() - left_at
        served, _ = await waiting
        return held, handed_over, served, time.perf_counter() - left_at, got

    held, handed_over, served, seconds, got = _run(work)
    assert held == {"total": 1, "busy": 1, "queued": 1}
    assert handed_over < 1.0  # the waiting request has the slot: within a decode step or two of the client leaving
    assert served and seconds < 10.0  # its whole answer (a pull and 2 tokens), not after the stream's 2000 tokens
    assert got.count(b"data:") < 2000
    assert metric_samples(daemon.url, daemon.token)[left] == before + 1  # counted as a client gone (499)


def test_a_client_that_leaves_before_its_whole_answer_frees_its_slot(hostile_daemon):
    """The same without streaming: the daemon noticed only once the whole answer was generated."""
    daemon = Target("daemon", hostile_daemon.url, hostile_daemon.token)
    finding = _run(lambda http: hostile_clients.leave(http, daemon, stream=False))
    assert finding.ok, finding.detail


def test_a_client_that_leaves_mid_payload_leaves_the_prefill_server_serving(prefill_server):
    prefill = Target("prefill", prefill_server.url, PREFILL_TOKEN)
    finding = _run(lambda http: hostile_clients.leave_mid_payload(http, prefill))
    assert finding.ok, finding.detail


def test_a_client_that_leaves_while_its_prefill_runs_is_a_quiet_499_and_the_server_serves_on(prefill_server):
    """The client hangs up while the server computes its payload (before the answer's headers): the
    server notes it in one line, logs no traceback, and answers the next request."""
    prefill = Target("prefill", prefill_server.url, PREFILL_TOKEN)
    depth = "edgedecode_prefill_queue_depth{}"
    log_before = prefill_server.log.stat().st_size

    async def work(http):
        host, port = prefill.url.removeprefix("http://").split(":")
        body = json.dumps({"token_ids": list(range(1000, 2500)), "budget": 0.3})  # a prefill of a second or more
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {PREFILL_TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            while not metric_samples(prefill.url, PREFILL_TOKEN)[depth]:
                await asyncio.sleep(0.01)
        writer.transport.abort()  # gone while its prefill runs: nothing of the answer was sent yet
        async with asyncio.timeout(BOUND_S):
            while metric_samples(prefill.url, PREFILL_TOKEN)[depth]:
                await asyncio.sleep(0.05)
        return await hostile_clients.healthy(http, prefill, BOUND_S)

    served, _ = _run(work)
    assert served
    with open(prefill_server.log, "rb") as log:
        log.seek(log_before)
        written = log.read().decode(errors="replace")
    assert "client gone before the end of its payload" in written, written[-2000:]
    assert "Traceback" not in written and "Error handling request" not in written, written[-2000:]


def test_floods_past_the_queues_get_429s_and_both_servers_serve_on(hostile_daemon, prefill_server):
    daemon, prefill = _targets(hostile_daemon, prefill_server)
    flood_daemon = 1 + hostile_daemon.config.daemon.max_queue + 3  # a slot, the queue, and 3 more

    async def work(http):
        return (
            await hostile_clients.flood(http, daemon, flood_daemon),
            await hostile_clients.flood(http, prefill, 4 * PREFILL_SETTINGS["max_queue"]),
        )

    for finding in _run(work):
        assert finding.ok, finding.detail
        assert set(finding.statuses) <= {"200", "429"}
