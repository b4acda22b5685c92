"""Hostile and failing prefill peers: an aiohttp app on 127.0.0.1 that stands in front of a real
prefill server and answers a decode daemon's KV pulls the way it is told (``PrefillPeer.fault``).

Faults (``FAULTS``), each applied to every request (prefills and resumes) until changed:

* ``relay``: forward to the real server and stream its answer back unchanged (a healthy peer);
* ``hang``: accept the request and never answer (no status line);
* ``stall``: forward the first half of the real payload, then go silent, connection open;
* ``drip``: send the real payload one byte every ``DRIP_INTERVAL_S``;
* ``reset``: reset the connection before answering;
* ``reset_mid_stream``: forward the first half of the real payload, then reset the connection;
* ``errors``: answer 500 to the next ``burst`` requests, then relay again (a peer that recovers);
* ``other_model``: a well-formed payload for the same tokens from a model with another KV layout;
* ``other_prompt``: the real server's payload for another prompt of the same length.

A held connection (hang, stall, drip) ends when the daemon hangs up or the app shuts down.
``served`` counts the requests each fault answered.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import aiohttp
import numpy as np
from aiohttp import web

from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.kv.wire.header import contract_from_doc
from edgedecode.model.spec import KVContract

FAULTS = ("relay", "hang", "stall", "drip", "reset", "reset_mid_stream", "errors", "other_model", "other_prompt")
DRIP_INTERVAL_S = 0.05  # one byte per interval: 20 B/s, a body that never idles but never ends
HOLD_POLL_S = 0.05  # how often a held connection checks whether the daemon hung up
_RELAYED_HEADERS = (
    "Content-Type",
    "X-EDKV-Tokens",
    "X-EDKV-Wire-Bytes",
    "X-EDKV-FP16-Bytes",
    "X-Prefill-Seconds",
    "X-Prefill-Compute-Seconds",
)


class PrefillPeer:
    """A prefill endpoint in front of the real one at ``upstream_url`` (its bearer token
    ``upstream_token``), faulty as ``fault`` says; ``app()`` is the aiohttp application to serve."""

    def __init__(self, upstream_url: str, upstream_token: str) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.upstream_token = upstream_token
        self.fault = "relay"
        self.burst = 0  # 500s left to answer under the "errors" fault
        self.served: collections.Counter[str] = collections.Counter()
        self._contract: KVContract | None = None
        self._closing = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None

    def set_fault(self, fault: str, burst: int = 0) -> None:
        """Answer every request with ``fault`` from now on (``burst``: the 500s of "errors")."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        self.fault, self.burst = fault, burst

    def app(self) -> web.Application:
        """The peer's application: POST /v1/prefill and POST /v1/prefill/transfers/{id}."""
        app = web.Application()
        app.router.add_post("/v1/prefill", self._answer)
        app.router.add_post("/v1/prefill/transfers/{transfer_id}", self._answer)
        app.cleanup_ctx.append(self._session)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _session(self, _: web.Application):
        self._closing = asyncio.Event()  # bound to the app's event loop
        self._http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.upstream_token}"})
        yield
        await self._http.close()

    async def _shutdown(self, _: web.Application) -> None:
        self._closing.set()  # held connections end, so the runner's cleanup does not wait on them

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fault = self.fault
        if fault == "errors":
            if self.burst > 0:
                self.burst -= 1
                self.served["errors"] += 1
                return web.json_response({"error": {"message": "injected fault", "type": "server_error"}}, status=500)
            fault = "relay"
        self.served[fault] += 1
        if fault == "hang":
            await self._hold(request)
            return web.Response(status=504)  # never reaches the daemon, which has hung up
        if fault == "reset":
            return self._reset(request)
        if fault == "other_model":
            return web.Response(body=await self._other_model_payload(body), content_type="application/x-edkv")
        if fault == "other_prompt" and "token_ids" in body:
            ids = body["token_ids"]
            body = {**body, "token_ids": ids[::-1] if ids[::-1] != ids else ids[1:] + ids[:1]}
        return await self._relay(request, body, fault)

    async def _relay(self, request: web.Request, body: dict, fault: str) -> web.StreamResponse:
        """Forward ``body`` to the real server and its answer back, broken as ``fault`` says."""
        assert self._http is not None
        async with self._http.post(self.upstream_url + request.path, json=body) as upstream:
            if upstream.status != 200:
                return web.Response(status=upstream.status, body=await upstream.read(), content_type="application/json")
            payload = await upstream.read()
            headers = {name: upstream.headers[name] for name in _RELAYED_HEADERS if name in upstream.headers}
        try:
            return await self._send(request, headers, payload, fault)
        except ConnectionResetError:  # the daemon hung up first (its timeout)
            return web.Response(status=499)

    async def _send(
        self, request: web.Request, headers: dict[str, str], payload: bytes, fault: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        half = payload[: len(payload) // 2]
        if fault == "drip":
            for i in range(len(payload)):
                if self._gone(request):
                    break
                await response.write(payload[i : i + 1])
                await asyncio.sleep(DRIP_INTERVAL_S)
            return response
        if fault in ("stall", "reset_mid_stream"):
            await response.write(half)
            if fault == "stall":
                await self._hold(request)
            else:
                self._reset(request)
            return response
        await response.write(payload)
        await response.write_eof()
        return response

    async def _other_model_payload(self, body: dict) -> bytes:
        """A payload for the asked tokens from a model with 6 layers fewer than the real one."""
        contract = await self._real_contract()
        other = dataclasses.replace(contract, n_layers=max(contract.n_layers - 6, 1))
        ids = np.asarray(body.get("token_ids", [0]), np.int64)
        held = int(body.get("held_tokens", 0))
        ids = ids[held:] if held < len(ids) else ids[-1:]
        shape = (other.n_layers, other.n_kv_heads, len(ids), other.head_dim)
        keys = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        snapshot = KVSnapshot(
            other, ids, np.arange(held, held + len(ids)), keys, keys, KVProducer("other-model", "0" * 64, "prefill")
        )
        return b"".join(encode_payload(snapshot, np.full(len(ids), Tier.INT8, np.uint8)))

    async def _real_contract(self) -> KVContract:
        if self._contract is None:
            assert self._http is not None
            async with self._http.get(self.upstream_url + "/v1/models") as response:
                card = (await response.json())["data"][0]
            self._contract = contract_from_doc({"contract": card["kv_contract"]})
        return self._contract

    async def _hold(self, request: web.Request, limit_s: float = 3600.0) -> None:
        """Keep the connection open, silent, until the daemon hangs up or the app shuts down."""
        deadline = time.monotonic() + limit_s
        while not self._gone(request) and time.monotonic() < deadline:
            await asyncio.sleep(HOLD_POLL_S)

    def _gone(self, request: web.Request) -> bool:
        return request.transport is None or request.transport.is_closing() or self._closing.is_set()

    @staticmethod
    def _reset(request: web.Request) -> web.Response:
        if request.transport is not None:
            request.transport.abort()  # an RST where the daemon waits for bytes
        return web.Response(status=502)  # never sent: the connection is gone
