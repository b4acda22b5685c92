"""Tier assignment under a byte budget: the allocator and the named policies the harness compares.

Budget b is bytes ÷ FP16 bytes of the same tokens. The allocator works on the raw (pre-zstd) cost
of each tier; ``prefill/pipeline.py`` scales its target so the compressed payload meets b.

The allocator maximises importance-weighted fidelity, sum_t importance_t * (1 - distortion(tier_t)):
every kept token starts at the cheapest allowed kept tier, tokens are dropped only when even that
does not fit (least important first), and the remaining bytes buy upgrades in order of fidelity
gained per byte. Pinned tokens (attention sinks, the recent window) weigh ten to twenty times the
most important scored token: they are kept first and upgraded first at every step, but a
near-lossless step for them (INT8 -> FP16) does not outbid a real one for others (INT4 -> INT8).
Among pinned tokens the sinks and the newest rank highest and the recent window's oldest lowest, so
a budget too small for all of them drops the window's oldest first, never the prompt's last tokens
(in a chat prompt, the generation prompt itself).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.importance import position_importance
from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation
from edgedecode.kv.tiers import Tier
from edgedecode.kv.value_range import PROFILE_KEY, KVValueRange
from edgedecode.model.registry import model_dir

if TYPE_CHECKING:
    from edgedecode.model.loader import LoadedModel

PROFILE_FILE = "tier_profile.json"
POLICIES = ("ours", "uniform-int8", "uniform-int4", "position", "pdtrim")
SINK_TOKENS = 4
RECENT_TOKENS = 64
_PIN_FACTOR = 10.0  # a pinned token weighs this much more than the most important scored one


class BudgetError(EdgeDecodeError, ValueError):
    """A budget that the allowed tiers cannot meet, or a policy that does not exist."""

    http_status = 422
    http_type = "invalid_request_error"
    http_code = "unprocessable"
    param = "budget"


@dataclass(frozen=True)
class TierProfile:
    """Which tiers a model tolerates and how much of a token's contribution each one loses.

    ``distortion`` is relative to dropping the token (DROP = 1, FP16 = 0). The defaults come from
    research/kv_calibration.md on SmolLM2 (KL per affected token vs that of dropped tokens; INT3, rotated:
    docs/kv-quality.md); ``edgedecode probe`` measures them per model and saves them beside it.
    ``rotated``: the tiers the probe found better rotated (EDKV 1.3, ``kv.rotation``) on this model — a
    rotation helps SmolLM2's INT4/INT3/INT2 and hurts Gemma 3's (docs/kv-quality.md); none by default.
    """

    allowed: tuple[Tier, ...] = (Tier.FP16, Tier.INT8, Tier.INT4, Tier.DROP)
    distortion: Mapping[Tier, float] = field(
        default_factory=lambda: {
            Tier.FP16: 0.0,
            Tier.INT8: 0.0002,
            Tier.INT4: 0.07,
            Tier.INT3: 0.3,
            Tier.INT2: 3.0,
            Tier.DROP: 1.0,
        }
    )
    source: str = "default (research/kv_calibration.md)"
    rotated: tuple[Tier, ...] = ()
    value_range: KVValueRange | None = None  # the probe's measured KV magnitudes (None: not measured)

    def rotation(self) -> Rotation | None:
        """The rotation an EDKV 1.3 receiver's payloads get for this model: the default one, on ``rotated``."""
        return replace(DEFAULT_ROTATION, tiers=self.rotated) if self.rotated else None

    def limited_to(self, readable: Collection[Tier]) -> TierProfile:
        """This profile with only the allowed tiers a receiver can read (``readable``); every other field kept."""
        return replace(self, allowed=tuple(t for t in self.allowed if t in readable))

    def to_json(self) -> str:
        data = asdict(self)
        data["allowed"] = [t.name for t in self.allowed]
        data["distortion"] = {t.name: d for t, d in self.distortion.items()}
        data["rotated"] = [t.name for t in self.rotated]
        data[PROFILE_KEY] = None if self.value_range is None else self.value_range.to_dict()
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> TierProfile:
        data = json.loads(text)
        value_range = data.get(PROFILE_KEY)
        return cls(
            tuple(Tier[name] for name in data["allowed"]),
            {Tier[name]: float(d) for name, d in data["distortion"].items()},
            data.get("source", ""),
            tuple(Tier[name] for name in data.get("rotated", [])),
            None if value_range is None else KVValueRange.from_dict(value_range),
        )

    @classmethod
    def load(cls, path: Path) -> TierProfile:
        """The saved probe verdict at ``path``, or the defaults when there is none."""
        return cls.from_json(path.read_text()) if path.exists() else cls()


def profile_path(model: LoadedModel) -> Path:
    """Where the probe's verdict for this model is saved (and where the allocator looks)."""
    return model_dir(model.record.name) / PROFILE_FILE


def pinned_mask(positions: np.ndarray, *, sinks: int = SINK_TOKENS, recent: int = RECENT_TOKENS) -> np.ndarray:
    """Attention sinks (the first positions) and the most recent tokens: kept at FP16 when possible."""
    mask = positions < sinks
    mask[max(len(positions) - recent, 0) :] = True
    return mask


def pin_priority(positions: np.ndarray, *, sinks: int = SINK_TOKENS, recent: int = RECENT_TOKENS) -> np.ndarray:
    """float64 [n]: 0 for unpinned tokens; for pinned ones a rank in (0, 1] falling linearly from the
    newest token (1) to the recent window's oldest, with the sinks just below the ``sinks`` newest:
    when not every pinned token fits, the window's oldest go first and the prompt's last tokens last."""
    n = len(positions)
    window = min(recent, n)
    priority = np.zeros(n)
    priority[n - window :] = np.arange(1, window + 1) / max(window, 1)
    sink = positions < sinks
    priority[sink] = np.maximum(priority[sink], (window - sinks + 0.5) / max(window, 1))
    return priority


def _ladder(costs: Mapping[Tier, float], profile: TierProfile) -> list[tuple[Tier, float, float]]:
    """Allowed kept tiers as (tier, cost, fidelity), cheapest first, on the upper concave hull that
    starts at DROP (cost 0, fidelity 0).

    A tier is skipped when another is both cheaper and at least as faithful, when it is no better
    than dropping, or when it sits below the line between its neighbours (an upgrade through it
    would never be the best buy).
    """
    points = sorted(
        ((t, costs[t], 1.0 - profile.distortion[t]) for t in profile.allowed if t != Tier.DROP),
        key=lambda p: (p[1], -p[2]),
    )
    hull: list[tuple[Tier, float, float]] = [(Tier.DROP, 0.0, 0.0)]
    for point in points:
        if point[2] <= hull[-1][2]:
            continue
        while len(hull) >= 2 and _slope(hull[-2], hull[-1]) <= _slope(hull[-1], point):
            hull.pop()
        hull.append(point)
    if len(hull) == 1:
        raise BudgetError("the tier profile allows no tier that keeps tokens better than dropping them")
    return hull[1:]


def _slope(a: tuple[Tier, float, float], b: tuple[Tier, float, float]) -> float:
    return (b[2] - a[2]) / (b[1] - a[1])


def allocate(
    importance: np.ndarray,
    budget: float,
    costs: Mapping[Tier, float],
    profile: TierProfile,
    pinned: np.ndarray | None = None,
    *,
    cost_scale: np.ndarray | None = None,
    undroppable: np.ndarray | None = None,
) -> np.ndarray:
    """Tiers uint8 [n] maximising importance-weighted fidelity within ``budget`` × FP16 bytes.

    ``pinned``: a mask, or a priority in [0, 1] per token (``pin_priority``; 0: not pinned).
    ``cost_scale``: float [n], each token's share of ``costs`` (1: every layer; less where some
    layers do not carry it, ``kv.window``); the budget stays relative to every layer at FP16.
    ``undroppable``: bool [n], tokens kept at least at the cheapest tier even beyond the budget (the
    windowed tail, ``kv.window``).

    Two phases. Keep: every token at the cheapest kept tier, or, when that does not fit, as many as
    fit, the least important (never a pinned one while another can go, never an undroppable one)
    dropped. Dropping is the costliest lever per byte (research/kv_calibration.md), so it buys
    nothing else. Upgrade: the spare bytes buy tier steps in order of importance-weighted fidelity
    gained per byte.
    """
    n = len(importance)
    weight = np.asarray(importance, np.float64)
    weight = weight / weight.mean() if n and weight.mean() > 0 else np.ones(n)
    if pinned is not None and n:
        priority = np.asarray(pinned, np.float64)
        weight = np.where(priority > 0, _PIN_FACTOR * weight.max() * (1.0 + priority), weight)
    scale = np.ones(n) if cost_scale is None else np.asarray(cost_scale, np.float64)
    must = np.zeros(n, bool) if undroppable is None else np.asarray(undroppable, bool)
    ladder = _ladder(costs, profile)
    floor, cheapest, _ = ladder[0]
    available = budget * n * costs[Tier.FP16]
    tiers = np.full(n, floor, np.uint8)
    kept = np.lexsort((-weight, ~must))  # undroppable first, then the most important
    spent = np.cumsum(cheapest * scale[kept])
    affordable = max(int(np.searchsorted(spent, available, side="right")), int(must.sum()))
    if affordable < n:
        if Tier.DROP not in profile.allowed:
            raise BudgetError(
                f"budget {budget:.3f} is below the cheapest allowed tier ({floor.name}) and DROP is not allowed"
            )
        tiers[kept[affordable:]] = Tier.DROP
        kept = kept[:affordable]
    spare = available - (spent[len(kept) - 1] if len(kept) else 0.0)
    steps = list(pairwise(ladder))
    if not steps or len(kept) == 0 or spare <= 0:
        return tiers
    gains = (weight / scale)[kept][:, None] * np.array([_slope(a, b) for a, b in steps])[None, :]  # falls per row
    step_costs = np.array([b[1] - a[1] for a, b in steps])
    ranked = np.argsort(-gains, axis=None, kind="stable")
    token_idx, step_idx = np.unravel_index(ranked, gains.shape)
    fits = np.cumsum(step_costs[step_idx] * scale[kept][token_idx]) <= spare
    taken = len(fits) if fits.all() else int(np.argmin(fits))
    reached = np.full(len(kept), -1)
    np.maximum.at(reached, token_idx[:taken], step_idx[:taken])
    step_tiers = np.array([b[0] for _, b in steps], np.uint8)
    upgraded = reached >= 0
    tiers[kept[upgraded]] = step_tiers[reached[upgraded]]
    return tiers


def pdtrim_tiers(n: int, budget: float, head_fraction: float) -> np.ndarray:
    """PDTrim-style head+tail: the first ``head_fraction`` of the kept tokens and the last rest at
    FP16, everything between them dropped; as many kept tokens as ``budget`` pays for at FP16."""
    keep = min(int(budget * n), n)
    head = round(head_fraction * keep)
    tiers = np.full(n, Tier.DROP, np.uint8)
    tiers[:head] = Tier.FP16
    tiers[n - (keep - head) :] = Tier.FP16
    return tiers


def policy_tiers(
    policy: str,
    budget: float,
    positions: np.ndarray,
    costs: Mapping[Tier, float],
    *,
    attention: np.ndarray | None = None,
    profile: TierProfile | None = None,
    pdtrim_head_fraction: float = 0.5,
    cost_scale: np.ndarray | None = None,
    undroppable: np.ndarray | None = None,
) -> np.ndarray:
    """Tiers uint8 [n] that ``policy`` assigns to tokens at ``positions`` under ``budget``
    (``cost_scale``, ``undroppable``: as for ``allocate``; pdtrim ignores them).

    * ours: attention importance (``attention`` [n]) through the allocator with the model's tier
      profile; sinks and the recent window pinned.
    * position: the same allocator and pins, importance from position alone (sinks, decay, recency).
    * uniform-int8 / uniform-int4: every kept token at that tier; under budget the least recent
      non-sink tokens are dropped.
    * pdtrim: head+tail FP16, the middle dropped (``pdtrim_head_fraction`` of the kept tokens first).
    """
    profile = profile or TierProfile()
    shape = {"cost_scale": cost_scale, "undroppable": undroppable}
    if policy == "ours":
        if attention is None:
            raise BudgetError("policy 'ours' needs attention importance")
        return allocate(attention, budget, costs, profile, pin_priority(positions), **shape)
    if policy == "position":
        return allocate(position_importance(positions), budget, costs, profile, pin_priority(positions), **shape)
    if policy in ("uniform-int8", "uniform-int4"):
        tier = Tier.INT8 if policy == "uniform-int8" else Tier.INT4
        uniform = TierProfile((tier, Tier.DROP), profile.distortion, f"uniform {tier.name}")
        return allocate(position_importance(positions), budget, costs, uniform, **shape)
    if policy == "pdtrim":
        return pdtrim_tiers(len(positions), budget, pdtrim_head_fraction)
    raise BudgetError(f"unknown KV policy {policy!r}; known: {', '.join(POLICIES)}")
