"""The planner's quality table comes from saved measurements of the served model: the shipped
calibrations are exactly what tools/study/calibration.py makes of the quality runs in docs/, a model
never measured plans with the worst measured costs, and the budgets the planner may ask are those
the measurements support."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from edgedecode.daemon.pull import calibration
from edgedecode.daemon.pull.adaptive import QUALITY_FLOOR_PCT
from tools.study.calibration import main as calibrate

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_RUNS = [
    "docs/kv-quality.json",
    "docs/bench/kv-quality-2k-ours-4contexts.json",
    "docs/bench/kv-quality-4k-ours-4contexts.json",
    "docs/bench/kv-quality-4k-ours-4contexts-b0.4-b0.15.json",
]
SMOLLM2_ADAPTIVE = [
    "docs/bench/adaptive-cpu-2threads-2026-11-26.json",
    "docs/bench/adaptive-h100-2026-11-26-run1.json",
    "docs/bench/adaptive-h100-2026-11-26-run2.json",
    "docs/bench/adaptive-h200-2026-11-26-run3.json",
]


@pytest.mark.parametrize(
    ("model", "argv"),
    [
        ("smollm2-135m-instruct", [*SMOLLM2_RUNS, "--adaptive", *SMOLLM2_ADAPTIVE]),
        ("gemma3-270m", ["docs/bench/kv-quality-gemma3-270m.json"]),
    ],
)
def test_the_shipped_calibrations_are_the_quality_runs_as_the_tool_saves_them(tmp_path, model, argv):
    out = tmp_path / f"{model}.json"
    calibrate([arg if arg.startswith("--") else str(ROOT / arg) for arg in argv] + ["--out", str(out)])
    remade, shipped = json.loads(out.read_text()), json.loads((calibration.CALIBRATIONS_DIR / out.name).read_text())
    assert remade["remote"] == shipped["remote"] and remade["local"] == shipped["local"]
    assert calibration.shipped()[model].model == model


def test_smollm2_s_costs_are_its_measured_means():
    costs = calibration.shipped()["smollm2-135m-instruct"].quality()
    rows = json.loads((ROOT / "docs/kv-quality.json").read_text())["perplexity"]["rows"]
    b03 = next(r for r in rows if r["policy"] == "ours" and r["budget"] == 0.3)
    assert costs.of_budget(0.3, 1024) == pytest.approx(b03["dppl_pct"])
    assert costs.of_budget(0.2, 4096) > QUALITY_FLOOR_PCT  # the 4k run: b 0.2 is +3.6 %


def test_budgets_come_from_the_measurements():
    smollm2, gemma = calibration.shipped()["smollm2-135m-instruct"], calibration.shipped()["gemma3-270m"]
    # the lowest measured budget within the +2 % floor at some length (SmolLM2 at 1k: b 0.2, +1.53 %)
    assert smollm2.min_budget == 0.2 and gemma.min_budget == 0.2
    # the lowest costing <= 1 % at every measured length: SmolLM2's b 0.25 is +2.29 % at 4k
    assert smollm2.default_budget == 0.3 and gemma.default_budget == 0.2
    # Gemma 3 was never measured below b 0.2: lower budgets are unknown, not assumed as cheap
    assert gemma.quality().of_budget(0.15, 1024) == math.inf


def test_a_model_never_measured_plans_with_the_worst_measured_costs_and_says_how_to_measure(caplog):
    shipped = calibration.shipped()
    with caplog.at_level(logging.WARNING):
        unknown = calibration.for_model("some-new-model")
    assert "tools/study/kv_quality.py --model some-new-model" in caplog.text
    assert unknown.model == calibration.GENERIC
    costs = unknown.quality()
    for n in (1024, 2048, 4096):
        for b in (0.5, 0.3, 0.25, 0.2):
            measured = [
                m.quality().of_budget(b, n) for m in shipped.values() if math.isfinite(m.quality().of_budget(b, n))
            ]
            if measured:
                assert costs.of_budget(b, n) >= max(measured) - 1e-9, (n, b)
    assert unknown.local_dppl_pct == max(m.local_dppl_pct for m in shipped.values())
    assert calibration.for_model("gemma3-270m") is shipped["gemma3-270m"]


def test_an_operator_s_local_cost_raises_the_measured_one_never_lowers_it():
    smollm2 = calibration.shipped()["smollm2-135m-instruct"]
    assert smollm2.quality(5.0).local == 5.0
    assert smollm2.quality(0.0).local == max(smollm2.local_dppl_pct, 0.0)
