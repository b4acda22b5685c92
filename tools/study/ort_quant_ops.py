#!/usr/bin/env python3
"""Which MatMulNBits and GatherBlockQuantized forms onnxruntime runs, each checked against numpy with a one-node graph.

    python tools/study/ort_quant_ops.py [--device cpu|cuda] [--dtype float32|float16]

One line per form: bit width, block size, zero points (none: the implicit 2^(bits-1); float: one per
block, the graph's dtype) and, for MatMulNBits, accuracy_level; then the relative error against
numpy, or onnxruntime's refusal. On cuda no node may fall back to the CPU, so a form the CUDA
provider lacks shows as refused. docs/model-formats.md records what onnxruntime 1.31.1 did on CPU;
the tensor types' graph forms (model/weights.py) use only forms that ran there.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])


import numpy as np

from edgedecode.model.onnx_builder import MS_DOMAIN, GraphBuilder, onnx_dtype
from edgedecode.model.weights import BlockQuantized
from edgedecode.runtime.session import import_onnxruntime
from tools.common import cli

K, N, M, VOCAB = 512, 64, 3, 50
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _session(builder: GraphBuilder, device: str):
    ort = import_onnxruntime()
    if device == "cuda":
        ort.preload_dlls()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1" if device != "cpu" else "0")
    return ort.InferenceSession(builder.model().SerializeToString(), options, providers=[PROVIDERS[device]])


def _refusal(exc: Exception) -> str:
    """onnxruntime's reason, without the C++ signature before it."""
    return "refused: " + str(exc).splitlines()[0].split(" was false. ")[-1]


def matmul(bits: int, block: int, float_zero_points: bool, accuracy_level: int, device: str, dtype: np.dtype) -> str:
    """Relative error of MatMulNBits (A [M, K] times a random [N, K] weight) against numpy, or the refusal."""
    rng = np.random.default_rng(bits * 1000 + block)
    g = GraphBuilder("matmul")
    a = g.input("A", onnx_dtype(dtype), [M, K])
    if bits in (2, 4, 8):
        codes = rng.integers(0, 1 << bits, (N, K), dtype=np.uint8)
        packed = BlockQuantized(codes, np.ones((N, K // block), np.float32), None, bits, block).packed()
    else:  # no packing to check: whether the width is taken at all
        codes = np.zeros((N, K), np.uint8)
        packed = np.zeros((N, K // block, block * bits // 8), np.uint8)
    scales = (rng.standard_normal((N, K // block)) * 0.02).astype(dtype)
    zero_points = np.full((N, K // block), float(1 << (bits - 1)), dtype)
    inputs = [a, g.initializer("B", packed), g.initializer("scales", scales.reshape(-1))]
    if float_zero_points:
        zero_points = (zero_points + rng.standard_normal(zero_points.shape)).astype(dtype)
        inputs.append(g.initializer("zero_points", zero_points.reshape(-1)))
    g.op1(
        "MatMulNBits",
        inputs,
        outputs=["Y"],
        domain=MS_DOMAIN,
        K=K,
        N=N,
        bits=bits,
        block_size=block,
        accuracy_level=accuracy_level,
    )
    g.output("Y", onnx_dtype(dtype), [M, N])
    x = rng.standard_normal((M, K)).astype(dtype)
    try:
        y = _session(g, device).run(None, {"A": x})[0].astype(np.float32)
    except Exception as exc:  # onnxruntime's refusal is the finding
        return _refusal(exc)
    w = (codes.reshape(N, -1, block) - zero_points.astype(np.float32)[..., None]) * scales.astype(np.float32)[..., None]
    reference = x.astype(np.float32) @ w.reshape(N, K).T
    return f"relative error {np.abs(y - reference).max() / np.abs(reference).max():.1e}"


def gather(bits: int, block: int, device: str, dtype: np.dtype) -> str:
    """Max error of GatherBlockQuantized over [V, blocks, block·bits/8] data (the layout the graphs share)."""
    rng = np.random.default_rng(bits * 100 + block)
    codes = rng.integers(0, 1 << bits, (VOCAB, K), dtype=np.uint8)
    scales = (rng.standard_normal((VOCAB, K // block, 1)) * 0.02).astype(dtype)
    g = GraphBuilder("gather")
    ids = g.input("ids", onnx_dtype(np.dtype(np.int64)), [1, 3])
    data = BlockQuantized(codes, scales[..., 0].astype(np.float32), None, bits, block).packed()
    g.op1(
        "GatherBlockQuantized",
        [g.initializer("data", data), ids, g.initializer("scales", scales)],
        outputs=["Y"],
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=2,
        block_size=block,
        bits=bits,
    )
    g.output("Y", onnx_dtype(dtype), None)
    rows = np.array([[3, 0, VOCAB - 1]], np.int64)
    try:
        y = _session(g, device).run(None, {"ids": rows})[0].astype(np.float32)
    except Exception as exc:
        return _refusal(exc)
    w = (codes.reshape(VOCAB, -1, block).astype(np.float32) - (1 << (bits - 1))) * scales.astype(np.float32)
    return f"max error {np.abs(y - w[rows[0]][None]).max():.1e}"


def main(argv: list[str] | None = None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--device", choices=tuple(PROVIDERS), default="cpu")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    args = p.parse_args(argv)
    dtype = np.dtype(args.dtype)
    print(f"onnxruntime {import_onnxruntime().__version__}, {args.device}, {args.dtype}")
    for bits in (2, 3, 4, 5, 6, 8):
        for block in (16, 32, 64):
            for float_zero_points in (False, True):
                for level in (0, 4):
                    zp = "float" if float_zero_points else "none"
                    result = matmul(bits, block, float_zero_points, level, args.device, dtype)
                    print(f"MatMulNBits bits={bits} block={block} zero_points={zp} accuracy_level={level}: {result}")
    for bits in (2, 4, 8):
        for block in (16, 32):
            print(f"GatherBlockQuantized bits={bits} block={block}: {gather(bits, block, args.device, dtype)}")


if __name__ == "__main__":
    cli.run(main)
