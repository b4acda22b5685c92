"""The decode daemon's Prometheus metrics, on their own registry (one per daemon in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from edgedecode.daemon.pull.segment import KVPullError
from edgedecode.kv.tiers import Tier
from edgedecode.serving.http import process_gauges

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SESSION_STATES = ("active", "resident", "compressed")
EVICTION_REASONS = ("memory", "max_sessions")
_RETIER_STEPS = ((Tier.FP16, Tier.INT4), (Tier.INT8, Tier.INT4), (Tier.INT4, Tier.DROP))


class DaemonMetrics:
    """Requests, latencies, KV traffic and tiers, fallbacks, and resident memory."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "edgedecode_requests_total",
            "Completion requests by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "edgedecode_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.inter_token = Histogram(
            "edgedecode_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1),
        )
        self.generated = Counter("edgedecode_generated_tokens_total", "Tokens generated.", registry=registry)
        self.kv_wire_bytes = Counter(
            "edgedecode_kv_wire_bytes_total", "EDKV bytes pulled from the prefill server.", registry=registry
        )
        self.kv_fp16_bytes = Counter(
            "edgedecode_kv_fp16_equivalent_bytes_total",
            "FP16 bytes of the KV pulled (what the wire bytes replaced).",
            registry=registry,
        )
        self.kv_tier_tokens = Counter(
            "edgedecode_kv_tier_tokens_total", "Tokens of pulled KV per tier.", ["tier"], registry=registry
        )
        for tier in Tier:
            self.kv_tier_tokens.labels(tier.name)
        self.kv_fetch = Histogram(
            "edgedecode_kv_fetch_seconds",
            "KV pull time, request to verified trailer.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.kv_tokens = Counter(
            "edgedecode_prompt_tokens_total",
            "Prompt tokens by where their KV came from: pulled, reused (held by a slot), or computed locally.",
            ["source"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "edgedecode_prefill_fallbacks_total",
            "Requests prefilled locally instead of by the prefill server, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in KVPullError.REASONS:
            self.fallbacks.labels(reason)
        self.decisions = Counter(
            "edgedecode_kv_decisions_total",
            "Where turns planned to get their KV: pulled (remote) or computed here (local).",
            ["decision"],
            registry=registry,
        )
        for decision in ("remote", "local"):
            self.decisions.labels(decision)
        self.reprobes = Counter(
            "edgedecode_link_reprobes_total",
            "Turns planned local that pulled instead, to measure a link not measured for long (daemon.link_reprobe_s).",
            registry=registry,
        )
        self.ttft_target = Counter(
            "edgedecode_ttft_target_total",
            "Turns with a time-to-first-token target, by whether their first token came in time.",
            ["met"],
            registry=registry,
        )
        for met in ("true", "false"):
            self.ttft_target.labels(met)
        self.queue_depth = Gauge("edgedecode_queue_depth", "Requests waiting for a decode slot.", registry=registry)
        self.active = Gauge("edgedecode_active_generations", "Requests holding a decode slot.", registry=registry)
        self.resident_kv = Gauge(
            "edgedecode_resident_kv_bytes", "Bytes of KV held in the decode slots.", registry=registry
        )
        self.breaker_open = Gauge(
            "edgedecode_prefill_breaker_open",
            "1 while the circuit breaker skips the prefill server.",
            registry=registry,
        )
        self.breaker_transitions = Counter(
            "edgedecode_prefill_breaker_transitions_total",
            "Times the prefill server's circuit breaker opened (to=open), or closed again after a good trial "
            "(to=closed).",
            ["to"],
            registry=registry,
        )
        for state in ("open", "closed"):
            self.breaker_transitions.labels(state)
        self.conversations = ConversationMetrics(registry)
        process_gauges(registry)


class ConversationMetrics:
    """Conversations whose KV is kept between turns, the KV memory they hold, and what the memory
    budget's pressure ladder did to them.

    States: "active" (a request holds the conversation's slot) and "resident" (idle in its slot) are
    set by the daemon; "compressed" (in the conversation store) and both counters by the store.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sessions = Gauge(
            "edgedecode_sessions",
            "Conversations whose KV is kept, by state: active (a request holds its slot), resident "
            "(idle in its slot), compressed (in the conversation store).",
            ["state"],
            registry=registry,
        )
        self.kv_memory = Gauge(
            "edgedecode_kv_memory_bytes",
            "Bytes of KV counted against daemon.kv_memory_mb, by conversation state.",
            ["state"],
            registry=registry,
        )
        for state in SESSION_STATES:
            self.sessions.labels(state)
            self.kv_memory.labels(state)
        self.retier = Counter(
            "edgedecode_kv_retier_total",
            "Tokens of kept conversations moved to a lower tier under memory pressure (to DROP: dropped).",
            ["from", "to"],
            registry=registry,
        )
        for high, low in _RETIER_STEPS:
            self.retier.labels(high.name, low.name)
        self.evictions = Counter(
            "edgedecode_session_evictions_total",
            "Conversations whose kept KV was discarded, by reason: memory (daemon.kv_memory_mb) or "
            "max_sessions (daemon.max_sessions).",
            ["reason"],
            registry=registry,
        )
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)
        self.kv_memory_peak = Gauge(
            "edgedecode_kv_memory_peak_bytes",
            "The most bytes of KV daemon.kv_memory_mb has counted at once since the daemon started.",
            registry=registry,
        )
        self.working_memory = Gauge(
            "edgedecode_working_memory_bytes",
            "Bytes of working memory counted against daemon.working_memory_mb: the prompt runs of turns and "
            "the KV scratch of moves to the store, restores and re-encodes.",
            registry=registry,
        )
        self.working_memory_allowance = Gauge(
            "edgedecode_working_memory_allowance_bytes",
            "daemon.working_memory_mb in bytes (as sized at start where it is 0).",
            registry=registry,
        )
        self.working_memory_peak = Gauge(
            "edgedecode_working_memory_peak_bytes",
            "The most bytes of working memory daemon.working_memory_mb has counted at once since the daemon started.",
            registry=registry,
        )
        self.active_evicted = Counter(
            "edgedecode_active_kv_evicted_tokens_total",
            "Tokens of an active conversation's own KV evicted so that its turn fits daemon.kv_memory_mb "
            "(the pressure ladder's last rung, once every idle conversation is evicted).",
            registry=registry,
        )
