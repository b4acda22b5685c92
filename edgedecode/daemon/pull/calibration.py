"""What the planner knows of the served model's KV quality: measured, saved per model, never typed in.

A model's calibration (``calibrations/<model>.json``, written by ``tools/study/calibration.py`` from
``tools/study/kv_quality.py`` runs and, for local prefill, ``tools/bench/adaptive.py``'s quality
scores) holds the Δ perplexity (%) of a pull at each measured budget and prompt length, with its
interval and KL, and of local prefill (the decode graph's own KV against the prefill graph's). From
it come the planner's quality table (``QualityCosts``) and two budgets:

* ``min_budget``: the lowest measured budget whose Δ PPL is within the planner's quality floor at
  some measured length (``daemon.min_budget`` = 0). Nothing below the lowest measured budget is ever
  asked for: a cost never measured is not assumed.
* ``default_budget``: the lowest measured budget whose Δ PPL is at most ``DEFAULT_BUDGET_DPPL_PCT``
  at every measured length: the budget of a pull planned without a link estimate, and of a daemon
  with no target whose ``daemon.budget`` is not pinned.

A model with no calibration gets the **generic** one, derived from every shipped calibration: at
each length and budget the worst (highest) Δ PPL any calibrated model measured there (at the nearest
measured length, for lengths a model lacks), so an unknown model plans as conservatively as the worst
measured one; the daemon logs how to calibrate it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgedecode.daemon.pull.adaptive import QUALITY_FLOOR_PCT, QualityCosts

logger = logging.getLogger(__name__)

CALIBRATIONS_DIR = Path(__file__).parent / "calibrations"
DEFAULT_BUDGET_DPPL_PCT = 1.0  # the default budget costs at most this at every measured length
GENERIC = "generic"


@dataclass(frozen=True)
class ModelCalibration:
    """A model's measured KV quality: ``remote[tokens][budget]`` Δ PPL (%) and local prefill's."""

    model: str
    remote: Mapping[int, Mapping[float, float]]
    local_dppl_pct: float | None  # None: local prefill's cost was never measured for this model
    source: str  # where the numbers come from (a calibration file, or "generic: derived from ...")

    def quality(self, extra_local_pct: float = 0.0) -> QualityCosts:
        """The planner's quality table; ``extra_local_pct`` (``daemon.local_dppl_pct``) raises local
        prefill's cost above the measured one."""
        if self.local_dppl_pct is None:
            raise ValueError(f"{self.model}'s local prefill cost was never measured: use for_model()")
        return QualityCosts(self.remote, max(self.local_dppl_pct, 0.0, extra_local_pct))

    @property
    def min_budget(self) -> float:
        """The lowest measured budget within the quality floor at some measured length."""
        within = [b for points in self.remote.values() for b, cost in points.items() if cost <= QUALITY_FLOOR_PCT]
        return min(within) if within else 1.0

    @property
    def default_budget(self) -> float:
        """The lowest budget measured at every length and costing at most ``DEFAULT_BUDGET_DPPL_PCT`` at each."""
        costs = self.quality()
        common = set.intersection(*(set(points) for points in self.remote.values()))
        fine = [b for b in common if all(costs.of_budget(b, n) <= DEFAULT_BUDGET_DPPL_PCT for n in self.remote)]
        return min(fine) if fine else 1.0

    @classmethod
    def from_json(cls, document: Mapping, source: str) -> ModelCalibration:
        """A calibration from its saved form (``tools/study/calibration.py``'s)."""
        remote: dict[int, dict[float, float]] = {}
        for point in document["remote"]:
            remote.setdefault(int(point["tokens"]), {})[float(point["budget"])] = float(point["dppl_pct"])
        local = document.get("local")
        return cls(document["model"], remote, None if local is None else float(local["dppl_pct"]), source)


def load_file(path: Path) -> ModelCalibration:
    """The calibration saved at ``path``."""
    return ModelCalibration.from_json(json.loads(path.read_text()), str(path))


@functools.cache
def shipped() -> dict[str, ModelCalibration]:
    """The calibrations shipped with edgedecode, by model name; a model whose local prefill was never
    measured gets the worst local cost measured on the others."""
    found = [load_file(path) for path in sorted(CALIBRATIONS_DIR.glob("*.json"))]
    measured = [c.local_dppl_pct for c in found if c.local_dppl_pct is not None]
    worst_local = max(measured, default=0.0)
    return {
        c.model: c if c.local_dppl_pct is not None else dataclasses.replace(c, local_dppl_pct=worst_local)
        for c in found
    }


def generic(calibrations: Iterable[ModelCalibration]) -> ModelCalibration:
    """The worst of ``calibrations`` at every measured (length, budget) (see the module docstring)."""
    models = list(calibrations)
    if not models:
        raise ValueError("a generic calibration needs at least one measured model")
    lengths = sorted({n for m in models for n in m.remote})
    budgets = sorted({b for m in models for points in m.remote.values() for b in points})
    remote: dict[int, dict[float, float]] = {}
    for n in lengths:
        for b in budgets:
            # a model is counted at a budget only where it measured it (nearest measured length)
            measured = [_costs(m).of_budget(b, n) for m in models if b in m.remote[_nearest(m.remote, n)]]
            if measured and math.isfinite(max(measured)):
                remote.setdefault(n, {})[b] = max(measured)
    names = ", ".join(m.model for m in models)
    local = max((m.local_dppl_pct for m in models if m.local_dppl_pct is not None), default=None)
    return ModelCalibration(GENERIC, remote, local, f"generic: the worst of {names}")


def _costs(model: ModelCalibration) -> QualityCosts:
    return QualityCosts(model.remote)


def _nearest(remote: Mapping[int, object], tokens: int) -> int:
    return min(remote, key=lambda n: abs(np.log2(n) - np.log2(tokens)))


def for_model(name: str) -> ModelCalibration:
    """The served model's calibration: its own when shipped, else the generic one (logged, with how to
    measure it)."""
    calibrations = shipped()
    if name in calibrations:
        return calibrations[name]
    logger.warning(
        "no KV quality calibration for model %s: planning with the generic one (the worst measured model's "
        "costs); measure it with `python tools/study/kv_quality.py --model %s --out DIR` and "
        "`python tools/study/calibration.py DIR/*.json --out %s`",
        name,
        name,
        CALIBRATIONS_DIR / f"{name}.json",
    )
    return generic(calibrations.values())
