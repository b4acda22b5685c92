"""The quality harness end to end at a tiny scale: every stage runs and the report holds real rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tool_modules import import_tools


def test_kv_quality_writes_tables_and_plot(smollm2_model, tmp_path):
    (kv_quality,) = import_tools("study.kv_quality")
    kv_quality.main(
        [
            "--contexts",
            "1",
            "--context-tokens",
            "160",
            "--continuation-tokens",
            "32",
            "--budgets",
            "1.0,0.2",
            "--policies",
            "ours,position,pdtrim",
            "--pdtrim-fractions",
            "0.25,0.75",
            "--niah-tokens",
            "150",
            "--niah-depths",
            "1",
            "--niah-trials",
            "1",
            "--threads",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
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


def test_kv_quality_report_keeps_other_models_sections():
    (kv_quality,) = import_tools("study.kv_quality")
    report = kv_quality.merged_report("", "a", "## a\nold a")
    report = kv_quality.merged_report(report, "b", "## b\nfirst b")
    report = kv_quality.merged_report(report, "a", "## a\nnew a")
    assert report.startswith(kv_quality.TITLE + "\n")
    assert "old a" not in report and report.index("new a") < report.index("first b")  # replaced in place
    assert report == kv_quality.merged_report(report, "b", "## b\nfirst b")
    noted = report.replace(kv_quality.TITLE, kv_quality.TITLE + "\n\nA note.", 1)
    assert "A note." in kv_quality.merged_report(noted, "a", "## a\nnewer a")  # notes before the sections stay


def _crossquant_part(cq, indices: list[int], targets: list[str], tokens: int = 128) -> dict:
    """A crossquant.json of a run over some prompts and targets, with synthetic per-token numbers."""
    scale = {"target": 1.0, "handoff": 0.5, "wire-0.3": 0.6}
    wire = {
        "budget": 0.3,
        "b_wire": 0.29,
        "b_raw": 0.3,
        "wire_bytes": 100,
        "tiers": {"FP16": 1, "INT8": 0, "INT4": 8, "INT2": 0, "DROP": 1},
    }
    return {
        "prompts": [
            {
                "index": i,
                "name": f"p{i}",
                "kind": "prose",
                "size": "short",
                "prompt_tokens": 10,
                "wire": {"wire-0.3": wire},
            }
            for i in indices
        ],
        "results": {
            t: {
                m: [
                    cq.summarize(np.full(tokens, 0.01 * (i + 1) * s * (10 if t == "b" else 1)), np.ones(tokens, bool))
                    for i in indices
                ]
                for m, s in scale.items()
            }
            for t in targets
        },
        "config": {
            "model": "m",
            "tokens": tokens,
            "window_tokens": cq.WINDOW_TOKENS,
            "budgets": [0.3],
            "wall_seconds": 1.0,
        },
    }


def test_crossquant_merges_runs_split_by_prompt_and_target():
    (cq,) = import_tools("study.crossquant")
    whole = _crossquant_part(cq, [0, 1, 2], ["a", "b"])
    merged = cq.merge(
        [
            _crossquant_part(cq, [2], ["a", "b"]),
            _crossquant_part(cq, [0, 1], ["a"]),
            _crossquant_part(cq, [0, 1], ["b"]),
        ]
    )
    assert merged["prompts"] == whole["prompts"] and merged["results"] == whole["results"]
    assert merged["config"]["prompt_indices"] == [0, 1, 2] and merged["config"]["part_wall_seconds"] == [1.0] * 3
    summary = cq.aggregate(merged["results"])
    assert summary["a"]["handoff"]["mean_kl_change"] == pytest.approx(-0.5)
    assert summary["b"]["wire-0.3"]["prompts_improved"] == 3
    table = cq.markdown_table(summary, 3, cq.wire_summary(merged["prompts"]))
    assert "| a | wire-0.3 | 0.290 |" in table and "| wire-0.3 | 0.3 | 0.290 (0.290–0.290) |" in table
    for parts in (
        [_crossquant_part(cq, [0], ["a"]), _crossquant_part(cq, [1], ["b"])],  # gaps
        [_crossquant_part(cq, [0, 1], ["a"]), _crossquant_part(cq, [1], ["a"])],  # overlap
        [_crossquant_part(cq, [0], ["a"]), _crossquant_part(cq, [1], ["a"], tokens=64)],
    ):  # settings
        with pytest.raises(SystemExit):
            cq.merge(parts)
