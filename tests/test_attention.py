"""DecodeAttention (edgedecode/kernels, csrc/op_attention.c) against a numpy oracle of grouped-query attention over
a float16 cache, through onnxruntime as the decode graph runs it, on every CPU path this machine runs.

The oracle computes what com.microsoft.GroupQueryAttention computes for the graph (rotate-half RoPE at
position_ids, keys and values appended at the slots seqlens_k gives, causal rows, a window of the last W keys,
the scale), in float64 over the float16 values the cache holds. Skipped where the kernel library is unusable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from edgedecode import kernels

ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

LIBRARY = kernels.load()
pytestmark = pytest.mark.skipif(not LIBRARY.available, reason=f"edgedecode kernels unusable: {LIBRARY.reason}")
POSITIONS = 4096  # rows of the RoPE caches


def _library():
    return kernels.open_library(LIBRARY.path)


def usable_isas() -> list[str]:
    return _library().edgedecode_kernels_cpu_isas().decode().split(",") if LIBRARY.available else ["portable"]


@pytest.fixture(params=usable_isas())
def isa(request):
    """Each CPU path this machine runs (the attention path follows the matmul path), chosen before sessions are made."""
    library = _library()
    before = library.edgedecode_kernels_cpu_isa()
    assert library.edgedecode_kernels_set_cpu_isa(request.param.encode()) == 0
    yield request.param
    library.edgedecode_kernels_set_cpu_isa(before)


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    dim: int
    slots: int = 400
    window: int = -1
    packed: bool = True
    scale: float = 0.0  # 0: 1/sqrt(dim)

    @property
    def applied_scale(self) -> float:
        return self.scale or 1.0 / np.sqrt(self.dim)


def rope_caches(dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 10_000.0 ** (-np.arange(dim // 2) / (dim // 2))
    angles = np.arange(POSITIONS)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def session(shape: Shape, threads: int = 2):
    """One DecodeAttention node; past and present are graph inputs and outputs the caller may bind together."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    q_width = (shape.heads + 2 * shape.kv_heads) * shape.dim if shape.packed else shape.heads * shape.dim
    kv = ["batch", shape.kv_heads, "slots", shape.dim]
    inputs = [
        helper.make_tensor_value_info("query", f32, ["batch", "rows", q_width]),
        helper.make_tensor_value_info("past_key", f16, kv),
        helper.make_tensor_value_info("past_value", f16, kv),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("cos", f32, [POSITIONS, shape.dim // 2]),
        helper.make_tensor_value_info("sin", f32, [POSITIONS, shape.dim // 2]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "rows"]),
    ]
    if not shape.packed:
        width = shape.kv_heads * shape.dim
        inputs += [helper.make_tensor_value_info(n, f32, ["batch", "rows", width]) for n in ("key", "value")]
    names = ["query", "" if shape.packed else "key", "" if shape.packed else "value"]
    node = helper.make_node(
        "DecodeAttention",
        [*names, "past_key", "past_value", "seqlens_k", "cos", "sin", "position_ids"],
        ["output", "present_key", "present_value"],
        domain=kernels.KERNEL_DOMAIN,
        num_heads=shape.heads,
        kv_num_heads=shape.kv_heads,
        local_window_size=shape.window,
        scale=shape.scale,
    )
    outputs = [
        helper.make_tensor_value_info("output", f32, ["batch", "rows", shape.heads * shape.dim]),
        helper.make_tensor_value_info("present_key", f16, kv),
        helper.make_tensor_value_info("present_value", f16, kv),
    ]
    model = helper.make_model(
        helper.make_graph([node], "attention", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.KERNEL_DOMAIN, 1)],
        ir_version=8,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@dataclass
class Case:
    shape: Shape
    query: np.ndarray  # [B, M, width] float32 (packed: q, k, v)
    key: np.ndarray  # [B, M, KVH*D]
    value: np.ndarray
    cache_k: np.ndarray  # [B, KVH, T, D] float16, slots before the past filled
    cache_v: np.ndarray
    past: np.ndarray  # [B] slots already held
    positions: np.ndarray  # [B, M] int64

    @property
    def rows(self) -> int:
        return self.query.shape[1]

    def feeds(self) -> dict[str, np.ndarray]:
        cos, sin = rope_caches(self.shape.dim)
        feeds = {
            "query": self.query,
            "seqlens_k": (self.past + self.rows - 1).astype(np.int32),
            "cos": cos,
            "sin": sin,
            "position_ids": self.positions,
        }
        if not self.shape.packed:
            feeds |= {"key": self.key, "value": self.value}
        return feeds


def make_case(shape: Shape, past: list[int], rows: int, seed: int, position_gap: int = 0) -> Case:
    """Random queries, new keys and values, a cache holding ``past[b]`` random float16 rows (garbage after them),
    positions from past + position_gap on."""
    rng = np.random.default_rng(seed)
    batch, h, kvh, d = len(past), shape.heads, shape.kv_heads, shape.dim
    q = rng.standard_normal((batch, rows, h * d)).astype(np.float32)
    k = (1.5 * rng.standard_normal((batch, rows, kvh * d))).astype(np.float32)
    v = rng.standard_normal((batch, rows, kvh * d)).astype(np.float32)
    cache_k = (1.5 * rng.standard_normal((batch, kvh, shape.slots, d))).astype(np.float16)
    cache_v = rng.standard_normal((batch, kvh, shape.slots, d)).astype(np.float16)
    query = np.concatenate([q, k, v], axis=-1) if shape.packed else q
    positions = np.array([np.arange(p, p + rows) + position_gap for p in past], np.int64)
    return Case(shape, query, k, v, cache_k, cache_v, np.array(past), positions)


def rotate(x: np.ndarray, position: np.ndarray, dim: int) -> np.ndarray:
    """Rotate-half RoPE of x [..., rows, heads, dim] in float64 at the caches' float32 angles."""
    cos, sin = (c.astype(np.float64)[position][..., None, :] for c in rope_caches(dim))
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def oracle_caches(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The presents in float64: (keys, values) holding the float16 rounding of the new rows' rotated keys and
    values, and (exact keys, exact values) holding them unrounded."""
    s = case.shape
    batch, rows = case.query.shape[0], case.rows
    k = case.key.astype(np.float64).reshape(batch, rows, s.kv_heads, s.dim)
    v = case.value.astype(np.float64).reshape(batch, rows, s.kv_heads, s.dim)
    keys, values = case.cache_k.astype(np.float64), case.cache_v.astype(np.float64)
    exact_k, exact_v = keys.copy(), values.copy()
    for b in range(batch):
        slots = slice(case.past[b], case.past[b] + rows)
        exact_k[b, :, slots] = rotate(k[b], case.positions[b], s.dim).transpose(1, 0, 2)
        exact_v[b, :, slots] = v[b].transpose(1, 0, 2)
        keys[b, :, slots] = exact_k[b, :, slots].astype(np.float16)
        values[b, :, slots] = exact_v[b, :, slots].astype(np.float16)
    return keys, values, exact_k, exact_v


def oracle(case: Case, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The output in float64: each row's rotated, scaled query against the keys and values [B, KVH, T, D] it sees."""
    s = case.shape
    batch, rows, group = case.query.shape[0], case.rows, s.heads // s.kv_heads
    q = case.query[..., : s.heads * s.dim].astype(np.float64).reshape(batch, rows, s.heads, s.dim)
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    out = np.zeros((batch, rows, s.heads, s.dim))
    for b in range(batch):
        rotated = rotate(q[b], case.positions[b], s.dim) * s.applied_scale
        for i in range(rows):
            last = case.past[b] + i
            first = max(0, last - s.window + 1) if s.window > 0 else 0
            for head in range(s.heads):
                kv = head // group
                scores = keys[b, kv, first : last + 1] @ rotated[i, head]
                weights = np.exp(scores - scores.max())
                out[b, i, head] = weights @ values[b, kv, first : last + 1] / weights.sum()
    return out.reshape(batch, rows, -1)


def run(case: Case, threads: int = 2, in_place: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(output, present key, present value); in place: both presents bound to their pasts' buffers, as the
    runtime binds its KV."""
    sess = session(case.shape, threads)
    io = sess.io_binding()
    for name, value in case.feeds().items():
        io.bind_cpu_input(name, value)
    cache_k, cache_v = case.cache_k.copy(), case.cache_v.copy()
    buffers = [ort.OrtValue.ortvalue_from_numpy(a) for a in (cache_k, cache_v)]
    for name, buffer in zip(("key", "value"), buffers):
        io.bind_ortvalue_input(f"past_{name}", buffer)
        if in_place:
            io.bind_ortvalue_output(f"present_{name}", buffer)
        else:
            io.bind_output(f"present_{name}")
    output = np.empty((case.query.shape[0], case.rows, case.shape.heads * case.shape.dim), np.float32)
    io.bind_output("output", "cpu", 0, np.float32, list(output.shape), output.ctypes.data)
    sess.run_with_iobinding(io)
    if in_place:
        return output, cache_k, cache_v
    present = io.copy_outputs_to_cpu()
    assert np.array_equal(cache_k, case.cache_k) and np.array_equal(cache_v, case.cache_v)  # the past untouched
    return output, present[0], present[1]  # in the order bound


def assert_cache_matches(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal, except that a rotated key may land one float16 step away where its float32 rotation sits on a
    rounding boundary the float64 oracle falls on the other side of."""
    step = np.spacing(np.abs(expected).astype(np.float16)).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - expected) <= step).all()
    assert np.mean(got.astype(np.float64) != expected) < 0.01


def assert_attention_matches(case: Case, got: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    output, cache_k, cache_v = got
    keys, values, exact_k, exact_v = oracle_caches(case)
    assert_cache_matches(cache_k, keys)
    assert np.array_equal(cache_v, values.astype(np.float16))  # values are rounded as given: exactly
    # float32 arithmetic over the float16 values the cache holds: a few float32 ulps of the output's scale
    expected = oracle(case, cache_k, cache_v)
    np.testing.assert_allclose(output, expected, rtol=0, atol=2e-6 * max(1.0, np.abs(expected).max()))
    # and against attention over unrounded keys and values: what float16 storage costs (2^-11 relative)
    assert np.abs(output - oracle(case, exact_k, exact_v)).max() < 0.02


SHAPES = {
    "group1-d64": Shape(4, 4, 64),
    "group3-d64": Shape(9, 3, 64),  # SmolLM2
    "group4-d128": Shape(8, 2, 128),
    "group7-d64-separate": Shape(14, 2, 64, packed=False),  # Qwen2.5-0.5B
    "group12-d128": Shape(12, 1, 128),  # more heads than one call serves: two query groups
    "group3-d256-scaled": Shape(6, 2, 256, scale=0.0625),  # Gemma 3's head_dim and explicit scale
    "group2-d40": Shape(4, 2, 40),  # head_dim not a multiple of 8: the portable kernel on every path
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("past", [0, 1, 150, 300])  # 150, 300: a filled cache spanning 2 and 3 chunks of 128
def test_a_decode_row_attends_to_the_filled_cache(isa, name, past):
    case = make_case(SHAPES[name], [past], 1, seed=past)
    assert_attention_matches(case, run(case))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize(("past", "rows"), [(0, 19), (120, 37), (250, 9)])
def test_prompt_rows_are_causal(isa, name, past, rows):
    case = make_case(SHAPES[name], [past], rows, seed=past + rows)
    assert_attention_matches(case, run(case))


@pytest.mark.parametrize("window", [1, 7, 130, 1000])
@pytest.mark.parametrize(("past", "rows"), [(0, 1), (299, 1), (140, 23)])
def test_a_window_shows_the_last_w_keys_itself_included(isa, window, past, rows):
    shape = Shape(9, 3, 64, window=window)
    case = make_case(shape, [past], rows, seed=window + past)
    assert_attention_matches(case, run(case))


def test_rope_takes_position_ids_not_slots(isa):
    """Positions run ahead of the cache slots once tokens were compacted away."""
    case = make_case(Shape(8, 2, 128), [200], 3, seed=5, position_gap=1500)
    assert_attention_matches(case, run(case))


def test_a_batch_of_rows_with_different_pasts(isa):
    case = make_case(Shape(9, 3, 64), [17, 290], 1, seed=11)
    assert_attention_matches(case, run(case))


def test_an_unshared_present_starts_as_the_past():
    case = make_case(Shape(8, 2, 64), [100], 4, seed=3)
    assert_attention_matches(case, run(case, in_place=False))


def test_matches_onnxruntimes_group_query_attention_over_the_same_values():
    """The graph's stock op over a float32 cache holding the same float16 values computes the same attention."""
    shape = Shape(9, 3, 64, window=40)
    case = make_case(shape, [180], 5, seed=21)
    output, cache_k, _ = run(case)
    f32 = TensorProto.FLOAT
    kv = [1, shape.kv_heads, shape.slots, shape.dim]
    width = (shape.heads + 2 * shape.kv_heads) * shape.dim
    inputs = [
        helper.make_tensor_value_info(name, kind, dims)
        for name, kind, dims in [
            ("query", f32, [1, "rows", width]),
            ("past_key", f32, kv),
            ("past_value", f32, kv),
            ("seqlens_k", TensorProto.INT32, [1]),
            ("total", TensorProto.INT32, []),
            ("cos", f32, [POSITIONS, shape.dim // 2]),
            ("sin", f32, [POSITIONS, shape.dim // 2]),
            ("position_ids", TensorProto.INT64, [1, "rows"]),
        ]
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin", "position_ids"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=shape.heads,
        kv_num_heads=shape.kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
        local_window_size=shape.window,
        scale=shape.applied_scale,
    )
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in ("output", "present_key", "present_value")]
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    gqa = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = case.feeds() | {
        "past_key": case.cache_k.astype(np.float32),
        "past_value": case.cache_v.astype(np.float32),
        "total": np.array(shape.slots, np.int32),
    }
    expected, gqa_keys, _ = gqa.run(None, feeds)
    # GQA keeps its keys in float32 (and, its present not bound to its past, zeros after the held slots): rounded
    # to float16 they are the op's, up to a boundary's float16 step
    held = slice(0, 185)
    assert_cache_matches(cache_k[:, :, held], gqa_keys[:, :, held].astype(np.float16).astype(np.float64))
    np.testing.assert_allclose(output, expected, rtol=0, atol=0.01)


@pytest.mark.parametrize(
    "shape",
    [
        SHAPES["group1-d64"],
        SHAPES["group3-d64"],
        SHAPES["group4-d128"],
        SHAPES["group12-d128"],
        Shape(4, 2, 64, window=37),
    ],
    ids=["group1", "group3", "group4", "group12", "group2-window"],
)
def test_a_row_is_the_same_in_a_run_of_any_size_and_on_any_threads(isa, shape):
    """Bit for bit: a decode row alone, the same row last in a prompt run (tiled with other rows and heads), on one
    thread and on two (prefix reuse and split prompts give the same KV and logits)."""
    run_case = make_case(shape, [270], 30, seed=9)
    whole, cache_k, cache_v = run(run_case, threads=2)
    alone = Case(
        shape,
        run_case.query[:, -1:],
        run_case.key[:, -1:],
        run_case.value[:, -1:],
        cache_k,
        cache_v,
        run_case.past + 29,
        run_case.positions[:, -1:],
    )
    for threads in (1, 2):
        output, _, _ = run(alone, threads=threads)
        assert np.array_equal(output[:, 0], whole[:, -1])


def _error(case: Case) -> str:
    with pytest.raises(Exception) as raised:
        run(case)
    return str(raised.value)


def test_rows_that_do_not_fit_the_cache_are_refused():
    case = make_case(Shape(4, 2, 64, slots=32), [30], 1, seed=1)
    case.past[0] = 32
    assert "must fit the cache" in _error(case)


def test_a_position_past_the_rope_caches_is_refused():
    case = make_case(Shape(4, 2, 64), [10], 1, seed=1, position_gap=POSITIONS)
    assert "outside the RoPE caches" in _error(case)
