"""The prefill node's work, independent of HTTP: validate a request, prefill it with the
higher-precision graph (from the prefix cache where a prefix is held), score and encode the KV the
client lacks under its budget.

Every onnxruntime call runs on one worker thread; the server awaits it, so its event loop never blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from edgedecode.errors import RequestError
from edgedecode.kv.policy import POLICIES, TierProfile, profile_path
from edgedecode.kv.prefix import chain_from_hex
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.stage_clock import StageClock
from edgedecode.kv.tiers import Tier, parse_tiers
from edgedecode.kv.wire import TransferRef
from edgedecode.kv.wire.frames import LOWBIT_MINOR, WINDOW_MAJOR
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.prefill.kv_device import KVDevice
from edgedecode.prefill.pipeline import (
    BudgetTooSmallError,
    EncodedKV,
    ScoredPrefill,
    encode_within_budget,
    payload_meta,
    prefill_and_score,
    smallest_payload,
)
from edgedecode.prefill.prefix_cache import PrefixCache
from edgedecode.prefill.transfers import TransferStore
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.session import default_threads

CHAT_ROLES = ("system", "user", "assistant")
Request = TypeVar("Request")
PREFILL_STALL_SECONDS = 300.0  # one prefill running longer than this marks the server unhealthy (watchdog)
WIDEST_FLOAT = -2.2250738585072014e-308  # a float whose JSON repr is as long as any (24 characters)


class PrefillRequestError(RequestError):
    """A prefill request that cannot be served as given."""


@dataclass(frozen=True)
class PrefillRequest:
    """What a client asks for: the KV of ``token_ids`` from position ``held_tokens`` on, at ``budget``."""

    token_ids: np.ndarray  # int64 [n], the whole prompt
    held_tokens: int  # leading positions whose KV the client already holds
    budget: float
    policy: str
    allowed: tuple[Tier, ...]
    edkv_major: int = 1  # the newest EDKV major the receiver reads: 2 takes windowed streams
    edkv_minor: int = 0  # the newest minor of that major it reads: 1.3 / 2.1 take INT3 and rotated tiers

    @property
    def lowbit(self) -> bool:
        """Whether the receiver reads EDKV 1.3 (and 2.1 where it asked for 2): the INT3 tier and ``rotation``."""
        return self.edkv_minor >= LOWBIT_MINOR[min(self.edkv_major, WINDOW_MAJOR)]

    @property
    def meta(self) -> dict:
        """What the payload's header meta records of the request beyond policy and budget."""
        return {"held_tokens": self.held_tokens}

    @classmethod
    def parse(
        cls, body: dict, model: LoadedModel, max_prompt_tokens: int, allow_special_tokens: bool = False
    ) -> PrefillRequest:
        """Validate a JSON body: exactly one of ``token_ids``, ``text`` or ``messages``; optional
        ``held_tokens`` (0), ``budget`` (1.0), ``policy`` ("ours"), ``allowed_tiers`` (all),
        ``edkv_major`` (1), ``edkv_minor`` (0) and ``model`` (must be this server's). Text spells control
        tokens only with ``allow_special_tokens``."""
        _check_known(body, {"model", "token_ids", "text", "messages", "held_tokens", *PAYLOAD_TERMS})
        if body.get("model") not in (None, model.record.name):
            raise PrefillRequestError(f"this server prefills {model.record.name!r}, not {body['model']!r}", "model")
        token_ids = _prompt(body, model, allow_special_tokens)
        if len(token_ids) < 1:
            raise PrefillRequestError("the prompt is empty", "token_ids")
        if len(token_ids) > max_prompt_tokens:
            raise PrefillRequestError(
                f"the prompt has {len(token_ids)} tokens; this server takes at most {max_prompt_tokens}", "token_ids"
            )
        return cls(token_ids, _held_tokens(body, len(token_ids)), *_payload_terms(body))


@dataclass(frozen=True)
class ResumeRequest:
    """What a client asks of a kept prefill: the KV of its positions from ``held_tokens`` on, at ``budget``."""

    transfer_id: str
    held_tokens: int
    budget: float
    policy: str
    allowed: tuple[Tier, ...]
    edkv_major: int = 1
    edkv_minor: int = 0

    @classmethod
    def parse(cls, transfer_id: str, body: dict) -> ResumeRequest:
        """Validate a JSON body: ``held_tokens`` (required), optional ``budget`` (1.0), ``policy``
        ("ours"), ``allowed_tiers`` (all), ``edkv_major`` (1) and ``edkv_minor`` (0); ``held_tokens`` is checked
        against the prompt once the transfer is found."""
        _check_known(body, {"held_tokens", *PAYLOAD_TERMS})
        if "held_tokens" not in body:
            raise PrefillRequestError("held_tokens is required: the positions the receiver holds", "held_tokens")
        held = body["held_tokens"]
        if not isinstance(held, int) or isinstance(held, bool) or held < 0:
            raise PrefillRequestError("held_tokens must be a non-negative integer", "held_tokens")
        return cls(transfer_id, held, *_payload_terms(body))

    def for_prompt(self, token_ids: np.ndarray) -> PrefillRequest:
        """The equivalent request for the transfer's prompt (PrefillRequestError if held_tokens is past it)."""
        held = _held_tokens({"held_tokens": self.held_tokens}, len(token_ids))
        return PrefillRequest(token_ids, held, self.budget, self.policy, self.allowed, self.edkv_major, self.edkv_minor)


PAYLOAD_TERMS = ("budget", "policy", "allowed_tiers", "edkv_major", "edkv_minor")


def _check_known(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise PrefillRequestError(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}", unknown[0]
        )


def _held_tokens(body: dict, n_tokens: int) -> int:
    held = body.get("held_tokens", 0)
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held < n_tokens:
        raise PrefillRequestError(f"held_tokens must be an integer in [0, {n_tokens}) for this prompt", "held_tokens")
    return held


def _payload_terms(body: dict) -> tuple[float, str, tuple[Tier, ...], int, int]:
    """The body's budget (1.0), policy ("ours"), allowed tiers (all), EDKV major (1) and minor (0), validated."""
    budget = body.get("budget", 1.0)
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= 1:  # NaN too
        raise PrefillRequestError("budget must be a number in (0, 1]: wire bytes / FP16 bytes", "budget")
    policy = body.get("policy", "ours")
    if policy not in POLICIES:
        raise PrefillRequestError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}", "policy")
    try:
        allowed = parse_tiers(body.get("allowed_tiers", [t.name for t in Tier]))
    except (ValueError, TypeError, AttributeError) as exc:
        raise PrefillRequestError(f"allowed_tiers: {exc}", "allowed_tiers") from None
    if Tier.FP16 not in allowed:
        raise PrefillRequestError("allowed_tiers must include fp16", "allowed_tiers")
    major = body.get("edkv_major", 1)
    if not isinstance(major, int) or isinstance(major, bool) or major < 1:
        raise PrefillRequestError("edkv_major must be a positive integer: the newest EDKV major read", "edkv_major")
    minor = body.get("edkv_minor", 0)
    if not isinstance(minor, int) or isinstance(minor, bool) or minor < 0:
        raise PrefillRequestError(
            "edkv_minor must be a non-negative integer: the newest minor of edkv_major read", "edkv_minor"
        )
    return float(budget), policy, allowed, major, minor


def _prompt(body: dict, model: LoadedModel, allow_special_tokens: bool) -> np.ndarray:
    given = [key for key in ("token_ids", "text", "messages") if key in body]
    if len(given) != 1:
        raise PrefillRequestError("give exactly one of token_ids, text or messages", "token_ids")
    value = body[given[0]]
    if given[0] == "token_ids":
        vocab = model.spec.vocab_size
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value
        ):
            raise PrefillRequestError(f"token_ids must be a list of integers in [0, {vocab})", "token_ids")
        return np.asarray(value, np.int64)
    if given[0] == "text":
        if not isinstance(value, str):
            raise PrefillRequestError("text must be a string", "text")
        return np.asarray(model.tokenizer.encode(value, parse_special=allow_special_tokens), np.int64)
    if not isinstance(value, list) or not value or not all(_chat_message(m) for m in value):
        raise PrefillRequestError(
            f"messages must be a non-empty list of {{role, content}} objects, role one of "
            f"{', '.join(CHAT_ROLES)}, content a string",
            "messages",
        )
    return np.asarray(model.tokenizer.encode_chat(value, special_in_content=allow_special_tokens), np.int64)


def _chat_message(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") in CHAT_ROLES and isinstance(message.get("content"), str)


@dataclass(frozen=True)
class PrefillResult:
    """An encoded answer and what producing it took."""

    encoded: EncodedKV
    prompt_tokens: int
    reused_tokens: int  # prompt positions whose KV came from the prefix cache (0 for a resume)
    seconds: float
    computed_tokens: int  # prompt positions this request ran through the prefill graph (0 for a resume)
    stages: dict[str, float] = field(default_factory=dict)  # wall seconds per stage (``kv.stage_clock``)


class PrefillService:
    """The prefill graph (higher precision, emits the queries that score tokens), its prefix cache
    and the measured tier profile of the model."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        device: str = "cpu",
        threads: int | None = None,
        max_prompt_tokens: int,
        prefix_cache_bytes: int,
        transfer_bytes: int = 0,
        transfer_ttl_s: float = 30.0,
        encode_threads: int = 1,
        allow_special_tokens: bool = False,
        transfer_id_prefix: str = "",
    ) -> None:
        """``transfer_bytes``/``transfer_ttl_s``: how much prefill KV is kept, and how long, for
        receivers to resume a cut pull (``transfers.TransferStore``; 0 bytes: none is kept);
        ``transfer_id_prefix`` starts its transfer ids (a replica's name in a prefill tier)."""
        self.model = model
        self.encode_threads = encode_threads
        self.allow_special_tokens = allow_special_tokens
        options = GraphOptions.for_device("prefill", device)
        self.max_prompt_tokens = min(max_prompt_tokens, model.spec.context_length)
        self.engine = Engine(model, options, max_context=self.max_prompt_tokens + 1, device=device, threads=threads)
        self.cache = PrefixCache(prefix_cache_bytes)
        self.transfers = TransferStore(transfer_bytes, transfer_ttl_s, id_prefix=transfer_id_prefix)
        self.profile = TierProfile.load(profile_path(model))
        # scoring and encoding on the engine's device (onnxruntime), the same bytes as the numpy reference
        self.kv_device = KVDevice(device, threads or default_threads())
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="edgedecode-prefill")
        self._busy_since: float | None = None  # when the running prefill started (monotonic)

    def parse(self, body: dict) -> PrefillRequest:
        """A validated request (PrefillRequestError names the field at fault)."""
        return PrefillRequest.parse(body, self.model, self.max_prompt_tokens, self.allow_special_tokens)

    def held_tokens(self, body: dict) -> int:
        """The held query's answer (``POST /v1/prefill/held``): how many leading tokens of the prompt whose block
        chain ``body["blocks"]`` names (``kv.prefix.chain_to_hex``) the prefix cache holds, at once and without the
        worker (PrefillRequestError names the field at fault)."""
        _check_known(body, {"model", "blocks"})
        if body.get("model") not in (None, self.model.record.name):
            raise PrefillRequestError(
                f"this server prefills {self.model.record.name!r}, not {body['model']!r}", "model"
            )
        try:
            chain = chain_from_hex(body.get("blocks"), self.max_prompt_tokens // self.cache.block_tokens)
        except ValueError as exc:
            raise PrefillRequestError(str(exc), "blocks") from None
        return self.cache.held_blocks(chain) * self.cache.block_tokens

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Run ``request`` on the worker thread; a budget that no payload can meet is refused first
        (BudgetTooSmallError), at once and without waiting for the worker."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.check_budget, request)
        return await loop.run_in_executor(self._worker, self._watched, self._prefill, request)

    async def resume(self, request: ResumeRequest) -> PrefillResult:
        """The KV of a kept prefill (``transfers``) from ``request.held_tokens`` on, at its budget,
        encoded on the worker thread; nothing is computed again.

        Raises:
            TransferNotFoundError: the transfer expired or is unknown (404).
            PrefillRequestError, BudgetTooSmallError: as for a prefill request.
        """
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._watched, self._resume, request)

    def check_budget(self, request: PrefillRequest) -> None:
        """Raise BudgetTooSmallError when ``request.budget`` is below the smallest payload for its
        tokens (every token dropped), whose size does not depend on the KV values."""
        contract, n = self.engine.spec.kv_contract, len(request.token_ids)
        zeros = np.broadcast_to(
            np.float16(0), (contract.n_layers, contract.n_kv_heads, n - request.held_tokens, contract.head_dim)
        )
        shell = KVSnapshot(
            contract,
            request.token_ids[request.held_tokens :],
            np.arange(request.held_tokens, n),
            zeros,
            zeros,
            self.engine.producer,
        )
        # the header records the budget asked: size it for the longest a float's repr can be, so the
        # minimum named holds for any budget a client then asks with
        meta = payload_meta(request.policy, WIDEST_FLOAT, request.meta)
        smallest = smallest_payload(shell, meta, self.transfers.placeholder()).b_wire
        if smallest > request.budget:
            raise BudgetTooSmallError(request.budget, smallest, shell.n_tokens)

    def healthy(self) -> bool:
        """No prefill has been running for more than PREFILL_STALL_SECONDS (what the systemd
        watchdog pings on: a worker stuck in one request is restarted, not left to hold the queue)."""
        since = self._busy_since
        return since is None or time.monotonic() - since < PREFILL_STALL_SECONDS

    def _watched(self, work: Callable[[Request], PrefillResult], request: Request) -> PrefillResult:
        self._busy_since = time.monotonic()
        try:
            return work(request)
        finally:
            self._busy_since = None

    def _prefill(self, request: PrefillRequest) -> PrefillResult:
        started, clock = time.perf_counter(), StageClock()
        ids = request.token_ids
        # The engine uses the hit only before the observation window (which always runs) and so that
        # every position's KV is bitwise what an empty cache would give: the payload does not depend
        # on what the cache holds.
        hit = self.cache.lookup(ids)
        scored = prefill_and_score(self.engine, ids, kv=hit.kv if hit else None, device=self.kv_device, clock=clock)
        reused = self.engine.stats.injected_tokens
        self.cache.store(scored.snapshot)
        encoded = self._encode(scored, request, self.transfers.put(scored), clock)
        seconds = time.perf_counter() - started
        return PrefillResult(encoded, len(ids), reused, seconds, len(ids) - reused, _stage_walls(clock))

    def _resume(self, resume: ResumeRequest) -> PrefillResult:
        started, clock = time.perf_counter(), StageClock()
        scored, transfer = self.transfers.get(resume.transfer_id)
        request = resume.for_prompt(scored.snapshot.token_ids)
        self.check_budget(request)
        encoded = self._encode(scored, request, transfer, clock)
        seconds = time.perf_counter() - started
        return PrefillResult(encoded, len(request.token_ids), 0, seconds, 0, _stage_walls(clock))

    def _encode(
        self, scored: ScoredPrefill, request: PrefillRequest, transfer: TransferRef | None, clock: StageClock
    ) -> EncodedKV:
        """The payload of ``request``'s positions of ``scored`` under its budget, policy and tiers."""
        readable = request.allowed if request.lowbit else tuple(t for t in request.allowed if t is not Tier.INT3)
        return encode_within_budget(
            scored.from_position(request.held_tokens),
            request.budget,
            request.policy,
            profile=self.profile.limited_to(readable),
            meta=request.meta,
            workers=self.encode_threads,
            transfer=transfer,
            windowed=request.edkv_major >= WINDOW_MAJOR,
            rotation=self.profile.rotation() if request.lowbit else None,
            device=self.kv_device,
            clock=clock,
        )

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def _stage_walls(clock: StageClock) -> dict[str, float]:
    """Wall seconds per stage; the writer's stages run on several threads at once, so they may add up to more
    than the request took."""
    return {name: times["wall_s"] for name, times in clock.as_dict().items()}
