#!/usr/bin/env python3
"""Where the prefill server's time goes, stage by stage: prefill, observe (the observation window's pass), export
(the KV to the host), importance, allocate, quantize, assemble, compress, frame and send, for prompts of
--tokens at each --budgets, on --device (cpu or cuda), for the reference path and the device path side by side.

For each prompt length the real default model prefills the first N tokens of CPython's bundled docs once (the
prefill server's graph, on --device; prefix cache off), then:

* importance: the reference (numpy, ``kv.importance``) and the device path (onnxruntime on --device,
  ``prefill.kv_device``) score the same queries; their largest relative difference is reported;
* for each budget, ``encode_within_budget`` as the server runs it (policy "ours", the model's tier profile, the
  refits included) with each path: the reference coder (every refit computed afresh: what the server did before)
  and the device path's coder (``KVDevice.coder``: on CUDA sections on the device, kept across refits; on the CPU
  the kernels library's one-pass section kernel, compressed chunks kept across refits). Both encode the same
  scored prefill (the reference's importance), and the tool checks that their payloads are byte for byte equal.
* send: the payload's frames written to a local socket that a thread drains (the kernel copy; no link);
* server: what a request costs the server, in wall time: the prefill stages, the path's scoring and its parallel
  fit; against the bare prefill (the prompt run through the same engine, nothing else).

Each encode runs twice per --runs: **serial** (one writer thread, onnxruntime on one thread) for each stage's CPU
time, taken with ``time.thread_time`` in the thread that runs it (other processes on a shared machine inflate it far
less than wall time), and **parallel** (--workers threads) for wall time and the process's CPU time. GB/s are of
FP16-equivalent KV (n × layers × 2 × kv_heads × head_dim × 2 bytes): per stage over its serial CPU time, a core's
over the serial run's whole process CPU time (what no stage clocks included: buffers, the fit's own Python), with
the figure that implies for two cores (twice it: the writer spreads the chunks over its threads), and end to end
over the parallel wall time. One warm-up encode per path and prompt is not counted (session builds).
A cell that fails is recorded with its error and the run goes on; --json is rewritten after every prompt.

    python tools/bench/prefill_stages.py [--model NAME | --gguf PATH] [--tokens 1024 4096 8191]
                                         [--budgets 1.0 0.5 0.3 0.2] [--device cpu|cuda] [--workers 2] [--runs 1]
                                         [--paths reference device] [--level 3] [--fast-level 1] [--json F]

``--gguf`` (or ``--model-path``) registers a GGUF file under ``$EDGEDECODE_HOME`` (default ~/.cache/edgedecode), where
its graphs are then built and cached: what a machine with no model cache runs (docs/performance.md gives the
command for a CUDA node).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import hashlib
import logging
import os
import socket
import statistics
import threading
import time
import traceback

import numpy as np

from edgedecode.config import PrefillConfig
from edgedecode.kv.importance import OBSERVATION_WINDOW, attention_importance
from edgedecode.kv.policy import TierProfile, profile_path
from edgedecode.kv.stage_clock import StageClock
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.model.registry import DEFAULT_MODEL
from edgedecode.prefill.kv_device import KVDevice
from edgedecode.prefill.pipeline import (
    SERVED_ZSTD_LEVEL,
    EncodedKV,
    ScoredPrefill,
    encode_within_budget,
    prefill_observed,
)
from edgedecode.runtime.engine import Engine
from tools.bench.models import gguf_model
from tools.bench.prompts import prompt_tokens
from tools.common import cli

logger = logging.getLogger(__name__)
PATHS = ("reference", "device")
ENCODE_STAGES = ("allocate", "header", "quantize", "assemble", "compress", "frame")


def server_context(model, longest: int) -> int:
    """The prefill server's engine context (its default ``max_prompt_tokens``, within the model's), or more for a
    longer prompt: on CUDA an export copies whole KV buffers, so their size is part of what a request costs."""
    return max(longest, min(PrefillConfig().max_prompt_tokens, model.spec.context_length)) + 1


def fp16_nbytes(scored: ScoredPrefill) -> int:
    c = scored.snapshot.contract
    return scored.snapshot.n_tokens * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2


def bare_prefill_s(engine: Engine, ids: np.ndarray, runs: int) -> float:
    """Wall seconds of the prompt's plain prefill on ``engine`` (no observation pass, no export): the fastest of
    ``runs`` (on a GPU the first run of a prompt length may grow the device's memory arena)."""
    walls = []
    for _ in range(runs):
        wall = time.perf_counter()
        engine.start(ids, None, 0)
        engine.forward(ids)
        walls.append(time.perf_counter() - wall)
    return min(walls)


def prefill(engine: Engine, ids: np.ndarray, devices: dict[str, KVDevice | None], bare_runs: int) -> dict:
    """Prefill ``ids`` once; score them with every path. Returns the scored prefill (reference importance),
    the prefill stages and each path's importance time."""
    bare = bare_prefill_s(engine, ids, bare_runs)
    clock = StageClock(time.process_time)  # one stage at a time: onnxruntime's threads counted
    wall = time.perf_counter()
    queries, positions = prefill_observed(engine, ids, OBSERVATION_WINDOW, None, clock)
    with clock.stage("export"):
        snapshot = engine.export_kv()
    stages = {name: t for name, t in clock.as_dict().items()}
    scores = {}
    for path, device in devices.items():
        timing = StageClock(time.process_time)
        for _ in range(2):  # the first builds the device's session
            timing = StageClock(time.process_time)
            with timing.stage("importance"):
                if device is None:
                    per_layer = attention_importance(engine.spec, queries, positions, snapshot.keys, snapshot.positions)
                else:
                    per_layer = device.importance(engine.spec, queries, positions, snapshot)
        scores[path] = per_layer.sum(axis=0)
        stages[f"importance ({path})"] = timing.as_dict()["importance"]
    reference = scores.get("reference", next(iter(scores.values())))
    differences = {
        path: float(np.abs(score - reference).max() / max(float(np.abs(reference).max()), 1e-30))
        for path, score in scores.items()
    }
    return {
        "scored": ScoredPrefill(snapshot, reference),
        "scores": scores,
        "stages": stages,
        "bare_prefill_wall_s": bare,
        "wall_s": time.perf_counter() - wall,
        "importance_max_rel_diff": differences,
    }


def encode(
    scored: ScoredPrefill,
    budget: float,
    device: KVDevice | None,
    workers: int,
    profile: TierProfile,
    levels: tuple[int, int],
) -> tuple[EncodedKV, StageClock, float, float]:
    """One fit at ``budget`` with zstd's ``levels`` (the payload's, and that of chunks with no 8-bit codes): the
    payload, its stage clock (process CPU time when serial), wall and process CPU seconds."""
    clock = StageClock(time.process_time if workers == 1 else time.thread_time)
    wall, cpu = time.perf_counter(), time.process_time()
    encoded = encode_within_budget(
        scored, budget, profile=profile, workers=workers, device=device, clock=clock, level=levels[0],
        fast_level=levels[1],
    )  # fmt: skip
    return encoded, clock, time.perf_counter() - wall, time.process_time() - cpu


def send(frames: list[bytes]) -> dict:
    """Write ``frames`` into a local socket drained by a thread: the sender's CPU and wall seconds."""
    sender, receiver = socket.socketpair()
    drained = 0

    def drain() -> None:
        nonlocal drained
        while chunk := receiver.recv(1 << 20):
            drained += len(chunk)

    thread = threading.Thread(target=drain)
    thread.start()
    cpu, wall = time.thread_time(), time.perf_counter()
    for frame in frames:
        sender.sendall(frame)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    sender.close()
    thread.join()
    receiver.close()
    return {"cpu_s": cpu, "wall_s": wall, "bytes": drained}


def measure_cell(scored: ScoredPrefill, budget: float, path: str, args, devices, profile) -> dict:
    """The serial and parallel encodes of one (prompt, budget, path), medians over --runs."""
    fp16 = fp16_nbytes(scored)
    serial_device = None if devices[path] is None else KVDevice(args.device, 1)
    levels = (args.level, args.fast_level)
    encode(scored, budget, serial_device, 1, profile, levels)  # warm-up: sessions
    runs = []
    for _ in range(args.runs):
        encoded, clock, serial_wall, serial_cpu = encode(scored, budget, serial_device, 1, profile, levels)
        _, _, wall, cpu = encode(scored, budget, devices[path], args.workers, profile, levels)
        runs.append((encoded, clock.as_dict(), serial_wall, wall, cpu, serial_cpu))
    encoded, stages, _, _, _, _ = runs[-1]
    samples = stages.get("sample", {}).get("calls", 0)
    stage_cpu = {name: statistics.median(r[1].get(name, {"cpu_s": 0.0})["cpu_s"] for r in runs) for name in stages}
    encode_cpu = sum(stage_cpu.get(name, 0.0) for name in ENCODE_STAGES)
    wall = statistics.median(r[3] for r in runs)
    serial_cpu = statistics.median(r[5] for r in runs)
    return {
        # a header stage to plan each payload and one to frame it; a sample plans one (and holds its own stages)
        "samples": samples,
        "encodes": (stages.get("header", {}).get("calls", 0) - samples) // 2,
        "b_wire": encoded.b_wire,
        "wire_bytes": encoded.wire_bytes,
        "tiers": encoded.tier_counts(),
        "stages_cpu_s": stage_cpu,
        "stages_gbps": {name: fp16 / s / 1e9 for name, s in stage_cpu.items() if s > 0},
        "encode_cpu_s": encode_cpu,
        "encode_gbps_per_core": fp16 / encode_cpu / 1e9 if encode_cpu else None,
        "serial_process_cpu_s": serial_cpu,
        "process_gbps_per_core": fp16 / serial_cpu / 1e9,
        "implied_2core_gbps": 2 * fp16 / serial_cpu / 1e9,
        "serial_wall_s": statistics.median(r[2] for r in runs),
        "parallel_wall_s": wall,
        "parallel_process_cpu_s": statistics.median(r[4] for r in runs),
        "parallel_gbps_wall": fp16 / wall / 1e9,
        "send": send(encoded.frames),
        "payload": b"".join(encoded.frames),
        "payload_sha256": hashlib.sha256(b"".join(encoded.frames)).hexdigest(),  # to compare runs of two checkouts
        "tier_map": encoded.tiers,
    }


def measure(args) -> dict:
    model = load_model(gguf_model(Path(args.gguf)) if args.gguf else args.model or DEFAULT_MODEL)
    longest = max(args.tokens)
    engine = Engine(
        model, GraphOptions.for_device("prefill", args.device), max_context=server_context(model, longest),
        device=args.device,
        threads=args.threads,
    )  # fmt: skip
    devices: dict[str, KVDevice | None] = {
        path: (None if path == "reference" else KVDevice(args.device, args.threads)) for path in args.paths
    }
    profile = TierProfile.load(profile_path(model))
    # warm-up: the first runs initialise the device and, on a GPU, choose kernels for each run shape (the prompt's
    # runs and the observation window's), which the first prompt measured would otherwise pay
    prefill_observed(engine, prompt_tokens(model.tokenizer, 512), OBSERVATION_WINDOW, None)
    cells = []
    for n in args.tokens:
        row: dict = {"tokens": n, "load_average_before": os.getloadavg()[0]}
        cells.append(row)
        try:
            done = prefill(engine, prompt_tokens(model.tokenizer, n), devices, 1 if args.device == "cpu" else 2)
        except Exception as exc:  # a failed prompt is recorded and the run goes on
            row["error"] = "".join(traceback.format_exception_only(exc)).strip()
            continue
        scored = done.pop("scored")
        scores = done.pop("scores")
        row.update(done, fp16_bytes=fp16_nbytes(scored), budgets={})
        for budget in args.budgets:
            cell: dict = {}
            row["budgets"][str(budget)] = cell
            for path in args.paths:
                try:
                    cell[path] = measure_cell(scored, budget, path, args, devices, profile)
                except Exception as exc:
                    cell[path] = {"error": "".join(traceback.format_exception_only(exc)).strip()}
            for path, result in cell.items():  # what a request costs the server: prefill stages, then the fit
                if "parallel_wall_s" in result:
                    before = sum(row["stages"][name]["wall_s"] for name in ("prefill", "observe", "export"))
                    result["server_wall_s"] = before + row["stages"][f"importance ({path})"]["wall_s"] + (
                        result["parallel_wall_s"])  # fmt: skip
            payloads = {path: result.pop("payload") for path, result in cell.items() if "payload" in result}
            tier_maps = [result.pop("tier_map") for result in cell.values() if "tier_map" in result]
            if len(payloads) > 1:
                cell["same_bytes"] = len(set(payloads.values())) == 1
            if "device" in scores and tier_maps:  # the tiers the device path's own scores pick
                other = ScoredPrefill(scored.snapshot, scores["device"])
                tiers = encode_within_budget(
                    other,
                    budget,
                    profile=profile,
                    device=devices["device"],
                    level=args.level,
                    fast_level=args.fast_level,
                ).tiers
                cell["device_scores_same_tiers"] = bool(np.array_equal(tiers, tier_maps[0]))
        row["load_average_after"] = os.getloadavg()[0]
        logger.info("%d tokens measured", n)
        if args.json:  # after every prompt: a run cut short keeps what it measured
            cli.write_json(record(args, cells), args.json)
    return record(args, cells)


def record(args, cells: list[dict]) -> dict:
    return {
        **cli.record(__file__, args.argv, args.started),
        "settings": cli.settings(args, ("argv", "started")),
        "cells": cells,
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a registered model (default: the default model)")
    which.add_argument(
        "--gguf", "--model-path", help="a GGUF file, registered under $EDGEDECODE_HOME (a machine with no model cache)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8191])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.3, 0.2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="writer threads (parallel runs)")
    cli.add_threads(parser, 2, "onnxruntime threads of the prefill engine and the device path")
    cli.add_runs(parser, 1)
    parser.add_argument("--level", type=int, default=SERVED_ZSTD_LEVEL, help="zstd level of the payloads")
    parser.add_argument(
        "--fast-level", type=int, default=None, help="zstd level of chunks with no 8-bit codes (default: --level, "
        "every chunk at one level, as the server; --level 3 --fast-level 1 was its choice before)"
    )  # fmt: skip
    cli.add_json_file(parser)
    args = parser.parse_args(argv)
    args.argv, args.started = argv, time.time()
    print_table(measure(args))


def print_table(run: dict) -> None:
    for row in run["cells"]:
        if "error" in row:
            print(f"{row['tokens']} tokens: {row['error']}")
            continue
        stages = row["stages"]
        head = ", ".join(f"{name} {t['cpu_s'] * 1e3:.0f} ms CPU ({t['wall_s'] * 1e3:.0f} wall)" for name, t in
                         stages.items())  # fmt: skip
        print(
            f"{row['tokens']} tokens ({row['fp16_bytes'] / 1e6:.1f} MB FP16): bare prefill "
            f"{row['bare_prefill_wall_s'] * 1e3:.0f} ms wall; {head}"
        )
        for budget, cell in row["budgets"].items():
            for path in PATHS:
                r = cell.get(path)
                if r is None:
                    continue
                if "error" in r:
                    print(f"  b {budget} {path}: {r['error']}")
                    continue
                parts = " ".join(f"{k} {v * 1e3:.0f}" for k, v in r["stages_cpu_s"].items())
                print(
                    f"  b {budget} {path:<9} samples {r['samples']} encodes {r['encodes']} b_wire {r['b_wire']:.4f} | "
                    f"CPU ms: {parts} | "
                    f"encode {r['encode_cpu_s'] * 1e3:.0f} ms CPU = {r['encode_gbps_per_core']:.2f} GB/s a core "
                    f"(process {r['serial_process_cpu_s'] * 1e3:.0f} ms = {r['process_gbps_per_core']:.2f}, "
                    f"{r['implied_2core_gbps']:.2f} GB/s on 2 cores); "
                    f"parallel wall {r['parallel_wall_s'] * 1e3:.0f} ms = {r['parallel_gbps_wall']:.2f} GB/s; "
                    f"send {r['send']['cpu_s'] * 1e3:.0f} ms CPU; server {r['server_wall_s'] * 1e3:.0f} ms wall "
                    f"= {r['server_wall_s'] / row['bare_prefill_wall_s']:.2f}× the bare prefill"
                )
            if "same_bytes" in cell:
                print(f"  b {budget} same bytes: {cell['same_bytes']}")


if __name__ == "__main__":
    cli.run(main)
