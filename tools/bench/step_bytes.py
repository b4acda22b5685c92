"""Bytes a decode step reads: the weights (from the built graph's initializers, and from the GGUF's
tensors for llama.cpp) plus the KV of the past, the quantities a memory-bandwidth bound divides.

Counted, not measured: every initializer a node consumes is read once per step, except tables only
gathered from (the token embedding: one row a step) and the attention's RoPE cos/sin caches
(one row a step). onnxruntime may read a prepacked copy of a MatMulNBits weight instead of the
initializer (MLAS's layout, about the same size); the graph figure counts the initializer.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from gguf import GGUFReader

from edgedecode.model.spec import ModelSpec

# (op type, input index) uses that read one row per step, not the whole initializer
ROW_READS = {
    ("Gather", 0),
    ("GatherBlockQuantized", 0),  # codes
    ("GatherBlockQuantized", 2),  # scales
    ("GatherBlockQuantized", 3),  # zero points
    ("GroupQueryAttention", 7),  # cos cache
    ("GroupQueryAttention", 8),  # sin cache
    ("DecodeAttention", 6),  # cos cache
    ("DecodeAttention", 7),  # sin cache
}


def _initializer_bytes(tensor: onnx.TensorProto) -> int:
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def graph_weight_bytes(graph_path: Path) -> int:
    """Bytes of initializers one run of the graph at ``graph_path`` reads in full (see module docstring)."""
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    uses: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for node in graph.node:
        for index, name in enumerate(node.input):
            uses[name].add((node.op_type, index))
    return sum(_initializer_bytes(t) for t in graph.initializer if uses[t.name] and not uses[t.name] <= ROW_READS)


def gguf_weight_bytes(gguf_path: Path) -> int:
    """Bytes of the GGUF's tensors llama.cpp reads per token: all but an untied token embedding."""
    tensors = GGUFReader(gguf_path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def kv_bytes_per_token(spec: ModelSpec, itemsize: int) -> int:
    """KV bytes one past token adds to each step's reads (K and V of every layer)."""
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * itemsize
