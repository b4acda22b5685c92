"""The held query (``POST /v1/prefill/held``): the prefill server says how much of a prompt its prefix cache holds,
from the prompt's block-chain hashes, and a planning daemon prices what another client left there before it plans
(real servers on 127.0.0.1 with the real model; ``daemon/pull/held_query.py``, docs/serving.md)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from openai import OpenAI
from serving_helpers import PREFILL_TOKEN, ServerProcess, ThreadedApp, metric_samples, server_config

from edgedecode.daemon.pull.held_query import MAX_SILENT, HeldQuery
from edgedecode.daemon.pull.link import LinkEstimate
from edgedecode.daemon.pull.segment import PullSettings
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, block_chain, chain_to_hex

B = DEFAULT_BLOCK_TOKENS
TOKEN = "daemon-secret"


def _ids(seed: int, n: int) -> list[int]:
    """``n`` token ids no other test's prompt shares a block with."""
    return np.random.default_rng(seed).integers(1000, 40000, n).tolist()


def _post(url: str, path: str, body: dict, token: str | None = PREFILL_TOKEN) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def _held(url: str, ids: list[int]) -> int:
    status, body, _ = _post(url, "/v1/prefill/held", {"blocks": chain_to_hex(block_chain(np.asarray(ids)))})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["block_tokens"] == B
    return answer["held_tokens"]


def test_the_prefill_server_says_how_much_of_a_prompt_its_prefix_cache_holds(prefill_server):
    url = prefill_server.url
    doc = _ids(1, 5 * B + 10)
    before = metric_samples(url, PREFILL_TOKEN)
    assert _held(url, doc) == 0
    status, payload, headers = _post(url, "/v1/prefill", {"token_ids": doc, "budget": 0.3})  # another client's
    assert status == 200 and payload.startswith(b"EDKV"), payload[:200]
    # its time, and the prefill pass's part of it (the rest: observation, scoring, encoding)
    assert 0 < float(headers["X-Prefill-Compute-Seconds"]) <= float(headers["X-Prefill-Seconds"])
    assert _held(url, doc) == 5 * B  # its complete blocks
    assert _held(url, doc + _ids(2, 3 * B)) == 5 * B  # a question after the document
    assert _held(url, doc[: 2 * B] + _ids(3, 3 * B)) == 2 * B  # sharing its first two blocks
    assert _held(url, _ids(4, 4 * B)) == 0

    status, body, _ = _post(url, "/v1/prefill/held", {"blocks": ["zz" * 16]})
    assert status == 400 and json.loads(body)["error"]["param"] == "blocks", body
    status, body, _ = _post(url, "/v1/prefill/held", {"blocks": chain_to_hex(block_chain(np.asarray(doc))), "x": 1})
    assert status == 400 and json.loads(body)["error"]["param"] == "x", body
    assert _post(url, "/v1/prefill/held", {"blocks": []}, token=None)[0] == 401

    after = metric_samples(url, PREFILL_TOKEN)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert added("edgedecode_prefill_held_queries_total{status=200}") == 5
    assert added("edgedecode_prefill_held_queries_total{status=400}") == 2
    assert added("edgedecode_prefill_requests_total{status=200}") == 1  # the prefill only


def _daemon(tmp_path, name: str, url: str, budget: float) -> ServerProcess:
    # budget 0: not pinned (the default objective plans every turn); local prefill pinned slow, so that a pull
    # could win whatever the box's speed
    config = server_config(tmp_path, name, prefill_token=PREFILL_TOKEN, budget=budget, local_prefill_tokens_per_s=50.0)
    return ServerProcess(
        ["serve", "--config", config, "--prefill-url", url],
        tmp_path / f"{name}.log",
        env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
    )


def _complete(server: ServerProcess, ids: list[int]) -> dict:
    client = OpenAI(base_url=server.url + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    completion = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=2, temperature=0)
    return completion.model_extra["edgedecode"]


def test_a_planning_daemon_prices_what_another_client_left_in_the_servers_cache(prefill_server, tmp_path):
    started = []
    try:
        for name, budget in (("another", 0.3), ("planning", 0.0), ("pinned", 0.3)):
            started.append(_daemon(tmp_path, name, prefill_server.url, budget))
        another, planning, pinned = started
        for seed, daemon in ((11, planning), (12, pinned)):  # each learns the link (its first pull is its probe)
            taught = _complete(daemon, _ids(seed, 3 * B))
            assert taught["kv"]["source"] == "prefill_server", taught
        # 16 blocks (47 MB of fp32 KV: within the server's 64 MB prefix cache): the compute a held answer saves (1024
        # tokens' prefill) outweighs the question's 50 ms wait however fast the box (it would need over 20k tokens/s
        # of fp32 prefill on the CPU not to)
        doc, question = _ids(13, 16 * B + 5), _ids(14, 20)
        assert _complete(another, doc)["kv"]["source"] == "prefill_server"  # the server now holds the document

        asked = _complete(planning, doc + question)
        assert asked["kv"]["server_held_tokens"] == 16 * B, asked  # asked before planning: not seen by this daemon
        assert asked["kv"]["decision"] == "remote", asked  # its local prefill is pinned at 50 tokens/s
        # a pinned budget pulls whatever the server holds: nothing asked, nothing believed
        assert _complete(pinned, doc + _ids(15, 20))["kv"]["server_held_tokens"] == 0
    finally:
        for server in reversed(started):
            server.stop()


LINK = LinkEstimate(goodput_bps=1e8, rtt_s=0.01, server_s_per_token=0.005)  # 64 tokens: 0.32 s to save


def _ask(query: HeldQuery, url: str, prompt: np.ndarray) -> int | None:
    settings = PullSettings(url, "", "ours", 1 << 20, aiohttp.ClientTimeout(total=5))

    async def ask() -> int | None:
        async with aiohttp.ClientSession() as http:
            return await query.ask(http, settings, prompt, rtt_s=0.01)

    return asyncio.run(ask())


def test_an_endpoint_without_the_route_is_not_asked_again():
    async def not_found(_: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    served = ThreadedApp.posting("/v1/prefill/held", not_found)
    try:
        query, prompt = HeldQuery(), np.asarray(_ids(21, 8 * B))
        assert query.worth_asking(served.url, len(prompt), 0, LINK)
        assert _ask(query, served.url, prompt) is None
        assert not query.worth_asking(served.url, len(prompt), 0, LINK)  # an older server: not asked again
    finally:
        served.stop()


def test_an_endpoint_that_keeps_answering_too_late_is_not_asked_again():
    async def late(_: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # the wait is 4 round trips of 10 ms, at least 50 ms
        return web.json_response({"held_tokens": 0, "block_tokens": B})

    served = ThreadedApp.posting("/v1/prefill/held", late)
    try:
        query, prompt = HeldQuery(), np.asarray(_ids(22, 8 * B))
        for _ in range(MAX_SILENT):
            assert query.worth_asking(served.url, len(prompt), 0, LINK)
            assert _ask(query, served.url, prompt) is None
        assert not query.worth_asking(served.url, len(prompt), 0, LINK)
    finally:
        served.stop()


@pytest.mark.parametrize(
    ("prompt_tokens", "believed", "server_s_per_token", "worth"),
    [
        (4 * B, 0, 0.005, True),
        (4 * B - 1, 0, 0.005, False),  # fewer than 4 complete blocks unknown
        (9 * B, 6 * B, 0.005, False),
        (10 * B, 6 * B, 0.005, True),
        (4 * B, 0, 0.0001, False),  # 256 tokens' server time (26 ms) is less than the 50 ms wait
        (4 * B, 0, None, False),  # the server's time unknown
    ],
)
def test_a_held_query_is_worth_asking_only_where_the_answer_can_save_more_than_its_wait(
    prompt_tokens, believed, server_s_per_token, worth
):
    link = LinkEstimate(goodput_bps=1e8, rtt_s=0.01, server_s_per_token=server_s_per_token)
    assert HeldQuery().worth_asking("http://127.0.0.1:1", prompt_tokens, believed, link) is worth
