#!/usr/bin/env python3
"""A model's KV quality calibration for the daemon's planner, from saved quality runs.

Reads ``tools/study/kv_quality.py`` JSON results (one per prompt length; all of one model) and,
optionally, ``tools/bench/adaptive.py`` runs whose quality scores include local prefill (the decode
graph's own KV against the prefill graph's FP16 KV), and writes the calibration the daemon loads
for that model (``edgedecode/daemon/pull/calibration.py``): for every measured (prompt length,
budget) of the ``--policy`` rows, Δ PPL with its interval, KL and the contexts behind it; FP16
transfer stands for b 1.0 where the policy's own b 1.0 row was not run (it is the reference: Δ 0);
and local prefill's worst Δ PPL over the adaptive runs' prompts (absent when none was given: the
daemon then charges local prefill the worst cost measured on another model).

    python tools/study/calibration.py docs/kv-quality.json docs/bench/kv-quality-2k-ours-4contexts.json \\
        docs/bench/kv-quality-4k-ours-4contexts.json docs/bench/kv-quality-4k-ours-4contexts-b0.4-b0.15.json \\
        --adaptive docs/bench/adaptive-cpu-2threads-2026-11-26.json \\
        --out edgedecode/daemon/pull/calibrations/smollm2-135m-instruct.json
    python tools/study/calibration.py docs/bench/kv-quality-gemma3-270m.json \\
        --out edgedecode/daemon/pull/calibrations/gemma3-270m.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json

from tools.common import cli

POINT_KEYS = ("dppl_pct", "dppl_low", "dppl_high", "kl", "contexts")


def remote_points(runs: list[dict], policy: str) -> list[dict]:
    """Every (tokens, budget) point of ``policy`` over ``runs`` (a later run's point replaces an earlier one's)."""
    points: dict[tuple[int, float], dict] = {}
    for run in runs:
        tokens = int(run["context_tokens"])
        rows = run["perplexity"]["rows"]
        own = {float(r["budget"]) for r in rows if r["policy"] == policy}
        for row in rows:
            reference = row["policy"] == "fp16-transfer" and 1.0 not in own
            if row["policy"] == policy or reference:
                point = {key: row.get(key) for key in POINT_KEYS}
                points[(tokens, float(row["budget"]))] = {"tokens": tokens, "budget": float(row["budget"]), **point}
    return [points[key] for key in sorted(points, key=lambda k: (k[0], -k[1]))]


def local_point(adaptive_runs: list[dict]) -> dict | None:
    """Local prefill's worst Δ PPL (and KL) over the adaptive runs' scored prompts; None without any."""
    scores = [cell["local"] for run in adaptive_runs for cell in run.get("quality", {}).values() if "local" in cell]
    if not scores:
        return None
    worst = max(scores, key=lambda score: score["dppl_pct"])
    return {"dppl_pct": worst["dppl_pct"], "kl": worst.get("kl"), "prompts": len(scores)}


def calibration(runs: list[dict], adaptive_runs: list[dict], policy: str, sources: list[str]) -> dict:
    """The calibration document of the one model ``runs`` measured."""
    models = {run["model"] for run in runs} | {run["model"] for run in adaptive_runs}
    if len(models) != 1:
        raise SystemExit(f"the runs are of several models ({', '.join(sorted(models))}): calibrate one at a time")
    return {
        "model": models.pop(),
        "policy": policy,
        "measured_by": sources,
        "commands": [run.get("command") for run in runs + adaptive_runs],
        "remote": remote_points(runs, policy),
        "local": local_point(adaptive_runs),
    }


def main(argv: list[str] | None = None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("runs", type=Path, nargs="+", help="tools/study/kv_quality.py JSON results, one model")
    p.add_argument("--adaptive", type=Path, nargs="*", default=[], help="tools/bench/adaptive.py JSON results")
    p.add_argument("--policy", default="ours")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    adaptive_runs = [json.loads(path.read_text()) for path in args.adaptive]
    sources = [str(path) for path in [*args.runs, *args.adaptive]]
    document = calibration(runs, adaptive_runs, args.policy, sources)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}: {len(document['remote'])} points of {document['model']}")


if __name__ == "__main__":
    cli.run(main)
