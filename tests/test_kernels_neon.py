"""The aarch64 NEON paths (Jetson's CPU), built with a cross compiler and run under QEMU user mode, against the same
numpy oracle as the x86 paths (tests/kernel_oracle.py).

csrc/harness/isa_compare.c runs one matmul on every path the emulated CPU offers (neondot, neon, portable) and writes
the results; this test checks each. It needs Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user`` (or the same
tools elsewhere on PATH) and skips, saying so, without them. QEMU's default CPU model has the dot-product extension,
so both NEON paths run.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from kernel_oracle import (
    K_TYPES,
    TYPES,
    activation_block,
    matmul_float,
    matmul_int8,
    quantize_activations,
    random_rows,
)

CSRC = Path(__file__).resolve().parent.parent / "edgedecode" / "kernels" / "csrc"
COMPILER, EMULATOR = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
pytestmark = pytest.mark.skipif(
    not (COMPILER and EMULATOR),
    reason="needs an aarch64 cross compiler and QEMU user mode (Debian: gcc-aarch64-linux-gnu, qemu-user)",
)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("neon") / "isa_compare"
    sources = sorted(str(p) for p in CSRC.glob("*.c")) + [str(CSRC / "harness" / "isa_compare.c")]
    built = subprocess.run(
        [COMPILER, "-std=c11", "-O2", "-static", "-o", str(binary), *sources, "-lm", "-lpthread"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return binary


def run_paths(harness: Path, tmp_path: Path, kind: QType, accuracy: int, a: np.ndarray, rows: np.ndarray) -> dict:
    """{path name: (Y [M, N], codes of A's first row, their scales)} from the emulated run."""
    m, k = a.shape
    n = rows.shape[0]
    source, result = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(struct.pack("<5i", int(kind), accuracy, k, n, m) + a.tobytes() + rows.tobytes())
    done = subprocess.run([EMULATOR, str(harness), str(source), str(result)], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data, paths, at = result.read_bytes(), {}, 0
    scales = k // activation_block(kind)
    while at < len(data):
        name = data[at : at + 16].rstrip(b"\0").decode()
        at += 16
        y = np.frombuffer(data, np.float32, m * n, at).reshape(m, n)
        at += 4 * m * n
        q = np.frombuffer(data, np.int8, k, at)
        at += k
        d = np.frombuffer(data, np.float32, scales, at)
        at += 4 * scales
        paths[name] = (y, q, d)
    return paths


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("accuracy", [4, 0])
def test_neon_paths_match_the_oracle(harness, tmp_path, kind, accuracy):
    rng = np.random.default_rng(int(kind) + accuracy)
    k = 768 if kind in K_TYPES else 608  # leaves each path's tail of blocks its work
    rows = random_rows(kind, 23, k, rng)
    a = rng.standard_normal((3, k)).astype(np.float32)
    a[0, :32] = 0.0  # a block of zeros: scale 0
    paths = run_paths(harness, tmp_path, kind, accuracy, a, rows)
    assert list(paths) == ["neondot", "neon", "portable"]
    expected, bound = (matmul_int8 if accuracy == 4 else matmul_float)(a, rows, kind)
    codes, scales = quantize_activations(a[:1], activation_block(kind))
    for name, (y, q, d) in paths.items():
        excess = np.abs(y.astype(np.float64) - expected) - bound
        assert excess.max() <= 0, f"{name}: {int((excess > 0).sum())} outputs beyond float32 rounding"
        assert np.array_equal(q, codes[0]) and np.array_equal(d, scales[0]), f"{name}: quantization differs"
