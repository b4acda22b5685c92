"""A turn's report: where its KV came from and what the turn took, sent as the ``edgedecode`` object
of its final response or stream chunk (docs/serving.md). The turn fills it from the values its owners
return: the memory ledger's ``Resume``, the remote's ``Pull`` and ``Fetched``, the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgedecode.daemon.memory.ledger import Resume
from edgedecode.daemon.pull.remote import Fetched, Pull


@dataclass
class TurnReport:
    """Where a turn's KV came from and what the turn took; sent as the ``edgedecode`` object."""

    kv_source: str = "local"  # "prefill_server" or "local" (a fallback names its reason)
    fallback_reason: str | None = None
    local_reason: str | None = None  # "prompt_logprobs": the request needs the prompt computed here (echo + logprobs)
    prompt_tokens: int = 0
    resume: str = "new"  # where the conversation's earlier KV was: "new" (none), "resident" (in its
    # slot), "compressed" (in the conversation store) or "evicted" (discarded under pressure: re-prefilled)
    reused_tokens: int = 0  # positions whose KV the slot held from the conversation's earlier turns
    restored_tokens: int = 0  # of those, positions whose KV came back from the compressed store
    restored_tiers: dict[str, int] = field(default_factory=dict)  # the tiers they were kept at (tokens)
    evicted_tokens: int = 0  # kept tokens whose KV this turn evicted to fit daemon.kv_memory_mb
    pulled_tokens: int = 0  # prompt positions whose KV the prefill server sent and the engine used
    computed_tokens: int = 0  # prompt positions run through the decode graph here (at least the last)
    budget: float | None = None  # first asked of the prefill server
    segments: list[dict] = field(default_factory=list)  # every request of the fetch (fetch.SegmentReport)
    wire_bytes: int = 0
    fp16_bytes: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    fetch_seconds: float = 0.0
    server_seconds: float | None = None  # the prefill server's share of fetch_seconds, as it reports it
    ttft_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    slot: int = -1
    decision: str | None = None  # the KV plan: "remote", "local" or "split" (None: no plan, e.g. no server)
    head_tokens: int = 0  # a split's leading tokens computed here while the rest was pulled
    server_held_tokens: int = 0  # leading prompt tokens the plan priced as held in the prefill server's prefix cache
    predicted_seconds: float | None = None  # the plan's predicted time to have the KV
    why: str | None = None  # what decided the plan
    ttft_target_seconds: float | None = None

    @property
    def target_met(self) -> bool | None:
        """Whether the first token came within the target (None: no target)."""
        return None if self.ttft_target_seconds is None else self.ttft_seconds <= self.ttft_target_seconds

    def resumed(self, resume: Resume, slot: int) -> None:
        """The conversation's earlier KV, as the turn's ``slot`` found it."""
        self.resume, self.reused_tokens, self.slot = resume.how, resume.keep, slot
        self.restored_tiers = resume.restored_tiers
        self.restored_tokens = resume.keep if resume.how == "compressed" else 0

    def pulled(self, pull: Pull) -> None:
        """What the remote made of the turn's KV (a split's tail reports with ``fetched`` once in)."""
        if pull.plan is not None:
            self.decision, self.predicted_seconds, self.head_tokens, self.why = (
                pull.plan.decision,
                pull.plan.predicted_s,
                pull.plan.head,
                pull.plan.why,
            )
        self.budget = pull.budget
        self.fallback_reason = pull.fallback
        self.server_held_tokens = pull.server_held
        if pull.fetched is not None:
            self.fetched(pull.fetched)

    def fetched(self, fetched: Fetched) -> None:
        """What the fetch brought."""
        outcome = fetched.outcome
        self.segments = [segment.to_json() for segment in outcome.segments]
        self.fetch_seconds = outcome.seconds
        self.fallback_reason = fetched.fallback
        if not fetched.tokens:
            return  # nothing arrived: the turn prefills locally
        self.kv_source = "prefill_server"
        self.pulled_tokens = fetched.tokens  # until the engine says which it computed (Turn.pieces)
        self.wire_bytes, self.fp16_bytes = outcome.wire_bytes, outcome.fp16_bytes
        self.tiers = outcome.tier_counts
        self.server_seconds = outcome.server_seconds

    def to_json(self) -> dict:
        return {
            "kv": {
                "source": self.kv_source,
                "fallback_reason": self.fallback_reason,
                "local_reason": self.local_reason,
                "resume": self.resume,
                "reused_tokens": self.reused_tokens,
                "restored_tokens": self.restored_tokens,
                "restored_tiers": self.restored_tiers,
                "evicted_tokens": self.evicted_tokens,
                "pulled_tokens": self.pulled_tokens,
                "computed_tokens": self.computed_tokens,
                "budget": self.budget,
                "segments": self.segments,
                "wire_bytes": self.wire_bytes,
                "fp16_bytes": self.fp16_bytes,
                "b_wire": round(self.wire_bytes / self.fp16_bytes, 4) if self.fp16_bytes else None,
                "tiers": self.tiers,
                "fetch_ms": round(self.fetch_seconds * 1e3, 2),
                "prefill_server_ms": None if self.server_seconds is None else round(self.server_seconds * 1e3, 2),
                "decision": self.decision,
                "head_tokens": self.head_tokens,
                "server_held_tokens": self.server_held_tokens,
                "predicted_ms": None if self.predicted_seconds is None else round(self.predicted_seconds * 1e3, 2),
                "why": self.why,
            },
            "ttft_target_ms": None if self.ttft_target_seconds is None else round(self.ttft_target_seconds * 1e3, 2),
            "ttft_target_met": self.target_met,
            "ttft_ms": round(self.ttft_seconds * 1e3, 2),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "slot": self.slot,
        }
