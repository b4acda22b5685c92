"""How large a model's KV gets: each layer's largest |key| and |value|, measured on calibration text.

A receiver refuses KV beyond ``VALUE_RANGE_MULTIPLE`` times the measured range (``kv/wire/value_check.py``):
finite but absurd values are a corrupt or hostile payload, never what the model computes. The range of a model
comes from ``edgedecode probe`` (saved in the tier profile beside the model) or, without one, from the measurement
shipped with edgedecode (``value_ranges/<model>.json``, written by ``tools/study/kv_value_range.py``).

The multiple is measured too (docs/security.md, "KV values"; docs/bench/kv-value-range-*.json): on prompts unlike
the calibration text (chat, Python source, digits, one token repeated, random token ids, 4096 tokens of other
prose), through the prefill graph and the decoder's own, no layer's |key| or |value| exceeded 1.33× its calibrated
range on SmolLM2-135M, 1.56× on Gemma 3 270M. 8× leaves five times the worst of those; the largest limits it gives
(204 on SmolLM2, layer 18's keys; 1247 on Gemma 3, layer 1's values) stay 50 times below what a float16 holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot

VALUE_RANGE_MULTIPLE = 8.0
RANGES_DIR = Path(__file__).parent / "value_ranges"
PROFILE_KEY = "value_range"  # where the probe's tier profile (kv/policy.py) keeps it


@dataclass(frozen=True)
class KVValueRange:
    """``abs_max``: float [layers][2]: the largest |key| and |value| of each layer seen on ``source``'s text."""

    abs_max: tuple[tuple[float, float], ...]
    source: str

    @classmethod
    def measure(cls, snapshots: Iterable[KVSnapshot], source: str) -> KVValueRange:
        """The range of every snapshot's keys and values together (snapshots of one model)."""
        peaks = [_abs_max(snap) for snap in snapshots]
        if not peaks:
            raise ValueError("measuring a KV value range needs at least one snapshot")
        return cls(_pairs(np.maximum.reduce(peaks)), source)

    def widened(self, snapshot: KVSnapshot) -> KVValueRange:
        """This range, widened to cover ``snapshot`` too."""
        return KVValueRange(_pairs(np.maximum(self.abs_max, _abs_max(snapshot))), self.source)

    def limits(self, multiple: float = VALUE_RANGE_MULTIPLE) -> np.ndarray:
        """float32 [layers, 2]: the largest |key| and |value| a receiver accepts in each layer."""
        return (np.asarray(self.abs_max, np.float64) * multiple).astype(np.float32)

    def to_dict(self) -> dict:
        return {"abs_max": [list(pair) for pair in self.abs_max], "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> KVValueRange:
        return cls(tuple((float(k), float(v)) for k, v in data["abs_max"]), str(data.get("source", "")))


def load_value_range(model: str, profile: Path | None = None) -> KVValueRange | None:
    """The range a receiver of ``model``'s KV checks against: the probe's (in the tier profile at ``profile``) if
    it measured one, else the one shipped for ``model``, else None (only non-finite values are refused)."""
    if profile is not None and profile.exists():
        saved = json.loads(profile.read_text()).get(PROFILE_KEY)
        if saved is not None:
            return KVValueRange.from_dict(saved)
    shipped = RANGES_DIR / f"{model}.json"
    return KVValueRange.from_dict(json.loads(shipped.read_text())) if shipped.exists() else None


def _abs_max(snap: KVSnapshot) -> np.ndarray:
    """float [layers, 2]: each layer's largest |key| and |value| in ``snap``."""
    layers = len(snap.keys)
    return np.stack([np.abs(x).reshape(layers, -1).max(axis=1, initial=0.0) for x in (snap.keys, snap.values)], axis=1)


def _pairs(peak: np.ndarray) -> tuple[tuple[float, float], ...]:
    return tuple((float(k), float(v)) for k, v in peak)
