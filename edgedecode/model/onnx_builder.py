"""A minimal ONNX graph assembler: named nodes, initializers and value infos, nothing model-specific."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"
# edgedecode's own ops (edgedecode/kernels: MatMulGGUF, GatherGGUF), registered from its custom-op library
KERNEL_DOMAIN = "com.edgedecode"
ONNX_OPSET = 17
MS_OPSET = 1
KERNEL_OPSET = 1


class GraphBuilder:
    """Accumulates nodes and initializers; every emitted value gets a unique, readable name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counts: dict[str, int] = {}

    def _unique(self, stem: str) -> str:
        n = self._counts.get(stem, 0)
        self._counts[stem] = n + 1
        return stem if n == 0 else f"{stem}_{n}"

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Add a constant tensor and return its name."""
        name = self._unique(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def op(
        self,
        op_type: str,
        inputs: list[str],
        n_outputs: int = 1,
        *,
        name: str | None = None,
        outputs: list[str] | None = None,
        domain: str = "",
        **attrs,
    ) -> list[str]:
        """Emit one node; returns its output names (fixed names may be given through ``outputs``)."""
        node_name = self._unique(name or op_type)
        outs = outputs or [f"{node_name}/out{i}" if n_outputs > 1 else f"{node_name}/out" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=node_name, domain=domain or None, **attrs))
        return outs

    def op1(self, op_type: str, inputs: list[str], **kwargs) -> str:
        """Emit a single-output node and return that output's name."""
        return self.op(op_type, inputs, 1, **kwargs)[0]

    def model(self) -> onnx.ModelProto:
        """The finished model (IR and opsets fixed so onnxruntime CPU and CUDA builds both load it)."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(MS_DOMAIN, MS_OPSET)]
        if any(node.domain == KERNEL_DOMAIN for node in self.nodes):
            opsets.append(helper.make_opsetid(KERNEL_DOMAIN, KERNEL_OPSET))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="edgedecode")
        model.ir_version = 8
        return model


def onnx_dtype(np_dtype: np.dtype) -> int:
    """TensorProto element type for a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype))


INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
