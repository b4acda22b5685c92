#!/usr/bin/env python3
"""edgedecode's CUDA ops against onnxruntime's MatMulNBits forms, per decode-layer role, at batch 1, on the card.

For the 0.5B (Qwen2.5), 1B and 3B (Llama 3.2) shapes and the Q4_0, Q4_1 and Q4_K_M files, each role of a layer
(qkv, o, gate_up, down, and the LM head) is timed in these forms:

* ``ours_fused``: one FusedMatMulGGUF (RMSNorm, every matrix, gate, residual add in one kernel);
* ``ours_matmul``: the role's matrices as MatMulGGUF nodes alone (no norm or glue);
* ``ort_matmul[_correction|_zero_point]``: the matrices as graph.py emits MatMulNBits for them: 4 bits without
  zero points (Q4_0), with Q4_1/Q4_K's offsets as the correction (ReduceSum, MatMul, Add) or as float zero points,
  8 bits for Q5_0/Q6_K/Q8_0; runs of one form per matmul, joined by Concat;
* ``ort_role[...]``: the same plus the glue the fused op replaces (SkipSimplifiedLayerNormalization before qkv and
  gate_up, Split + SiLU + Mul after gate_up, the final norm before the head).

Each model holds ``copies`` independent instances of its role (own weights, so none is read from L2 twice), runs
through a captured CUDA graph on bound device buffers, and is timed by wall clock over ``--runs`` replays and, where
PyTorch is importable, by CUPTI (torch.profiler): kernels and GPU µs per instance. Weights are random (timing only;
tests/test_gpu_ops.py checks the values). One failing form or role is recorded and the rest go on; the JSON is
rewritten after every role, so a run cut short keeps what it measured.

    python tools/bench/cuda_ops.py OUT_DIR [--shapes 0.5b 1b 3b] [--types Q4_0 Q4_1 Q4_K_M] [--runs 100]
        [--roles qkv o gate_up down head] [--budget-mb 256] [--tune]

Needs numpy, onnx, onnxruntime-gpu, NVRTC (nvidia-cuda-nvrtc, or EDGEDECODE_NVRTC) and this checkout's edgedecode
(only edgedecode.kernels is imported); PyTorch is optional.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's edgedecode
from edgedecode import kernels
from edgedecode.kernels import nvrtc

SHAPES = {  # hidden, q width, k/v width, intermediate, vocab
    "0.5b": (896, 896, 128, 4864, 151936),
    "1b": (2048, 2048, 512, 8192, 128256),
    "3b": (3072, 3072, 1024, 8192, 128256),
}
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK = {
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
OFFSETS = {3, 12, 13, 7}  # types with an offset per block (Q4_1's m, the K-quants' mins)
NBITS = {2: 4, 3: 4, 12: 4, 6: 8, 7: 8, 8: 8, 13: 8, 14: 8}  # MatMulNBits width graph.py gives each type
ROLES = ("qkv", "o", "gate_up", "down", "head")
MS = "com.microsoft"
EPS = 1e-5


def role_types(file_type: str, role: str, k: int) -> list[int]:
    """GGML types of the role's matrices in a llama.cpp file of ``file_type`` (the head is Q6_K, as llama.cpp's
    quantize gives the output tensor; Q4_K_M keeps V and down in Q6_K; K-quants fall back to Q5_0 / Q8_0 where K
    is not a multiple of 256, as the 0.5B shape's 896 is not)."""
    base = {"Q4_0": 2, "Q4_1": 3, "Q4_K_M": 12}[file_type]
    wide = {"qkv": [base, base, 14 if base == 12 else base], "gate_up": [base, base], "o": [base],
            "down": [14 if base == 12 else base], "head": [14]}[role]  # fmt: skip
    if k % 256:
        wide = [{12: 6, 13: 6, 14: 8}.get(t, t) for t in wide]
    return wide


def role_dims(shape: str, role: str) -> tuple[int, list[int]]:
    """K and the N of each matrix of a role."""
    hidden, q, kv, inter, vocab = SHAPES[shape]
    return {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [inter, inter]),
            "down": (inter, [hidden]), "head": (hidden, [vocab])}[role]  # fmt: skip


def gguf_rows(rng, kind: int, n: int, k: int) -> np.ndarray:
    """Random GGUF rows with small finite float16 scales (values do not matter here, only that none is NaN)."""
    elems, size = BLOCK[kind]
    rows = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        rows[..., at : at + 2] = np.full(rows.shape[:2], 0.01, np.float16)[..., None].view(np.uint8)
    return rows.reshape(n, -1)


@dataclass
class Builder:
    """Nodes and initializers of one benchmark model; every instance reads the shared x (and residual)."""

    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    count: int = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def init(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        kind = TensorProto.UINT8 if array.dtype == np.uint8 else TensorProto.FLOAT16
        if array.dtype == np.int64:
            kind = TensorProto.INT64
        self.inits.append(helper.make_tensor(name, kind, array.shape, array.tobytes(), raw=True))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, domain=domain, **attrs))
        return outs

    def half(self, stem: str, shape, scale: float = 0.01) -> str:
        return self.init(stem, (self.rng.standard_normal(shape) * scale).astype(np.float16))

    # ---- onnxruntime's forms, as graph.py builds them --------------------------------------------------------
    def nbits(self, x: str, k: int, n: int, kind: int, offsets: str | None) -> str:
        bits, blocks = NBITS[kind], k // 32
        packed = self.init("qw", self.rng.integers(0, 256, (n, blocks, 32 * bits // 8), dtype=np.uint8))
        inputs = [x, packed, self.half("sc", n * blocks)]
        with_offsets = kind in OFFSETS and bits == 4
        if with_offsets and offsets == "zero_point":
            inputs.append(self.init("zp", np.full(n * blocks, 8.0, np.float16)))
        attrs = {"K": k, "N": n, "bits": bits, "block_size": 32, "accuracy_level": 0}
        y = self.node("MatMulNBits", inputs, domain=MS, **attrs)[0]
        if not with_offsets or offsets == "zero_point":
            return y
        shape = self.init("shape", np.array([0, 0, blocks, 32], np.int64))
        grouped = self.node("Reshape", [x, shape])[0]
        blocksum = self.node("ReduceSum", [grouped, self.init("axes", np.array([-1], np.int64))], keepdims=0)[0]
        correction = self.node("MatMul", [blocksum, self.half("corr", (blocks, n))])[0]
        return self.node("Add", [y, correction])[0]

    def ort_matrices(self, x: str, k: int, ns: list[int], kinds: list[int], offsets: str | None) -> str:
        """Runs of neighbours in one MatMulNBits form share a matmul over their stacked rows; Concat joins runs."""
        parts = []
        for _, run in itertools.groupby(zip(ns, kinds), key=lambda item: (NBITS[item[1]], item[1] in OFFSETS)):
            run = list(run)
            parts.append(self.nbits(x, k, sum(n for n, _ in run), run[0][1], offsets))
        return parts[0] if len(parts) == 1 else self.node("Concat", parts, axis=-1)[0]

    def ort_role(self, role: str, x: str, residual: str, k: int, ns, kinds, offsets, glue: bool) -> str:
        if glue and role in ("qkv", "gate_up", "head"):
            x = self.node("SkipSimplifiedLayerNormalization", [x, residual, self.half("g", k, 1.0)], domain=MS,
                          epsilon=EPS)[0]  # fmt: skip
        y = self.ort_matrices(x, k, ns, kinds, offsets)
        if glue and role == "gate_up":
            split = self.init("split", np.array(ns, np.int64))
            gate, up = self.node("Split", [y, split], n_out=2, axis=-1)
            silu = self.node("Mul", [gate, self.node("Sigmoid", [gate])[0]])[0]
            y = self.node("Mul", [silu, up])[0]
        return y

    # ---- ours --------------------------------------------------------------------------------------------------
    def ours_matrices(self, x: str, k: int, ns, kinds) -> list[str]:
        return [
            self.node("MatMulGGUF", [x, self.init("w", gguf_rows(self.rng, t, n, k))], domain=kernels.KERNEL_DOMAIN,
                      K=k, N=n, ggml_type=t, accuracy_level=0)[0]
            for n, t in zip(ns, kinds)
        ]  # fmt: skip

    def ours_fused(self, role: str, x: str, residual: str, k: int, ns, kinds) -> str:
        weights = [self.init("w", gguf_rows(self.rng, t, n, k)) for n, t in zip(ns, kinds)]
        attrs = {"K": k, "epsilon": EPS}
        for s, (n, t) in enumerate(zip(ns, kinds)):
            attrs[f"N{s}"], attrs[f"ggml_type{s}"] = n, t
        attrs["activation"] = 1 if role == "gate_up" else 0
        attrs["N"] = ns[0] if role == "gate_up" else sum(ns)
        norm = self.half("g", k, 1.0) if role in ("qkv", "gate_up", "head") else ""
        inputs = [x, *weights, *[""] * (3 - len(weights)), norm]
        if role in ("o", "down"):
            inputs.append(residual)
        return self.node("FusedMatMulGGUF", inputs, domain=kernels.KERNEL_DOMAIN, **attrs)[0]


def build(form: str, role: str, shape: str, file_type: str, copies: int, rng) -> tuple[bytes, dict, dict]:
    """A model of ``copies`` instances of a role in a form, the shapes of its inputs and of its outputs."""
    k, ns = role_dims(shape, role)
    kinds = role_types(file_type, role, k)
    glued = form in ("ours_fused",) or form.startswith("ort_role")
    n_out = ns[0] if role == "gate_up" and glued else sum(ns)
    offsets = "correction" if form.endswith("_correction") else "zero_point" if form.endswith("_zero_point") else None
    b = Builder(rng)
    shapes = {"x": [1, 1, k], "residual": [1, 1, n_out if role in ("o", "down") else k]}
    outputs: dict[str, list[int]] = {}
    for _ in range(copies):
        if form == "ours_fused":
            outputs[b.ours_fused(role, "x", "residual", k, ns, kinds)] = [1, 1, n_out]
        elif form == "ours_matmul":
            outputs.update({name: [1, 1, n] for name, n in zip(b.ours_matrices("x", k, ns, kinds), ns)})
        else:
            outputs[b.ort_role(role, "x", "residual", k, ns, kinds, offsets, glue=glued)] = [1, 1, n_out]
    used = {name for node in b.nodes for name in node.input}
    inputs = {name: shape for name, shape in shapes.items() if name in used}
    graph = helper.make_graph(
        b.nodes, "bench",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in outputs.items()], b.inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1), helper.make_opsetid(kernels.KERNEL_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return model.SerializeToString(), inputs, outputs


def forms_for(file_type: str, role: str, shape: str) -> list[str]:
    k, _ = role_dims(shape, role)
    offsets = any(t in OFFSETS and NBITS[t] == 4 for t in role_types(file_type, role, k))
    ort = ["_correction", "_zero_point"] if offsets else [""]
    return ["ours_fused", "ours_matmul", *(f"ort_matmul{o}" for o in ort), *(f"ort_role{o}" for o in ort)]


def weight_bytes(role: str, shape: str, file_type: str) -> int:
    k, ns = role_dims(shape, role)
    return sum(n * k // BLOCK[t][0] * BLOCK[t][1] for n, t in zip(ns, role_types(file_type, role, k)))


class Timer:
    """Sessions on the CUDA provider with graph capture, timed by wall clock and (with PyTorch) by CUPTI."""

    def __init__(self, ort, runs: int) -> None:
        self.ort, self.runs = ort, runs
        try:
            from torch.profiler import ProfilerActivity, profile

            self.profile, self.cuda = profile, ProfilerActivity.CUDA
        except Exception:  # no PyTorch: wall clock only
            self.profile = None

    def session(self, model: bytes):
        options = self.ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not kernels.register(options):
            raise RuntimeError(f"kernels not registered: {kernels.load().reason}")
        provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"})
        return self.ort.InferenceSession(model, options, providers=[provider, "CPUExecutionProvider"])

    def measure(self, model: bytes, inputs: dict, outputs: dict, copies: int) -> dict:
        ort = self.ort
        session = self.session(model)
        io = session.io_binding()
        keep = []
        for name, shape in inputs.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float16),
                                                     "cuda", 0)  # fmt: skip
            keep.append(value)
            io.bind_ortvalue_input(name, value)
        for name, shape in outputs.items():  # fixed device buffers: a replay writes where the capture did
            value = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float16, "cuda", 0)
            keep.append(value)
            io.bind_ortvalue_output(name, value)
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", "1")
        for _ in range(3):  # capture, then warm replays
            session.run_with_iobinding(io, options)
        start = time.perf_counter()
        for _ in range(self.runs):
            session.run_with_iobinding(io, options)
        wall = (time.perf_counter() - start) / self.runs * 1e6
        result = {"copies": copies, "wall_us_per_run": round(wall, 2), "wall_us": round(wall / copies, 2)}
        if self.profile is not None:
            steps = 20
            with self.profile(activities=[self.cuda]) as prof:
                for _ in range(steps):
                    session.run_with_iobinding(io, options)
            count, gpu = Counter(), Counter()
            for event in prof.events():
                if event.device_type.name == "CUDA":
                    count[event.name] += 1
                    gpu[event.name] += event.device_time_total
            per = steps * copies
            result["kernels"] = round(sum(count.values()) / per, 2)
            result["gpu_us"] = round(sum(gpu.values()) / per, 2)
            result["by_kernel"] = [
                {"name": name[:90], "per_call": round(count[name] / per, 2), "gpu_us": round(gpu[name] / per, 2)}
                for name, _ in gpu.most_common(6)
            ]
        return result


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        return out.stdout.strip() or out.stderr.strip()
    except Exception as error:
        return f"unknown ({error})"


def tune(timer: Timer, library, out: dict, shapes, file_type: str, roles, budget: int, write) -> None:
    """ours_fused per role over a grid of launch shapes (lanes, rows, threads, blocks per SM; 0: the default)."""
    grid = [(0, 0, 0, 0)] + [(lanes, rows, threads, 0) for lanes in (16, 32, 64, 128) for rows in (1, 2, 4)
                             for threads in (128, 256) if threads >= lanes]  # fmt: skip
    grid += [(0, 0, 0, per_sm) for per_sm in (1, 2, 8, 16)]
    for shape, role in itertools.product(shapes, roles):
        entries = []
        for lanes, rows, threads, per_sm in grid:
            if role == "gate_up" and rows == 1:
                continue
            try:
                nvrtc.set_tuning(library, lanes, rows, threads, per_sm)
                copies = max(1, min(16, budget // weight_bytes(role, shape, file_type)))
                model, inputs, outputs = build("ours_fused", role, shape, file_type, copies, np.random.default_rng(1))
                entries.append({"lanes": lanes, "rows": rows, "threads": threads, "blocks_per_sm": per_sm,
                                **timer.measure(model, inputs, outputs, copies)})  # fmt: skip
                entries[-1].pop("by_kernel", None)
            except Exception as error:
                entries.append({"lanes": lanes, "rows": rows, "threads": threads, "blocks_per_sm": per_sm,
                                "error": str(error)[:300]})  # fmt: skip
        nvrtc.set_tuning(library)
        key = "gpu_us" if any("gpu_us" in e for e in entries) else "wall_us"
        ok = [e for e in entries if key in e]
        best = min(ok, key=lambda e: e[key]) if ok else None
        out["tuning"].append({"shape": shape, "type": file_type, "role": role, "best": best, "grid": entries})
        if best:
            print(f"tune {shape} {file_type} {role}: best lanes {best['lanes']} rows {best['rows']} threads "
                  f"{best['threads']} per SM {best['blocks_per_sm']}: {best[key]} µs (default {entries[0].get(key)})",
                  flush=True)  # fmt: skip
        write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for cuda_ops.json")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q4_K_M"], choices=["Q4_0", "Q4_1", "Q4_K_M"])
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=list(ROLES))
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--budget-mb", type=int, default=256, help="weights per model (sets the copies, 1 to 16)")
    parser.add_argument("--cache", type=Path, default=None, help="cubin cache (default OUT/cubins)")
    parser.add_argument("--tune", action="store_true", help="also sweep ours_fused's launch shapes (Q4_K_M)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import onnxruntime as ort

    ort.preload_dlls()
    out: dict = {"device": device_name(), "onnxruntime": ort.__version__, "onnx": onnx.__version__,
                 "python": platform.python_version(), "runs": args.runs, "results": [], "tuning": []}  # fmt: skip
    path = args.out / "cuda_ops.json"

    def write() -> None:
        path.write_text(json.dumps(out, indent=1))

    library_info = kernels.load()
    if not library_info.available:
        out["error"] = f"kernels library unusable: {library_info.reason}"
        write()
        sys.exit(out["error"])
    library = kernels.open_library(library_info.path)
    started = time.perf_counter()
    image = nvrtc.prepare(args.cache or args.out / "cubins", library=library)
    out["cubin"] = {"arch": image.arch, "compiled": image.compiled, "seconds": round(time.perf_counter() - started, 1),
                    "nvrtc": str(nvrtc.find_nvrtc())}  # fmt: skip
    print(f"{out['device']}: kernels for sm_{image.arch} {'compiled' if image.compiled else 'cached'} "
          f"({out['cubin']['seconds']} s)", flush=True)  # fmt: skip
    write()
    timer = Timer(ort, args.runs)
    budget = args.budget_mb << 20
    for shape, file_type, role in itertools.product(args.shapes, args.types, args.roles):
        copies = max(1, min(16, budget // weight_bytes(role, shape, file_type)))
        row = {"shape": shape, "type": file_type, "role": role, "copies": copies,
               "ggml_types": role_types(file_type, role, role_dims(shape, role)[0]), "forms": {}}  # fmt: skip
        for form in forms_for(file_type, role, shape):
            try:
                model, inputs, outputs = build(form, role, shape, file_type, copies, np.random.default_rng(1))
                row["forms"][form] = timer.measure(model, inputs, outputs, copies)
            except Exception as error:
                row["forms"][form] = {"error": f"{type(error).__name__}: {str(error)[:400]}",
                                      "trace": traceback.format_exc()[-800:]}  # fmt: skip
        out["results"].append(row)
        write()
        key = "gpu_us" if any("gpu_us" in f for f in row["forms"].values()) else "wall_us"
        cells = "  ".join(f"{form} {f.get(key, 'ERR')}µs/{f.get('kernels', '?')}k" for form, f in row["forms"].items())
        print(f"{shape:>4} {file_type:6} {role:7} x{copies:<2} {cells}", flush=True)
    if args.tune:
        tune(timer, library, out, args.shapes, "Q4_K_M", args.roles, budget, write)
    out["seconds"] = round(time.perf_counter() - started, 1)
    write()
    print(f"wrote {path} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
