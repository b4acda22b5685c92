"""The quality harness end to end at a tiny scale: every stage runs and the report holds real rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def test_kv_quality_writes_tables_and_plot(smollm2_model, tmp_path):
    sys.path.insert(0, str(TOOLS))
    try:
        import kv_quality
    finally:
        sys.path.remove(str(TOOLS))
    kv_quality.main(["--contexts", "1", "--context-tokens", "160", "--continuation-tokens", "32",
                     "--budgets", "1.0,0.2", "--policies", "ours,position,pdtrim", "--pdtrim-fractions", "0.25,0.75",
                     "--niah-tokens", "150", "--niah-depths", "1", "--niah-trials", "1", "--threads", "2",
                     "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kv-quality.json").read_text())
    rows = {(r["policy"], r["budget"]): r for r in result["perplexity"]["rows"]}
    assert set(rows) == {("fp16-transfer", 1.0), *((p, b) for p in ("ours", "position", "pdtrim") for b in (1.0, 0.2))}
    assert rows[("fp16-transfer", 1.0)]["kl"] == 0.0
    for (policy, budget), row in rows.items():
        assert row["b_wire"] <= budget and row["kl"] >= 0, (policy, budget)
    assert rows[("ours", 0.2)]["kl"] > 0 and rows[("ours", 0.2)]["tiers"]["DROP"] > 0
    assert rows[("pdtrim", 0.2)]["pdtrim_head_fraction"] in (0.25, 0.75)  # tuned over the grid
    assert len(result["needle"]) == 1 + 6 and all(n["trials"] == 1 for n in result["needle"])
    report = (tmp_path / "kv-quality.md").read_text()
    assert "## Goals" in report and "| 0.2 | ours |" in report
    assert (tmp_path / "kv-quality.png").stat().st_size > 10_000
