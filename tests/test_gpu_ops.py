"""The CUDA ops on the card, through onnxruntime-gpu: MatMulGGUF and FusedMatMulGGUF equal the numpy model
(tests/cuda_oracle.py) to float16 rounding on every type, for one row of A (decode) and several; GatherGGUF is exact;
a small decode-like graph of the three replays through a captured CUDA graph exactly as it runs without one.

Needs onnxruntime-gpu with a CUDA device, the kernels library and NVRTC (the kernels compile at the first test, into a
temporary cache); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_oracle import GELU_TANH, SILU, assert_float16_close, fused
from gguf import GGMLQuantizationType as QType
from kernel_oracle import K_TYPES, TYPES, random_rows, weights

from edgedecode import kernels
from edgedecode.kernels import nvrtc

ort = pytest.importorskip("onnxruntime")
helper = pytest.importorskip("onnx.helper")
from onnx import TensorProto  # noqa: E402


def _why_not() -> str:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "needs onnxruntime-gpu"
    library = kernels.load()
    if not library.available:
        return f"edgedecode kernels unusable: {library.reason}"
    if nvrtc.find_nvrtc() is None:
        return "needs NVRTC (nvidia-cuda-nvrtc, or EDGEDECODE_NVRTC)"
    try:
        nvrtc.device_arch()
    except nvrtc.KernelBuildError as error:
        return str(error)
    return ""


REASON = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(REASON), reason=REASON)]


@pytest.fixture(scope="module", autouse=True)
def cubin(tmp_path_factory) -> nvrtc.Cubin:
    ort.preload_dlls()
    library = kernels.open_library(kernels.load().path)
    return nvrtc.prepare(tmp_path_factory.mktemp("cubins"), library=library)


def _model(nodes, inputs, outputs, initializers) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(kernels.KERNEL_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def _session(model: bytes, cuda_graph: bool = False):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    assert kernels.register(options)
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if cuda_graph else "CUDAExecutionProvider"
    return ort.InferenceSession(model, options, providers=[provider, "CPUExecutionProvider"])


def _bytes(name: str, data: np.ndarray):
    return helper.make_tensor(name, TensorProto.UINT8, data.shape, data.tobytes(), raw=True)


def _half(name: str, data: np.ndarray):
    return helper.make_tensor(name, TensorProto.FLOAT16, data.shape, data.astype(np.float16).tobytes(), raw=True)


def _input(name: str, dtype: int, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _fused_node(
    matrices, k: int, *, norm: bool = False, residual: bool = False, gate: int = 0, eps: float = 1e-6, bias=False
):
    """A FusedMatMulGGUF node over weights W0.. (initializers named so), A, and optionally gamma, R and bias."""
    n = matrices[0][0].shape[0] if gate else sum(data.shape[0] for data, _ in matrices)
    attributes = {"K": k, "N": n, "activation": gate, "epsilon": eps}
    for s, (data, kind) in enumerate(matrices):
        attributes[f"N{s}"], attributes[f"ggml_type{s}"] = data.shape[0], int(kind)
    names = ["A", *(f"W{s}" if s < len(matrices) else "" for s in range(3)), "gamma" if norm else ""]
    names += ["R" if residual else "", "bias"] if bias else ["R"] if residual else []
    return helper.make_node("FusedMatMulGGUF", names, ["Y"], domain=kernels.KERNEL_DOMAIN, **attributes), n


def _run_fused(x, matrices, gamma=None, residual=None, gate=0, eps=1e-6, bias=None) -> np.ndarray:
    m, k = x.shape
    node, n = _fused_node(
        matrices, k, norm=gamma is not None, residual=residual is not None, gate=gate, eps=eps, bias=bias is not None
    )
    inits = [_bytes(f"W{s}", data) for s, (data, _) in enumerate(matrices)]
    inits += [_half("gamma", gamma)] if gamma is not None else []
    inits += [_half("bias", bias)] if bias is not None else []
    inputs = [_input("A", TensorProto.FLOAT16, [1, m, k])]
    feeds = {"A": x.reshape(1, m, k)}
    if residual is not None:
        inputs.append(_input("R", TensorProto.FLOAT16, [1, m, n]))
        feeds["R"] = residual.reshape(1, m, n)
    model = _model([node], inputs, [_input("Y", TensorProto.FLOAT16, [1, m, n])], inits)
    return _session(model).run(None, feeds)[0].reshape(m, n)


def _k_for(kind: QType) -> int:
    return 1024 if kind in K_TYPES else 288  # 288: nine 32-blocks, rows of odd block counts (2-byte aligned rows)


@pytest.mark.parametrize("m", (1, 4))
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_matmul_equals_the_reference_to_float16_rounding(kind, m):
    rng = np.random.default_rng(int(kind) * 10 + m)
    k = _k_for(kind)
    data = random_rows(kind, 203, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float16)
    node = helper.make_node(
        "MatMulGGUF", ["A", "W"], ["Y"], domain=kernels.KERNEL_DOMAIN, K=k, N=203, ggml_type=int(kind),
        accuracy_level=0,
    )  # fmt: skip
    model = _model(
        [node], [_input("A", TensorProto.FLOAT16, [1, m, k])], [_input("Y", TensorProto.FLOAT16, [1, m, 203])],
        [_bytes("W", data)],
    )  # fmt: skip
    y = _session(model).run(None, {"A": x.reshape(1, m, k)})[0].reshape(m, 203)
    assert_float16_close(y, fused(x, [(data, kind)]))


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_gather_is_exact(kind):
    rng = np.random.default_rng(int(kind))
    k = _k_for(kind)
    table = random_rows(kind, 50, k, rng)
    ids = np.array([[3, 0, 49, -1, 50]], np.int64)  # -1 counts from the end; 50 is outside: a row of zeros
    node = helper.make_node(
        "GatherGGUF", ["T", "ids"], ["Y"], domain=kernels.KERNEL_DOMAIN, K=k, ggml_type=int(kind), dtype=10
    )
    model = _model(
        [node], [_input("ids", TensorProto.INT64, [1, 5])], [_input("Y", TensorProto.FLOAT16, [1, 5, k])],
        [_bytes("T", table)],
    )  # fmt: skip
    y = _session(model).run(None, {"ids": ids})[0]
    rows = weights(table, kind).astype(np.float32)
    expected = np.stack([rows[3], rows[0], rows[49], rows[49], np.zeros(k, np.float32)])[None].astype(np.float16)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("m", (1, 3))
@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
def test_norm_qkv_of_mixed_types_plus_residual(m, with_bias):
    """A Q4_K_M layer's attention input: RMSNorm, Q and K in Q4_K and V in Q6_K (and Qwen's bias), one kernel;
    plus a residual."""
    rng = np.random.default_rng(17)
    k = 2048
    matrices = [(random_rows(QType.Q4_K, 2048, k, rng), QType.Q4_K), (random_rows(QType.Q4_K, 512, k, rng), QType.Q4_K),
                (random_rows(QType.Q6_K, 512, k, rng), QType.Q6_K)]  # fmt: skip
    x = (rng.standard_normal((m, k)) * 4).astype(np.float16)
    gamma = rng.uniform(0.02, 0.1, k).astype(np.float16)
    residual = rng.standard_normal((m, 3072)).astype(np.float16)
    bias = rng.standard_normal(3072).astype(np.float16) if with_bias else None
    y = _run_fused(x, matrices, gamma, residual, eps=1e-5, bias=bias)
    assert_float16_close(y, fused(x, matrices, gamma, residual, eps=1e-5, bias=bias))


@pytest.mark.parametrize("m", (1, 5))
@pytest.mark.parametrize("gate", (SILU, GELU_TANH), ids=("silu", "gelu_tanh"))
@pytest.mark.parametrize("kind", (QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_0), ids=lambda kind: kind.name)
def test_gated_up_projection(kind, gate, m):
    rng = np.random.default_rng(int(kind) + gate + m)
    k = _k_for(kind) * 2
    matrices = [(random_rows(kind, 700, k, rng), kind), (random_rows(kind, 700, k, rng), kind)]
    x = rng.standard_normal((m, k)).astype(np.float16)
    gamma = rng.uniform(0.01, 0.05, k).astype(np.float16)
    y = _run_fused(x, matrices, gamma, gate=gate)
    assert_float16_close(y, fused(x, matrices, gamma, gate=gate))


def test_down_projection_plus_residual():
    rng = np.random.default_rng(4)
    k = 8192  # the 1B and 3B shapes' intermediate size: the staged activations' largest
    data = random_rows(QType.Q6_K, 640, k, rng)
    x = (rng.standard_normal((1, k)) * 0.1).astype(np.float16)
    residual = rng.standard_normal((1, 640)).astype(np.float16)
    assert_float16_close(_run_fused(x, [(data, QType.Q6_K)], residual=residual), fused(x, [(data, QType.Q6_K)],
                         residual=residual))  # fmt: skip


def _decode_like_model(rng) -> bytes:
    """ids -> GatherGGUF -> norm + gated up (Q4_K) -> down + residual (Q6_K) -> norm + head (Q8_0) -> logits."""
    hidden, inter, vocab = 512, 1536, 3000
    table = random_rows(QType.Q8_0, vocab, hidden, rng)
    gate_up = [random_rows(QType.Q4_K, inter, hidden, rng), random_rows(QType.Q4_K, inter, hidden, rng)]
    down = random_rows(QType.Q6_K, hidden, inter, rng)
    d = kernels.KERNEL_DOMAIN
    nodes = [
        helper.make_node("GatherGGUF", ["table", "ids"], ["h"], domain=d, K=hidden, ggml_type=8, dtype=10),
        helper.make_node(
            "FusedMatMulGGUF", ["h", "Wg", "Wu", "", "g1"], ["a"], domain=d, K=hidden, N=inter, N0=inter,
            ggml_type0=12, N1=inter, ggml_type1=12, activation=SILU, epsilon=1e-5,
        ),
        helper.make_node(
            "FusedMatMulGGUF", ["a", "Wd", "", "", "", "h"], ["h2"], domain=d, K=inter, N=hidden, N0=hidden,
            ggml_type0=14,
        ),
        helper.make_node(
            "FusedMatMulGGUF", ["h2", "table", "", "", "g2"], ["logits"], domain=d, K=hidden, N=vocab, N0=vocab,
            ggml_type0=8, epsilon=1e-5,
        ),
    ]  # fmt: skip
    inits = [_bytes("table", table), _bytes("Wg", gate_up[0]), _bytes("Wu", gate_up[1]), _bytes("Wd", down),
             _half("g1", rng.uniform(0.02, 0.1, hidden)), _half("g2", rng.uniform(0.5, 1.5, hidden))]  # fmt: skip
    return _model(
        nodes, [_input("ids", TensorProto.INT64, [1, 1])], [_input("logits", TensorProto.FLOAT16, [1, 1, vocab])],
        inits,
    )  # fmt: skip


def test_a_captured_cuda_graph_replays_what_plain_runs_compute():
    model = _decode_like_model(np.random.default_rng(23))
    plain = _session(model)
    expected = {token: plain.run(None, {"ids": np.array([[token]], np.int64)})[0] for token in (5, 2999, 0, 17)}
    assert not np.array_equal(expected[5], expected[0])
    captured = _session(model, cuda_graph=True)
    ids = ort.OrtValue.ortvalue_from_numpy(np.array([[5]], np.int64), "cuda", 0)
    logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, 3000], np.float16, "cuda", 0)
    io = captured.io_binding()
    io.bind_ortvalue_input("ids", ids)
    io.bind_ortvalue_output("logits", logits)
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "1")
    # onnxruntime runs the first step(s) normally, then captures (and replays) the graph, then replays it
    for token in (5, 2999, 0, 17, 5, 2999, 0, 17):
        ids.update_inplace(np.array([[token]], np.int64))
        io.synchronize_inputs()
        captured.run_with_iobinding(io, options)
        np.testing.assert_array_equal(logits.numpy(), expected[token])
