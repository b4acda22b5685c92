#!/usr/bin/env python3
"""How many GPUs for N edge boxes running model M: the fleet simulation (``tools/sim/fleet.py``) searched for the
fewest replicas beyond which more GPUs buy the boxes little.

For each ``--sizes`` model (``tools/sim/sizes.py``: 135M, the 1B and 3B shapes, 8B on paper) and each ``--boxes``
count, the simulation of ``tools/sim/fleet.py`` (its workload and link mix, the daemon's adaptive policy as
implemented, the tier's relay at ``--relay-ms-per-mb``) runs first with one replica for every ``UNLIMITED_BOXES``
boxes (a tier that is never busy: its p95 TTFT is what the links and the boxes allow), then at growing replica
counts (doubling, then bisecting) for the fewest whose **p95 TTFT and p95 wait for a replica are both within
``--slack`` of that unlimited tier's** (the wait also within ``WAIT_GRACE_S`` more; seed 0); that count is then run
with every ``--seeds`` and reported (medians over the seeds). Both, because each alone misleads: where most turns
are computed on the boxes or crawl over slow links, the p95 TTFT of all turns hardly moves while the pulled turns
queue (a 3B tier at 96 % utilisation passed it), and the wait alone never reaches zero: the affinity router keeps
a conversation on its replica while that one is at most two requests busier than the least busy, so some requests
wait behind others however many replicas there are (the unlimited tier's wait is that floor).
Boxes beyond ``--shard-boxes`` are run as independent shards of that many boxes each (so 100,000 boxes = 10
shards of 10,000: 10 × the replicas of one, the same TTFTs and shares): conservative, since one pooled tier queues
less than its shards, and said so in the table.

Per row: the replicas (one GPU each), the tier's requests/s, the share of turns the boxes computed themselves, TTFT
p50 and p95, the wait p95, mean utilisation, egress per replica, and the cost of a million turns at
``--gpu-hour-usd`` a GPU-hour (an assumption: the price is yours to set; nothing else is counted, not the boxes,
the network or the ingress).

    python tools/sim/sizing.py [--sizes 135m 1b 3b 8b] [--boxes 1000 10000 100000] [--slack 1.1]
        [--relay-ms-per-mb 17] [--gpu-hour-usd 3] [--seeds 0 1 2] [--jobs 2] [--json-out F] [--write-docs]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import functools
import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import tools.sim.fleet_report as report
from tools.common import cli
from tools.sim.fleet import BENCH, ServiceModel, Workload, simulate
from tools.sim.sizes import ModelSize, sizes

DOCS_BEGIN, DOCS_END = "<!-- sim_sizing: begin -->", "<!-- sim_sizing: end -->"
POLICY = "adaptive"  # the daemon's default
UNLIMITED_BOXES = 10  # the unlimited tier: a replica for every this many boxes
WAIT_GRACE_S = 0.05  # the p95 wait may exceed the unlimited tier's by the slack and this much


def fewest_replicas(meets: Callable[[int], bool], guess: int = 1) -> int:
    """The fewest replica count (>= 1) for which ``meets`` holds, taking it to hold from there on: from ``guess``,
    doubling until it holds, then bisecting (below ``guess`` where it holds there)."""
    if meets(guess):
        low, high = 0, guess  # no replica at all never meets it
    else:
        low, high = guess, 2 * guess
        while not meets(high):
            low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def sized_shard(size: ModelSize, boxes: int, guess: int, args, pool: ProcessPoolExecutor) -> tuple[int, dict, dict]:
    """The fewest replicas for ``boxes`` boxes of model ``size`` (searched from ``guess``), the seeds' runs there
    combined, and the search: the p95 TTFT and wait by replicas (the unlimited tier's included)."""
    workload = Workload(boxes=boxes, decode_tok_s=size.edge_decode_tok_s)
    run = functools.partial(
        simulate,
        workload,
        ServiceModel.from_bench(BENCH["gpu"], size),
        policy=POLICY,
        sim_s=args.sim_s,
        warmup_s=args.warmup_s,
        size=size,
        relay_s_per_mb=args.relay_ms_per_mb / 1e3,
    )
    tried: dict[int, dict] = {}

    def p95s(replicas: int) -> tuple[float, float]:
        """(p95 TTFT, p95 wait) of ``replicas``, seed 0."""
        if replicas not in tried:
            tried[replicas] = pool.submit(run, replicas, seed=args.seeds[0]).result()
        ttft, wait = tried[replicas]["ttft_p95_s"], tried[replicas]["wait_p95_s"]
        print(f"  {size.name}, {boxes} boxes, {replicas} replicas: p95 TTFT {ttft:.3f} s, wait {wait:.3f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        return ttft, wait

    unlimited_ttft, unlimited_wait = p95s(max(1, boxes // UNLIMITED_BOXES))

    def meets(replicas: int) -> bool:
        ttft, wait = p95s(replicas)
        return ttft <= args.slack * unlimited_ttft and wait <= args.slack * unlimited_wait + WAIT_GRACE_S

    replicas = fewest_replicas(meets, guess)
    futures = [pool.submit(run, replicas, seed=seed) for seed in args.seeds]
    searched = {str(n): [tried[n]["ttft_p95_s"], tried[n]["wait_p95_s"]] for n in sorted(tried)}
    return replicas, report.combine([future.result() for future in futures]), searched


def size_rows(size: ModelSize, args, pool: ProcessPoolExecutor) -> list[dict]:
    """The sized tier for each ``--boxes`` count of model ``size`` (a count beyond ``--shard-boxes`` as shards of
    the largest count within it, each shard count searched once)."""
    rows, shards_done, guess, last = [], {}, 1, None
    for boxes in sorted(args.boxes):
        shards = max(1, math.ceil(boxes / args.shard_boxes))
        shard_boxes = math.ceil(boxes / shards)
        if shard_boxes not in shards_done:
            if last is not None:  # the last count's replicas scaled by the boxes, halved: a guess to search from
                guess = max(1, last[0] * shard_boxes // (2 * last[1]))
            shards_done[shard_boxes] = sized_shard(size, shard_boxes, guess, args, pool)
            last = (shards_done[shard_boxes][0], shard_boxes)
        replicas, row, searched = shards_done[shard_boxes]
        rows.append(sized_row(size, boxes, shards, replicas, row, searched, args.gpu_hour_usd))
    return rows


def sized_row(size: ModelSize, boxes: int, shards: int, replicas: int, row: dict, searched: dict, usd: float) -> dict:
    """One table row: a shard's combined runs at ``replicas``, times ``shards``."""
    turns_per_s = row["turns_per_s"] * shards
    return {
        "size": size.name,
        "source": size.source,
        "boxes": boxes,
        "shards": shards,
        "replicas": replicas * shards,
        "requests_per_s": row["requests_per_s"] * shards,
        "turns_per_s": turns_per_s,
        "local_share": row["local_share"],
        "ttft_p50_s": row["ttft_p50_s"],
        "ttft_p95_s": row["ttft_p95_s"],
        "ttft_p95_s_range": row["ttft_p95_s_range"],
        "wait_p95_s": row["wait_p95_s"],
        "utilisation": row["utilisation"],
        "egress_gbit_s_per_replica": row["egress_gbit_s"] / replicas,
        "usd_per_million_turns": replicas * shards * usd / (turns_per_s * 3600) * 1e6,
        "search": searched,
        "runs": row["runs"],
    }


def table(rows: list[dict]) -> str:
    """The sized tiers as a Markdown table."""
    lines = [
        "| model | edge boxes | GPUs (replicas) | requests/s at the tier | turns computed on the box | TTFT p50 s "
        "| TTFT p95 s | wait p95 s | utilisation | egress Gbit/s a replica | $ per 1M turns |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        boxes = f"{row['boxes']:,}" + (f" ({row['shards']} shards)" if row["shards"] > 1 else "")
        lines.append(
            f"| {row['size']} | {boxes} | {row['replicas']} | {row['requests_per_s']:.1f} | {row['local_share']:.0%} "
            f"| {row['ttft_p50_s']:.2f} | {row['ttft_p95_s']:.2f} | {row['wait_p95_s']:.2f} | {row['utilisation']:.0%} "
            f"| {row['egress_gbit_s_per_replica']:.2f} | {row['usd_per_million_turns']:.2f} |"
        )
    return "\n".join(lines)


def write_docs(args, rows: list[dict], text: str) -> None:
    """Rewrite docs/scale.md's sizing table."""
    raw = f" --json-out {report._relative(args.json_out)}" if args.json_out else ""
    command = (
        f"python tools/sim/sizing.py --sizes {' '.join(args.sizes)} --boxes {' '.join(map(str, args.boxes))} "
        f"--slack {args.slack:g} --relay-ms-per-mb {args.relay_ms_per_mb:g} "
        f"--gpu-hour-usd {args.gpu_hour_usd:g} --seeds {' '.join(map(str, args.seeds))} --warmup-s {args.warmup_s:g} "
        f"--sim-s {args.sim_s:g}{raw} --write-docs"
    )
    sources = "\n".join(f"- `{name}`: {size.source}" for name, size in sizes().items() if name in args.sizes)
    section = "\n".join(
        [DOCS_BEGIN, f"`{command}`", "", text, "", "Where each model's figures come from:", "", sources, DOCS_END]
    )
    path = cli.ROOT / "docs/scale.md"
    document = path.read_text()
    start, stop = document.index(DOCS_BEGIN), document.index(DOCS_END) + len(DOCS_END)
    path.write_text(document[:start] + section + document[stop:])


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--sizes", nargs="+", choices=sorted(sizes()), default=["135m", "1b", "3b", "8b"])
    parser.add_argument("--boxes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--shard-boxes", type=int, default=10_000, help="boxes beyond this run as shards")
    parser.add_argument("--slack", type=float, default=1.1, help="p95 TTFT and wait within this of an unlimited tier's")
    parser.add_argument("--relay-ms-per-mb", type=float, default=17.0, help="the tier's relay (Ray Serve's, 2 cores)")
    parser.add_argument("--gpu-hour-usd", type=float, default=3.0, help="a GPU-hour's price (an assumption)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sim-s", type=float, default=300.0)
    parser.add_argument("--warmup-s", type=float, default=150.0)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/scale.md's sizing table")
    cli.add_json_file(parser, "--json-out", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    known = sizes()
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [row for name in args.sizes for row in size_rows(known[name], args, pool)]
    text = table(rows)
    print(text)
    if args.json_out:
        cli.write_json({"args": cli.settings(args), "rows": rows}, args.json_out)
    if args.write_docs:
        write_docs(args, rows, text)


if __name__ == "__main__":
    cli.run(main)
