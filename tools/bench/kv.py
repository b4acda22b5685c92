#!/usr/bin/env python3
"""EDKV throughput on one core: encode, and decode + dequantise + write into a preallocated float32 KV buffer.

Throughput is in GB/s of FP16-equivalent bytes (n_tokens × layers × 2 × kv_heads × head_dim × 2), for a
SmolLM2-135M-shaped KV (30 layers, 3 KV heads, head_dim 64) of synthetic data: standard normal, with 4 of
the 64 key channels of every head scaled ×10 (the per-channel key outliers real models have). Tier mixes: all
FP16, all INT8, all INT4, all INT3, all INT2, each of the last three also rotated (EDKV 1.3 Hadamard rotation,
`-rot`), and a mix (5 % FP16: the first 4 tokens and the most recent ones; then, at random positions, 20 % INT8,
65 % INT4, 10 % DROP). The reader checks every value against the data's own range × 8, as a daemon checks against
its model's (``kv.value_range``). b_raw / b_zstd: chunk bytes before zstd / whole payload, over
FP16 bytes. Medians over --runs; the process is pinned to one CPU. On a shared machine, --cpu-time measures
the process's CPU time instead of wall time, which other load inflates far less.

    python tools/bench/kv.py [--tokens 4096] [--runs 5] [--level 3] [--chunk-tokens 256] [--cpu-time] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import os
import statistics
import time

import numpy as np
import zstandard

from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.value_range import KVValueRange
from edgedecode.kv.wire import EDKVReader, encode_payload
from edgedecode.model.spec import KVContract, KVLayout
from tools.common import cli

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, 10.0
MIX = {Tier.INT8: 0.20, Tier.INT4: 0.65, Tier.DROP: 0.10}  # of all tokens; the other 5 % are FP16
SINK_TOKENS = 4


def synthetic_snapshot(n: int, rng: np.random.Generator) -> KVSnapshot:
    contract = KVContract("llama", LAYERS, KV_HEADS, HEAD_DIM, 100000.0, KVLayout(), "synthetic")
    keys = rng.standard_normal((LAYERS, KV_HEADS, n, HEAD_DIM), np.float32)
    for head in range(KV_HEADS):
        keys[:, head, :, rng.choice(HEAD_DIM, OUTLIER_CHANNELS, replace=False)] *= OUTLIER_SCALE
    values = rng.standard_normal((LAYERS, KV_HEADS, n, HEAD_DIM), np.float32)
    producer = KVProducer("synthetic", "0" * 64, "float32")
    return KVSnapshot(contract, np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), keys, values, producer)


def tier_mixes(n: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Rotation | None]]:
    """name -> (tier map [n], rotation or None)."""
    mixed = np.full(n, Tier.FP16, np.uint8)
    recent = round(0.05 * n) - SINK_TOKENS
    middle = np.arange(SINK_TOKENS, n - recent)
    shuffled = rng.permutation(middle)
    start = 0
    for tier, share in MIX.items():
        count = round(share * n)
        mixed[shuffled[start : start + count]] = tier
        start += count
    uniform = {name: np.full(n, Tier[name.upper()], np.uint8) for name in ("fp16", "int8", "int4", "int3", "int2")}
    mixes: dict[str, tuple[np.ndarray, Rotation | None]] = {name: (tiers, None) for name, tiers in uniform.items()}
    for name in ("int4", "int3", "int2"):
        mixes[f"{name}-rot"] = (uniform[name], DEFAULT_ROTATION)
    mixes["mix"] = (mixed, None)
    return mixes


def median_seconds(fn, runs: int, clock) -> float:
    times = []
    for _ in range(runs):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def bench_mix(
    snapshot: KVSnapshot, tiers: np.ndarray, rotation: Rotation | None, args: argparse.Namespace
) -> dict[str, float]:
    n = snapshot.n_tokens
    fp16_bytes = n * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    payload = b""

    def encode() -> None:
        nonlocal payload
        payload = b"".join(
            encode_payload(snapshot, tiers, level=args.level, chunk_tokens=args.chunk_tokens, rotation=rotation)
        )

    clock = time.process_time if args.cpu_time else time.perf_counter
    encode_s = median_seconds(encode, args.runs, clock)
    kv = np.zeros((LAYERS, 2, KV_HEADS, n, HEAD_DIM), np.float32)  # the decoder's buffer, touched once here
    limits = KVValueRange.measure([snapshot], "the synthetic data").limits()
    raw_bytes = 0

    def decode() -> None:
        nonlocal raw_bytes
        reader = EDKVReader(snapshot.contract, max_tokens=n, target_factory=lambda header: kv, value_limits=limits)
        reader.feed(payload)
        raw_bytes = sum(chunk.raw_nbytes for chunk in reader.finish().chunks)

    decode_s = median_seconds(decode, args.runs, clock)
    return {
        "b_raw": raw_bytes / fp16_bytes,
        "b_zstd": len(payload) / fp16_bytes,
        "encode_gbps": fp16_bytes / encode_s / 1e9,
        "decode_gbps": fp16_bytes / decode_s / 1e9,
        "encode_ms": encode_s * 1e3,
        "decode_ms": decode_s * 1e3,
    }


def pin_one_core() -> int | None:
    """Pin this process to its last allowed CPU (Linux); None where affinity is not available."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    cli.add_runs(parser, 5)
    parser.add_argument("--level", type=int, default=3, help="zstd level of the writer")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per EDKV chunk (all layers in each)")
    parser.add_argument("--cpu-time", action="store_true", help="time with process CPU time, not wall time")
    cli.add_json_flag(parser, help="machine-readable output")
    args = parser.parse_args(argv)
    cpu = pin_one_core()
    rng = np.random.default_rng(0)
    snapshot = synthetic_snapshot(args.tokens, rng)
    mixes = tier_mixes(args.tokens, rng)
    results = {name: bench_mix(snapshot, tiers, rotation, args) for name, (tiers, rotation) in mixes.items()}
    setup = {
        "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "tokens": args.tokens},
        "data": f"synthetic: standard normal, {OUTLIER_CHANNELS} key channels per head ×{OUTLIER_SCALE:g}",
        "mix": "5% FP16 (first 4 + most recent), random 20% INT8, 65% INT4, 10% DROP",
        "value_limits": "the data's range × 8 (kv.value_range)",
        "zstd_level": args.level,
        "runs": args.runs,
        "clock": "process CPU time" if args.cpu_time else "wall",
        "cpu": cpu,
        "host": cli.cpu_name(),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
    }
    if args.json:
        cli.print_json({"setup": setup, "results": results}, indent=2)
        return
    print(
        f"EDKV, {args.tokens} tokens × {LAYERS} layers × {KV_HEADS} KV heads × head_dim {HEAD_DIM}; "
        f"{setup['data']}; zstd level {args.level}; median of {args.runs} runs ({setup['clock']}) on CPU {cpu}"
    )
    print(f"mix: {setup['mix']}; GB/s of FP16-equivalent bytes")
    print(f"{'tiers':<8} {'b_raw':>6} {'b_zstd':>7} {'encode GB/s':>12} {'decode GB/s':>12} {'decode ms':>10}")
    for name, r in results.items():
        print(
            f"{name:<8} {r['b_raw']:>6.3f} {r['b_zstd']:>7.3f} {r['encode_gbps']:>12.2f} {r['decode_gbps']:>12.2f} "
            f"{r['decode_ms']:>10.1f}"
        )


if __name__ == "__main__":
    cli.run(main)
