"""The prefill tier's HTTP ingress (a Ray Serve deployment behind Serve's HTTP proxy).

It reads a request's body (bounded as the prefill server bounds it), works out its ``Route`` and
hands it to a replica through Serve's router (``router.py``), then streams the replica's answer
back as the replica relays it. A replica lost before its answer began (killed, its node gone) is
retried on another; one lost after leaves the answer cut short, as a prefill server dying would:
the client keeps what it verified and resumes or computes the rest. ``GET /healthz`` is answered
here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edgedecode.config import Config
from edgedecode.prefill.fleet.replica import ForwardedRequest, ResponseHead
from edgedecode.prefill.fleet.route import route_for

logger = logging.getLogger(__name__)
REPLICA_LOST = (RayActorError, ActorUnavailableError)
ATTEMPTS = 3  # replicas tried for one request before it is answered 503
REPLICA_HEADER = "X-Prefill-Replica"  # names the replica that answered (informative)


class PrefillIngress:
    """A Serve deployment: the tier's HTTP surface in front of the replicas' handle."""

    def __init__(self, replicas: DeploymentHandle, config: Config) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = config.prefill.max_body_bytes
        self.client_timeout_s = config.prefill.client_timeout_s

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP request (Serve's proxy calls this with every request to the tier)."""
        if request.url.path == "/healthz":
            return JSONResponse({"status": "ok"})
        try:
            body = await self._body(request)
        except BodyRefused as refused:
            return refused.response
        forwarded = ForwardedRequest(
            request.method, request.url.path, request.url.query, tuple(request.headers.items()), body
        )
        route = route_for(request.method, request.url.path, request.query_params, body)
        lost: BaseException | None = None
        for _ in range(ATTEMPTS):
            answer = cast(DeploymentResponseGenerator, self.replicas.forward.remote(route, forwarded))
            try:
                head = await answer.__anext__()
            except REPLICA_LOST as exc:
                lost = exc
                logger.warning("a prefill replica was lost before answering; trying another: %s", exc)
                continue
            if not isinstance(head, ResponseHead):
                raise TypeError(f"a replica answered {type(head).__name__} before its ResponseHead")
            headers = dict(head.headers)
            headers[REPLICA_HEADER] = head.replica
            return StreamingResponse(answer, status_code=head.status, headers=headers)
        return _error(503, f"no prefill replica answered ({ATTEMPTS} tried; the last: {lost})", "server_error")

    async def _body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` of it, arriving within ``client_timeout_s``."""
        body = bytearray()
        try:
            async with asyncio.timeout(self.client_timeout_s):
                async for piece in request.stream():
                    body += piece
                    if len(body) > self.max_body_bytes:
                        raise BodyRefused(
                            _error(413, f"the body is larger than {self.max_body_bytes} bytes", "request_too_large")
                        )
        except TimeoutError:
            raise BodyRefused(
                _error(
                    408, f"the request body did not arrive within {self.client_timeout_s:g} s", "invalid_request_error"
                )
            ) from None
        return bytes(body)


class BodyRefused(Exception):
    """A request body not taken, with the answer to give."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _error(status: int, message: str, kind: str) -> JSONResponse:
    """An error in the prefill server's (OpenAI's) shape."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}, status_code=status
    )
