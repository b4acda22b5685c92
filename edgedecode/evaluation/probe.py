"""`edgedecode probe`: which KV tiers a model tolerates, measured once per deployment.

For each quantized tier, every context token is sent at that tier (INT4, INT3 and INT2 both plain and
rotated, EDKV 1.3: the profile keeps the rotation where its KL is lower, and measures the tier so);
perplexity of a teacher-forced continuation (t-interval over contexts)
and needle retrieval (Wilson interval) are compared with FP16 transfer. A tier is tolerated when the
upper end of its Δ PPL interval stays under the limit and its needle rate is not below FP16's
interval. Dropping half the droppable tokens (least attended first; not pinned, not a windowed
model's tail: kv/window.py) calibrates DROP, so each tier's distortion is per-token KL relative to a
dropped token's: the exchange rate the allocator trades bytes with. (Per unit of the allocator's
importance weight instead, the dropped half being the least attended, INT3 came out ten times cheaper
against DROP and the allocator kept 78 % of tokens at INT3 at b 0.2 where it keeps 64 % at INT4
today: mean KL 0.0156 against 0.0088 on SmolLM2, docs/kv-quality.md. Per token it is.) A tier that is
not tolerated for every token is still allowed where it loses less per token than dropping it: the
allocator gives such a tier only to tokens it would otherwise drop (the least important), as DROP
itself is always allowed. The verdict is saved beside the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.evaluation.niah import answer, needle_trials
from edgedecode.evaluation.scoring import mean_kl, score_continuation
from edgedecode.evaluation.stats import mean_interval, wilson_interval
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.evaluation.transfer import with_tiers
from edgedecode.kv.policy import TierProfile, pinned_mask
from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation
from edgedecode.kv.tiers import QUANTIZED_TIERS, Tier
from edgedecode.kv.value_range import KVValueRange
from edgedecode.kv.window import tail_mask
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.model.spec import KVContract
from edgedecode.prefill.pipeline import prefill_and_score
from edgedecode.progress import NO_PROGRESS, Progress
from edgedecode.runtime.engine import Engine


class ProbeError(EdgeDecodeError):
    """The probe's settings cannot measure what it needs."""


@dataclass(frozen=True)
class ProbeSettings:
    contexts: int = 4
    context_tokens: int = 1024
    continuation_tokens: int = 128
    niah_tokens: int = 1000  # research/niah.md: FP16 retrieval is reliable at 1k, a coin flip at 2k
    niah_depths: int = 5
    niah_trials_per_depth: int = 2
    max_dppl_pct: float = 2.0
    threads: int | None = None


@dataclass(frozen=True)
class TierVerdict:
    tier: str
    dppl_pct: float
    dppl_high_pct: float
    kl: float
    needle_hits: int
    needle_trials: int
    tolerated: bool
    reason: str


def run_probe(
    model: LoadedModel, settings: ProbeSettings = ProbeSettings(), progress=print, tracker: Progress = NO_PROGRESS
) -> tuple[TierProfile, list[TierVerdict]]:
    """Measure every quantized tier and DROP; return the profile (not yet saved) and the verdicts.

    ``progress`` gets a line as each context and needle trial is done; ``tracker`` counts them.
    """
    s = settings
    if not droppable(np.arange(s.context_tokens), model.spec.kv_contract).any():
        tail = " and the windowed tail" if model.spec.sliding_window else ""
        raise ProbeError(
            f"contexts of {s.context_tokens} tokens leave none to drop for the DROP calibration (the first and "
            f"last ones are pinned{tail}): give more context tokens"
        )
    context_len = max(s.context_tokens + s.continuation_tokens, s.niah_tokens + 128) + 64
    prefiller = Engine(model, GraphOptions("prefill"), max_context=context_len, threads=s.threads)
    # Perplexity is scored with exact arithmetic over the INT4 weights (acc 0): the deployed acc-4 graph's
    # int8 activations add KL ≈ 0.002–0.004 to any input change, more than INT8 KV costs. Needles decode
    # with the deployed graph.
    scorer = Engine(model, GraphOptions(accuracy_level=0), max_context=context_len, threads=s.threads)
    decoder = Engine(model, GraphOptions(), max_context=context_len, threads=s.threads)
    contract = model.spec.kv_contract
    windows = calibration_windows(model, s)
    dnll: dict[Tier, list[float]] = {t: [] for t in (*QUANTIZED_TIERS, Tier.DROP)}
    kl: dict[Tier, list[float]] = {t: [] for t in dnll}  # mean KL(FP16 transfer ‖ tier) per context
    dnll_rotated: dict[Tier, list[float]] = {t: [] for t in DEFAULT_ROTATION.tiers}  # the same, rotated (1.3)
    kl_rotated: dict[Tier, list[float]] = {t: [] for t in DEFAULT_ROTATION.tiers}
    affected: dict[Tier, int] = {}  # tokens sent at that tier per context
    value_range: KVValueRange | None = None  # the calibration contexts' KV magnitudes (kv/value_range.py)
    with tracker.task("probe: perplexity contexts", len(windows), "context") as advance:
        for index, window in enumerate(windows):
            context, continuation = window[: s.context_tokens], window[s.context_tokens :]
            scored = prefill_and_score(prefiller, context)
            snap, n = scored.snapshot, scored.snapshot.n_tokens
            if value_range is None:
                value_range = KVValueRange.measure([snap], calibration_source(s))
            else:
                value_range = value_range.widened(snap)
            fp16 = with_tiers(snap, np.zeros(n, np.uint8), contract)
            reference = score_continuation(scorer, context, continuation, fp16)
            for tier, tiers in _probe_tiers(scored.importance, droppable(snap.positions, contract)):
                score = score_continuation(scorer, context, continuation, with_tiers(snap, tiers, contract))
                dnll[tier].append(score.mean_nll - reference.mean_nll)
                kl[tier].append(mean_kl(reference, score))
                affected[tier] = int((tiers == tier).sum())
                if tier in kl_rotated:
                    turned = with_tiers(snap, tiers, contract, DEFAULT_ROTATION)
                    score = score_continuation(scorer, context, continuation, turned)
                    dnll_rotated[tier].append(score.mean_nll - reference.mean_nll)
                    kl_rotated[tier].append(mean_kl(reference, score))
            progress(f"probe: context {index + 1}/{len(windows)} scored")
            advance(1)
    rotated = tuple(t for t in kl_rotated if np.mean(kl_rotated[t]) < np.mean(kl[t]))  # where it helps this model
    for tier in rotated:
        dnll[tier], kl[tier] = dnll_rotated[tier], kl_rotated[tier]
    rotation = replace(DEFAULT_ROTATION, tiers=rotated) if rotated else None
    needle = _needle_hits(model, prefiller, decoder, s, progress, tracker, rotation)
    fp16_low, _ = wilson_interval(needle[Tier.FP16], len(needle["trials"]))
    per_token = {tier: float(np.mean(kl[tier])) / affected[tier] for tier in kl}
    verdicts, allowed, distortion = [], [Tier.FP16], {Tier.FP16: 0.0, Tier.DROP: 1.0}
    for tier in QUANTIZED_TIERS:
        mean, _, high = mean_interval(dnll[tier])
        hits, trials = needle[tier], len(needle["trials"])
        dppl, dppl_high = 100 * math.expm1(mean), 100 * math.expm1(high)
        ppl_ok, needle_ok = dppl_high <= s.max_dppl_pct, hits / trials >= fp16_low
        reason = (
            "; ".join(
                filter(
                    None,
                    [
                        None if ppl_ok else f"Δ PPL upper bound {dppl_high:+.2f} % > {s.max_dppl_pct:g} %",
                        None if needle_ok else f"needle {hits}/{trials} below FP16's interval (≥ {fp16_low:.2f})",
                    ],
                )
            )
            or "within limits"
        )
        verdicts.append(
            TierVerdict(
                tier.name, dppl, dppl_high, float(np.mean(kl[tier])), hits, trials, ppl_ok and needle_ok, reason
            )
        )
        distortion[tier] = max(per_token[tier] / per_token[Tier.DROP], 0.0) if per_token[Tier.DROP] > 0 else 1.0
        below_drop = distortion[tier] < distortion[Tier.DROP]
        if (ppl_ok and needle_ok) or below_drop:
            allowed.append(tier)
        if below_drop and not (ppl_ok and needle_ok):
            verdicts[-1] = replace(
                verdicts[-1],
                reason=f"{reason}; allowed in place of DROP (distortion {distortion[tier]:.2f} per token, DROP's 1)",
            )
    allowed.append(Tier.DROP)
    source = (
        f"edgedecode probe: {s.contexts} contexts × {s.continuation_tokens} tokens, needle "
        f"{len(needle['trials'])} trials at {s.niah_tokens} tokens (FP16 {needle[Tier.FP16]}/{len(needle['trials'])})"
    )
    return TierProfile(tuple(allowed), distortion, source, rotated, value_range), verdicts


def calibration_windows(model: LoadedModel, settings: ProbeSettings) -> list[np.ndarray]:
    """The probe's calibration text: ``contexts`` windows of context and continuation tokens of pydoc prose."""
    s = settings
    return token_windows(model.tokenizer, pydoc_corpus(), s.context_tokens + s.continuation_tokens + 1, s.contexts)


def calibration_contexts(model: LoadedModel, settings: ProbeSettings) -> list[np.ndarray]:
    """The prompts whose KV the probe prefills (each window's context part): where the KV value range is measured."""
    return [window[: settings.context_tokens] for window in calibration_windows(model, settings)]


def calibration_source(settings: ProbeSettings) -> str:
    """How a value range measured on ``calibration_contexts`` was measured."""
    return f"{settings.contexts} calibration contexts of {settings.context_tokens} tokens (pydoc prose), prefill graph"


def droppable(positions: np.ndarray, contract: KVContract) -> np.ndarray:
    """bool [n]: the tokens a policy may drop: not pinned, not in a windowed model's tail."""
    return ~pinned_mask(positions) & ~tail_mask(len(positions), contract)


def _probe_tiers(importance: np.ndarray, may_drop: np.ndarray):
    """(tier, tiers [n]) per probed tier: all tokens at a quantized tier; or half the droppable
    tokens, least attended first, dropped (the rest FP16)."""
    n = len(may_drop)
    for tier in QUANTIZED_TIERS:
        yield tier, np.full(n, tier, np.uint8)
    candidates = np.flatnonzero(may_drop)
    dropped = candidates[np.argsort(importance[candidates], kind="stable")[: len(candidates) // 2]]
    tiers = np.zeros(n, np.uint8)
    tiers[dropped] = Tier.DROP
    yield Tier.DROP, tiers


def _needle_hits(
    model: LoadedModel,
    prefiller: Engine,
    decoder: Engine,
    s: ProbeSettings,
    progress,
    tracker: Progress,
    rotation: Rotation | None,
) -> dict:
    trials = needle_trials(
        model.tokenizer,
        context_tokens=s.niah_tokens,
        depth_count=s.niah_depths,
        trials_per_depth=s.niah_trials_per_depth,
        seed=1,
    )
    hits: dict = {tier: 0 for tier in (Tier.FP16, *QUANTIZED_TIERS)}
    with tracker.task("probe: needle trials", len(trials), "trial") as advance:
        for index, trial in enumerate(trials):
            snap = prefill_and_score(prefiller, trial.prompt_ids).snapshot
            for tier in hits:
                kv = with_tiers(snap, np.full(snap.n_tokens, tier, np.uint8), model.spec.kv_contract, rotation)
                hits[tier] += answer(decoder, model.tokenizer, trial, kv)
            progress(f"probe: needle {index + 1}/{len(trials)}")
            advance(1)
    hits["trials"] = trials
    return hits
