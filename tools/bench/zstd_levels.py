#!/usr/bin/env python3
"""What each zstd level buys on EDKV chunks of real KV: the compressed share and the CPU time, one tier at a time.

The real default model prefills the first --tokens of CPython's bundled docs (the prefill server's graph, on
--device), then for each tier the whole prompt is encoded at that tier in the served chunk size, and every raw chunk
(before zstd) is compressed at each of --levels on one thread: the ratio is compressed ÷ raw bytes, the time is
``time.thread_time`` (other processes on a shared machine inflate it far less than wall time), best of --runs. The
writer's choice of a level per chunk (``kv/wire/writer.py``: ``FAST_ZSTD_LEVEL``) rests on this table.

    python tools/bench/zstd_levels.py [--tokens 4096] [--levels -1 1 2 3] [--device cpu] [--runs 2] [--json F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import time

import numpy as np
import zstandard

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.kv.wire.frames import CHUNK_PREFIX
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.prefill.pipeline import PAYLOAD_CHUNK_TOKENS
from edgedecode.runtime.engine import Engine
from tools.bench.prompts import prompt_tokens
from tools.common import cli

TIERS = (Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2)


def raw_chunks(snapshot: KVSnapshot, tier: Tier, chunk_tokens: int = PAYLOAD_CHUNK_TOKENS) -> list[bytes]:
    """The chunks (before zstd) of ``snapshot`` encoded whole at ``tier``."""
    frames = list(encode_payload(snapshot, np.full(snapshot.n_tokens, tier, np.uint8), chunk_tokens=chunk_tokens))
    decompressor = zstandard.ZstdDecompressor()
    return [decompressor.decompress(frame[CHUNK_PREFIX.size :]) for frame in frames[1:-1]]


def level_table(snapshot: KVSnapshot, tiers, levels, runs: int, chunk_tokens: int = PAYLOAD_CHUNK_TOKENS) -> dict:
    """Per tier: raw bytes, and per level the compressed bytes, their ratio, the best CPU seconds and raw GB/s."""
    table = {}
    for tier in tiers:
        chunks = raw_chunks(snapshot, tier, chunk_tokens)
        raw = sum(map(len, chunks))
        row: dict = {}
        for level in levels:
            compressor = zstandard.ZstdCompressor(level=level)
            best, size = float("inf"), 0
            for _ in range(runs):
                cpu = time.thread_time()
                size = sum(len(compressor.compress(chunk)) for chunk in chunks)
                best = min(best, time.thread_time() - cpu)
            row[str(level)] = {
                "compressed_bytes": size,
                "ratio": size / raw,
                "cpu_s": best,
                "gbps_raw": raw / best / 1e9 if best else None,
            }
        table[tier.name] = {"raw_bytes": raw, "levels": row}
    return table


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--levels", type=int, nargs="+", default=[-1, 1, 2, 3])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli.add_threads(parser)
    cli.add_runs(parser, 2)
    cli.add_json_file(parser)
    args = parser.parse_args(argv)
    started = time.time()
    model = load_model(args.model)
    engine = Engine(
        model, GraphOptions.for_device("prefill", args.device), max_context=args.tokens + 1, device=args.device,
        threads=args.threads,
    )  # fmt: skip
    ids = prompt_tokens(model.tokenizer, args.tokens)
    engine.start(ids, None, 0)
    engine.forward(ids)
    table = level_table(engine.export_kv(), TIERS, args.levels, args.runs)
    if args.json:
        cli.write_json({**cli.record(__file__, argv, started), "tiers": table}, args.json)
    for tier, row in table.items():
        cells = "; ".join(
            f"level {level}: {r['ratio']:.4f} in {r['cpu_s'] * 1e3:.0f} ms CPU ({r['gbps_raw']:.2f} GB/s)"
            for level, r in row["levels"].items()
        )
        print(f"{tier} ({row['raw_bytes'] / 1e6:.1f} MB raw): {cells}")


if __name__ == "__main__":
    cli.run(main)
