#!/usr/bin/env python3
"""Per-layer decode attention on the CPU: onnxruntime's GroupQueryAttention over a float32 cache (the decode graph's
stock form), the same over a float16 cache (which needs a float16 graph: GQA ties the query's type to the cache's),
and edgedecode's DecodeAttention (float32 query, float16 cache; edgedecode/kernels), at each past length.

For each model shape (heads / KV heads / head_dim of tools/bench/synth_gguf.py's SHAPES) and past length, one graph
per variant holds ``copies`` attention nodes, each over its own cache buffer bound in place as past and present (as
the runtime binds its KV), all fed one new token (packed QKV, RoPE at position ``past``); a run executes them all,
so a figure is a run's time over its copies, onnxruntime's per-node overhead included. ``copies`` makes the caches
of one run at least ``--mib`` MiB in float16 (at least 4, at most 256 nodes), so every node reads its cache from
memory, as a decode step does; the variants alternate run by run in the same process, medians of ``--runs``.

Columns: µs per layer (node), wall clock and the process's CPU time (all threads; run with ``EDGEDECODE_SPIN=0``
so idle threads do not spin, and on a loaded machine, where wall time waits on descheduled threads, CPU time is
the steadier figure), the cache bytes a node reads (K and V of past + 1 slots: 2 · KV heads · slots ·
head_dim · bytes per value), those bytes ÷ the time in GB/s, and that as a fraction of this machine's read
bandwidth with the same threads (tools/bench/membw.py, measured first). On a shared machine the figures are
indicative.

    EDGEDECODE_SPIN=0 python tools/bench/attention.py [--shapes smollm2-135m qwen2.5-0.5b llama3.2-1b llama3.2-3b]
        [--past 16 512 2048 4096] [--variants gqa-f32 gqa-f16 op-f16] [--runs 7] [--threads 2] [--json-out F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import math
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
from onnx import TensorProto

from edgedecode import kernels
from edgedecode.model.onnx_builder import INT32, INT64, KERNEL_DOMAIN, MS_DOMAIN, GraphBuilder
from edgedecode.runtime.session import create_session, import_onnxruntime
from tools.bench.membw import read_bandwidth_gb_s
from tools.bench.synth_gguf import SHAPES
from tools.common import cli

DEFAULT_SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b", "llama3.2-3b")
# variant: (the cache's numpy dtype, the query's, the op)
VARIANTS = {
    "gqa-f32": (np.float32, np.float32, "GroupQueryAttention"),
    "gqa-f16": (np.float16, np.float16, "GroupQueryAttention"),
    "op-f16": (np.float16, np.float32, "DecodeAttention"),
}
ROPE_BASE = 10_000.0  # the angles' values do not change the cost


@dataclass(frozen=True)
class Geometry:
    heads: int
    kv_heads: int
    dim: int

    @classmethod
    def of(cls, shape: str) -> Geometry:
        s = SHAPES[shape]
        return cls(s.heads, s.kv_heads, s.hidden // s.heads)


def cache_bytes(geometry: Geometry, past: int, itemsize: int) -> int:
    """Bytes of K and V a decode row reads at ``past``: its past and itself."""
    return 2 * geometry.kv_heads * (past + 1) * geometry.dim * itemsize


def build(variant: str, geometry: Geometry, slots: int, copies: int) -> bytes:
    """``copies`` independent attention nodes of one variant, one new token each over its own cache."""
    cache_dtype, query_dtype, op = VARIANTS[variant]
    kv_type = TensorProto.FLOAT16 if cache_dtype == np.float16 else TensorProto.FLOAT
    query_type = TensorProto.FLOAT16 if query_dtype == np.float16 else TensorProto.FLOAT
    g = GraphBuilder(f"attention-{variant}")
    width = (geometry.heads + 2 * geometry.kv_heads) * geometry.dim
    g.input("query", query_type, [1, 1, width])
    g.input("seqlens_k", INT32, [1])
    g.input("position_ids", INT64, [1, 1])
    half = geometry.dim // 2
    angles = np.arange(slots)[:, None] * ROPE_BASE ** (-np.arange(half) / half)[None, :]
    cos = g.initializer("cos", np.cos(angles).astype(query_dtype))
    sin = g.initializer("sin", np.sin(angles).astype(query_dtype))
    total = g.initializer("total", np.array(slots, np.int32))
    kv_shape = [1, geometry.kv_heads, slots, geometry.dim]
    for i in range(copies):
        past = [f"past.{i}.key", f"past.{i}.value"]
        for name in past:
            g.input(name, kv_type, kv_shape)
        gqa = op == "GroupQueryAttention"
        extra = {"do_rotary": 1, "rotary_interleaved": 0} if gqa else {}
        g.op(
            op,
            ["query", "", "", *past, "seqlens_k", *([total] if gqa else []), cos, sin, "position_ids"],
            3,
            name=f"attention.{i}",
            domain=MS_DOMAIN if gqa else KERNEL_DOMAIN,
            outputs=[f"out.{i}", f"present.{i}.key", f"present.{i}.value"],
            num_heads=geometry.heads,
            kv_num_heads=geometry.kv_heads,
            local_window_size=-1,
            scale=1.0 / math.sqrt(geometry.dim),
            **extra,
        )
        g.output(f"out.{i}", query_type, [1, 1, geometry.heads * geometry.dim])
        g.output(f"present.{i}.key", kv_type, kv_shape)
        g.output(f"present.{i}.value", kv_type, kv_shape)
    return g.model().SerializeToString()


class Bench:
    """One variant's session with its caches, inputs and outputs bound; ``run()`` times one pass of every node."""

    def __init__(self, variant: str, geometry: Geometry, past: int, copies: int, threads: int) -> None:
        ort = import_onnxruntime()
        cache_dtype, query_dtype, op = VARIANTS[variant]
        slots = past + 1
        self.session = create_session(
            build(variant, geometry, slots, copies), threads=threads, own_kernels=op == "DecodeAttention"
        )
        rng = np.random.default_rng(0)
        width = (geometry.heads + 2 * geometry.kv_heads) * geometry.dim
        self.query = rng.standard_normal((1, 1, width)).astype(query_dtype)
        self.io = self.session.io_binding()
        self.io.bind_cpu_input("query", self.query)
        self.io.bind_cpu_input("seqlens_k", np.array([past], np.int32))
        self.io.bind_cpu_input("position_ids", np.array([[past]], np.int64))
        self.caches = rng.standard_normal((copies, 2, 1, geometry.kv_heads, slots, geometry.dim)).astype(cache_dtype)
        self.outputs = np.empty((copies, 1, 1, geometry.heads * geometry.dim), query_dtype)
        for i in range(copies):
            for kind, name in enumerate(("key", "value")):
                value = ort.OrtValue.ortvalue_from_numpy(self.caches[i, kind])
                self.io.bind_ortvalue_input(f"past.{i}.{name}", value)
                self.io.bind_ortvalue_output(f"present.{i}.{name}", value)
            out = self.outputs[i]
            self.io.bind_output(f"out.{i}", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
        self.copies = copies
        self.run()  # warm-up: arenas, first touch of every page

    def run(self) -> tuple[float, float]:
        """Seconds per node of one run of all nodes: wall clock, and the process's CPU time."""
        started, cpu = time.perf_counter(), time.process_time()
        self.session.run_with_iobinding(self.io)
        return (time.perf_counter() - started) / self.copies, (time.process_time() - cpu) / self.copies


@dataclass(frozen=True)
class Row:
    shape: str
    past: int
    variant: str
    copies: int
    us_per_layer: float
    cpu_us_per_layer: float
    bytes_per_layer: int
    gb_s: float
    of_bandwidth: float


def measure(
    shape: str, past: int, variants: list[str], runs: int, threads: int, mib: int, bandwidth: float
) -> list[Row]:
    """Every variant at one shape and past length, alternating run by run; medians."""
    geometry = Geometry.of(shape)
    copies = min(256, max(4, math.ceil(mib * (1 << 20) / cache_bytes(geometry, past, 2))))
    benches = {v: Bench(v, geometry, past, copies, threads) for v in variants}
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(runs):
        for variant, bench in benches.items():
            times[variant].append(bench.run())
    rows = []
    for variant in variants:
        seconds = statistics.median(wall for wall, _ in times[variant])
        cpu = statistics.median(cpu for _, cpu in times[variant])
        nbytes = cache_bytes(geometry, past, np.dtype(VARIANTS[variant][0]).itemsize)
        gb_s = nbytes / seconds / 1e9
        rows.append(Row(shape, past, variant, copies, seconds * 1e6, cpu * 1e6, nbytes, gb_s, gb_s / bandwidth))
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | past | variant | µs / layer | CPU µs / layer | KB read / layer | GB/s | of bandwidth |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.shape} | {r.past} | {r.variant} | {r.us_per_layer:.1f} | {r.cpu_us_per_layer:.1f} | "
        f"{r.bytes_per_layer / 1e3:.0f} | "
        f"{r.gb_s:.1f} | {r.of_bandwidth:.0%} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    cli.add_past(p, [16, 512, 2048, 4096])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    cli.add_runs(p, 7)
    cli.add_threads(p)
    p.add_argument("--mib", type=int, default=256, help="float16 cache MiB one run reads at least")
    cli.add_json_file(p, "--json-out")
    args = p.parse_args(argv)
    started = time.time()
    variants = list(args.variants)
    if "op-f16" in variants and not kernels.load().available:
        print(f"op-f16 left out: edgedecode's kernels are not usable ({kernels.load().reason})")
        variants.remove("op-f16")
    bandwidth = read_bandwidth_gb_s(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s", flush=True)
    rows: list[Row] = []
    for shape in args.shapes:
        for past in args.past:
            rows += measure(shape, past, variants, args.runs, args.threads, args.mib, bandwidth)
            print(table(rows[-len(variants) :]).split("\n", 2)[2], flush=True)
    print(table(rows))
    if args.json_out:
        record = cli.record(__file__, argv, started) | {"settings": cli.settings(args), "bandwidth_gb_s": bandwidth}
        cli.write_json(record | {"rows": [asdict(r) for r in rows]}, args.json_out)
    return 0


if __name__ == "__main__":
    cli.run(main)
