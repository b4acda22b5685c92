#!/usr/bin/env python3
"""What a hostile EDKV header can cost a receiver: CPU time to parse and check the worst header the
limits of docs/kv-format.md §7 accept, against the cost of refusing the 122,880-chunk attack.

For a SmolLM2-shaped receiver (30 layers, 3 KV heads, head_dim 64) with a 4096-token context: a
header at every declared limit (as many chunks as allowed, per-layer tiers making the most sections,
full meta and 1024-character names), and one chunk per layer per token (what an adversarial run sent).
Prints the median and the worst of --runs feeds of the header frame into a fresh reader.

    python tools/bench/kv_header.py [--runs 15]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import base64
import dataclasses
import itertools
import json
import statistics
import time
import zlib

import numpy as np

from edgedecode.kv.quant import DEFAULT_LAYOUTS
from edgedecode.kv.wire import EDKVReader, KVFormatError
from edgedecode.kv.wire.chunks import chunk_sizes
from edgedecode.kv.wire.frames import HEADER_CRC, HEADER_PREFIX, MAX_META_VALUES, max_chunks
from edgedecode.model.spec import KVContract, KVLayout
from tools.common import cli

LAYERS, HEADS, HEAD_DIM, TOKENS = 30, 3, 64, 4096
CONTRACT = KVContract("llama", LAYERS, HEADS, HEAD_DIM, 100000.0, KVLayout(), "t" * 64)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def header_frame(rects: np.ndarray, tiers: np.ndarray) -> bytes:
    """A well-formed header frame declaring ``rects`` (layer_start, layer_stop, token_start, token_stop)."""
    raw, _ = chunk_sizes(tiers, DEFAULT_LAYOUTS, HEADS, HEAD_DIM, rects)
    layouts = {
        tier.name.lower(): {part: dataclasses.asdict(layout) for part, layout in zip(("keys", "values"), pair)}
        for tier, pair in DEFAULT_LAYOUTS.items()
    }
    doc = {
        "contract": dataclasses.asdict(CONTRACT),
        "producer": {"model": "m" * 1024, "weights_sha256": "0" * 64, "precision": "p" * 1024},
        "n_tokens": TOKENS,
        "token_ids": _b64(np.arange(TOKENS, dtype="<i8")),
        "positions": _b64(np.arange(TOKENS, dtype="<i8")),
        "tiers": _b64(tiers),
        "layouts": layouts,
        "chunks": np.column_stack([rects, raw]).tolist(),
        "zstd_level": 3,
        "meta": {f"k{i:03d}": "v" * 27 for i in range(MAX_META_VALUES // 2 - 1)},
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    return HEADER_PREFIX.pack(b"EDKV", 1, 0, len(body)) + body + HEADER_CRC.pack(zlib.crc32(body))


def worst_accepted(tiers: np.ndarray) -> np.ndarray:
    """As many chunks as the limit allows: one per layer per 64 tokens, layer 0 cut finer."""
    extra = max_chunks(TOKENS, LAYERS) - (LAYERS - 1) * (TOKENS // 64)
    edges = np.linspace(0, TOKENS, extra + 1).astype(int)
    rects = [(0, 1, int(a), int(b)) for a, b in itertools.pairwise(edges)]
    rects += [(layer, layer + 1, t, t + 64) for layer in range(1, LAYERS) for t in range(0, TOKENS, 64)]
    return np.array(rects, np.int64)


def one_cell_chunks() -> np.ndarray:
    return np.array([(layer, layer + 1, t, t + 1) for layer in range(LAYERS) for t in range(TOKENS)], np.int64)


def time_feed(frame: bytes, runs: int) -> tuple[float, float, str]:
    """(median ms, worst ms, outcome) of feeding ``frame`` into fresh readers."""
    target = np.zeros((LAYERS, 2, HEADS, TOKENS, HEAD_DIM), np.float32)
    seconds, outcome = [], ""
    for _ in range(runs):
        reader = EDKVReader(CONTRACT, max_tokens=TOKENS, target_factory=lambda _: target)
        started = time.perf_counter()
        try:
            reader.feed(frame)
            outcome = "accepted"
        except KVFormatError as exc:
            outcome = f"refused: {type(exc).__name__} ({exc.field})"
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3, max(seconds) * 1e3, outcome


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_runs(parser, 15)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    tiers = rng.choice(np.array([0, 1, 2, 3], np.uint8), (LAYERS, TOKENS))  # per-layer tiers: most sections
    tiers[:, rng.random(TOKENS) < 0.1] = 4  # DROP is shared by all layers of a token
    print(f"receiver: {LAYERS} layers, {HEADS} KV heads, head_dim {HEAD_DIM}, {TOKENS} tokens")
    print(f"median / worst of {args.runs} feeds")
    for name, rects in (("worst accepted header", worst_accepted(tiers)), ("one chunk per cell", one_cell_chunks())):
        frame = header_frame(rects, tiers)
        median, worst, outcome = time_feed(frame, args.runs)
        print(f"{name:24s} {len(rects):7d} chunks {len(frame):9d} B  {median:7.2f} / {worst:7.2f} ms  {outcome}")


if __name__ == "__main__":
    cli.run(main)
