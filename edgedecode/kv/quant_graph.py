"""The EDKV section encoders and the observation-window scorer as ONNX graphs: the bytes of ``kv/quant.py``, computed
by onnxruntime wherever the KV is (the CPU EP on a CPU server, the CUDA EP next to a GPU prefill).

Every graph reads the whole K or V of a prompt, ``rows [layers, kv_heads, n, head_dim]`` (float32 or float16), and
gathers the cells it encodes itself (``layers`` int64 [l], ``tokens`` int64 [m]), so the KV is bound once and only
the encoded bytes leave the device:

* ``fp16_graph``: ``fp16 [l, H, m, D]`` float16, ``largest`` (magnitude: infinite where a value overflowed) and
  ``total`` (NaN where a value is NaN), float32 scalars: the writer refuses a section with a value not finite in
  float16.
* ``quant_graph(layout)``: ``codes uint8 [l, H, m, D·bits/8]``, ``scales`` and ``zeros`` float16 shaped as
  ``quant.params_shape`` over the m tokens; ``bad``: groups beyond ±65504 or not finite (refused), and
  ``zero_groups``: groups whose minimum is ±0, where a reduction's choice between -0 and +0 is not specified, so
  the caller encodes those sections with the numpy reference instead. For ``axis="channel"`` m is a multiple of the
  group: each section's tokens padded with copies of its last token, which change no group's minimum or maximum.

Bit-exact with ``quant.quantize``: the minimum and maximum are exact whatever the order; the float16 ``zero`` (largest
≤ min) and ``scale`` (smallest ≥ (max − zero)/(2^b − 1), in float64 as the reference computes it) are found as
multiples of the float16 spacing of their binade, ``floor(v / u)·u`` and ``ceil(v / u)·u``, where ``u`` is a power of
two looked up from the binade and every step is exact; codes are ``Round((x − zero) / scale)`` in float32 (IEEE
division, round half to even), packed along D by exact float sums. ``tests/test_kv_coder.py`` compares the bytes.
"""

from __future__ import annotations

import numpy as np
import onnx

from edgedecode.kv.quant import FP16_MAX, MIN_SCALE, QuantLayout
from edgedecode.model.onnx_builder import INT64, GraphBuilder, onnx_dtype

FLOAT, DOUBLE, FLOAT16, UINT8 = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                 onnx.TensorProto.UINT8)  # fmt: skip
# float16's binades, largest first: 2^15, 2^14, ..., 2^-14 (the smallest normal). With c of them above |v|, v lies in
# [2^(15-c), 2^(16-c)), where float16 values are 2^(5-c) apart; below 2^-14 (c = 30) subnormals are 2^-24 apart.
_BINADE_FLOORS = np.exp2(np.arange(15, -15, -1, dtype=np.float64))
_SPACING = np.exp2(np.maximum(5 - np.arange(len(_BINADE_FLOORS) + 1), -24).astype(np.float64))


def fp16_graph(source: np.dtype) -> onnx.ModelProto:
    """``rows`` at the given cells cast to float16 (see the module docstring)."""
    g = _Graph("edkv-fp16")
    x = _gathered(g, source)
    half = x if np.dtype(source) == np.float16 else g.op1("Cast", [x], to=FLOAT16)
    g.op("Identity", [half], outputs=["fp16"])
    g.output("fp16", FLOAT16, ["l", "H", "m", "D"])
    wide = g.op1("Cast", [half], to=FLOAT)
    # not finite in float16: an infinity is the largest magnitude, a NaN poisons the sum
    g.op("ReduceMax", [g.op1("Abs", [wide])], outputs=["largest"], keepdims=0)
    g.op("ReduceSum", [wide, g.initializer("all", np.array([0, 1, 2, 3], np.int64))], outputs=["total"], keepdims=0)
    for name in ("largest", "total"):
        g.output(name, FLOAT, [])
    return g.model()


def quant_graph(layout: QuantLayout, source: np.dtype) -> onnx.ModelProto:
    """``rows`` at the given cells quantized with ``layout`` (see the module docstring)."""
    g = _Graph(f"edkv-quant-{layout.axis}-{layout.group}-{layout.bits}")
    x = _gathered(g, source)
    if np.dtype(source) != np.float32:
        x = g.op1("Cast", [x], to=FLOAT)
    shape = g.op1("Shape", [x])
    grouped = g.op1("Reshape", [x, _group_shape(g, shape, layout)])
    axis = 4 if layout.axis == "token" else 3  # [l, H, m, D/g, g] or [l, H, m/g, g, D]
    lo = g.op1("ReduceMin", [grouped], axes=[axis], keepdims=1)
    hi = g.op1("ReduceMax", [grouped], axes=[axis], keepdims=1)
    zero64 = _round_fp16(g, g.op1("Cast", [lo], to=DOUBLE), up=False)
    span = g.op1("Sub", [g.op1("Cast", [hi], to=DOUBLE), zero64])
    steps = g.initializer("steps", np.array(float((1 << layout.bits) - 1)))
    least = g.initializer("min_scale", np.array(MIN_SCALE))
    scale64 = _round_fp16(g, g.op1("Max", [g.op1("Div", [span, steps]), least]), up=True)
    zero, scale = g.op1("Cast", [zero64], to=FLOAT), g.op1("Cast", [scale64], to=FLOAT)
    params_shape = _params_shape(g, shape, layout)
    for name, value in (("scales", scale), ("zeros", zero)):
        g.op("Reshape", [g.op1("Cast", [value], to=FLOAT16), params_shape], outputs=[name])
        g.output(name, FLOAT16, ["l", "H", "groups", "params"])
    q = g.op1("Round", [g.op1("Div", [g.op1("Sub", [grouped, zero]), scale])])
    g.op("Cast", [_packed(g, g.op1("Reshape", [q, shape]), shape, layout.bits)], outputs=["codes"], to=UINT8)
    g.output("codes", UINT8, ["l", "H", "m", "Dp"])
    extreme = g.op1("Max", [g.op1("Abs", [lo]), g.op1("Abs", [hi])])
    in_range = g.op1("LessOrEqual", [extreme, g.initializer("fp16_max", np.array(FP16_MAX, np.float32))])
    g.op("ReduceSum", [g.op1("Cast", [g.op1("Not", [in_range])], to=FLOAT)], outputs=["bad"], keepdims=0)
    g.output("bad", FLOAT, [])
    at_zero = g.op1("Equal", [lo, g.initializer("zero", np.array(0.0, np.float32))])
    g.op("ReduceSum", [g.op1("Cast", [at_zero], to=FLOAT)], outputs=["zero_groups"], keepdims=0)
    g.output("zero_groups", FLOAT, [])
    return g.model()


def range_graph(layout: QuantLayout) -> onnx.ModelProto:
    """``quant.numpy_group_range`` of float32 ``x [l, H, m, D]`` (m a multiple of the group for the channel axis):
    ``lo`` and ``hi`` shaped like the params, and ``total``, the sum of x (NaN where x holds a NaN, which a
    reduction may skip). Equal to numpy's except, perhaps, the sign of a zero minimum: the caller checks."""
    g = _Graph(f"edkv-range-{layout.axis}-{layout.group}")
    x = g.input("x", FLOAT, ["l", "H", "m", "D"])
    shape = g.op1("Shape", [x])
    grouped = g.op1("Reshape", [x, _group_shape(g, shape, layout)])
    axis = 4 if layout.axis == "token" else 3
    for op, name in (("ReduceMin", "lo"), ("ReduceMax", "hi")):
        g.op(op, [grouped], outputs=[name], axes=[axis], keepdims=0)
        g.output(name, FLOAT, ["l", "H", "groups", "params"])
    g.op("ReduceSum", [x, g.initializer("all", np.array([0, 1, 2, 3], np.int64))], outputs=["total"], keepdims=0)
    g.output("total", FLOAT, [])
    return g.model()


def _gathered(g: _Graph, source: np.dtype) -> str:
    """The graph's inputs and ``rows[layers][:, :, tokens]``: [l, H, m, D] in the source dtype."""
    rows = g.input("rows", onnx_dtype(source), ["L", "H", "N", "D"])
    layers = g.input("layers", INT64, ["l"])
    tokens = g.input("tokens", INT64, ["m"])
    return g.op1("Gather", [g.op1("Gather", [rows, layers], axis=0), tokens], axis=2)


def _group_shape(g: _Graph, shape: str, layout: QuantLayout) -> str:
    """[l, H, m, D/g, g] (token axis) or [l, H, m/g, g, D] (channel axis) from x's shape [l, H, m, D]."""
    lead = g.op1("Slice", [shape, _i64(g, "s0", [0]), _i64(g, "s2", [2])])
    group = _i64(g, "group", [layout.group])
    if layout.axis == "token":
        return g.op1("Concat", [lead, _dim(g, shape, 2), _i64(g, "minus1", [-1]), group], axis=0)
    return g.op1("Concat", [lead, _i64(g, "minus1", [-1]), group, _dim(g, shape, 3)], axis=0)


def _params_shape(g: _Graph, shape: str, layout: QuantLayout) -> str:
    """``quant.params_shape`` with the leading [l, H]: [l, H, m, D/g] or [l, H, m/g, D]."""
    lead = g.op1("Slice", [shape, _i64(g, "s0", [0]), _i64(g, "s2", [2])])
    if layout.axis == "token":
        return g.op1("Concat", [lead, _dim(g, shape, 2), _i64(g, "minus1", [-1])], axis=0)
    return g.op1("Concat", [lead, _i64(g, "minus1", [-1]), _dim(g, shape, 3)], axis=0)


def _round_fp16(g: _Graph, v: str, up: bool) -> str:
    """float64 ``v`` (within ±65504) rounded to a float16 value, kept as float64: the smallest ≥ v when ``up``,
    else the largest ≤ v. The binade's spacing u is looked up by counting the binade floors above |v|."""
    floors = g.initializer("binade_floors", _BINADE_FLOORS)
    above = g.op1("Less", [g.op1("Unsqueeze", [g.op1("Abs", [v]), _i64(g, "last", [-1])]), floors])
    count = g.op1("ReduceSum", [g.op1("Cast", [above], to=INT64), _i64(g, "last", [-1])], keepdims=0)
    spacing = g.op1("Gather", [g.initializer("spacing", _SPACING), count])
    steps = g.op1("Ceil" if up else "Floor", [g.op1("Div", [v, spacing])])
    return g.op1("Mul", [steps, spacing])


def _packed(g: _Graph, q: str, shape: str, bits: int) -> str:
    """Codes (exact floats 0 … 2^bits − 1) [l, H, m, D] packed along D, lowest bits first, as exact floats < 256."""
    if bits == 8:
        return q
    per = 8 // bits
    lanes = g.op1("Concat", [g.op1("Slice", [shape, _i64(g, "s0", [0]), _i64(g, "s3", [3])]),
                             _i64(g, "minus1", [-1]), _i64(g, f"per{per}", [per])], axis=0)  # fmt: skip
    weights = g.initializer(f"lane_weights{bits}", np.exp2(bits * np.arange(per)).astype(np.float32))
    return g.op1("ReduceSum", [g.op1("Mul", [g.op1("Reshape", [q, lanes]), weights]), _i64(g, "last", [-1])],
                 keepdims=0)  # fmt: skip


def _dim(g: _Graph, shape: str, index: int) -> str:
    return g.op1("Slice", [shape, _i64(g, f"s{index}", [index]), _i64(g, f"s{index + 1}", [index + 1])])


def _i64(g: _Graph, name: str, values: list[int]) -> str:
    """An int64 constant, one per name and graph."""
    if name not in g.constants:
        g.constants[name] = g.initializer(name, np.array(values, np.int64))
    return g.constants[name]


class _Graph(GraphBuilder):
    """A GraphBuilder that shares its small int64 constants."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.constants: dict[str, str] = {}
