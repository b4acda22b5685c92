"""The report of ``tools/sim/fleet.py``: its table, the plot and docs/scale.md's simulation section."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.common.cli import ROOT

DOCS_BEGIN, DOCS_END = "<!-- sim_fleet: begin -->", "<!-- sim_fleet: end -->"


SPREAD_KEYS = ("ttft_p50_s", "ttft_p95_s", "wait_p95_s")  # reported with their range over the seeds


def combine(runs: list[dict]) -> dict:
    """One cell's runs (one per seed) as one row: the median of each figure over the seeds, the
    range of ``SPREAD_KEYS`` (``<key>_range``: [min, max]) and the runs themselves."""
    first = runs[0]
    row: dict = {key: first[key] for key in ("replicas", "policy", "routing")}
    for key, value in first.items():
        if isinstance(value, float):
            row[key] = float(np.median([run[key] for run in runs]))
    by_link = [run["ttft_p95_by_link_s"] for run in runs]
    row["ttft_p95_by_link_s"] = {link: float(np.median([p95[link] for p95 in by_link])) for link in by_link[0]}
    for key in SPREAD_KEYS:
        row[f"{key}_range"] = [min(run[key] for run in runs), max(run[key] for run in runs)]
    row["seeds"] = [run["seed"] for run in runs]
    row["runs"] = runs
    return row


def _spread(row: dict, key: str) -> str:
    """``key``'s median, with its range over the seeds when there were several."""
    low, high = row[f"{key}_range"]
    return f"{row[key]:.2f}" if len(row["seeds"]) == 1 else f"{row[key]:.2f} ({low:.2f}–{high:.2f})"


def table(rows: list[dict]) -> str:
    """The simulation's rows as a Markdown table."""
    links = list(rows[0]["ttft_p95_by_link_s"])
    lines = [
        "| policy | replicas | requests/s | egress Gbit/s | TTFT p50 s | TTFT p95 s | p95 by link (Mbit/s): "
        + ", ".join(links)
        + " | wait p95 s | utilisation | local turns |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        per_link = ", ".join(f"{row['ttft_p95_by_link_s'].get(link, float('nan')):.2f}" for link in links)
        lines.append(
            f"| {row['policy']} | {row['replicas']} | {row['requests_per_s']:.1f} | {row['egress_gbit_s']:.2f} "
            f"| {_spread(row, 'ttft_p50_s')} | {_spread(row, 'ttft_p95_s')} | {per_link} "
            f"| {_spread(row, 'wait_p95_s')} "
            f"| {row['utilisation']:.0%} | {row['local_share']:.0%} |"
        )
    return "\n".join(lines)


def workload_json(workload) -> dict:
    """A ``sim_fleet.Workload`` as JSON."""
    return {**vars(workload), "links": [vars(link) for link in workload.links]}


def needed_replicas(rows: list[dict], policy: str, p95_s: float = 1.0) -> int | None:
    """The fewest replicas whose p95 TTFT is within ``p95_s`` for ``policy`` with every seed (None:
    none simulated)."""
    meeting = [row["replicas"] for row in rows if row["policy"] == policy and row["ttft_p95_s_range"][1] <= p95_s]
    return min(meeting) if meeting else None


def write_docs(args, rows: list[dict], table_text: str, bench: Path) -> None:
    """Plot p95 TTFT and utilisation against replicas (docs/scale.png) and rewrite docs/scale.md's
    simulation section with ``table_text`` and the replicas each policy needs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy in args.policies:
        mine = [row for row in rows if row["policy"] == policy]
        axes[0].plot([r["replicas"] for r in mine], [r["ttft_p95_s"] for r in mine], marker="o", label=policy)
        axes[1].plot([r["replicas"] for r in mine], [r["utilisation"] for r in mine], marker="o", label=policy)
    axes[0].axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    axes[0].set(xlabel="replicas", ylabel="p95 TTFT (s)", yscale="log", title=f"{args.boxes} edge boxes")
    axes[1].set(xlabel="replicas", ylabel="mean replica utilisation", ylim=(0, 1.05))
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(ROOT / "docs/scale.png", dpi=110)
    needs = {policy: needed_replicas(rows, policy) for policy in args.policies}
    command = (
        f"python tools/sim/fleet.py --boxes {args.boxes} --device {args.device} --model-size {args.model_size} "
        f"--relay-ms-per-mb {args.relay_ms_per_mb:g} --replicas {' '.join(map(str, args.replicas))} "
        f"--policies {' '.join(args.policies)} "
        f"--warmup-s {args.warmup_s:g} --sim-s {args.sim_s:g} --seeds {' '.join(map(str, args.seeds))} --write-docs"
        + (f" --json-out {_relative(args.json_out)}" if args.json_out else "")
    )
    raw = f"; raw output `{_relative(args.json_out)}`" if args.json_out else ""
    section = "\n".join(
        [
            DOCS_BEGIN,
            f"`{command}` ({args.warmup_s:g} s warm-up, {args.sim_s:g} s measured; the median over the seeds, "
            "TTFT and wait with their range over the seeds; "
            f"service times: `{bench}`{raw}):",
            "",
            table_text,
            "",
            "![p95 TTFT and utilisation against replicas](scale.png)",
            "",
            "Replicas needed for p95 TTFT ≤ 1 s with every seed: "
            + "; ".join(f"{p}: {n if n is not None else 'none of those simulated'}" for p, n in needs.items())
            + ".",
            DOCS_END,
        ]
    )
    path = ROOT / "docs/scale.md"
    text = path.read_text()
    start, stop = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    path.write_text(text[:start] + section + text[stop:])


def _relative(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
