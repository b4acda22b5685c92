#!/usr/bin/env python3
"""This machine's memory read bandwidth with N threads: the ceiling for a memory-bound decode step.

Each thread takes the maximum over its share of a large uint64 array (numpy releases the GIL in the
reduction, and ``max`` does one compare per 8 bytes, so the cores are not the limit); the array is
many times the last-level cache. Best of ``repeats`` passes, as STREAM reports, in GB/s (10^9 B/s).

    python tools/membw.py [--threads 2] [--mib 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{read_bandwidth_gb_s(args.threads, args.mib, args.repeats):.1f} GB/s read, {args.threads} threads")


if __name__ == "__main__":
    main()
