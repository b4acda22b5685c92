"""``importance.attention_importance`` as an ONNX graph, run by onnxruntime where the keys are (CPU or CUDA EP).

Inputs: ``queries`` float32 [l, kv_heads, group, w, head_dim] (a KV head's query heads, each with the w window
queries), post-RoPE and already multiplied by the attention scale (``observation_queries``); ``keys`` [l, kv_heads,
n, head_dim] post-RoPE, float32 or float16 (with ``gather_layers``: ``keys`` [L, ...] and ``layers`` int64 [l], the
layers scored); ``hidden`` float32 [w, n], 0 where a query sees the key and -inf where the key lies after it.
Output ``importance`` float32 [l, n]: the softmax attention each key receives, summed over heads and window queries.
Same arithmetic as the numpy function, summed in another order: equal within float32 rounding, not bitwise.
"""

from __future__ import annotations

import numpy as np
import onnx

from edgedecode.model.onnx_builder import INT64, GraphBuilder, onnx_dtype
from edgedecode.model.rope import apply_rope
from edgedecode.model.spec import ModelSpec

FLOAT = onnx.TensorProto.FLOAT


def importance_graph(source: np.dtype, gather_layers: bool, window: int) -> onnx.ModelProto:
    """The scoring graph for keys of dtype ``source`` and ``window`` observation queries."""
    g = GraphBuilder(f"edkv-importance-w{window}")
    queries = g.input("queries", FLOAT, ["l", "H", "G", window, "D"])
    keys = g.input("keys", onnx_dtype(source), ["L" if gather_layers else "l", "H", "n", "D"])
    if gather_layers:
        keys = g.op1("Gather", [keys, g.input("layers", INT64, ["l"])], axis=0)
    if np.dtype(source) != np.float32:
        keys = g.op1("Cast", [keys], to=FLOAT)
    hidden = g.input("hidden", FLOAT, [window, "n"])
    transposed = g.op1("Transpose", [keys], perm=[0, 1, 3, 2])  # [l, H, D, n]
    per_group = g.op1("Unsqueeze", [transposed, g.initializer("group_axis", np.array([2], np.int64))])
    logits = g.op1("MatMul", [queries, per_group])  # [l, H, G, w, n]
    weights = g.op1("Softmax", [g.op1("Add", [logits, hidden])], axis=-1)
    axes = g.initializer("heads_and_queries", np.array([1, 2, 3], np.int64))
    g.op("ReduceSum", [weights, axes], outputs=["importance"], keepdims=0)
    g.output("importance", FLOAT, ["l", "n"])
    return g.model()


def observation_queries(spec: ModelSpec, queries: np.ndarray, query_positions: np.ndarray, layers: range) -> np.ndarray:
    """float32 [l, kv_heads, group, w, head_dim]: the pre-RoPE ``queries [layers, w, heads·head_dim]`` of ``layers``
    rotated to their positions and scaled, as ``importance_graph`` takes them."""
    w = queries.shape[1]
    group = spec.n_heads // spec.n_kv_heads
    out = np.empty((len(layers), spec.n_kv_heads, group, w, spec.head_dim), np.float32)
    for i, layer in enumerate(layers):
        q = queries[layer].astype(np.float32).reshape(w, spec.n_heads, spec.head_dim).transpose(1, 0, 2)
        rotated = apply_rope(q, query_positions, spec.rope_inv_freq(layer))
        out[i] = rotated.reshape(spec.n_kv_heads, group, w, spec.head_dim) * np.float32(spec.attention_scale)
    return out


def hidden_bias(query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
    """float32 [w, n]: 0 where a query at ``query_positions`` sees the key, -inf where the key comes after it."""
    return np.where(key_positions[None, :] > query_positions[:, None], -np.inf, 0.0).astype(np.float32)
