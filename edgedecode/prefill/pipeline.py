"""Prefill a prompt with the higher-precision graph, score its tokens, assign tiers under a budget
and encode the KV as EDKV frames.

The budget is on wire bytes (after zstd): tiers are first assigned against the raw cost model,
then the target is rescaled by the measured compression until the payload fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.importance import OBSERVATION_WINDOW, attention_importance, relative_importance
from edgedecode.kv.policy import BudgetError, TierProfile, policy_tiers
from edgedecode.kv.quant import token_nbytes
from edgedecode.kv.rotation import Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.stage_clock import UNCLOCKED, StageClock
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import tail_mask, tail_tokens, window_start, windowed_cost_scale
from edgedecode.kv.wire import TransferRef, decode_snapshot, encode_payload
from edgedecode.kv.wire.coder import SectionCoder
from edgedecode.kv.wire.writer import FAST_ZSTD_LEVEL, PlannedPayload
from edgedecode.model.spec import KVContract
from edgedecode.prefill.kv_device import KVDevice
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS, Engine, lone_row_free

# Tokens per EDKV chunk of the payloads served: a pull cut short keeps whole chunks (kv-format.md §5),
# so smaller chunks lose less. 128 rather than the format's default 256 costs ~1 % more bytes and
# ~5 % more ingest CPU: `python tools/bench/kv.py --tokens 2048 --cpu-time --chunk-tokens 128|256`
# (one core): INT4 b_zstd 0.305 vs 0.302 and decode 37.5 vs 35.8 ms; the mix 0.356 vs 0.353, 48.6 vs 45.8 ms.
PAYLOAD_CHUNK_TOKENS = 128
# zstd's level of every chunk of a served payload: level 3 gains INT8 codes 1.9 % (the rest 0.1-0.6 %) at 1.7x level
# 1's CPU, and an INT8-heavy budget (b 0.5) is what a daemon asks over a fast link, where the node's CPU costs more
# than those bytes: at 4k tokens, b 0.5, level 1 cut the fit's CPU by a third (docs/performance.md)
SERVED_ZSTD_LEVEL = FAST_ZSTD_LEVEL
_FIT_ATTEMPTS = 6
_CLOSE_ENOUGH = 0.99  # stop refitting once the payload uses this share of the budget
# The fit's first encode aims at this share of the budget, zstd's gain predicted from every FIT_SAMPLE_EVERY-th chunk
# compressed (kept for the encode): within _CLOSE_ENOUGH of it, one encode, where aiming at the raw budget needed two
_FIT_AIM = 0.995
_FIT_REAIM = 0.02  # aim again (one more sample) where the aim moved the raw target by this share or more
FIT_SAMPLE_EVERY = 8


@dataclass(frozen=True)
class ScoredPrefill:
    """A prompt's KV from the prefill graph and each token's attention importance."""

    snapshot: KVSnapshot
    importance: np.ndarray  # float32 [n]: attention from the observation window, summed over layers

    def from_position(self, position: int) -> ScoredPrefill:
        """The tokens at ``position`` and after: what a receiver that holds the positions before it needs."""
        start = int(np.searchsorted(self.snapshot.positions, position))
        return ScoredPrefill(self.snapshot.slots(start), self.importance[start:])


@dataclass(frozen=True)
class EncodedKV:
    """An EDKV payload (its frames in order) and what it cost."""

    frames: list[bytes]
    tiers: np.ndarray  # uint8 [n]
    fp16_bytes: int  # the same tokens' K and V at FP16
    raw_bytes: int  # tier payload before zstd (codes, scales, FP16 rows)

    @property
    def wire_bytes(self) -> int:
        return sum(len(frame) for frame in self.frames)

    @property
    def b_raw(self) -> float:
        return self.raw_bytes / self.fp16_bytes

    @property
    def b_wire(self) -> float:
        return self.wire_bytes / self.fp16_bytes

    def tier_counts(self) -> dict[str, int]:
        counts = np.bincount(self.tiers, minlength=len(Tier))
        return {tier.name: int(counts[tier]) for tier in Tier}


def prefill_observed(
    engine: Engine,
    prompt_ids: np.ndarray,
    window: int,
    kv: KVSnapshot | None = None,
    clock: StageClock = UNCLOCKED,
) -> tuple[np.ndarray, np.ndarray]:
    """Process the prompt on ``engine`` (from ``kv`` of a prefix of it if given, e.g. from a prefix
    cache) and return the pre-RoPE queries [layers, w, heads*head_dim] of its last w tokens and
    their positions.

    The last w tokens run as their own pass, which outputs their queries, so the prompt is
    processed once. Needs a graph built with ``emit_queries``; the prefill side scores token
    importance from these queries.

    Reproducible: the KV, queries and logits are bitwise those of the same prompt without ``kv``
    when ``kv`` was computed this way too (by this graph, prompts from position 0, as a prefix
    cache holds them). Of ``kv``, the leading positions 0, 1, 2, ... before the window are used;
    the window always runs (with the token before it for a window of 1, 129, ... tokens); the rest of
    the prompt in runs that leave no row alone (``chunk_sizes``), reusing one token fewer where
    only one would be left to run. ``clock`` times the stages "prefill" (the prompt before the window) and
    "observe" (the window's pass).
    """
    if not engine.options.emit_queries:
        raise EdgeDecodeError("this engine's graph was built without emit_queries")
    if not 0 < window <= PREFILL_CHUNK_TOKENS:
        raise ValueError(f"window must be in 1..{PREFILL_CHUNK_TOKENS}")
    prompt_ids = np.asarray(prompt_ids, np.int64)
    w = min(window, len(prompt_ids))
    # The last pass: the window, with the token before it where the window would leave a row
    # alone in its attention tile (a window of 1, 129, ... tokens).
    observed = w if lone_row_free(w) or w == len(prompt_ids) else w + 1
    head = len(prompt_ids) - observed
    injected = 0
    if kv is not None and head:
        injected = _leading_run(kv.positions, head)
        if head - injected == 1 and injected:  # run the last two rows before the window, not one alone
            injected -= 1
    with clock.stage("prefill"):
        engine.start(prompt_ids, kv if head else None, injected)
        if head > injected:
            engine.forward(prompt_ids[injected:head])
    with clock.stage("observe"):
        queries, positions = engine.run_with_queries(prompt_ids[head:])
    skip = observed - w
    return queries[:, skip:], positions[skip:]


def _leading_run(positions: np.ndarray, limit: int) -> int:
    """How many of ``positions`` are 0, 1, 2, ... from the start, below ``limit``."""
    n = int(np.searchsorted(positions, limit))
    gaps = np.flatnonzero(positions[:n] != np.arange(n))
    return int(gaps[0]) if len(gaps) else n


def prefill_and_score(
    engine: Engine,
    prompt_ids: np.ndarray,
    window: int = OBSERVATION_WINDOW,
    kv: KVSnapshot | None = None,
    *,
    device: KVDevice | None = None,
    clock: StageClock = UNCLOCKED,
) -> ScoredPrefill:
    """Run the prompt through ``engine`` (built with emit_queries), from ``kv`` of a prefix of it if
    given (e.g. from a prefix cache), and score every token: on ``device`` (onnxruntime where the
    engine runs, ``prefill.kv_device``), else with numpy (``kv.importance``, the reference; the two
    agree within float32 rounding). With ``kv`` from this engine the result is bitwise the one
    without it (see ``prefill_observed``). ``clock`` times prefill, observe, export and importance."""
    queries, query_positions = prefill_observed(engine, prompt_ids, window, kv, clock)
    with clock.stage("export"):
        snapshot = engine.export_kv()
    with clock.stage("importance"):
        if device is None:
            per_layer = attention_importance(engine.spec, queries, query_positions, snapshot.keys, snapshot.positions)
        else:
            per_layer = device.importance(engine.spec, queries, query_positions, snapshot)
        importance = per_layer.sum(axis=0)
    return ScoredPrefill(snapshot, importance)


def tier_costs(snapshot: KVSnapshot) -> dict[Tier, float]:
    """Raw wire bytes per token (all layers, K and V) of each tier."""
    c = snapshot.contract
    return {tier: c.n_layers * token_nbytes(tier, c.n_kv_heads, c.head_dim) for tier in Tier}


class BudgetTooSmallError(BudgetError):
    """A budget below the smallest payload possible for the tokens asked (every droppable token dropped:
    header and framing, and a sliding-window model's tail, ``kv.window``); ``minimum`` is that payload's b."""

    http_code = "budget_too_small"

    def __init__(self, budget: float, minimum: float, n_tokens: int) -> None:
        super().__init__(
            f"budget {budget:.3g} is below the smallest EDKV payload for these {n_tokens} tokens "
            f"(b {minimum:.4f}: header and framing, every token that may be dropped dropped); ask for at least "
            f"{math.ceil(minimum * 1e4) / 1e4:.4f}"
        )
        self.minimum = minimum


def payload_meta(policy: str, budget: float, extra: dict | None = None) -> dict:
    """The header meta of a payload encoded under ``policy`` and ``budget`` (plus ``extra``)."""
    return {"policy": policy, "budget": budget, **(extra or {})}


def encode_within_budget(
    scored: ScoredPrefill,
    budget: float,
    policy: str = "ours",
    *,
    profile: TierProfile | None = None,
    pdtrim_head_fraction: float = 0.5,
    meta: dict | None = None,
    workers: int = 1,
    transfer: TransferRef | None = None,
    windowed: bool = False,
    rotation: Rotation | None = None,
    device: KVDevice | None = None,
    clock: StageClock = UNCLOCKED,
    level: int = SERVED_ZSTD_LEVEL,
    fast_level: int | None = None,
) -> EncodedKV:
    """The policy's tiers at the largest raw target whose compressed payload stays within ``budget``
    (``workers``: threads encoding chunks at once; ``transfer``: the header's resume reference;
    ``rotation``: the tiers rotated before quantizing, for a receiver that reads EDKV 1.3).

    For a model with sliding-window layers the prompt's tail (``kv.window``) is never dropped; with
    ``windowed`` (the receiver reads EDKV 2.0) the windowed layers carry only that tail, and the
    tokens before it cost the allocator only their global layers' bytes.

    Where a tier could rise, the first encode aims at ``_FIT_AIM`` of the budget, zstd's gain predicted from a
    sample of the chunks at the raw budget's tiers (``PlannedPayload.predicted_bytes``; a keeping coder keeps the
    sampled chunks); each refit encodes the payload again. ``device`` (``prefill.kv_device``) computes the chunks there
    and keeps what a refit can reuse (a token's codes, unchanged sections and chunks); without it the
    reference coder computes every payload afresh. Either gives the same bytes (a CUDA device leaves a payload
    that may hold INT3 or a rotation to the host: ``KVDevice.coder``). ``clock`` times the
    stages allocate, header, quantize, assemble, compress and frame; ``level`` is zstd's, ``fast_level`` (if given)
    its level for chunks with no 8-bit codes (``encode_payload``; the budget binds the compressed bytes, so a level
    also moves the tiers a little; docs/performance.md measures what each costs)."""
    snapshot = scored.snapshot
    contract, n = snapshot.contract, snapshot.n_tokens
    costs = tier_costs(snapshot)
    fp16_bytes = int(costs[Tier.FP16] * n)
    meta = payload_meta(policy, budget, meta)
    windowed = windowed and tail_tokens(contract) > 0
    undroppable = tail_mask(n, contract) if tail_tokens(contract) else None
    cost_scale = windowed_cost_scale(n, contract) if windowed else None

    def tiers_at(target: float) -> np.ndarray:
        with clock.stage("allocate"):
            return policy_tiers(
                policy,
                target,
                snapshot.positions,
                costs,
                attention=scored.importance,
                profile=profile,
                pdtrim_head_fraction=pdtrim_head_fraction,
                cost_scale=cost_scale,
                undroppable=undroppable,
            )

    importance = relative_importance(scored.importance)
    int3 = Tier.INT3 in (profile or TierProfile()).allowed
    coder = None if device is None else device.coder(snapshot, rotation, int3)

    def planned(tiers: np.ndarray) -> tuple[int, PlannedPayload]:
        """The payload of ``tiers`` planned, and its raw bytes as the allocator counts them."""
        start = window_start(tiers != Tier.DROP, tail_tokens(contract)) if windowed else None
        scale = np.ones(n) if start is None else windowed_cost_scale(n, contract, start)
        raw = int(np.sum(np.array([costs[tier] for tier in Tier])[tiers] * scale))
        payload = served_payload(
            snapshot, tiers, meta, importance, transfer, workers, start, coder, clock, level, fast_level, rotation
        )
        return raw, payload

    def encode(tiers: np.ndarray) -> EncodedKV:
        raw, payload = planned(tiers)
        return EncodedKV(list(payload), tiers, fp16_bytes, raw)

    best: EncodedKV | None = None
    target = budget
    tiers = tiers_at(target)
    if (tiers != Tier.FP16).any():  # a tier to raise: aim the first encode by zstd's gain, predicted from a sample
        for _ in range(2):  # and again from the aimed tiers where they moved far (zstd gains differently on them)
            step = _FIT_AIM * budget * fp16_bytes / planned(tiers)[1].predicted_bytes(FIT_SAMPLE_EVERY)
            target *= step
            tiers = tiers_at(target)
            if abs(step - 1) < _FIT_REAIM:
                break
    encoded = encode(tiers)
    for _ in range(_FIT_ATTEMPTS):
        if encoded.b_wire <= budget and (best is None or encoded.b_wire > best.b_wire):
            best = encoded
        if best is not None and (best.b_wire >= _CLOSE_ENOUGH * budget or encoded is not best):
            break
        target *= budget / encoded.b_wire
        tiers = tiers_at(target)
        if np.array_equal(tiers, encoded.tiers):  # e.g. everything already FP16: encoding again changes nothing
            break
        encoded = encode(tiers)
    for _ in range(_FIT_ATTEMPTS):  # every refit overshot (zstd gained less than assumed): shrink until it fits
        if best is not None:
            return best
        target *= _CLOSE_ENOUGH * budget / encoded.b_wire
        encoded = encode(tiers_at(target))
        best = encoded if encoded.b_wire <= budget else None
    if best is not None:
        return best
    # Still over: as small as the policy goes (every token dropped; BudgetError where DROP is not allowed).
    smallest = encode(tiers_at(0.0))
    if smallest.b_wire > budget:
        raise BudgetTooSmallError(budget, smallest.b_wire, snapshot.n_tokens)
    return smallest


def through_wire(
    scored: ScoredPrefill,
    budget: float,
    policy: str,
    receiver: KVContract,
    *,
    profile: TierProfile | None = None,
    pdtrim_head_fraction: float = 0.5,
    windowed: bool = False,
    rotation: Rotation | None = None,
) -> tuple[KVSnapshot, EncodedKV]:
    """What a decoder with contract ``receiver`` gets for this prefill at ``budget`` under ``policy``;
    ``windowed``: as EDKV 2.0, the windowed layers' cells before the window read as zeros (a sliding
    layer never attends to them), as the daemon asks for it; ``rotation``: as EDKV 1.3, those tiers rotated."""
    encoded = encode_within_budget(
        scored,
        budget,
        policy,
        profile=profile,
        pdtrim_head_fraction=pdtrim_head_fraction,
        windowed=windowed,
        rotation=rotation,
    )
    return decode_snapshot(b"".join(encoded.frames), receiver), encoded


def served_payload(
    snapshot: KVSnapshot,
    tiers: np.ndarray,
    meta: dict,
    importance: np.ndarray,
    transfer: TransferRef | None = None,
    workers: int = 1,
    window_start: int | None = None,
    coder: SectionCoder | None = None,
    clock: StageClock = UNCLOCKED,
    level: int = SERVED_ZSTD_LEVEL,
    fast_level: int | None = None,
    rotation: Rotation | None = None,
) -> PlannedPayload:
    """A served payload (``encode_payload``: iterated, its frames): ``snapshot`` at ``tiers`` in PAYLOAD_CHUNK_TOKENS
    chunks encoded on ``workers`` threads, with each token's ``importance`` (``relative_importance``) for the
    receiver's memory ladder (and the windowed layers from ``window_start`` on only, where given; ``rotation``'s tiers
    rotated), its sections computed by ``coder`` (made for that rotation)."""
    return encode_payload(
        snapshot,
        tiers,
        chunk_tokens=PAYLOAD_CHUNK_TOKENS,
        meta=meta,
        workers=workers,
        transfer=transfer,
        importance=importance,
        window_start=window_start,
        rotation=rotation,
        coder=coder,
        clock=clock,
        level=level,
        fast_level=fast_level,
    )


def smallest_payload(snapshot: KVSnapshot, meta: dict, transfer: TransferRef | None = None) -> EncodedKV:
    """The payload of ``snapshot`` with every token dropped: header, empty chunks and trailer. Its
    size does not depend on the KV values, so a receiver's request can be sized before any prefill
    (``transfer``: a reference of the size the served payload will carry, if any)."""
    tiers = np.full(snapshot.n_tokens, Tier.DROP, np.uint8)
    costs = tier_costs(snapshot)
    fp16_bytes = int(costs[Tier.FP16] * snapshot.n_tokens)
    importance = np.zeros(snapshot.n_tokens, np.float32)  # its size on the wire does not depend on the values
    return EncodedKV(list(served_payload(snapshot, tiers, meta, importance, transfer)), tiers, fp16_bytes, 0)
