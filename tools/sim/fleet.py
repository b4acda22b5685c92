#!/usr/bin/env python3
"""A discrete-event simulation of many edge boxes against a prefill tier of R replicas.

**Workload** (``Workload``, every number a stated assumption): each box runs conversations one
after another, an exponential gap (mean ``conversation_gap_s``) between them; a conversation has a
geometric number of turns (mean ``turns_mean``); its first turn sends a ``system_tokens`` system
prompt and a user message, later turns the previous answer and a new user message (lognormal
lengths around ``user_median_tokens`` and ``answer_median_tokens``, σ 0.8 and 0.6 in log space);
the user reads the answer (decoded at ``decode_tok_s``) and thinks (lognormal around
``think_median_s``, σ 0.8) before the next turn. A box's daemon keeps its conversation's KV, so a
turn asks only for its new tokens' KV (as ``edgedecode serve`` does with a ``session_id``: the
answer's KV is the box's own, from decoding it); a conversation past ``max_context`` tokens starts
over. Each box has one link drawn from
``links`` (bandwidth, round trip, share of boxes).

**The budget policy as implemented**: a fixed budget (``fixed-0.3``: the daemon's default without
a TTFT target; ``fixed-1.0``), or ``adaptive``: every box runs the daemon's own planner
(``edgedecode.daemon.pull.adaptive.plan_kv``, TTFT target ``target_s``) on its own ``LinkModel``
(``edgedecode.daemon.pull.link``), which learns from each pull what the daemon learns (round trip:
the response headers' wait less the server's own time, so queueing at the tier counts; goodput;
server time per token), and a ``LocalPrefillModel`` from measured local prefill times. Local
prefill loads no replica; a split pulls the tail's bytes only. Every box has pulled before the
simulation starts (one typical pull, a 256-token prompt at b 0.3, between ``HISTORY_MIN_S`` and an
hour earlier, uniformly, as in a steady state where a box re-probes once an hour: the daemon keeps
its link estimate in ``daemon.state_dir`` across restarts), so its estimate starts stale; an
estimate idle past its lapse (the model's 60 s half-life) plans with the remembered link worsened
by the daemon's default ``link_stale_margin``, as the daemon does, and the next pull refreshes it
(a split's pull teaches its round trip and server time, not its goodput, as in the daemon). A turn
planned local re-probes the link once nothing measured it for ``daemon.link_reprobe_s`` (an hour;
``Reprobes``): it pulls instead. The pull's watch is modelled coarsely: a whole pull (not a split)
whose body would end past the target is cut ``WATCH_S`` into its body when computing the whole
turn here from then on ends sooner than ``WATCH_MARGIN`` of the pull (the daemon computes only the
part not yet verified, and may resume instead: this overstates the cut turn's time), and the cut
pull teaches what it measured.

**The tier**: R replicas, each one worker in FIFO order (the prefill service runs one request at
a time). Routing as ``prefill.fleet.router`` does: a conversation stays on the replica that
served it unless that one has ``imbalance`` more requests outstanding than the least busy
(then the least busy, which becomes its home); ``round_robin`` for comparison. A replica that
holds the conversation computes only what its prefix cache lacks, the previous answer and the new
tokens (the cache is assumed big enough to keep its conversations' prompts: the measured
affinity hit rate is near the best possible, docs/scale.md); another computes the whole prompt.
Service seconds come from measurements of the real server (``ServiceModel.from_bench``:
``tools/bench/serve.py``'s ``server_ms``, the prefill server's own prefill + scoring + encoding
time, prefix cache off), interpolated in tokens and budget. The payload (b × FP16 bytes of the
tokens sent; measured b_wire is within 0.001 of b) follows after the whole prefill (the server
encodes every frame before the first is sent), over the box's link, and through the tier's relay
(``--relay-ms-per-mb``: Ray Serve's ingress and proxy read each frame and pass it on, ~17 ms a MB on 2
cores, docs/scale.md): the payload flows at the slower of the two, the relay keeping up with any link
it outpaces. TTFT = round trip + queue + service + transfer + one decode step.

**The model** (``--model-size``, ``tools/sim/sizes.py``): the real SmolLM2-135M (the default), or the
1B and 3B shapes (replica and edge speeds measured on those shapes, quality costs the generic
calibration's) and an 8B on paper: its KV bytes per token, its replica service times, its edge box's
local prefill and decode speeds and the quality costs its daemons plan with.

Reported per (replicas, policy): requests/s at the tier, egress Gbit/s, p50/p95 TTFT over all
turns and p95 per link class, the p95 of the wait for a replica, mean replica utilisation, and the
share of turns prefilled locally.

    python tools/sim/fleet.py [--boxes 10000] [--replicas 4 6 8 10 12 16] [--device gpu|cpu]
                              [--model-size 135m|1b|3b|8b] [--relay-ms-per-mb 0]
                              [--policies fixed-0.3 fixed-1.0 adaptive] [--seeds 0 1 2] [--jobs 2]
                              [--write-docs] [--json]
                              [--json-out docs/bench/sim-fleet-....json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import functools
import heapq
import json
import math
import re
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

import tools.sim.fleet_report as report
from edgedecode.config import DaemonConfig
from edgedecode.daemon.pull.adaptive import PlanInputs, plan_kv
from edgedecode.daemon.pull.link import LinkModel, Reprobes
from edgedecode.daemon.pull.local_speed import LocalPrefillModel
from edgedecode.daemon.pull.segment import PullResult
from tools.common import cli
from tools.sim.sizes import LOCAL_BENCH, SERVE_BENCH, SMOLLM2_DECODE_TOK_S, ModelSize, sizes

BENCH = {
    "gpu": SERVE_BENCH,  # H100, EDKV encoded on 16 threads
    "cpu": LOCAL_BENCH,  # 2 onnxruntime threads on the 2-core VM
}
DEFAULT_SIZE = "135m"
MIN_WIRE_BYTES = 64 << 10  # daemon.min_wire_bytes
SPLIT_SLOWDOWN = DaemonConfig.split_slowdown  # the daemon's prior, before a split was measured
HISTORY_MIN_S = 300.0  # each box's one pull before the simulation was at least this long before it starts
REPROBE_S = 3600.0  # daemon.link_reprobe_s
WATCH_S, WATCH_MARGIN = 0.2, 0.8  # the watch's min_observe_s and margin (daemon.pull.adaptive.SegmentWatch)
USER_SIGMA, ANSWER_SIGMA, THINK_SIGMA = 0.8, 0.6, 0.8  # lognormal spreads (log space) of the workload


@dataclass(frozen=True)
class Link:
    mbit_s: float
    rtt_s: float
    share: float


@dataclass(frozen=True)
class Workload:
    """What the boxes do (see the module docstring)."""

    boxes: int = 10_000
    conversation_gap_s: float = 600.0
    turns_mean: float = 4.0
    think_median_s: float = 20.0
    system_tokens: int = 256
    user_median_tokens: float = 60.0
    answer_median_tokens: float = 150.0
    max_context: int = 4096
    decode_tok_s: float = SMOLLM2_DECODE_TOK_S  # the 2-core edge box's decode speed (tools/sim/sizes.py)
    first_step_s: float = 0.025  # the first token's own decode step
    links: tuple[Link, ...] = (
        Link(5, 0.080, 0.10),
        Link(20, 0.050, 0.30),
        Link(50, 0.030, 0.40),
        Link(200, 0.015, 0.20),
    )


@dataclass
class ServiceModel:
    """Seconds a replica takes for a request, by tokens computed and budget: measured points
    (tokens, seconds) per budget, linear between them in both (the nearest budget's beyond them;
    below the fewest tokens measured, that point's time; above the most, its last slope), times a
    factor drawn from ``residuals`` when given (measured ÷ fitted times of single requests: their
    spread; medians alone give none)."""

    points: dict[float, list[tuple[int, float]]]
    residuals: tuple[float, ...] = ()

    @classmethod
    def from_bench(cls, path: Path, size: ModelSize | None = None) -> ServiceModel:
        """From a ``tools/bench/serve.py --json`` report: each ``pull b=B`` mode's ``server_ms`` (as ``size``'s,
        ``ModelSize.replica_seconds``, when given)."""
        results = json.loads(path.read_text())["results"]
        points = {}
        for mode, by_length in results.items():
            found = re.fullmatch(r"pull b=([\d.]+)", mode)
            if found:
                points[float(found.group(1))] = sorted((int(n), row["server_ms"] / 1e3) for n, row in by_length.items())
        return cls(points if size is None else size.replica_seconds(points))

    def seconds(self, tokens: int, budget: float, rng: np.random.Generator | None = None) -> float:
        """The service time of a request computing ``tokens`` at ``budget`` (``rng`` draws its spread)."""
        base = self._interpolated(tokens, budget)
        return base * float(rng.choice(self.residuals)) if self.residuals and rng is not None else base

    def _interpolated(self, tokens: int, budget: float) -> float:
        budgets = sorted(self.points)
        if budget <= budgets[0] or len(budgets) == 1:
            return self._at(budgets[0], tokens)
        if budget >= budgets[-1]:
            return self._at(budgets[-1], tokens)
        upper = next(b for b in budgets if b >= budget)
        lower = max(b for b in budgets if b <= budget)
        if upper == lower:
            return self._at(lower, tokens)
        w = (budget - lower) / (upper - lower)
        return (1 - w) * self._at(lower, tokens) + w * self._at(upper, tokens)

    def _at(self, budget: float, tokens: int) -> float:
        pts = self.points[budget]
        ns, ss = [p[0] for p in pts], [p[1] for p in pts]
        if tokens <= ns[-1] or len(pts) == 1:
            return float(np.interp(tokens, ns, ss))
        slope = (ss[-1] - ss[-2]) / (ns[-1] - ns[-2])
        return ss[-1] + slope * (tokens - ns[-1])


@dataclass
class Replica:
    free_at: float = 0.0
    pending: deque = field(default_factory=deque)  # completion times of its requests not yet done

    def outstanding(self, now: float) -> int:
        while self.pending and self.pending[0] <= now:
            self.pending.popleft()
        return len(self.pending)


class Tier:
    """R FIFO replicas behind the affinity (or round-robin) router."""

    def __init__(self, replicas: int, routing: str = "affinity", imbalance: int = 2) -> None:
        self.replicas = [Replica() for _ in range(replicas)]
        self.routing, self.imbalance = routing, imbalance
        self._turn = 0

    def submit(self, home: int | None, arrival: float, service: Callable[[bool], float]) -> tuple[int, float, float]:
        """Route a request arriving at ``arrival`` from a conversation whose KV ``home`` holds;
        ``service(hit)`` is its service time. Returns (replica, completion time, service time)."""
        loads = [r.outstanding(arrival) for r in self.replicas]
        least = min(range(len(loads)), key=loads.__getitem__)
        if self.routing == "round_robin":
            chosen = self._turn % len(self.replicas)
            self._turn += 1
        elif home is not None and loads[home] - loads[least] <= self.imbalance:
            chosen = home
        else:
            chosen = least
        seconds = service(chosen == home)
        replica = self.replicas[chosen]
        replica.free_at = max(arrival, replica.free_at) + seconds
        replica.pending.append(replica.free_at)
        return chosen, replica.free_at, seconds


@dataclass
class Box:
    link: Link
    model: LinkModel
    reprobes: Reprobes
    turns_left: int = 0
    held: int = 0  # tokens of the conversation whose KV the box keeps
    last_answer: int = 0
    home: int | None = None


def simulate(
    workload: Workload,
    service: ServiceModel,
    replicas: int,
    policy: str,
    *,
    sim_s: float = 600.0,
    warmup_s: float = 300.0,
    target_s: float = 1.0,
    routing: str = "affinity",
    seed: int = 0,
    size: ModelSize | None = None,
    relay_s_per_mb: float = 0.0,
) -> dict:
    """Run the fleet for ``warmup_s + sim_s`` seconds; figures over turns starting after the warm-up. ``size``:
    the model (its KV bytes, quality costs and the edge box's local prefill; the 135M model when None), whose
    replica times ``service`` must already be; ``relay_s_per_mb``: the tier's relay (0: none)."""
    rng = np.random.default_rng(seed)
    size = size or sizes()[DEFAULT_SIZE]
    local = size.local_model()
    kv_bytes = size.kv_bytes_per_token
    now = [0.0]
    shares = np.array([link.share for link in workload.links])
    picks = rng.choice(len(workload.links), workload.boxes, p=shares / shares.sum())
    boxes = [
        Box(workload.links[i], LinkModel("tier", clock=lambda: now[0]), Reprobes(REPROBE_S, lambda: now[0]))
        for i in picks
    ]
    if policy == "adaptive":
        for box in boxes:
            now[0] = -float(rng.uniform(HISTORY_MIN_S, REPROBE_S))
            _teach_history(box, service, kv_bytes)
        now[0] = 0.0
    tier = Tier(replicas, routing)
    events = [(float(rng.exponential(workload.conversation_gap_s)), i) for i in range(workload.boxes)]
    heapq.heapify(events)
    end = warmup_s + sim_s
    ttfts, egress_bytes, requests, local_turns, turns, busy_s = [], 0.0, 0, 0, 0, 0.0
    waits: list[float] = []  # seconds requests waited for their replica
    by_link: dict[float, list[float]] = {}  # TTFTs by the box's link bandwidth

    while events:
        t, index = heapq.heappop(events)
        if t >= end:
            break
        now[0] = t
        box = boxes[index]
        user = max(1, int(lognormal(rng, workload.user_median_tokens, USER_SIGMA)))
        if box.turns_left == 0 or box.held + user > workload.max_context:
            box.turns_left = int(rng.geometric(1 / workload.turns_mean))
            box.held, box.last_answer, box.home = 0, 0, None
            new = workload.system_tokens + user
        else:
            new = user  # the box decoded the answer: its KV is there; the server's cache holds the prompts only
        prompt = box.held + new
        uncached = box.last_answer + new  # what the replica holding the conversation computes
        fp16 = new * kv_bytes
        decision, budget, head = _plan(box, policy, new, prompt, fp16, local, target_s - workload.first_step_s, size)
        counted = t >= warmup_s
        local_s = local.predict_seconds(new)
        if decision == "local":
            ttft = local_s
            local_turns += counted
        else:
            sent = new - head
            wire = int(min(1.0, max(budget, MIN_WIRE_BYTES / max(fp16, 1))) * sent * kv_bytes)
            half_rtt = box.link.rtt_s / 2
            chosen, done, seconds = tier.submit(
                box.home,
                t + half_rtt,
                lambda hit, n=uncached, p=prompt, b=budget: service.seconds(n if hit else p, b, rng),
            )
            box.home = chosen
            headers_s = done + half_rtt - t
            transfer_s = wire * max(8 / (box.link.mbit_s * 1e6), relay_s_per_mb / 1e6)
            ttft = headers_s + transfer_s
            if head:
                ttft = max(ttft, local.predict_between(box.held, box.held + head))
            elif policy == "adaptive" and ttft > target_s and headers_s + WATCH_S + local_s < WATCH_MARGIN * ttft:
                ttft, transfer_s = headers_s + WATCH_S + local_s, WATCH_S  # cut by the watch; computed here
                wire = int(WATCH_S * box.link.mbit_s * 1e6 / 8)
            # as the daemon: a split's pull teaches no goodput (the head's compute shares its cores)
            box.model.observe(
                PullResult(wire, sent * kv_bytes, {}, ttft, seconds, headers_s, transfer_s, wire),
                new,
                goodput=not head,
            )
            if counted:
                egress_bytes += wire
                requests += 1
                busy_s += seconds
                waits.append(done - seconds - t - half_rtt)
        ttft += workload.first_step_s
        if counted:
            ttfts.append(ttft)
            by_link.setdefault(box.link.mbit_s, []).append(ttft)
            turns += 1
        box.last_answer = max(1, int(lognormal(rng, workload.answer_median_tokens, ANSWER_SIGMA)))
        box.held = prompt + box.last_answer
        box.turns_left -= 1
        pause = (
            lognormal(rng, workload.think_median_s, THINK_SIGMA)
            if box.turns_left
            else float(rng.exponential(workload.conversation_gap_s))
        )
        heapq.heappush(events, (t + ttft + box.last_answer / workload.decode_tok_s + pause, index))

    ttft_array = np.array(ttfts)
    return {
        "replicas": replicas,
        "policy": policy,
        "routing": routing,
        "seed": seed,
        "turns_per_s": turns / sim_s,
        "requests_per_s": requests / sim_s,
        "egress_gbit_s": egress_bytes * 8 / sim_s / 1e9,
        "ttft_p50_s": float(np.percentile(ttft_array, 50)),
        "ttft_p95_s": float(np.percentile(ttft_array, 95)),
        "utilisation": min(busy_s / (sim_s * replicas), 1.0),  # service seconds of the window's requests
        "local_share": local_turns / max(turns, 1),
        "wait_p95_s": float(np.percentile(waits, 95)) if waits else 0.0,
        "ttft_p95_by_link_s": {f"{mbit:g}": float(np.percentile(v, 95)) for mbit, v in sorted(by_link.items())},
    }


def _teach_history(box: Box, service: ServiceModel, kv_bytes: int) -> None:
    """The box's pull before the simulation: a 256-token prompt at b 0.3 over its link, to an idle tier."""
    wire, server = int(0.3 * 256 * kv_bytes), service.seconds(256, 0.3)
    transfer = wire * 8 / (box.link.mbit_s * 1e6)
    box.model.observe(PullResult(wire, 0, {}, 0.0, server, box.link.rtt_s + server, transfer, wire), 256)


def lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    """A lognormal draw around ``median`` (spread ``sigma`` in log space)."""
    return median * math.exp(sigma * rng.standard_normal())


def _plan(
    box: Box,
    policy: str,
    new: int,
    prompt: int,
    fp16: int,
    local: LocalPrefillModel,
    target_s: float,
    size: ModelSize,
) -> tuple[str, float, int]:
    """(decision, budget, head tokens computed here) for one turn under ``policy`` (the daemon's default
    ``min_budget``: the calibration's)."""
    if policy.startswith("fixed-"):
        return "remote", float(policy.removeprefix("fixed-")), 0
    held = box.held

    def planned(reprobe: bool):
        return plan_kv(
            PlanInputs(
                target_s=target_s,
                fixed_budget=0.3,
                wire_bytes=lambda b: int(min(1.0, max(b, MIN_WIRE_BYTES / max(fp16, 1))) * fp16),
                predict_remote_s=lambda wire: box.model.predict_fetch_s(wire, new),
                local_s=math.inf if reprobe else local.predict_seconds(new),
                min_budget=size.calibration.min_budget,
                quality=size.calibration.quality(),
                tokens=new,
                context_tokens=prompt,
                local_head_s=None if reprobe else lambda h: local.predict_between(held, held + h),
                split_slowdown=SPLIT_SLOWDOWN,
            )
        )

    plan = planned(reprobe=False)
    if plan.decision == "local" and box.reprobes.due("tier", box.model):
        plan = planned(reprobe=True)  # as the daemon: the best pull, local prefill left out
    if plan.decision == "local":
        return "local", 0.0, 0
    return plan.decision, float(plan.budget or 0.3), plan.head


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--boxes", type=int, default=Workload.boxes)
    parser.add_argument("--device", choices=sorted(BENCH), default="gpu")
    parser.add_argument("--model-size", choices=sorted(sizes()), default=DEFAULT_SIZE, help="tools/sim/sizes.py")
    parser.add_argument("--relay-ms-per-mb", type=float, default=0.0, help="the tier's relay (0: none)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 6, 8, 10, 12, 16])
    parser.add_argument("--policies", nargs="+", default=["fixed-0.3", "fixed-1.0", "adaptive"])
    parser.add_argument("--routing", choices=("affinity", "round_robin"), default="affinity")
    parser.add_argument("--target-s", type=float, default=1.0, help="the adaptive policy's TTFT target")
    parser.add_argument("--sim-s", type=float, default=600.0)
    parser.add_argument("--warmup-s", type=float, default=300.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed and cell")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/scale.md's simulation section")
    cli.add_json_flag(parser, help="print the rows as JSON instead of the table")
    cli.add_json_file(parser, "--json-out", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if args.model_size != DEFAULT_SIZE and args.device != "gpu":
        parser.error("the other model sizes are scaled from the GPU server's measurements: --device gpu")
    size = sizes()[args.model_size]
    workload = Workload(boxes=args.boxes, decode_tok_s=size.edge_decode_tok_s)
    service = ServiceModel.from_bench(BENCH[args.device], size)
    cells = [(policy, r) for policy in args.policies for r in args.replicas]
    run = functools.partial(
        simulate,
        workload,
        service,
        sim_s=args.sim_s,
        warmup_s=args.warmup_s,
        target_s=args.target_s,
        routing=args.routing,
        size=size,
        relay_s_per_mb=args.relay_ms_per_mb / 1e3,
    )  # each process makes its own local prefill model (it holds a lock)
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = {(policy, r, seed): pool.submit(run, r, policy, seed=seed) for policy, r in cells for seed in args.seeds}
        rows = [report.combine([runs[policy, r, seed].result() for seed in args.seeds]) for policy, r in cells]
    document = {"args": cli.settings(args), "workload": report.workload_json(workload), "rows": rows}
    if args.json_out:
        cli.write_json(document, args.json_out)
    if args.json:
        cli.print_json(document)
        return
    table = report.table(rows)
    print(table)
    if args.write_docs:
        report.write_docs(args, rows, table, BENCH[args.device].relative_to(cli.ROOT))


if __name__ == "__main__":
    cli.run(main)
