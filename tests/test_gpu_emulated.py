"""The CUDA kernels' own sources (edgedecode/kernels/cuda) run on the CPU under a host emulator (tests/cuda_emu),
planned by the library's launch planner (csrc/cuda_plan.c), against the numpy model (tests/cuda_oracle.py).

The emulator compiles the .cu files with g++ (prelude.cuh swaps the CUDA intrinsics for plain C++) and runs every
thread of a block as a fiber, meeting at __syncthreads and at each warp shuffle, so the kernels' indexing, block
decoding, reductions and epilogues are checked on machines without a GPU (CI's). What it cannot check is the GPU
itself: instruction semantics, memory ordering and speed are tests/test_gpu.py's, on the card.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cuda_oracle import GELU_TANH, SILU, assert_float16_close, fused
from gguf import GGMLQuantizationType as QType
from kernel_oracle import K_TYPES, TYPES, random_rows, weights

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "edgedecode" / "kernels" / "cuda"
CSRC = ROOT / "edgedecode" / "kernels" / "csrc"
EMU = Path(__file__).resolve().parent / "cuda_emu"
SM_COUNT = 2  # what the planner sizes grids by: small, so tests see several rows per block
_Pointer = ctypes.c_void_p


class GemvArgs(ctypes.Structure):
    """EdGemvArgs (edgedecode/kernels/cuda/ed_cuda_args.h)."""

    _fields_ = [
        ("x", _Pointer),
        ("gamma", _Pointer),
        ("residual", _Pointer),
        ("bias", _Pointer),
        ("y", _Pointer),
        ("w", _Pointer * 3),
        ("rows", ctypes.c_int * 3),
        ("type", ctypes.c_int * 3),
        ("row_bytes", ctypes.c_int * 3),
        ("cta_start", ctypes.c_int * 4),
        ("k", ctypes.c_int),
        ("m", ctypes.c_int),
        ("n_out", ctypes.c_int),
        ("lanes", ctypes.c_int),
        ("gate", ctypes.c_int),
        ("eps", ctypes.c_float),
    ]


class GatherArgs(ctypes.Structure):
    """EdGatherArgs (ed_cuda_args.h)."""

    _fields_ = [
        ("table", _Pointer),
        ("ids", _Pointer),
        ("y", _Pointer),
        ("count", ctypes.c_longlong),
        ("vocab", ctypes.c_int),
        ("row_bytes", ctypes.c_int),
        ("k", ctypes.c_int),
        ("type", ctypes.c_int),
        ("out_float32", ctypes.c_int),
        ("pad_", ctypes.c_int),
    ]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to build the kernels' host emulator")
    library = tmp_path_factory.mktemp("cuda_emu") / "emu.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-fPIC", "-shared", "-w", f"-I{CUDA}", f"-I{CSRC}", f"-I{EMU}",
         "-x", "c++", str(EMU / "emu_launch.cpp"), "-x", "c", str(CSRC / "cuda_plan.c"), "-o", str(library)],
        check=True,
    )  # fmt: skip
    emu = ctypes.CDLL(str(library))
    emu.emu_gemv.argtypes = [ctypes.POINTER(GemvArgs)] + [ctypes.c_int] * 7 + [ctypes.c_char_p]
    emu.emu_gather.argtypes = [ctypes.POINTER(GatherArgs)]
    return emu


def _address(array: np.ndarray | None) -> int | None:
    if array is None:
        return None
    assert array.flags.c_contiguous and array.ctypes.data % 16 == 0  # as onnxruntime's allocations are
    return array.ctypes.data


def run_gemv(
    emu,
    x: np.ndarray,
    matrices: list[tuple[np.ndarray, QType]],
    gamma: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    gate: int = 0,
    eps: float = 1e-6,
    tuning: tuple[int, int, int, int] = (0, 0, 0, 0),
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """The emulated GEMV's output and the kernel the planner chose."""
    k = x.shape[-1]
    n_out = matrices[0][0].shape[0] if gate else sum(data.shape[0] for data, _ in matrices)
    y = np.full((len(x), n_out), np.nan, np.float16)
    args = GemvArgs()
    args.x, args.gamma, args.residual, args.y = _address(x), _address(gamma), _address(residual), _address(y)
    args.bias = _address(bias)
    for s, (data, kind) in enumerate(matrices):
        args.w[s], args.rows[s], args.type[s], args.row_bytes[s] = _address(data), data.shape[0], kind, data.shape[1]
    args.k, args.m, args.gate, args.eps = k, len(x), gate, eps
    kernel = ctypes.create_string_buffer(32)
    status = emu.emu_gemv(ctypes.byref(args), len(matrices), int(gate != 0), *tuning, SM_COUNT, kernel)
    assert status == 0, f"planner refused (-1) or threads deadlocked (-2): {status}"
    return y, kernel.value.decode()


def _k_for(kind: QType) -> int:
    return 512 if kind in K_TYPES else 96  # 96: three 32-blocks, rows of odd block counts (2-byte aligned rows)


def _activations(rng, m: int, k: int) -> np.ndarray:
    return rng.standard_normal((m, k)).astype(np.float16)


@pytest.mark.parametrize("m", (1, 3, 6))
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_matmul_equals_the_reference_to_float16_rounding(emulator, kind, m):
    rng = np.random.default_rng(int(kind) * 10 + m)
    k = _k_for(kind)
    data = random_rows(kind, 37, k, rng)
    x = _activations(rng, m, k)
    y, kernel = run_gemv(emulator, x, [(data, kind)])
    assert kernel.endswith("_m1" if m == 1 else "_m4")
    assert_float16_close(y, fused(x, [(data, kind)]))


@pytest.mark.parametrize("kind", (QType.Q4_0, QType.Q4_K, QType.Q6_K), ids=lambda kind: kind.name)
@pytest.mark.parametrize(
    "tuning",
    [(lanes, rows, threads, blocks_per_sm) for lanes in (8, 16, 32, 64, 128, 256) for rows in (1, 2, 4)
     for threads in (128, 256) for blocks_per_sm in (0, 1) if threads >= lanes],
    ids=lambda t: "lanes{}-rows{}-threads{}-per_sm{}".format(*t),
)  # fmt: skip
def test_every_launch_shape_gives_the_same_product(emulator, kind, tuning):
    rng = np.random.default_rng(5)
    k = 1024 if kind in K_TYPES else 320  # more units than lanes on narrow groups, fewer on wide ones
    data = random_rows(kind, 21, k, rng)
    x = _activations(rng, 2 if tuning[1] == 2 else 1, k)
    y, kernel = run_gemv(emulator, x, [(data, kind)], tuning=tuning)
    assert f"_r{tuning[1]}_" in kernel
    assert_float16_close(y, fused(x, [(data, kind)]))


@pytest.mark.parametrize("rows", (1, 2, 4))
@pytest.mark.parametrize("kind", (QType.Q4_0, QType.Q4_K), ids=lambda kind: kind.name)
def test_prompt_rows_on_groups_of_eight_lanes(emulator, kind, rows):
    """M > 1 takes 4 columns of x a block, so R = 4 rows give 16 outputs a group; the planner's groups have 8
    lanes wherever K < 1024 (SmolLM2's 576, the 0.5B shape's 896), and each lane then writes two of them."""
    rng = np.random.default_rng(rows)
    k = 512 if kind in K_TYPES else 576
    data = random_rows(kind, 29, k, rng)
    x = _activations(rng, 7, k)
    y, kernel = run_gemv(emulator, x, [(data, kind)], tuning=(8, rows, 0, 0))
    assert kernel == f"ed_gemv_r{rows}_m4"
    assert_float16_close(y, fused(x, [(data, kind)]))


@pytest.mark.parametrize("m", (1, 2))
@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
def test_norm_three_matrices_of_mixed_types_and_a_residual(emulator, m, with_bias):
    """The attention input of a Q4_K_M layer: Q and K in Q4_K, V in Q6_K, after RMSNorm (and Qwen's bias), plus a
    residual."""
    rng = np.random.default_rng(11)
    k = 512
    matrices = [(random_rows(QType.Q4_K, 40, k, rng), QType.Q4_K), (random_rows(QType.Q4_K, 9, k, rng), QType.Q4_K),
                (random_rows(QType.Q6_K, 9, k, rng), QType.Q6_K)]  # fmt: skip
    x = (_activations(rng, m, k) * 3).astype(np.float16)
    gamma = rng.uniform(0.5, 2.0, k).astype(np.float16)
    residual = rng.standard_normal((m, 58)).astype(np.float16)
    bias = rng.standard_normal(58).astype(np.float16) if with_bias else None
    y, _ = run_gemv(emulator, x, matrices, gamma, residual, eps=1e-5, bias=bias)
    assert_float16_close(y, fused(x, matrices, gamma, residual, eps=1e-5, bias=bias))


@pytest.mark.parametrize("m", (1, 5))
@pytest.mark.parametrize("gate", (SILU, GELU_TANH), ids=("silu", "gelu_tanh"))
@pytest.mark.parametrize("kind", (QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_0), ids=lambda kind: kind.name)
def test_gated_product_with_norm(emulator, kind, gate, m):
    rng = np.random.default_rng(int(kind) + 7 * gate + m)
    k = _k_for(kind)
    matrices = [(random_rows(kind, 33, k, rng), kind), (random_rows(kind, 33, k, rng), kind)]
    x = _activations(rng, m, k)
    gamma = rng.uniform(0.02, 0.08, k).astype(np.float16)  # small: products of two dots stay inside float16
    y, kernel = run_gemv(emulator, x, matrices, gamma, gate=gate)
    assert "_gated_" in kernel
    assert_float16_close(y, fused(x, matrices, gamma, gate=gate))


def test_a_residual_alone_is_added_to_one_matrix(emulator):
    """The attention output and the down projection: y = residual + x · W^T."""
    rng = np.random.default_rng(3)
    data = random_rows(QType.Q6_K, 30, 768, rng)
    x = _activations(rng, 1, 768)
    residual = (rng.standard_normal((1, 30)) * 10).astype(np.float16)
    y, _ = run_gemv(emulator, x, [(data, QType.Q6_K)], residual=residual)
    assert_float16_close(y, fused(x, [(data, QType.Q6_K)], residual=residual))


def test_the_planner_refuses_what_the_kernels_cannot_read(emulator):
    rng = np.random.default_rng(0)
    x = _activations(rng, 1, 96)
    data = random_rows(QType.Q4_0, 4, 96, rng)
    args = GemvArgs()
    args.x, args.w[0], args.rows[0], args.type[0], args.row_bytes[0] = x.ctypes.data, data.ctypes.data, 4, 12, 54
    args.k, args.m = 96, 1  # Q4_K rows need K a multiple of 256
    assert emulator.emu_gemv(ctypes.byref(args), 1, 0, 0, 0, 0, 0, SM_COUNT, ctypes.create_string_buffer(32)) == -1


@pytest.mark.parametrize("out_float32", (0, 1), ids=("float16", "float32"))
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_gather_dequantizes_rows_exactly(emulator, kind, out_float32):
    rng = np.random.default_rng(int(kind))
    k = _k_for(kind)
    table = random_rows(kind, 11, k, rng)
    ids = np.array([[3, 0, 10], [-1, 11, 7]], np.int64)  # -1 counts from the end; 11 is outside: a zero row
    y = np.full((*ids.shape, k), np.nan, np.float32 if out_float32 else np.float16)
    args = GatherArgs(_address(table), _address(ids), _address(y), ids.size, 11, table.shape[1], k, kind, out_float32)
    assert emulator.emu_gather(ctypes.byref(args)) == 0
    rows = weights(table, kind).astype(np.float32)  # float32 products of exact factors: the reference's values
    expected = np.stack([rows[3], rows[0], rows[10], rows[10], np.zeros(k, np.float32), rows[7]]).reshape(y.shape)
    np.testing.assert_array_equal(y, expected.astype(y.dtype))
