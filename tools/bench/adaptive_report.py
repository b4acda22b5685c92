"""What tools/bench/adaptive.py reports: per-cell TTFT statistics, the issue's goals, the table,
docs/adaptive.md and its plot (matplotlib: pip install -e '.[bench]').

Censored requests (no first token within the cap) count as TTFT = +inf: medians and p95 are
nearest-rank order statistics (no interpolation), so a censored one shows as "> cap", and a ratio
with one censored side is a bound ("> 3.2×").
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgedecode.testing.link_traces import MBIT

LOCAL = "local"
FIXED = ("b1.0", "b0.5", "b0.3")
POLICIES = ("adaptive", *FIXED, LOCAL)
TIERS = ("FP16", "INT8", "INT4", "INT2", "DROP")


@dataclass(frozen=True)
class Ratio:
    """``a ÷ b`` of two medians where either may be censored: ``op`` is "=", ">" (a censored: the
    ratio is above ``value``), "<" (b censored: below) or "?" (both)."""

    value: float
    op: str

    @classmethod
    def of(cls, a: float, b: float, cap_ms: float) -> Ratio:
        if math.isinf(a) and math.isinf(b):
            return cls(math.nan, "?")
        if math.isinf(a):
            return cls(cap_ms / b, ">")
        if math.isinf(b):
            return cls(a / cap_ms, "<")
        return cls(a / b, "=")

    def at_most(self, limit: float) -> bool | None:
        """Whether the ratio is ≤ ``limit`` (None: the bound does not tell)."""
        if self.op == "=":
            return self.value <= limit
        if self.op == ">":
            return False if self.value >= limit else None
        if self.op == "<":
            return True if self.value <= limit else None
        return None

    def __str__(self) -> str:
        return "?" if self.op == "?" else f"{'' if self.op == '=' else self.op + ' '}{self.value:.2f}×"


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (inf stays inf); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def policy_stats(records: list[dict], quality: dict, target_ms: float) -> dict:
    """TTFT median and p95 (censored: inf), target attainment, decisions, KV used, tier shares and
    the mean quality cost of one policy's requests in one cell."""
    ttfts = [math.inf if r["censored"] else r["ttft_ms"] for r in records]
    costs = [quality[r["prompt"]][r["kv_used"]] for r in records if r["kv_used"] in quality.get(r["prompt"], {})]
    tiers: Counter[str] = Counter()
    for r in records:
        tiers.update(((r["report"] or {}).get("kv") or {}).get("tiers") or {})
    total = sum(tiers.values())
    return {
        "n": len(records),
        "median_ms": quantile(ttfts, 0.5),
        "p95_ms": quantile(ttfts, 0.95),
        "met": sum(t <= target_ms for t in ttfts) / len(ttfts),
        "censored": sum(r["censored"] for r in records),
        "errors": sum(r["error"] is not None for r in records),
        "decisions": Counter(((r["report"] or {}).get("kv") or {}).get("decision") or "—" for r in records),
        "kv_used": Counter(r["kv_used"] or "—" for r in records),
        "tiers": {name: tiers[name] / total for name in TIERS if tiers[name]} if total else {},
        "goodput_mbits": quantile([r["goodput_mbits"] for r in records if r["goodput_mbits"]], 0.5),
        "dppl_pct": float(np.mean([c["dppl_pct"] for c in costs])) if costs else math.nan,
        "kl": float(np.mean([c["kl"] for c in costs])) if costs else math.nan,
    }


def summarise(run: dict) -> list[dict]:
    """One row group per (cell, prompt length), in run order: per policy stats, and adaptive ÷ the
    best of the others and ÷ the best fixed budget."""
    target_ms, cap_ms = run["args"]["target_ms"], 1e3 * run["args"]["cell_timeout_s"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in run["results"]:
        groups.setdefault((r["cell"], r["prompt_tokens"]), []).append(r)
    rows = []
    for (cell, tokens), records in groups.items():
        stats = {
            p: policy_stats([r for r in records if r["policy"] == p], run["quality"], target_ms)
            for p in POLICIES
            if any(r["policy"] == p for r in records)
        }
        medians = {p: s["median_ms"] for p, s in stats.items()}
        others = min((p for p in medians if p != "adaptive"), key=lambda p: medians[p])
        fixed = min((p for p in medians if p in FIXED), key=lambda p: medians[p])
        rows.append(
            {
                "cell": cell,
                "trace": records[0]["trace"],
                "mbits": records[0]["mbits"],
                "prompt_tokens": tokens,
                "stats": stats,
                "best_other": others,
                "vs_best": Ratio.of(medians["adaptive"], medians[others], cap_ms),
                "best_fixed": fixed,
                "vs_fixed": Ratio.of(medians["adaptive"], medians[fixed], cap_ms),
                "any_met": any(m <= target_ms for m in medians.values()),
            }
        )
    return rows


def _verdict(ok: bool | None, missed: str) -> str:
    return "met" if ok else ("undetermined (censored)" if ok is None else f"MISSED ({missed})")


def goal_checks(run: dict, rows: list[dict]) -> list[str]:
    """The issue's four goals, each met or missed with the distance."""
    target_ms = run["args"]["target_ms"]
    lines = []
    checks = [(r, r["vs_best"].at_most(1.1)) for r in rows]
    worst = [
        f"{r['cell']}, {r['prompt_tokens']} tokens: {r['vs_best']} of {r['best_other']}" for r, ok in checks if not ok
    ]
    lines.append(
        f"- adaptive ≤ 1.1 × the best of the fixed budgets and local, in every cell: "
        f"{sum(bool(ok) for _, ok in checks)} of {len(checks)} cells met"
        + (f"; not met: {'; '.join(worst)}" if worst else "")
    )
    moving = [r for r in rows if r["trace"] in ("step", "walk")]
    if moving:
        parts = [
            f"{r['cell']}, {r['prompt_tokens']} tokens: {r['vs_fixed']} of {r['best_fixed']} "
            f"({_verdict(r['vs_fixed'].at_most(0.7), 'goal ≤ 0.70×')})"
            for r in moving
        ]
        lines.append("- on the step and walk traces, adaptive ≤ 0.7 × the best fixed budget: " + "; ".join(parts))
    can = [r for r in rows if r["any_met"]]
    goal = f"- target attainment ≥ 90 % where any policy's median meets {target_ms:g} ms"
    if can:
        met = sum(r["stats"]["adaptive"]["met"] * r["stats"]["adaptive"]["n"] for r in can)
        total = sum(r["stats"]["adaptive"]["n"] for r in can)
        share = met / total
        lines.append(
            f"{goal} ({len(can)} cells): adaptive met it in {met:.0f} of {total} requests ({100 * share:.0f} %): "
            + _verdict(share >= 0.9, f"{100 * (0.9 - share):.0f} points short")
        )
    else:
        lines.append(f"{goal}: no cell where any policy's median met it; not measurable in this run")
    lines.append(_four_k_goal(run, rows))
    return lines


def _four_k_goal(run: dict, rows: list[dict]) -> str:
    cap_ms = 1e3 * run["args"]["cell_timeout_s"]
    cell = next((r for r in rows if r["trace"] == "constant" and r["mbits"] == 50 and r["prompt_tokens"] == 4096), None)
    if cell is None or "b1.0" not in cell["stats"]:
        return "- 4k-token prompt at 50 Mbit/s, ≥ 4× lower TTFT than b 1.0 at ≤ +1 % perplexity: not in this grid"
    adaptive, fp16 = cell["stats"]["adaptive"], cell["stats"]["b1.0"]
    speedup = Ratio.of(fp16["median_ms"], adaptive["median_ms"], cap_ms)
    fast = None if speedup.op == "?" else (speedup.value >= 4 if speedup.op in ("=", ">") else None)
    dppl = adaptive["dppl_pct"]
    quality = (
        "adaptive Δ PPL not scored (its turns' KV has no scored source: a run from before composites were scored "
        "is scored by --report RUN --rescore)"
        if math.isnan(dppl)
        else f"adaptive Δ PPL {dppl:+.2f} % (goal ≤ +1 %: {_verdict(dppl <= 1.0, f'by {dppl - 1:.2f} points')})"
    )
    return (
        f"- 4k-token prompt at 50 Mbit/s: b 1.0 ÷ adaptive = {speedup} (goal ≥ 4×: "
        f"{_verdict(fast, f'{4 - speedup.value:.2f}× short')}), {quality}"
    )


def _ms(value: float, cap_ms: float) -> str:
    return f"> {cap_ms:.0f}" if math.isinf(value) else f"{value:.0f}"


def _number(value: float, spec: str) -> str:
    return "—" if math.isnan(value) else format(value, spec)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{key} {count}" if len(counter) > 1 else key for key, count in counter.most_common())


def table(run: dict, rows: list[dict]) -> list[str]:
    """The per-cell markdown table."""
    cap_ms = 1e3 * run["args"]["cell_timeout_s"]
    lines = [
        "| cell | tokens | policy | TTFT median ms | p95 ms | target met | decision | KV used | tiers | Δ PPL % "
        "| KL | link Mbit/s got | adaptive ÷ best other |",
        "|---|---:|---|---:|---:|---:|---|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        for policy, s in row["stats"].items():
            tiers = " ".join(f"{name} {share:.2f}" for name, share in s["tiers"].items()) or "—"
            vs = f"{row['vs_best']} ({row['best_other']})" if policy == "adaptive" else ""
            lines.append(
                f"| {row['cell']} | {row['prompt_tokens']} | {policy} | {_ms(s['median_ms'], cap_ms)} | "
                f"{_ms(s['p95_ms'], cap_ms)} | {100 * s['met']:.0f} % | {_counts(s['decisions'])} | "
                f"{_counts(s['kv_used'])} | {tiers} | {_number(s['dppl_pct'], '+.2f')} | {_number(s['kl'], '.4f')} | "
                f"{_number(s['goodput_mbits'], '.0f')} | {vs} |"
            )
    return lines


def quality_table(run: dict) -> list[str]:
    """Mean Δ PPL and KL per prompt length and KV source, over the prompts scored."""
    pooled: dict[tuple[int, str], list[dict]] = {}
    for key, sources in run["quality"].items():
        for source, cost in sources.items():
            pooled.setdefault((int(key.split(":")[0]), source), []).append(cost)
    lines = ["| tokens | KV | prompts | Δ PPL % | KL |", "|---:|---|---:|---:|---:|"]
    for (tokens, source), costs in sorted(pooled.items()):
        lines.append(
            f"| {tokens} | {source} | {len(costs)} | {np.mean([c['dppl_pct'] for c in costs]):+.2f} | "
            f"{np.mean([c['kl'] for c in costs]):.4f} |"
        )
    return lines


def print_summary(run: dict) -> None:
    """The table and the goal checks on stdout."""
    rows = summarise(run)
    print("\n".join([*table(run, rows), "", *goal_checks(run, rows), "", *quality_table(run)]))


METHOD = (
    "One prefill server ({prefill_device}, prefix cache off) behind a link-shaping proxy on loopback "
    "(edgedecode/testing/link_shaper.py: a token bucket for the rate, {rtt_ms:g} ms round trip), and one "
    "decode daemon per policy pulling through it: **adaptive** (daemon.ttft_target_ms = {target_ms:g}: of "
    "the budgets and local prefill predicted in time, the fastest of the best measured quality, else the "
    "fastest; a pull whose goodput collapses is cut and its rest resumed or computed, docs/serving.md), "
    "fixed budgets "
    "**b1.0**, **b0.5**, **b0.3** (no target) and **local** (local_prefill_only). Each request is a streamed "
    "completion ({max_tokens} tokens) of a distinct pydoc prose window; TTFT is the client's. Traces "
    "(edgedecode/testing/link_traces.py), restarted at every request: constant links; a step "
    "{step_hi:g} → {step_lo:g} Mbit/s once the link has carried {step_at:g} × the prompt's FP16 KV bytes (inside "
    "every pull at a budget ≥ 0.2); a seeded random walk in log space between {walk_lo:g} and {walk_hi:g} "
    "Mbit/s, a new rate every 100 ms (the same rates for every policy). The adaptive daemon is restarted "
    "for each cell and sent {warmups} warm-up request(s) under the cell's trace first (with the link unknown "
    "it pulls at the configured b 0.3, which teaches its link model); its hourly re-probe of a link that keeps "
    "every turn local (daemon.link_reprobe_s) never fires within a cell, which lasts minutes. The others are "
    "started once. "
    "**Target attainment** is the share of requests with TTFT ≤ {target_ms:g} ms, every policy against the "
    "same target. A request without a first token within {cap_s:g} s is **censored** (the pull is cut at "
    "the cap and the daemon falls back to local prefill): it counts as TTFT > cap, medians and p95 are "
    "nearest-rank, and a ratio with a censored side is a bound. Quality: Δ perplexity and KL of "
    "{continuation} teacher-forced continuation tokens against FP16 transfer, with the quality harness's "
    "functions (tools/study/kv_quality.py's protocol; fp32 prefill, INT4 scoring graph at accuracy level 0), "
    "for every (prompt, KV source) a request used; local = the decode graph's own prefill."
)


def write_docs(run: dict, directory: Path) -> None:
    """``directory``/adaptive.md (method, command, machine, goals, tables) and adaptive.png."""
    rows = summarise(run)
    args, machine = run["args"], run["machine"]
    directory.mkdir(parents=True, exist_ok=True)
    plot(run, rows, directory / "adaptive.png")
    method = METHOD.format(
        **args,
        step_hi=args["step_mbits"][0],
        step_lo=args["step_mbits"][1],
        walk_lo=args["walk_mbits"][0],
        walk_hi=args["walk_mbits"][1],
        cap_s=args["cell_timeout_s"],
        continuation=args["continuation_tokens"],
    )
    pinned = f"daemons pinned to CPUs {args['edge_cpus']}" if args["edge_cpus"] else "daemons not pinned"
    lines = [
        "# The adaptive KV plan over shaped links (generated by tools/bench/adaptive.py)",
        "",
        method,
        "",
        f"Command: `{run['command']}` — {run['date']}, {run['wall_s']} s, model {run['model']}.",
        f"Machine: {machine['cpu']} ({machine['cpus']} CPUs), GPU: {machine['gpu'] or 'none'}, "
        f"{machine['platform']}; prefill server on {args['prefill_device']}, {pinned}.",
        "",
        "## Goals (issue 13)",
        "",
        *goal_checks(run, rows),
        "",
        "## TTFT per cell",
        "",
        *table(run, rows),
        "",
        "## Quality cost of the KV used (mean over the prompts scored)",
        "",
        *quality_table(run),
        "",
        "![TTFT against bandwidth per policy, and the step trace over time](adaptive.png)",
        "",
    ]
    (directory / "adaptive.md").write_text("\n".join(lines))


def plot(run: dict, rows: list[dict], path: Path) -> None:
    """Left: median TTFT against the constant links' bandwidth per policy (log-log); right: the step
    trace of the longest prompt's first run, the link rate and each policy's bytes received."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {policy: f"C{i}" for i, policy in enumerate(POLICIES)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    _plot_constant(left, run, [r for r in rows if r["trace"] == "constant"], colors)
    _plot_step(right, run, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_constant(ax, run: dict, rows: list[dict], colors: dict[str, str]) -> None:
    cap_ms = 1e3 * run["args"]["cell_timeout_s"]
    lengths = sorted({r["prompt_tokens"] for r in rows}, reverse=True)
    for length, style in zip(lengths, ("-", "--", ":", "-.")):
        for policy in POLICIES:
            points = sorted(
                (r["mbits"], r["stats"][policy]["median_ms"])
                for r in rows
                if r["prompt_tokens"] == length and policy in r["stats"]
            )
            if not points:
                continue
            xs, ys = [x for x, _ in points], [min(y, cap_ms) for _, y in points]
            ax.plot(xs, ys, style, color=colors[policy], marker="o", label=policy if length == lengths[0] else None)
            censored = [(x, cap_ms) for x, y in points if math.isinf(y)]
            if censored:
                ax.scatter(*zip(*censored), marker="^", s=80, color=colors[policy], zorder=3)
    ax.axhline(run["args"]["target_ms"], color="grey", linestyle="-.", label="target")
    ax.axhline(cap_ms, color="red", alpha=0.3, label="cap (▲ censored)")
    styles = ", ".join(f"{n} {s}" for n, s in zip(lengths, ("solid", "dashed", "dotted", "dash-dot")))
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="link bandwidth, Mbit/s (constant trace)",
        ylabel="TTFT median, ms",
        title=f"Constant links, RTT {run['args']['rtt_ms']:g} ms (prompt tokens: {styles})",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _plot_step(ax, run: dict, colors: dict[str, str]) -> None:
    steps = [r for r in run["results"] if r["trace"] == "step"]
    if not steps:
        ax.text(0.5, 0.5, "no step trace in this run", ha="center", transform=ax.transAxes)
        return
    length = max(r["prompt_tokens"] for r in steps)
    chosen = [r for r in steps if r["prompt_tokens"] == length and r["run"] == 0]
    end_s = 0.0
    for r in chosen:
        ttft_s = math.inf if r["ttft_ms"] is None else r["ttft_ms"] / 1e3
        progress = r["link"]["progress"]
        if progress and progress[-1][1] > 0:
            ax.plot([t for t, _ in progress], [b / 1e6 for _, b in progress], color=colors[r["policy"]])
            end_s = max(end_s, progress[-1][0])
        if math.isfinite(ttft_s):
            ax.axvline(ttft_s, color=colors[r["policy"]], linestyle=":", label=f"{r['policy']}: TTFT {ttft_s:.1f} s")
    twin = ax.twinx()
    for r in chosen:  # each request's own rate: the step comes after the same bytes, at its own time
        changes = r["link"]["changes"]
        times = [t for t, _ in changes] + [max(end_s, changes[-1][0])]
        rates = [rate / MBIT for _, rate in changes] + [changes[-1][1] / MBIT]
        twin.step(times, rates, where="post", color=colors[r["policy"]], alpha=0.35, linewidth=1)
    ax.axvline(run["args"]["target_ms"] / 1e3, color="grey", linestyle="-.", label="target")
    twin.set(ylabel="link rate, Mbit/s (thin lines)", yscale="log")
    ax.set(
        xlabel="seconds since the request",
        ylabel="MB received by the daemon",
        title=f"{chosen[0]['cell']}, {length} tokens, first run: bytes received (lines) and TTFT (dotted)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
