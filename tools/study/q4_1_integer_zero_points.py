#!/usr/bin/env python3
"""What integer zero points would cost: Q4_1 blocks (x = d·q + m) rewritten as d·(q − z) with
z = round(−m/d) clipped to 0..15, the only form onnxruntime 1.31's fast 4-bit kernels take with an
offset (uint8 zero points, CPU and CUDA). Prints the relative RMS change of the layer weights per
matrix and overall, and how many blocks need z outside 0..15. Compare with the re-quantized
decoders of docs/crossquant.md (q4b16 5.4 %, q4b64 8.0 %, q4b128 9.9 % relative RMS error).

    python tools/study/q4_1_integer_zero_points.py [--model NAME]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])


import numpy as np

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.loader import load_model
from edgedecode.model.weights import BlockQuantized, load_tensors
from tools.common import cli


def rounding_error(w: BlockQuantized) -> tuple[float, float, int, int]:
    """(sum of squared weight changes, sum of squared weights, blocks, blocks whose z is clipped)."""
    # BlockQuantized holds d·(q − 2^(bits−1)) + C per block (C = m + 8d for Q4_1); as d·(q − z): z = 8 − C/d
    d, c = w.scales.astype(np.float64), w.offsets.astype(np.float64)  # [N, blocks]
    n, blocks = d.shape
    middle, top = 1 << (w.bits - 1), (1 << w.bits) - 1
    codes = np.zeros((n, blocks * w.block_size))
    codes[:, : w.codes.shape[1]] = w.codes
    codes = codes.reshape(n, blocks, w.block_size)
    exact = d[..., None] * (codes - middle) + c[..., None]
    ideal = middle - c / np.where(d == 0, 1, d)
    z = np.clip(np.round(ideal), 0, top)
    changed = d[..., None] * (codes - z[..., None])
    valid = np.arange(blocks * w.block_size).reshape(blocks, w.block_size) < w.codes.shape[1]
    diff = ((changed - exact) ** 2 * valid).sum()
    return float(diff), float((exact**2 * valid).sum()), d.size, int((ideal != np.clip(ideal, 0, top)).sum())


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    tensors = load_tensors(open_gguf(model.record.gguf_path), model.spec, dense=False)
    totals: dict[str, list[float]] = {}
    for layer in tensors.layers:
        named = dict(zip(("q", "k", "v"), layer.qkv)) | dict(zip(("gate", "up"), layer.gate_up))
        named |= {"o": layer.o, "down": layer.down}
        for name, w in named.items():
            if not isinstance(w, BlockQuantized) or w.offsets is None:
                continue
            sums = totals.setdefault(name, [0.0, 0.0, 0, 0])
            for i, value in enumerate(rounding_error(w)):
                sums[i] += value
    print("| matrix | relative RMS change | blocks with z outside 0..15 |")
    print("|---|---:|---:|")
    for name, (diff, norm, blocks, clipped) in totals.items():
        print(f"| {name} | {np.sqrt(diff / norm):.1%} | {clipped / blocks:.1%} |")
    diff, norm, blocks, clipped = (sum(v[i] for v in totals.values()) for i in range(4))
    print(f"| all layer matrices | {np.sqrt(diff / norm):.1%} | {clipped / blocks:.1%} |")


if __name__ == "__main__":
    cli.run(main)
