"""tools/bench/memory.py's pure parts on synthetic data (no daemon, no model): the workload and its
budget, how a turn's resume is named, the store tiers a replay reproduces, which conversations are
replayed, and the report: goals met or missed by how much, tables and docs."""

from __future__ import annotations

import numpy as np
import pytest
from tool_modules import import_tools

from edgedecode.kv.tiers import Tier

FP16, SLOT = 23_040, 46_080  # SmolLM2's bytes a token
MIB = 1 << 20


@pytest.fixture(scope="module")
def tools():
    return import_tools("bench.memory_workload", "study.memory_quality", "bench.memory_report", "bench.memory_docs")


def _conversations(workload, count: int, tokens: int, turns: int = 3, max_tokens: int = 8) -> list:
    cuts = workload.turn_cuts(tokens - max_tokens, turns)
    return [workload.Conversation(i, np.arange(cuts[-1]), cuts) for i in range(count)]


def test_every_turn_is_scheduled_once_each_conversation_in_order_and_the_order_is_seeded(tools):
    workload, *_ = tools
    steps = workload.schedule(5, 3, seed=1)
    assert sorted(steps) == [(c, t) for c in range(5) for t in range(3)]
    for c in range(5):
        assert [t for conv, t in steps if conv == c] == [0, 1, 2]
    assert steps == workload.schedule(5, 3, seed=1) != workload.schedule(5, 3, seed=2)
    assert workload.turn_cuts(1016, 3) == (339, 677, 1016)


def test_eight_conversations_of_1024_tokens_fit_a_quarter_of_their_fp16_need_exactly(tools):
    workload, *_ = tools
    exact = workload.budget(_conversations(workload, 8, 1024), 8, 0.25, FP16, SLOT)
    assert (exact.mb, exact.nbytes, exact.largest_turn_bytes, exact.feasible) == (45, 45 * MIB, 45 * MIB, True)
    short = workload.budget(_conversations(workload, 8, 1000), 8, 0.25, FP16, SLOT)
    assert short.exact_bytes == 8 * 1000 * FP16 / 4 and short.mb == 43 and not short.feasible  # floor to MiB


def test_a_turn_resume_is_the_daemon_field_when_present_else_derived(tools):
    _, _, report, _ = tools
    kv = {"restored_tokens": 0, "reused_tokens": 0}
    assert report.resume_kind(kv | {"resume": "evicted"}, seen_before=False) == "evicted"
    assert report.resume_kind(kv | {"restored_tokens": 40, "reused_tokens": 40}, True) == "compressed"
    assert report.resume_kind(kv | {"reused_tokens": 40}, True) == "resident"
    assert (report.resume_kind(kv, True), report.resume_kind(kv, False)) == ("evicted", "new")


def test_the_replayed_store_tiers_keep_the_pins_and_drop_the_oldest_after_the_sinks(tools):
    _, quality, *_ = tools
    positions, held = np.arange(40), np.ones(40, bool)
    held[5] = False  # dropped in an earlier compression
    assert quality.tier_counts(quality.stored_tiers(positions, held, {"INT8": 39, "DROP": 1})) == {
        "INT8": 39,
        "DROP": 1,
    }
    tiers = quality.stored_tiers(positions, held, {"INT8": 14, "INT4": 20, "DROP": 6})
    assert quality.tier_counts(tiers) == {"INT8": 14, "INT4": 20, "DROP": 6}
    assert (tiers[:4] == Tier.INT8).all() and (tiers[-10:] == Tier.INT8).all()  # sinks; a quarter of 40 recent
    assert np.flatnonzero(tiers == Tier.DROP).tolist() == [4, 5, 6, 7, 8, 9]
    assert quality.tier_class({"INT8": 14, "INT4": 20}) == "INT4" and quality.tier_class({"INT8": 3}) == "INT8"
    assert quality.tier_class({"INT8": 14, "INT3": 20}) == "INT3"
    assert quality.tier_class({"INT3": 4, "DROP": 1}) == "dropped"
    tiers = quality.stored_tiers(positions, held, {"INT8": 14, "INT3": 20, "DROP": 6})  # the INT3 rung, then drops
    assert quality.tier_counts(tiers) == {"INT8": 14, "INT3": 20, "DROP": 6}


def _record(conversation: int, turn: int, resume: str, tiers: dict | None = None, **kv) -> dict:
    report = {
        "kv": {
            "resume": resume,
            "reused_tokens": 40 if resume in ("resident", "compressed") else 0,
            "restored_tokens": 40 if resume == "compressed" else 0,
            "restored_tiers": tiers or {},
            "computed_tokens": 41 if resume != "evicted" else 81,
            **kv,
        }
    }
    ttft = {"new": 300.0, "resident": 200.0, "compressed": 250.0, "evicted": 600.0}[resume]
    return {
        "cell": "4 conversations, 25 %",
        "conversation": conversation,
        "turn": turn,
        "error": None,
        "ttft_ms": ttft,
        "resume": resume,
        "report": report,
    }


RECORDS = [
    _record(0, 0, "new"),
    _record(1, 0, "new"),
    _record(2, 0, "new"),
    _record(0, 1, "compressed", {"INT8": 44}),
    _record(1, 1, "compressed", {"INT8": 10, "INT4": 34}),
    _record(2, 1, "compressed", {"INT8": 10, "INT4": 14, "DROP": 20}, evicted_tokens=3),  # own tokens evicted
    _record(0, 2, "resident"),
    _record(1, 2, "evicted"),
]


def test_replayed_conversations_cover_the_tier_classes_but_not_ones_whose_own_tokens_were_evicted(tools):
    _, quality, *_ = tools
    assert sorted(quality.pick_conversations(RECORDS, per_class=1, seed=0)) == [
        ("4 conversations, 25 %", 0),
        ("4 conversations, 25 %", 1),
    ]
    failed = [*RECORDS[:3], RECORDS[3] | {"error": "503"}]
    assert quality.pick_conversations(failed, per_class=1, seed=0) == []


def _run(peak_bytes: float, dppl: float) -> dict:
    budget = {
        "fraction": 0.25,
        "fp16_need_bytes": 4 * 256 * FP16,
        "exact_bytes": 4 * 256 * FP16 / 4,
        "mb": 5,
        "largest_turn_bytes": 100 * SLOT,
        "nbytes": 5 * MIB,
        "feasible": True,
    }
    records = [*RECORDS, RECORDS[-1] | {"conversation": 3, "turn": 0, "error": "503: no room", "resume": None}]
    cell = {
        "label": "4 conversations, 25 %",
        "conversations": 4,
        "tokens": 256,
        "turns": 3,
        "budget": budget,
        "rss_start_bytes": 400 * MIB,
        "records": records,
        "kv_samples": [[0.1 * i, 2.0 * MIB, 1.0 * MIB, 1.5 * MIB, peak_bytes] for i in range(20)],
        "rss_samples": [[0.1 * i, (400 + i) * MIB] for i in range(20)],
        "metrics_end": {
            "edgedecode_kv_memory_peak_bytes{}": peak_bytes,
            "edgedecode_session_evictions_total{reason=memory}": 1.0,
            "edgedecode_kv_retier_total{from=INT8,to=INT4}": 48.0,
        },
        "wall_s": 2.0,
    }
    scored = {"cell": cell["label"], "conversation": 0, "turn": 1, "kl": 0.004, "top1": 0.95}
    scored |= {"continuation_tokens": 80, "kept": 40, "kept_match": True, "tiers_match": True}
    quality = [
        scored | {"tier_class": "INT8", "daemon_tiers": {"INT8": 44}, "replayed_tiers": {"INT8": 44}, "dppl_pct": d}
        for d in (dppl, dppl + 0.2)
    ]
    resume = {"context_tokens": 2048, "new_tokens": 32, "resume_ms": 400.0, "reprefill_ms": 4000.0}
    resume["runs"] = [{"resume_ms": 400.0, "reprefill_ms": 4000.0, "restored_tiers": {"INT8": 2055}}]
    return {
        "command": "python tools/bench_memory.py --test",
        "date": "today",
        "wall_s": 9.0,
        "model": "smollm2-135m-instruct",
        "machine": {"cpu": "test CPU", "cpus": 2, "gpu": None, "platform": "test"},
        "args": {"slots": 2, "turns": 3, "max_tokens": 8, "seed": 0, "threads": 2, "edge_cpus": None}
        | {"resume_tokens": 2048, "resume_new_tokens": 32, "quality_per_class": 4},
        "bytes_per_token": {"fp16": FP16, "slot": SLOT},
        "cells": [cell],
        "resume_2k": resume,
        "quality": quality,
    }


def test_a_cell_counts_turns_resumes_and_memory(tools):
    _, _, report, _ = tools
    row = report.summarise(_run(4.5 * MIB, 0.1)["cells"][0], [])
    assert (row["completed"], row["total"], row["kv_max_sampled"], row["kv_peak"]) == (8, 9, 4.5 * MIB, 4.5 * MIB)
    assert row["resumes"]["evicted"] == {"n": 1, "ttft_ms": 600.0, "computed": 81}
    assert row["resumes"]["compressed"]["n"] == 3 and row["resumes"]["new"]["ttft_ms"] == 300.0
    assert row["rss_ratio"] == pytest.approx(419 / 405)
    assert (row["evictions"]["memory"], row["retiered"], row["dropped"]) == (1.0, 48.0, 0.0)
    assert round(row["kv_hz"], 6) == 10.0


def test_the_goals_say_by_how_much_they_are_missed(tools):
    _, _, report, _ = tools
    run = _run(5.5 * MIB, 0.6)
    rows = [report.summarise(cell, run["quality"]) for cell in run["cells"]]
    goals = "\n".join(report.goal_checks(run, rows))
    assert "8 of 9 turns completed (MISSED (1 failed))" in goals
    assert "1.100 × the budget (MISSED (10.0 % over))" in goals
    assert "medians of the 1 runs that came back from the store): 400 ms ÷ 4000 ms = 0.100 (met)" in goals
    assert "INT8: mean +0.70 %" in goals and "(MISSED (0.20 points over))" in goals and "INT4: none scored" in goals
    assert "1 of 1 cells met; worst 1.03×" in goals


def test_the_docs_hold_the_tables_and_the_plot(tools, tmp_path):
    _, _, _, docs = tools
    docs.write_docs(_run(4.5 * MIB, 0.1), tmp_path)
    text = (tmp_path / "memory.md").read_text()
    assert "python tools/bench_memory.py --test" in text
    assert "| 4 | 256 | 25 % | 5 (5,898,240) | 4.4 | 8/9 | 0.900; 0.900 |" in text
    assert "| 4 | 25 % | 1, 200 (41) | 3, 250 (41) | 1, 600 (81) | 3, 300 (41) |" in text
    assert (tmp_path / "memory.png").stat().st_size > 10_000


def test_rss_growth_is_held_to_the_budget_plus_the_working_memory_and_the_weights_are_the_ggufs_bytes(tools):
    _, _, report, _ = tools
    run = _run(4.5 * MIB, 0.1)
    cell = run["cells"][0]
    cell |= {"weights_bytes": 100 * MIB, "working_memory_bytes": 10 * MIB}
    cell["metrics_end"]["edgedecode_working_memory_peak_bytes{}"] = 6 * MIB
    rows = [report.summarise(cell, run["quality"])]
    assert (rows[0]["rss_growth"], rows[0]["growth_bound"]) == (19 * MIB, 15 * MIB)  # RSS 400 → 419 MiB
    assert rows[0]["rss_ratio"] == pytest.approx(419 / 105)
    goals = "\n".join(report.goal_checks(run, rows))
    assert (
        "0 of 1 cells met; worst 19.0 MiB against 15.0 MiB, 1.27× (4 conversations, 25 %: MISSED (27 % over))" in goals
    )
    assert "weights = the GGUF's bytes (100.0 MiB): 0 of 1 cells met; worst 3.99×" in goals
    assert "| 400.0 → 419.0 | 19.0 ÷ 15.0 = 1.27 | 6.0 | 3.99 |" in "\n".join(report.memory_table(rows))
    cell["working_memory_bytes"] = 14 * MIB
    goals = "\n".join(report.goal_checks(run, [report.summarise(cell, run["quality"])]))
    assert "1 of 1 cells met; worst 19.0 MiB against 19.0 MiB, 1.00× (4 conversations, 25 %: met)" in goals
