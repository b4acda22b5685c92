"""tools/bench/adaptive_report.py on synthetic results: censored requests count as slower than the cap,
ratios with a censored side are bounds, the goals name the cells that miss them, and the docs are
written."""

from __future__ import annotations

import math

import pytest
from tool_modules import import_tools

CAP_S, TARGET_MS = 10.0, 1500.0


@pytest.fixture(scope="module")
def report():
    return import_tools("bench.adaptive_report")[0]


def _record(cell: str, trace: str, policy: str, ttft_ms: float, kv_used: str, decision: str | None = "remote") -> dict:
    censored = ttft_ms > 1e3 * CAP_S
    local = kv_used == "local"
    return {
        "cell": cell,
        "trace": trace,
        "mbits": 20.0 if trace == "constant" else None,
        "policy": policy,
        "run": 0,
        "prompt_tokens": 1024,
        "prompt": "1024:0",
        "ttft_ms": ttft_ms,
        "censored": censored,
        "error": None,
        "kv_used": kv_used,
        "goodput_mbits": None if local else 19.5,
        "report": {"kv": {"decision": decision, "tiers": {} if local else {"INT4": 1000, "DROP": 24}}},
        "link": {
            "trace": {"kind": "Step"},
            "changes": [(0.0, 12.5e6), (1.0, 1.25e6)],
            "progress": [(0.0, 0), (1.0, 0 if local else 12_000_000), (2.0, 0 if local else 13_000_000)],
        },
    }


def _run(cells: dict[tuple[str, str], dict[str, tuple[float, str]]]) -> dict:
    results = [
        _record(cell, trace, policy, ttft, kv, None if policy == "local" else "local" if kv == "local" else "remote")
        for (cell, trace), policies in cells.items()
        for policy, (ttft, kv) in policies.items()
    ]
    quality = {"1024:0": {"local": {"dppl_pct": 0.0, "kl": 0.0}, "b0.3": {"dppl_pct": 0.5, "kl": 0.004}}}
    for source in ("b1.0", "b0.5"):
        quality["1024:0"][source] = {"dppl_pct": 0.0, "kl": 0.0}
    args = {
        "target_ms": TARGET_MS,
        "cell_timeout_s": CAP_S,
        "rtt_ms": 20.0,
        "prefill_device": "cpu",
        "max_tokens": 8,
        "step_mbits": [100, 10],
        "step_at": 0.1,
        "walk_mbits": [5, 100],
        "warmups": 1,
        "continuation_tokens": 256,
        "edge_cpus": None,
    }
    machine = {"cpu": "test CPU", "cpus": 2, "gpu": None, "platform": "test"}
    return {"args": args, "results": results, "quality": quality, "machine": machine} | {
        "command": "python tools/bench_adaptive.py --test",
        "date": "today",
        "wall_s": 1.0,
        "model": "smollm2-135m-instruct",
    }


GRID = {
    ("constant 20 Mbit/s", "constant"): {
        "adaptive": (2000.0, "b0.3"),
        "b1.0": (60_000.0, "local"),  # cut at the cap, fell back to local prefill: censored
        "b0.5": (5000.0, "b0.5"),
        "b0.3": (3000.0, "b0.3"),
        "local": (1000.0, "local"),
    },
    ("step 100→10 Mbit/s", "step"): {
        "adaptive": (1200.0, "local"),
        "b1.0": (60_000.0, "local"),
        "b0.5": (60_000.0, "local"),
        "b0.3": (9000.0, "b0.3"),
        "local": (1150.0, "local"),
    },
}


def test_a_censored_request_counts_as_slower_than_the_cap(report):
    assert report.quantile([5.0, math.inf, 7.0], 0.5) == 7.0
    assert report.quantile([5.0, math.inf, math.inf], 0.5) == math.inf
    rows = report.summarise(_run(GRID))
    assert rows[0]["stats"]["b1.0"]["median_ms"] == math.inf and rows[0]["stats"]["b1.0"]["censored"] == 1
    assert "| b1.0 | > 10000 | > 10000 |" in "\n".join(report.table(_run(GRID), rows))


def test_a_ratio_with_a_censored_side_is_a_bound(report):
    above = report.Ratio.of(math.inf, 2000.0, 10_000.0)
    assert (above.op, above.value, above.at_most(1.1), str(above)) == (">", 5.0, False, "> 5.00×")
    below = report.Ratio.of(500.0, math.inf, 10_000.0)
    assert (below.op, below.at_most(0.7)) == ("<", True)
    assert report.Ratio.of(math.inf, math.inf, 10_000.0).at_most(1.1) is None
    assert report.Ratio.of(1.0, 2.0, 10_000.0).at_most(0.5) is True


def test_the_goals_name_the_cells_that_miss_them(report):
    run = _run(GRID)
    rows = report.summarise(run)
    assert (rows[0]["best_other"], rows[1]["best_fixed"]) == ("local", "b0.3")
    goals = "\n".join(report.goal_checks(run, rows))
    assert "1 of 2 cells met; not met: constant 20 Mbit/s, 1024 tokens: 2.00× of local" in goals
    assert "step 100→10 Mbit/s, 1024 tokens: 0.13× of b0.3 (met)" in goals
    assert "adaptive met it in 1 of 2 requests (50 %): MISSED (40 points short)" in goals
    assert "4k-token prompt at 50 Mbit/s" in goals and "not in this grid" in goals


def test_the_docs_hold_the_table_and_the_plot(report, tmp_path):
    report.write_docs(_run(GRID), tmp_path)
    text = (tmp_path / "adaptive.md").read_text()
    assert "python tools/bench_adaptive.py --test" in text and "| step 100→10 Mbit/s | 1024 | adaptive |" in text
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000
