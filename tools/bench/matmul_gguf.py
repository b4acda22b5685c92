#!/usr/bin/env python3
"""MatMulGGUF (edgedecode's kernel, reading GGUF blocks as stored) against onnxruntime's MatMulNBits, per layer.

For the layer matrices of real model shapes (tools/synth_gguf.py SHAPES) in the types a file of each preset holds,
times one matmul at M = 1 (decode) and M = 64 (a prompt chunk) in both forms, in the same process, alternating run
by run, medians of ``--runs``:

* ``gguf``: the ``com.edgedecode`` MatMulGGUF node on the tensor's GGUF rows (what the graphs wire when the kernels
  load), accuracy level 4 unless ``--accuracy 0``;
* ``nbits``: today's graph form (edgedecode/model/graph.py ``_linear_nbits``): MatMulNBits on the weight as
  ``load_block_quantized`` converts it (5- to 8-bit types become 8-bit codes), plus the per-block correction
  (ReduceSum of the input's blocks, MatMul, Add) for the types with offsets (Q4_1, Q4_K, Q5_K ...).

Each graph holds enough copies of the matrix (``--mib``, default 192 MiB, several times this CPU's last-level cache;
one byte differs in each, so onnxruntime cannot share one prepacked copy) that every node streams its weights from
memory, as a decode step does; a run executes them all, so a figure is a run's time over its copies,
onnxruntime's per-node overhead included. GB/s counts the GGUF's bytes of the matrix (what MatMulGGUF reads;
MatMulNBits reads its own prepacked copy, larger for every type but Q4_0 and Q8_0), and "of bw" divides it by this
machine's read bandwidth with the same threads (tools/membw.py), measured first. Weights are random valid blocks:
speed does not depend on values. On a shared machine the figures are indicative;
``--cpu-time --threads 1`` compares the two forms' work by CPU time, which other processes disturb far less.

    python tools/bench/matmul_gguf.py [--shapes qwen2.5-0.5b llama3.2-1b llama3.2-3b] [--types Q4_0 Q4_1 Q4_K_M]
        [--m 1 64] [--runs 7] [--threads 2] [--matrices qkv o gate_up down lm_head] [--cpu-time] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES
from onnx import TensorProto, helper

TOOLS = Path(__file__).resolve().parent
for folder in (TOOLS, TOOLS.parent):  # synth_gguf and membw live in tools/ or tools/bench/
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from membw import read_bandwidth_gb_s  # noqa: E402
from synth_gguf import SHAPES, Shape, tensor_types  # noqa: E402

from edgedecode import kernels  # noqa: E402
from edgedecode.model.onnx_builder import MS_DOMAIN, GraphBuilder  # noqa: E402
from edgedecode.model.weights import BlockQuantized, load_block_quantized  # noqa: E402

MATRICES = ("qkv", "o", "gate_up", "down", "lm_head")


@dataclass(frozen=True)
class Case:
    shape: str
    matrix: str
    kind: str  # GGML type name
    n: int
    k: int

    @property
    def gguf_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[QType[self.kind]]
        return self.n * (self.k // block) * size


def cases(shape_name: str, preset: str, matrices: tuple[str, ...]) -> list[Case]:
    """The layer matrices of a shape in the types a ``preset`` file holds (one case per distinct type)."""
    shape: Shape = SHAPES[shape_name]
    kv = shape.kv_heads * shape.head_dim
    dims = {
        "qkv": (shape.hidden + 2 * kv, shape.hidden, "attn_q"),
        "o": (shape.hidden, shape.hidden, "attn_output"),
        "gate_up": (2 * shape.ffn, shape.hidden, "ffn_gate"),
        "down": (shape.hidden, shape.ffn, "ffn_down"),
        "lm_head": (shape.vocab, shape.hidden, None),
    }
    choose = tensor_types(shape, preset)
    found = []
    for matrix in matrices:
        n, k, tensor = dims[matrix]
        names = ["token_embd.weight"] if tensor is None else [f"blk.{i}.{tensor}.weight" for i in range(shape.layers)]
        for kind in sorted({choose(name, k) for name in names}, key=int):
            found.append(Case(shape_name, matrix, kind.name, n, k))
    return found


def random_rows(kind: QType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF rows: random bytes with finite float16 scales (tests/kernel_oracle.py does the same)."""
    block, size = GGML_QUANT_SIZES[kind]
    rows = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    fields = (
        (208,) if kind == QType.Q6_K else (0, 2) if kind in (QType.Q4_1, QType.Q5_1, QType.Q4_K, QType.Q5_K) else (0,)
    )
    for at in fields:
        rows[..., at : at + 2] = (
            (rng.standard_normal(rows.shape[:2]) * 0.02).astype(np.float16)[..., None].view(np.uint8)
        )
    return rows.reshape(n, -1)


def distinct(array: np.ndarray, copy: int, at: int) -> np.ndarray:
    """The copy-th copy of a weight, one code byte (flat index ``at``) changed after the first.

    onnxruntime prepacks identical MatMulNBits weights once and shares the result, so identical copies would be
    read from cache, not memory (measured: 79 against 200 us a 2048 x 2048 Q4_0 node). Byte 10 of a GGUF row is a
    code or a 6-bit scale in every type, so any value keeps the blocks valid.
    """
    if copy == 0:  # the first copy is the weight itself, in both forms
        return array
    changed = array.copy()
    changed.reshape(-1)[at] ^= np.uint8(copy % 255)
    return changed


def _finish(g: GraphBuilder, outputs: list[str], domain: str | None) -> bytes:
    for name in outputs:
        g.output(name, TensorProto.FLOAT, None)
    model = g.model()
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model.SerializeToString()


def gguf_graph(rows: np.ndarray, case: Case, copies: int, accuracy: int) -> bytes:
    g = GraphBuilder("matmul_gguf")
    x = g.input("A", TensorProto.FLOAT, [1, "M", case.k])
    outputs = []
    for i in range(copies):
        b = g.initializer(f"B{i}", distinct(rows, i, 10))
        outputs.append(
            g.op1(
                "MatMulGGUF",
                [x, b],
                domain=kernels.KERNEL_DOMAIN,
                K=case.k,
                N=case.n,
                ggml_type=int(QType[case.kind]),
                accuracy_level=accuracy,
            )
        )
    return _finish(g, outputs, kernels.KERNEL_DOMAIN)


def nbits_graph(w: BlockQuantized, case: Case, copies: int, accuracy: int) -> bytes:
    """graph.py's MatMulNBits form: codes and scales, plus blocksum @ offsets where the type has offsets."""
    g = GraphBuilder("matmul_nbits")
    x = g.input("A", TensorProto.FLOAT, [1, "M", case.k])
    packed, scales = w.packed(), w.scales.reshape(-1)
    blocksum = None
    if w.offsets is not None:
        grouped = g.op1("Reshape", [x, g.initializer("shape", np.array([0, 0, -1, w.block_size], np.int64))])
        blocksum = g.op1("ReduceSum", [grouped, g.initializer("axes", np.array([-1], np.int64))], keepdims=0)
    outputs = []
    for i in range(copies):
        inputs = [x, g.initializer(f"B{i}", distinct(packed, i, 0)), g.initializer(f"S{i}", scales)]
        y = g.op1(
            "MatMulNBits",
            inputs,
            domain=MS_DOMAIN,
            K=case.k,
            N=case.n,
            bits=w.bits,
            block_size=w.block_size,
            accuracy_level=accuracy,
        )
        if blocksum is not None:
            correction = g.op1("MatMul", [blocksum, g.initializer(f"C{i}", w.offsets.T.copy())])
            y = g.op1("Add", [y, correction])
        outputs.append(y)
    return _finish(g, outputs, None)


def session(model: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not kernels.register(options):
        raise SystemExit(f"edgedecode kernels unusable: {kernels.load().reason}")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@dataclass
class Row:
    shape: str
    matrix: str
    kind: str
    n: int
    k: int
    m: int
    gguf_us: float
    nbits_us: float
    speedup: float  # nbits time / gguf time
    gguf_gb_s: float  # GGUF bytes of the matrix / gguf time
    nbits_gb_s: float  # the same bytes / nbits time
    gguf_of_bandwidth: float


def measure(
    case: Case,
    ms: list[int],
    runs: int,
    threads: int,
    mib: int,
    accuracy: int,
    bandwidth: float,
    clock=time.perf_counter,
) -> list[Row]:
    rng = np.random.default_rng(0)
    rows = random_rows(QType[case.kind], case.n, case.k, rng)
    copies = max(1, min(64, (mib << 20) // case.gguf_bytes))
    w = load_block_quantized(SimpleNamespace(tensor_type=int(QType[case.kind]), data=rows))
    engines = {
        "gguf": session(gguf_graph(rows, case, copies, accuracy), threads),
        "nbits": session(nbits_graph(w, case, copies, accuracy), threads),
    }
    found = []
    for m in ms:
        feed = {"A": rng.standard_normal((1, m, case.k)).astype(np.float32)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for run in range(runs + 1):  # the first run of each warms up and is not counted
            for name, engine in engines.items():
                started = clock()
                engine.run(None, feed)
                if run:
                    times[name].append((clock() - started) / copies)
        ours, theirs = statistics.median(times["gguf"]), statistics.median(times["nbits"])
        gb_s = case.gguf_bytes / ours / 1e9
        found.append(
            Row(
                case.shape,
                case.matrix,
                case.kind,
                case.n,
                case.k,
                m,
                ours * 1e6,
                theirs * 1e6,
                theirs / ours,
                gb_s,
                case.gguf_bytes / theirs / 1e9,
                gb_s / bandwidth,
            )
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "llama3.2-1b", "llama3.2-3b"], choices=SHAPES)
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q4_K_M"], choices=["Q4_0", "Q4_1", "Q4_K_M"])
    parser.add_argument("--matrices", nargs="+", default=list(MATRICES), choices=MATRICES)
    parser.add_argument("--m", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=192, help="weights per graph, MiB (several times the LLC)")
    parser.add_argument("--accuracy", type=int, default=4, choices=[0, 4])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the process's CPU time, not the wall clock: with --threads 1, a comparison of the two forms' "
        "work that other processes on a shared machine disturb far less (GB/s and 'of bw' then mean per CPU second)",
    )
    args = parser.parse_args()
    library = kernels.load()
    if not library.available:
        raise SystemExit(f"edgedecode kernels unusable: {library.reason}")
    bandwidth = read_bandwidth_gb_s(args.threads)
    print(
        f"read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads); kernels: {library.cpu_isa}; "
        f"{'CPU' if args.cpu_time else 'wall'} time; "
        f"onnxruntime {ort.__version__}; accuracy level {args.accuracy}"
    )
    header = f"{'shape':<13} {'matrix':<8} {'type':<5} {'N x K':>13} {'M':>3} {'gguf us':>9} {'nbits us':>9} "
    print(header + f"{'speedup':>8} {'gguf GB/s':>10} {'nbits GB/s':>11} {'of bw':>6}")
    seen: set[Case] = set()
    found: list[Row] = []
    for shape in args.shapes:
        for preset in args.types:
            for case in cases(shape, preset, tuple(args.matrices)):
                if case in seen:  # Q4_K_M shares its Q8_0 head with the other presets
                    continue
                seen.add(case)
                clock = time.process_time if args.cpu_time else time.perf_counter
                for row in measure(case, args.m, args.runs, args.threads, args.mib, args.accuracy, bandwidth, clock):
                    found.append(row)
                    print(
                        f"{row.shape:<13} {row.matrix:<8} {row.kind:<5} {f'{row.n} x {row.k}':>13} {row.m:>3} "
                        f"{row.gguf_us:>9.1f} {row.nbits_us:>9.1f} {row.speedup:>7.2f}x {row.gguf_gb_s:>10.1f} "
                        f"{row.nbits_gb_s:>11.1f} {row.gguf_of_bandwidth:>6.0%}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gb_s": bandwidth, "rows": [asdict(r) for r in found]}, indent=1))


if __name__ == "__main__":
    main()
