"""Pull one segment of a prompt's KV from the prefill server into a decode engine's buffers while it downloads.

A segment is one HTTP request: the prompt after the positions held (``first_segment``), or the
rest of a prefill the server keeps under a transfer id, after the positions covered so far
(``resume_segment``). The response body is fed to the engine's KV handoff (``StreamedKV``) piece
by piece on a separate ingest thread, one network read ahead: verification, decompression and
dequantization of one piece overlap the download of the next. A complete segment is confirmed by
its trailer (``StreamedKV.finish``).

A ``watch`` may stop a segment early: it is asked after every network read and every
``WATCH_TICK_S`` of silence, and answers a reason to cut (e.g. the link slowed down so much that
the rest should come another way) or None. A cut segment keeps the tokens of its verified chunks
(``StreamedKV.cut``) and its ``PullResult`` says ``complete=False``. A segment that fails is cut
the same way and its result carries the ``KVPullError`` (with a short ``reason``, the label of
the fallback metric), so the caller may keep what arrived and resume or compute the rest.

A pull also times itself for the link model (``pull.link``): from sending the request to the
response headers, and from the first to the last piece of the body with the bytes after the first
(one clock reading per network read, nothing else per read).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import aiohttp
import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import KVFormatError, KVTooLargeError, KVTruncatedError
from edgedecode.kv.wire.frames import LOWBIT_MINOR, READABLE_MAJORS
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.runtime.kvcache import KVInjectionError

FEED_BYTES = 1 << 20  # hand the ingest thread at least this much at a time (fewer thread hops)
WATCH_TICK_S = 0.1  # the watch is asked at least this often while the body is silent

Watch = Callable[[float, int, int | None], str | None]
"""(seconds since the request was sent, body bytes received, body bytes announced or None) -> a
reason to cut the segment now, or None to go on."""


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
    """What one segment brought."""

    wire_bytes: int
    fp16_bytes: int  # the counted tokens' K and V at FP16
    tier_counts: dict[str, int]  # counted tokens per tier (a token's best tier over its layers)
    seconds: float
    server_seconds: float | None  # the prefill server's own time (its X-Prefill-Seconds header; informative)
    headers_seconds: float = 0.0  # request sent to response headers (round trip + server time); 0: none came
    transfer_seconds: float = 0.0  # from the body's first network read to its last (or to the failure that broke it)
    transfer_bytes: int = 0  # bytes of the reads after the first (0: the body came in one read)
    complete: bool = True  # False: cut by the watch, or by a failure (its verified tokens counted)
    cut_reason: str | None = None  # the watch's reason
    failure: KVPullError | None = None  # what ended the segment early, if a failure did
    server_reused_tokens: int | None = None  # prompt tokens the server's prefix cache held (X-Prefix-Reused-Tokens)
    server_compute_seconds: float | None = None  # the prefill's share of server_seconds (X-Prefill-Compute-Seconds)

    @property
    def tokens(self) -> int:
        """Tokens of the segment that count (kept or dropped)."""
        return sum(self.tier_counts.values())

    @property
    def ended(self) -> str:
        """How the segment ended: "complete", "cut" (by the watch) or the failure's reason."""
        if self.failure is not None:
            return self.failure.reason
        return "complete" if self.complete else "cut"


@dataclass(frozen=True)
class PullSettings:
    """Where to pull from and the limits of one pull."""

    url: str  # the prefill server's base URL
    token: str
    policy: str
    max_payload_bytes: int
    timeout: aiohttp.ClientTimeout


@dataclass(frozen=True)
class SegmentRequest:
    """One segment's HTTP request: its path on the prefill server and its JSON body."""

    path: str
    body: dict
    budget: float


def first_segment(prompt_ids: np.ndarray, held_tokens: int, budget: float, policy: str) -> SegmentRequest:
    """The prefill request: the KV of ``prompt_ids`` after the ``held_tokens`` positions held."""
    body = {"token_ids": prompt_ids.tolist(), "held_tokens": held_tokens, **_terms(budget, policy)}
    return SegmentRequest("/v1/prefill", body, budget)


def resume_segment(transfer_id: str, covered: int, budget: float, policy: str) -> SegmentRequest:
    """A resume of the prefill kept under ``transfer_id``: the KV of its positions from ``covered`` on."""
    body = {"held_tokens": covered, **_terms(budget, policy)}
    return SegmentRequest(f"/v1/prefill/transfers/{transfer_id}", body, budget)


def _terms(budget: float, policy: str) -> dict:
    """What every segment request asks of the payload: its budget and policy, and EDKV up to the newest
    major this daemon reads (2: windowed layers send only the tail they attend to) and the newest minor of it (2.1,
    as 1.3: INT3 and rotated tiers, which the reader undoes at ingest)."""
    major = max(READABLE_MAJORS)
    return {"budget": budget, "policy": policy, "edkv_major": major, "edkv_minor": LOWBIT_MINOR[major]}


@dataclass
class _Timing:
    """What one segment's transfer measured so far (filled in as it goes, read when it ends)."""

    received: int = 0
    first_bytes: int = 0  # bytes up to the end of the body's first read
    first_at: float = 0.0
    last_at: float = 0.0
    headers_seconds: float = 0.0
    server_seconds: float | None = None
    server_reused_tokens: int | None = None
    server_compute_seconds: float | None = None
    cut_reason: str | None = None


async def pull_segment(
    http: aiohttp.ClientSession,
    settings: PullSettings,
    request: SegmentRequest,
    stream: StreamedKV,
    ingest: Executor,
    kv_bytes_per_token_fp16: int,
    watch: Watch | None = None,
) -> PullResult:
    """Send ``request`` and stream the answer into ``stream``'s current segment, which has ended
    when this returns: complete, cut by ``watch`` (``cut_reason``), or cut at what it verified
    before a failure (``failure``: unreachable, timeout, an HTTP error, a payload cut short, too
    large or invalid)."""
    started = time.perf_counter()
    timing = _Timing()
    failure = None
    try:
        await _transfer(http, settings, request, stream, ingest, watch, timing)
    except KVPullError as exc:
        failure = exc
    segment = stream.segments[-1]
    header, tokens = segment.header, segment.tokens
    counts = np.zeros(len(Tier), np.int64)
    if header is not None:
        best = header.tiers[:, :tokens].min(axis=0, initial=max(Tier))  # a token's best tier over its layers
        counts = np.bincount(best, minlength=len(Tier))
    return PullResult(
        timing.received,
        tokens * kv_bytes_per_token_fp16,
        {tier.name: int(counts[tier]) for tier in Tier},
        time.perf_counter() - started,
        timing.server_seconds,
        timing.headers_seconds,
        timing.last_at - timing.first_at,
        timing.received - timing.first_bytes,
        complete=segment.complete,
        cut_reason=timing.cut_reason,
        failure=failure,
        server_reused_tokens=timing.server_reused_tokens,
        server_compute_seconds=timing.server_compute_seconds,
    )


async def _transfer(
    http: aiohttp.ClientSession,
    settings: PullSettings,
    request: SegmentRequest,
    stream: StreamedKV,
    ingest: Executor,
    watch: Watch | None,
    timing: _Timing,
) -> None:
    """The request and its body into ``stream`` (see ``pull_segment``); the segment has ended when
    this returns or raises KVPullError."""
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None  # the ingest thread's current piece of work
    buffered = bytearray()
    try:
        sent = time.perf_counter()
        # No redirects: the prompt goes to the configured server only, never on to where it points
        # (another host, or plain http after https).
        async with http.post(
            settings.url.rstrip("/") + request.path,
            json=request.body,
            headers=headers,
            timeout=settings.timeout,
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                detail = (await response.text())[:500]
                if 300 <= response.status < 400:
                    detail = f"a redirect to {response.headers.get('Location')!r}, not followed"
                client_fault = 400 <= response.status < 500 and response.status not in (408, 429)
                reason = "rejected" if client_fault else "http_error"
                raise KVPullError(reason, f"the prefill server answered {response.status}: {detail}")
            timing.headers_seconds = time.perf_counter() - sent
            timing.server_seconds = _header_float(response.headers.get("X-Prefill-Seconds"))
            timing.server_reused_tokens = _header_int(response.headers.get("X-Prefix-Reused-Tokens"))
            timing.server_compute_seconds = _header_float(response.headers.get("X-Prefill-Compute-Seconds"))
            announced = _header_int(response.headers.get("X-EDKV-Wire-Bytes"))
            while True:
                data = await _read(response.content, WATCH_TICK_S if watch is not None else None)
                if data == b"":
                    break
                now = time.perf_counter()
                if data:
                    timing.received += len(data)
                    timing.last_at = now
                    if not timing.first_bytes:
                        timing.first_bytes, timing.first_at = timing.received, now
                    if timing.received > settings.max_payload_bytes:
                        raise KVPullError(
                            "too_large", f"the KV payload exceeds max_payload_bytes ({settings.max_payload_bytes})"
                        )
                    buffered += data
                    if len(buffered) >= FEED_BYTES:
                        if pending is not None:
                            await pending
                        # hand the buffer itself over (no copy) and gather the next piece in a fresh one
                        pending, buffered = loop.run_in_executor(ingest, stream.feed, buffered), bytearray()
                if watch is not None:
                    timing.cut_reason = watch(now - sent, timing.received, announced)
                    if timing.cut_reason is not None:
                        break
        if pending is not None:
            await pending
        end = _feed_and_cut if timing.cut_reason is not None else _feed_and_finish
        pending = loop.run_in_executor(ingest, end, stream, buffered)
        await pending
    except KVPullError:
        raise
    except KVTruncatedError as exc:
        raise KVPullError("truncated", f"the KV payload ended early: {exc}") from None
    except KVTooLargeError as exc:
        raise KVPullError("too_large", f"the KV payload is too large: {exc}") from None
    except (KVFormatError, KVInjectionError) as exc:
        raise KVPullError("bad_payload", f"the KV payload was refused: {exc}") from None
    except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        failure = _network_failure(exc, timing.received, settings.url)
        if timing.first_bytes:
            timing.last_at = time.perf_counter()  # a silence before the failure is part of the transfer's time
        if pending is not None:
            await asyncio.wait([pending])  # the ingest thread's piece first
        if buffered and (pending is None or pending.exception() is None):
            # the bytes that arrived since are verified too (their complete chunks count), as in a cut:
            # a segment broken off keeps everything it received intact, not only what was handed over
            pending = loop.run_in_executor(ingest, _feed_and_cut, stream, buffered)
            await asyncio.wait([pending])
            pending.exception()  # a bad chunk among them: the connection's failure is still what is reported
        raise failure from None
    except aiohttp.ClientError as exc:
        raise KVPullError("http_error", f"the prefill request failed: {exc}") from None
    finally:
        if pending is not None and not pending.done():
            await asyncio.wait([pending])  # the caller reuses the KV buffers: the ingest thread must be done
        if not stream.ended:
            stream.cut()  # a failure: what was verified stays


async def _read(content: aiohttp.StreamReader, tick_s: float | None) -> bytes | None:
    """The body's next piece (b"" at its end); None after ``tick_s`` of silence (None: wait)."""
    if tick_s is None:
        return await content.readany()
    tick = asyncio.timeout(tick_s)
    try:
        async with tick:
            return await content.readany()
    except TimeoutError:
        if not tick.expired():
            raise  # aiohttp's own timeout
        return None


def _network_failure(exc: Exception, received: int, url: str) -> KVPullError:
    """The KVPullError for a segment whose connection failed after ``received`` body bytes."""
    if isinstance(exc, TimeoutError):
        return KVPullError("timeout", f"the prefill server timed out after {received} bytes")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return KVPullError("truncated", f"the KV download broke off after {received} bytes: {exc}")
    return KVPullError("unreachable" if received == 0 else "truncated", f"the prefill server at {url} failed: {exc}")


def _header_float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _header_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _feed_and_finish(stream: StreamedKV, data: bytearray) -> None:
    if data:
        stream.feed(data)
    stream.finish()


def _feed_and_cut(stream: StreamedKV, data: bytearray) -> None:
    """Feed what arrived (its complete chunks count), then cut the segment there."""
    try:
        if data:
            stream.feed(data)
    finally:
        stream.cut()
