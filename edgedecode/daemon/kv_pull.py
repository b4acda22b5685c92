"""Pull a prompt's KV from the prefill server into a decode engine's buffers while it downloads.

The response body is fed to the engine's KV handoff (``StreamedKV``) chunk by chunk on a separate
ingest thread, one network read ahead: verification, decompression and dequantization of one piece
overlap the download of the next; the ingest thread then confirms the stream's end (``finish``).
Every way this can fail ends in a ``KVPullError`` with a short ``reason`` (the label of the
fallback metric) and a message saying what happened.

A pull also times itself for the link model (``daemon.link``): from sending the request to the
response headers, and from the first to the last piece of the body with the bytes after the first
(one clock reading per network read, nothing else per read).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import aiohttp
import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVHeader, KVFormatError, KVTooLargeError, KVTruncatedError
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.runtime.kvcache import KVInjectionError

FEED_BYTES = 1 << 20  # hand the ingest thread at least this much at a time (fewer thread hops)


class KVPullError(EdgeDecodeError):
    """The KV could not be pulled; ``reason`` is one of REASONS."""

    REASONS = (
        "breaker_open",
        "unreachable",
        "timeout",
        "http_error",
        "rejected",
        "truncated",
        "bad_payload",
        "too_large",
    )

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def endpoint_fault(self) -> bool:
        """Whether this counts against the endpoint's health (a request it refused as invalid does not)."""
        return self.reason not in ("rejected", "breaker_open")


@dataclass(frozen=True)
class PullResult:
    """What one pull brought."""

    wire_bytes: int
    fp16_bytes: int  # the same tokens' K and V at FP16
    tier_counts: dict[str, int]  # tokens per tier
    seconds: float
    server_seconds: float | None  # the prefill server's own time (its X-Prefill-Seconds header; informative)
    headers_seconds: float = 0.0  # from sending the request to its response headers (round trip + server time)
    transfer_seconds: float = 0.0  # from the body's first network read to its last
    transfer_bytes: int = 0  # bytes of the reads after the first (0: the body came in one read)


@dataclass(frozen=True)
class PullSettings:
    """Where to pull from and the limits of one pull."""

    url: str  # the prefill server's base URL
    token: str
    budget: float
    policy: str
    max_payload_bytes: int
    timeout: aiohttp.ClientTimeout


async def pull_kv(
    http: aiohttp.ClientSession,
    settings: PullSettings,
    prompt_ids: np.ndarray,
    held_tokens: int,
    stream: StreamedKV,
    ingest: Executor,
    kv_bytes_per_token_fp16: int,
) -> PullResult:
    """POST the prompt to the prefill server and stream the answer into ``stream``; on success the
    stream is complete (``stream.finish()`` has returned its header).

    Raises:
        KVPullError: unreachable, timeout, an HTTP error, a payload cut short, too large or invalid.
    """
    started = time.perf_counter()
    body = {
        "token_ids": prompt_ids.tolist(),
        "held_tokens": held_tokens,
        "budget": settings.budget,
        "policy": settings.policy,
    }
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    loop = asyncio.get_running_loop()
    received = 0
    first_bytes, first_at, last_at = 0, 0.0, 0.0  # the body's first read (bytes to its end, time); the last read
    pending: asyncio.Future | None = None  # the ingest thread's current piece of work
    try:
        sent = time.perf_counter()
        async with http.post(
            settings.url.rstrip("/") + "/v1/prefill", json=body, headers=headers, timeout=settings.timeout
        ) as response:
            if response.status != 200:
                detail = (await response.text())[:500]
                client_fault = 400 <= response.status < 500 and response.status not in (408, 429)
                reason = "rejected" if client_fault else "http_error"
                raise KVPullError(reason, f"the prefill server answered {response.status}: {detail}")
            headers_seconds = time.perf_counter() - sent
            server_seconds = _header_seconds(response.headers.get("X-Prefill-Seconds"))
            buffered = bytearray()
            async for data in response.content.iter_any():
                received += len(data)
                last_at = time.perf_counter()
                if not first_bytes:
                    first_bytes, first_at = received, last_at
                if received > settings.max_payload_bytes:
                    raise KVPullError(
                        "too_large", f"the KV payload exceeds max_payload_bytes ({settings.max_payload_bytes})"
                    )
                buffered += data
                if len(buffered) >= FEED_BYTES:
                    if pending is not None:
                        await pending
                    # hand the buffer itself over (no copy) and gather the next piece in a fresh one
                    pending, buffered = loop.run_in_executor(ingest, stream.feed, buffered), bytearray()
            if pending is not None:
                await pending
            pending = loop.run_in_executor(ingest, _feed_and_finish, stream, buffered)
            header = await pending
    except KVPullError:
        raise
    except KVTruncatedError as exc:
        raise KVPullError("truncated", f"the KV payload ended early: {exc}") from None
    except KVTooLargeError as exc:
        raise KVPullError("too_large", f"the KV payload is too large: {exc}") from None
    except (KVFormatError, KVInjectionError) as exc:
        raise KVPullError("bad_payload", f"the KV payload was refused: {exc}") from None
    except TimeoutError:
        raise KVPullError("timeout", f"the prefill server timed out after {received} bytes") from None
    except aiohttp.ClientPayloadError as exc:
        raise KVPullError("truncated", f"the KV download broke off after {received} bytes: {exc}") from None
    except aiohttp.ClientConnectionError as exc:
        reason = "unreachable" if received == 0 else "truncated"
        raise KVPullError(reason, f"the prefill server at {settings.url} failed: {exc}") from None
    except aiohttp.ClientError as exc:
        raise KVPullError("http_error", f"the prefill request failed: {exc}") from None
    finally:
        if pending is not None and not pending.done():
            await asyncio.wait([pending])  # the caller reuses the KV buffers: the ingest thread must be done
    best = header.tiers.min(axis=0, initial=max(Tier))  # a token's best tier over its layers (none: no tokens)
    counts = np.bincount(best, minlength=len(Tier))
    return PullResult(
        received,
        header.n_tokens * kv_bytes_per_token_fp16,
        {tier.name: int(counts[tier]) for tier in Tier},
        time.perf_counter() - started,
        server_seconds,
        headers_seconds,
        last_at - first_at,
        received - first_bytes,
    )


def _header_seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _feed_and_finish(stream: StreamedKV, data: bytearray) -> EDKVHeader:
    if data:
        stream.feed(data)
    return stream.finish()
