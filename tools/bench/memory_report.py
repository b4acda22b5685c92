"""What tools/bench/memory.py reports: per cell, completion, KV memory and RSS against the budget,
resume TTFT by how each turn resumed, the ladder's counters and the quality of compressed resumes;
the issue's goals; the tables (tools/bench/memory_docs.py puts them in docs/memory.md).

A turn's resume is the daemon's ``kv.resume`` where it reports one; else (older daemons) it is
derived: KV restored from the store → compressed, KV reused in the slot → resident, neither →
evicted when an earlier turn of the conversation completed, new otherwise.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from edgedecode.evaluation.stats import mean_interval
from tools.study.memory_quality import TIER_CLASSES

MIB = 1 << 20
RESUMES = ("resident", "compressed", "evicted", "new")
GOAL_FRACTION = 0.25
RESUME_GOAL = 0.3  # resume from compressed ÷ re-prefill, 2k tokens
DPPL_GOAL_PCT = 0.5  # at the INT8 and INT4 tiers
RSS_GOAL = 1.3  # × (weights + KV at the budget), weights = the GGUF's bytes


def resume_kind(kv: dict, seen_before: bool) -> str:
    """How the turn resumed (see the module docstring); ``seen_before``: an earlier turn of the
    conversation completed on this daemon."""
    if "resume" in kv:
        return kv["resume"]
    if kv["restored_tokens"] > 0:
        return "compressed"
    if kv["reused_tokens"] > 0:
        return "resident"
    return "evicted" if seen_before else "new"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def kv_series(cell: dict) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, bytes by state [n, 3]) of the cell's /metrics samples."""
    rows = cell["kv_samples"]
    return np.array([row[0] for row in rows]), np.array([row[1:4] for row in rows], dtype=float).reshape(-1, 3)


def sample_rate(rows: list[list]) -> float:
    """Samples per second achieved over the rows' span."""
    return (len(rows) - 1) / rows[-1][0] if len(rows) > 1 and rows[-1][0] > 0 else math.nan


def counter(cell: dict, name: str, **labels: str) -> float:
    """A counter of the daemon's /metrics at the end of the cell (0 where it is not exported)."""
    key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return cell["metrics_end"].get(f"{name}{{{key}}}", 0.0)


def summarise(cell: dict, quality: list[dict]) -> dict:
    """One cell's figures (see the tables)."""
    budget, records = cell["budget"], cell["records"]
    _, states = kv_series(cell)
    peak = cell["metrics_end"].get("edgedecode_kv_memory_peak_bytes{}")  # the high-water mark, if exported
    rss = [row[1] for row in cell["rss_samples"]]
    # Runs before the working-memory allowance carry no weights_bytes: their goal counted the RSS at start as weights.
    weights = cell.get("weights_bytes") or cell["rss_start_bytes"]
    growth_bound = budget["nbytes"] + cell.get("working_memory_bytes", 0)
    growth = max(rss) - cell["rss_start_bytes"] if rss else math.nan
    resumes = {}
    for kind in RESUMES:
        done = [r for r in records if r["error"] is None and r["resume"] == kind]
        if done:
            resumes[kind] = {
                "n": len(done),
                "ttft_ms": _median([r["ttft_ms"] for r in done]),
                "computed": _median([r["report"]["kv"]["computed_tokens"] for r in done]),
            }
    scored = [q for q in quality if q["cell"] == cell["label"]]
    return {
        "cell": cell,
        "completed": sum(r["error"] is None for r in records),
        "total": len(records),
        "kv_max_sampled": float(states.sum(axis=1).max()) if len(states) else math.nan,
        "kv_peak": peak,
        "rss_max": max(rss) if rss else math.nan,
        "rss_ratio": (max(rss) / (weights + budget["nbytes"])) if rss else math.nan,
        "rss_growth": growth,
        "growth_bound": growth_bound,
        "working_peak": cell["metrics_end"].get("edgedecode_working_memory_peak_bytes{}"),
        "kv_hz": sample_rate(cell["kv_samples"]),
        "rss_hz": sample_rate(cell["rss_samples"]),
        "resumes": resumes,
        "evictions": {
            reason: counter(cell, "edgedecode_session_evictions_total", reason=reason)
            for reason in ("memory", "max_sessions")
        },
        "retiered": counter(cell, "edgedecode_kv_retier_total", **{"from": "INT8", "to": "INT4"}),
        "retiered_int3": counter(cell, "edgedecode_kv_retier_total", **{"from": "INT4", "to": "INT3"}),
        "dropped": sum(
            counter(cell, "edgedecode_kv_retier_total", **{"from": tier, "to": "DROP"})
            for tier in ("INT8", "INT4", "INT3")
        ),
        "own_evicted": counter(cell, "edgedecode_active_kv_evicted_tokens_total"),
        "quality": quality_by_class(scored),
    }


def quality_by_class(scores: list[dict]) -> dict[str, dict]:
    """Per tier class of the scored resumes: their count, mean Δ PPL % with its 95 % t-interval (a
    resume is the unit: the tokens of one continuation are not independent), the worst one, mean KL
    and top-1 agreement, and the tokens scored."""
    out = {}
    for name in TIER_CLASSES:
        of = [s for s in scores if s["tier_class"] == name]
        if of:
            mean, low, high = mean_interval([s["dppl_pct"] for s in of])
            out[name] = {
                "n": len(of),
                "dppl_pct": mean,
                "dppl_interval": (low, high),
                "worst_dppl_pct": max(s["dppl_pct"] for s in of),
                "kl": float(np.mean([s["kl"] for s in of])),
                "top1": float(np.mean([s["top1"] for s in of])),
                "continuation_tokens": int(sum(s["continuation_tokens"] for s in of)),
            }
    return out


def _kv_max(row: dict) -> float:
    """The most KV the budget counted: the peak gauge where exported, else the sampled maximum."""
    return row["kv_peak"] if row["kv_peak"] is not None else row["kv_max_sampled"]


def _verdict(ok: bool, missed: str) -> str:
    return "met" if ok else f"MISSED ({missed})"


def goal_checks(run: dict, rows: list[dict]) -> list[str]:
    """The issue's four goals, each met or missed, by how much."""
    lines = []
    tight = [r for r in rows if math.isclose(r["cell"]["budget"]["fraction"], GOAL_FRACTION)]
    if not tight:
        lines.append(f"- at {100 * GOAL_FRACTION:.0f} % of the FP16 need: no such cell in this run")
    for r in tight:
        budget = r["cell"]["budget"]["nbytes"]
        over = _kv_max(r) / budget
        complete, failed = r["completed"] == r["total"], r["total"] - r["completed"]
        infeasible = "" if r["cell"]["budget"]["feasible"] else " (not feasible in principle: see the table)"
        lines.append(
            f"- {r['cell']['conversations']} conversations at {100 * GOAL_FRACTION:.0f} % of the FP16 need"
            f"{infeasible}: {r['completed']} of {r['total']} turns completed "
            f"({_verdict(complete, f'{failed} failed')}); most KV memory counted "
            f"{over:.3f} × the budget ({_verdict(over <= 1, f'{100 * (over - 1):.1f} % over')})"
        )
    lines.append(_resume_goal(run.get("resume_2k")))
    lines.append(_quality_goal(run["quality"]))
    if rows:
        lines += [_growth_goal(rows), _rss_goal(rows)]
    return lines


def _growth_goal(rows: list[dict]) -> str:
    """RSS growth over each cell against its budget plus its working-memory allowance (issue 34)."""
    worst = max(rows, key=lambda r: r["rss_growth"] / r["growth_bound"])
    met = sum(r["rss_growth"] <= r["growth_bound"] for r in rows)
    ratio = worst["rss_growth"] / worst["growth_bound"]
    return (
        f"- daemon RSS growth (most sampled RSS − RSS after start) ≤ daemon.kv_memory_mb + daemon.working_memory_mb: "
        f"{met} of {len(rows)} cells met; worst {_mib(worst['rss_growth'])} MiB against {_mib(worst['growth_bound'])} "
        f"MiB, {ratio:.2f}× ({worst['cell']['label']}: {_verdict(ratio <= 1, f'{100 * (ratio - 1):.0f} % over')})"
    )


def _rss_goal(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: r["rss_ratio"])
    met = sum(r["rss_ratio"] <= RSS_GOAL for r in rows)
    weights = worst["cell"].get("weights_bytes")
    of = f"the GGUF's bytes ({_mib(weights)} MiB)" if weights else "the RSS after start before any turn"
    return (
        f"- daemon RSS ≤ {RSS_GOAL} × (weights + KV at the budget), weights = {of}: {met} of {len(rows)} cells "
        f"met; worst {worst['rss_ratio']:.2f}× ({worst['cell']['label']}: "
        f"{_verdict(worst['rss_ratio'] <= RSS_GOAL, f'goal ≤ {RSS_GOAL}×')})"
    )


def _resume_goal(resume: dict | None) -> str:
    goal = f"- resuming a conversation from compressed KV ≤ {RESUME_GOAL} × re-prefilling it"
    if not resume or not resume["runs"]:
        return f"{goal}: not measured in this run"
    if resume["resume_ms"] is None:
        return f"{goal}: MISSED (no run came back from the store: see the runs)"
    ratio = resume["resume_ms"] / resume["reprefill_ms"]
    return (
        f"{goal} ({resume['context_tokens']} tokens + {resume['new_tokens']} new, medians of the "
        f"{sum(bool(r['restored_tiers']) for r in resume['runs'])} runs that came back from the store): "
        f"{resume['resume_ms']:.0f} ms ÷ {resume['reprefill_ms']:.0f} ms = {ratio:.3f} "
        f"({_verdict(ratio <= RESUME_GOAL, f'{ratio / RESUME_GOAL:.2f}× the goal')})"
    )


def _quality_goal(quality: list[dict]) -> str:
    goal = f"- Δ perplexity of resumed conversations ≤ +{DPPL_GOAL_PCT} % at the INT8/INT4 tiers"
    classes = quality_by_class(quality)
    parts = []
    for name in ("INT8", "INT4"):
        q = classes.get(name)
        if q is None:
            parts.append(f"{name}: none scored")
            continue
        over = q["dppl_pct"] - DPPL_GOAL_PCT
        low, high = q["dppl_interval"]
        interval = f"95 % interval {low:+.2f} … {high:+.2f}" if q["n"] > 1 else "one resume: no interval"
        parts.append(
            f"{name}: mean {q['dppl_pct']:+.2f} % ({interval}) over {q['n']} resumes "
            f"and {q['continuation_tokens']} tokens, worst {q['worst_dppl_pct']:+.2f} % "
            f"({_verdict(over <= 0, f'{over:.2f} points over')})"
        )
    dropped = classes.get("dropped")
    if dropped is not None:
        parts.append(f"(with tokens dropped, outside the goal: mean {dropped['dppl_pct']:+.2f} % over {dropped['n']})")
    return f"{goal}: " + "; ".join(parts)


def _mib(nbytes: float | None) -> str:
    return "—" if nbytes is None or math.isnan(nbytes) else f"{nbytes / MIB:.1f}"


def memory_table(rows: list[dict]) -> list[str]:
    """Completion, KV memory and RSS per cell."""
    lines = [
        "| conversations | tokens each | budget | budget MiB (exact bytes) | largest turn MiB | turns done "
        "| max KV ÷ budget (peak; sampled) | RSS start → max MiB | RSS growth ÷ (budget + allowance) MiB "
        "| working memory peak MiB | RSS ÷ (weights + budget) "
        "| evictions (memory; max_sessions) | tokens re-tiered INT8→INT4; INT4→INT3; dropped | own tokens evicted "
        "| samples/s KV; RSS | wall s |",
        "|---:|---:|---:|---|---:|---:|---|---|---|---:|---:|---|---|---:|---|---:|",
    ]
    for r in rows:
        c, b = r["cell"], r["cell"]["budget"]
        peak = "—" if r["kv_peak"] is None else f"{r['kv_peak'] / b['nbytes']:.3f}"
        feasible = "" if b["feasible"] else " (does not fit)"
        lines.append(
            f"| {c['conversations']} | {c['tokens']} | {100 * b['fraction']:.0f} % "
            f"| {b['mb']} ({b['exact_bytes']:,.0f}) | {_mib(b['largest_turn_bytes'])}{feasible} "
            f"| {r['completed']}/{r['total']} "
            f"| {peak}; {r['kv_max_sampled'] / b['nbytes']:.3f} | {_mib(c['rss_start_bytes'])} → {_mib(r['rss_max'])} "
            f"| {_mib(r['rss_growth'])} ÷ {_mib(r['growth_bound'])} = {r['rss_growth'] / r['growth_bound']:.2f} "
            f"| {_mib(r['working_peak'])} | {r['rss_ratio']:.2f} "
            f"| {r['evictions']['memory']:.0f}; {r['evictions']['max_sessions']:.0f} "
            f"| {r['retiered']:.0f}; {r.get('retiered_int3', 0):.0f}; {r['dropped']:.0f} | {r['own_evicted']:.0f} "
            f"| {r['kv_hz']:.1f}; {r['rss_hz']:.1f} "
            f"| {c['wall_s']:.0f} |"
        )
    return lines


def resume_table(rows: list[dict]) -> list[str]:
    """Turns and TTFT by how they resumed, and the quality of compressed resumes, per cell."""
    kinds = " | ".join(f"{kind}: n, TTFT ms (computed tokens)" for kind in RESUMES)
    classes = " | ".join(f"{name}: n, Δ PPL %, KL" for name in TIER_CLASSES)
    lines = [f"| conversations | budget | {kinds} | {classes} |", "|---:|---:|" + "---|" * (len(RESUMES) + 3)]
    for r in rows:
        cells = []
        for kind in RESUMES:
            s = r["resumes"].get(kind)
            cells.append("—" if s is None else f"{s['n']}, {s['ttft_ms']:.0f} ({s['computed']:.0f})")
        for name in TIER_CLASSES:
            q = r["quality"].get(name)
            cells.append("—" if q is None else f"{q['n']}, {q['dppl_pct']:+.2f}, {q['kl']:.4f}")
        b = r["cell"]["budget"]
        lines.append(f"| {r['cell']['conversations']} | {100 * b['fraction']:.0f} % | " + " | ".join(cells) + " |")
    return lines


def resume_2k_table(resume: dict | None) -> list[str]:
    if not resume or not resume["runs"]:
        return ["Not measured in this run."]
    lines = [
        "| run | resumed from compressed: TTFT ms | restored tiers | re-prefilled: TTFT ms | ratio |",
        "|---:|---:|---|---:|---:|",
    ]
    for i, run in enumerate(resume["runs"]):
        tiers = ", ".join(f"{k} {v}" for k, v in run["restored_tiers"].items()) or "—"
        ratio = run["resume_ms"] / run["reprefill_ms"]
        lines.append(f"| {i} | {run['resume_ms']:.0f} | {tiers} | {run['reprefill_ms']:.0f} | {ratio:.3f} |")
    if resume["resume_ms"] is None:
        return [*lines, "No run came back from the store."]
    ratio = resume["resume_ms"] / resume["reprefill_ms"]
    lines.append(f"| median | {resume['resume_ms']:.0f} | | {resume['reprefill_ms']:.0f} | {ratio:.3f} |")
    return lines


def quality_table(quality: list[dict]) -> list[str]:
    """Every scored resume."""
    lines = [
        "| cell | conversation | turn | tiers restored (daemon) | replay matched | tokens scored | Δ PPL % | KL "
        "| top-1 |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for q in quality:
        tiers = ", ".join(f"{k} {v}" for k, v in q["daemon_tiers"].items())
        matched = "yes" if q["tiers_match"] and q["kept_match"] else f"tiers {q['replayed_tiers']}, kept {q['kept']}"
        lines.append(
            f"| {q['cell']} | {q['conversation']} | {q['turn']} | {tiers} | {matched} | {q['continuation_tokens']} "
            f"| {q['dppl_pct']:+.2f} | {q['kl']:.4f} | {q['top1']:.3f} |"
        )
    return lines


def print_summary(run: dict) -> None:
    """The tables and the goal checks on stdout."""
    rows = [summarise(cell, run["quality"]) for cell in run["cells"]]
    print("\n".join([*memory_table(rows), "", *resume_table(rows), "", *resume_2k_table(run.get("resume_2k"))]))
    print("\n".join(["", *goal_checks(run, rows)]))
