"""MatMulGGUF and GatherGGUF (edgedecode/kernels) against the numpy oracle (tests/kernel_oracle.py), through
onnxruntime as the graphs run them, on every CPU path this machine can run.

Skipped, with the reason, where the library was not built (no C compiler at install) or onnxruntime cannot host it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracle import (
    K_TYPES,
    TYPES,
    activation_block,
    matmul_float,
    matmul_int8,
    quantize_activations,
    random_rows,
    row_elements,
    weights,
)

from edgedecode import kernels
from edgedecode.model.tensor_encode import encode

ort = pytest.importorskip("onnxruntime")
onnx_helper = pytest.importorskip("onnx.helper")
from onnx import TensorProto  # noqa: E402

LIBRARY = kernels.load()
pytestmark = pytest.mark.skipif(not LIBRARY.available, reason=f"edgedecode kernels unusable: {LIBRARY.reason}")


def _library():
    return kernels.open_library(LIBRARY.path)


def usable_isas() -> list[str]:
    return _library().edgedecode_kernels_cpu_isas().decode().split(",") if LIBRARY.available else ["portable"]


@pytest.fixture(params=usable_isas())
def isa(request):
    """Each CPU path this machine runs, chosen before the sessions are made (kernels take it at creation)."""
    library = _library()
    before = library.edgedecode_kernels_cpu_isa()
    assert library.edgedecode_kernels_set_cpu_isa(request.param.encode()) == 0
    yield request.param
    library.edgedecode_kernels_set_cpu_isa(before)


def _session(node, inputs, initializers, threads: int = 2) -> ort.InferenceSession:
    graph = onnx_helper.make_graph(
        [node], "g", inputs, [onnx_helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)], initializers
    )
    model = onnx_helper.make_model(
        graph,
        opset_imports=[onnx_helper.make_opsetid("", 17), onnx_helper.make_opsetid(kernels.KERNEL_DOMAIN, 1)],
        ir_version=8,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _uint8(name: str, data: np.ndarray):
    return onnx_helper.make_tensor(name, TensorProto.UINT8, data.shape, data.tobytes(), raw=True)


def matmul_session(
    data: np.ndarray, kind: QType, k: int, accuracy: int, a_shape=("batch", "rows")
) -> ort.InferenceSession:
    node = onnx_helper.make_node(
        "MatMulGGUF", ["A", "B"], ["Y"], domain=kernels.KERNEL_DOMAIN,
        K=k, N=data.shape[0], ggml_type=int(kind), accuracy_level=accuracy,
    )  # fmt: skip
    a = onnx_helper.make_tensor_value_info("A", TensorProto.FLOAT, [*a_shape, k])
    return _session(node, [a], [_uint8("B", data)])


def gather_session(table: np.ndarray, kind: QType, k: int, dtype: int = 1) -> ort.InferenceSession:
    node = onnx_helper.make_node(
        "GatherGGUF", ["T", "ids"], ["out"], domain=kernels.KERNEL_DOMAIN, K=k, ggml_type=int(kind), dtype=dtype
    )
    ids = onnx_helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"])
    return _session(node, [ids], [_uint8("T", table)])


def run_matmul(data: np.ndarray, kind: QType, a: np.ndarray, accuracy: int) -> np.ndarray:
    session = matmul_session(data, kind, a.shape[-1], accuracy)
    return session.run(None, {"A": a.reshape(1, -1, a.shape[-1])})[0].reshape(len(a), -1)


def assert_within(y: np.ndarray, model: tuple[np.ndarray, np.ndarray]) -> None:
    expected, bound = model
    excess = np.abs(y.astype(np.float64) - expected) - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs off by more than float32 rounding allows"


def activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Activations with a zero block, an outlier, and values on rounding ties (half-way between codes)."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[0, :32] = 0.0
    a[-1, -1] = 40.0
    a[0, 32:64] = np.arange(-16, 16, dtype=np.float32) + 0.5  # ties once scaled by 127/|max|
    a[0, 63] = 127.0
    return a


def odd_k(kind: QType) -> int:
    """A K that leaves every tail path its work: 19 blocks of 32 (two groups of 8, a pair, a single) or 3 of 256."""
    return 768 if kind in K_TYPES else 608


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
# 5: tiles of activation rows (4 or 2 in the one-row SIMD paths) and a remainder; 37 (from 16 rows on, 32 for the
# K-quants): AVX-512's packed tiles of 16 weight rows (37 = two and a part) against 8 activation rows at a time, and
# a remainder
@pytest.mark.parametrize("m", [1, 5, 37])
def test_int8_activations_give_the_integer_block_products(isa, kind, m):
    rng = np.random.default_rng(int(kind) * 10 + m)
    k = odd_k(kind)
    data = random_rows(kind, 37, k, rng)
    a = activations(rng, m, k)
    assert_within(run_matmul(data, kind, a, 4), matmul_int8(a, data, kind))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5])
def test_float_activations_give_the_exact_product(isa, kind, m):
    rng = np.random.default_rng(int(kind) * 10 + m + 1)
    k = odd_k(kind)
    data = random_rows(kind, 37, k, rng)
    a = activations(rng, m, k)
    assert_within(run_matmul(data, kind, a, 0), matmul_float(a, data, kind))


@pytest.mark.parametrize("kind", [QType.Q4_0, QType.Q4_K], ids=lambda t: t.name)
def test_activation_quantization_follows_the_documented_rule(isa, kind):
    library = _library()
    rng = np.random.default_rng(7)
    k = 1024
    a = activations(rng, 1, k)
    block = activation_block(kind)
    q = np.zeros(k, np.int8)
    d = np.zeros(k // block, np.float32)
    sum16, sum32 = np.zeros(k // 16, np.int16), np.zeros(k // 32, np.int16)
    pointer = np.ctypeslib.as_ctypes
    assert library.edgedecode_kernels_quantize(
        int(kind), k, pointer(a[0]), pointer(q), pointer(d), pointer(sum16), pointer(sum32)
    ) == 0  # fmt: skip
    expected_q, expected_d = quantize_activations(a, block)
    assert np.array_equal(q, expected_q[0])
    assert np.array_equal(d, expected_d[0])
    assert np.array_equal(sum16, expected_q[0].reshape(-1, 16).sum(-1, dtype=np.int64))
    assert np.array_equal(sum32, expected_q[0].reshape(-1, 32).sum(-1, dtype=np.int64))


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(TYPES),
    blocks=st.integers(1, 12),
    n=st.integers(1, 45),
    m=st.sampled_from([1, 2, 3, 5, 8, 15, 16, 17, 33, 40]),
    accuracy=st.sampled_from([0, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_valid_quantized_weights_of_any_shape(kind, blocks, n, m, accuracy, seed):
    """Weights quantized from floats as a GGUF writer does, K any whole number of blocks (not only multiples of
    256 for the 32-element types), N not a multiple of the kernels' row tiles; on every CPU path."""
    rng = np.random.default_rng(seed)
    k = blocks * (256 if kind in K_TYPES else 32)
    data = encode(rng.standard_normal((n, k)).astype(np.float32), kind)
    a = rng.standard_normal((m, k)).astype(np.float32)
    expected = (matmul_int8 if accuracy == 4 else matmul_float)(a, data, kind)
    library = _library()
    before = library.edgedecode_kernels_cpu_isa()
    try:
        for isa in usable_isas():
            library.edgedecode_kernels_set_cpu_isa(isa.encode())
            assert_within(run_matmul(data, kind, a, accuracy), expected)
    finally:
        library.edgedecode_kernels_set_cpu_isa(before)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_gather_returns_the_rows_dequantized_exactly(isa, kind):
    rng = np.random.default_rng(int(kind))
    k = 512
    table = random_rows(kind, 50, k, rng)
    ids = np.array([[3, 0, 49, 3], [7, 7, 1, 20]], np.int64)
    out = gather_session(table, kind, k).run(None, {"ids": ids})[0]
    assert out.shape == (2, 4, k) and out.dtype == np.float32
    # each weight is one float16 scale times a small integer plus at most one rounding: correctly rounded
    assert np.array_equal(out, weights(table, kind)[ids].astype(np.float32))


def test_gather_refuses_ids_outside_the_table():
    table = random_rows(QType.Q8_0, 10, 64, np.random.default_rng(0))
    session = gather_session(table, QType.Q8_0, 64)
    for bad in (10, -1):
        with pytest.raises(Exception, match=rf"id {bad} at position 1 is outside \[0, 10\)"):
            session.run(None, {"ids": np.array([[2, bad]], np.int64)})
    assert session.run(None, {"ids": np.array([[9]], np.int64)})[0].shape == (1, 1, 64)


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"ggml_type": 1}, "ggml_type 1 is not one of"),
        ({"accuracy_level": 2}, "accuracy_level 2"),
        ({"K": 48}, "multiple of Q4_0's 32-element block"),
    ],
)
def test_matmul_refuses_attributes_it_cannot_honour(attributes, message):
    values = {"K": 64, "N": 4, "ggml_type": int(QType.Q4_0), "accuracy_level": 4, **attributes}
    node = onnx_helper.make_node("MatMulGGUF", ["A", "B"], ["Y"], domain=kernels.KERNEL_DOMAIN, **values)
    a = onnx_helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, values["K"]])
    with pytest.raises(Exception, match=message):
        _session(node, [a], [_uint8("B", np.zeros((4, 36), np.uint8))])


def test_gather_refuses_float16_output_on_the_cpu():
    # the op name's one schema infers the output type from dtype (float16 here), which the CPU kernel does not write
    with pytest.raises(Exception, match=r"does not match expected type \(tensor\(float16\)\)"):
        gather_session(random_rows(QType.Q4_0, 4, 64, np.random.default_rng(0)), QType.Q4_0, 64, dtype=10)


def test_output_shapes_are_inferred_from_the_inputs():
    data = random_rows(QType.Q4_1, 24, 64, np.random.default_rng(1))
    matmul = matmul_session(data, QType.Q4_1, 64, 4, a_shape=("batch", 5))
    assert matmul.get_outputs()[0].shape == ["batch", 5, 24]
    gather = gather_session(data, QType.Q4_1, 64)
    assert gather.get_outputs()[0].shape == ["batch", "tokens", 64]


def test_concurrent_decode_steps_on_one_session_do_not_share_scratch():
    """A session serves every slot; two steps at once must each get their own quantized activations."""
    rng = np.random.default_rng(5)
    kind, k = QType.Q4_K, 2048
    data = random_rows(kind, 64, k, rng)
    session = matmul_session(data, kind, k, 4)
    inputs = [rng.standard_normal((1, 1, k)).astype(np.float32) for _ in range(4)]
    expected = [session.run(None, {"A": a})[0] for a in inputs]
    failures: list[int] = []

    def step(i: int) -> None:
        for _ in range(50):
            if not np.array_equal(session.run(None, {"A": inputs[i]})[0], expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def _real_tensors(reader, kinds: set[QType], limit_rows: int = 512) -> list[tuple[str, QType, np.ndarray]]:
    """The first tensor of each kind (rows capped, so the big embeddings stay quick)."""
    found: dict[QType, tuple[str, QType, np.ndarray]] = {}
    for tensor in reader.tensors:
        kind = QType(tensor.tensor_type)
        if kind in kinds and kind not in found:
            found[kind] = (tensor.name, kind, np.asarray(tensor.data[:limit_rows]))
    assert set(found) == kinds, f"expected tensors of {sorted(t.name for t in kinds)}"
    return list(found.values())


def _check_real(tensors) -> None:
    rng = np.random.default_rng(11)
    for name, kind, data in tensors:
        k = row_elements(kind, data.shape[1])
        for m in (1, 4):
            a = rng.standard_normal((m, k)).astype(np.float32)
            for accuracy, model in ((4, matmul_int8), (0, matmul_float)):
                try:
                    assert_within(run_matmul(data, kind, a, accuracy), model(a, data, kind))
                except AssertionError as error:
                    raise AssertionError(f"{name} ({kind.name}), M={m}, accuracy {accuracy}: {error}") from error
        ids = np.array([[0, len(data) - 1, 5]], np.int64)
        out = gather_session(data, kind, k).run(None, {"ids": ids})[0]
        assert np.array_equal(out, weights(data, kind)[ids].astype(np.float32)), name


def test_smollm2_tensors(smollm2_reader):
    _check_real(_real_tensors(smollm2_reader, {QType.Q4_1, QType.Q8_0}))


def test_gemma3_tensors(gemma_reader):
    _check_real(_real_tensors(gemma_reader, {QType.Q5_0, QType.Q4_K, QType.Q6_K, QType.Q8_0}))
