#!/usr/bin/env python3
"""This machine's memory read bandwidth with N threads: the ceiling for a memory-bound decode step.

Each thread takes the maximum over its share of a large uint64 array (numpy releases the GIL in the
reduction, and ``max`` does one compare per 8 bytes, so the cores are not the limit); the array is
many times the last-level cache. Best of ``repeats`` passes, as STREAM reports, in GB/s (10^9 B/s).

    python tools/bench/membw.py [--threads 2] [--mib 1024] [--repeats 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import threading
import time

import numpy as np

from tools.common import cli


def read_bandwidth_gb_s(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth, in GB/s, of ``threads`` threads over a ``mib`` MiB array."""
    data = np.ones(mib * (1 << 20) // 8, np.uint64)  # written once, so every page is resident
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.max, args=(part,)) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_threads(parser)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{read_bandwidth_gb_s(args.threads, args.mib, args.repeats):.1f} GB/s read, {args.threads} threads")


if __name__ == "__main__":
    cli.run(main)
