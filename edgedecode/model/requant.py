"""Re-quantization of the decode graph's layer matrices to another bit width or block size.

A weight format is ``native`` (the GGUF's own blocks, as shipped) or ``q{bits}b{block_size}``, e.g.
``q4b128`` or ``q2b32``: every layer matrix (fused QKV, attention output, gate+up, down) is
dequantized and quantized again with asymmetric min/max blocks (``weights.quantize_asymmetric``).
The result has the same ``scale·(code − 2^(bits−1)) + offset`` form as Q4_1, so the graph's exact
MatMulNBits-plus-correction path applies unchanged. The embedding and the tied LM head stay native
8-bit. This is how the cross-quant study (``tools/study/crossquant.py``) builds lower-precision decoders
from the same weights as its higher-precision reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.weights import (
    BlockQuantized,
    LayerTensors,
    ModelTensors,
    Weight,
    dense_weight,
    quantize_asymmetric,
)

NATIVE = "native"
WEIGHT_BITS = (2, 4, 8)  # the widths onnxruntime's MatMulNBits takes
MIN_BLOCK_SIZE = 16  # MatMulNBits: a power of two, at least 16
_FORMAT = re.compile(r"q(\d+)b(\d+)")


class WeightFormatError(EdgeDecodeError, ValueError):
    """A weight format name that no decode graph can be built for."""


@dataclass(frozen=True)
class WeightFormat:
    """Bit width and block size every layer matrix is re-quantized to."""

    bits: int
    block_size: int

    def __post_init__(self) -> None:
        if self.bits not in WEIGHT_BITS:
            raise WeightFormatError(f"weight bits must be one of {WEIGHT_BITS}, not {self.bits}")
        size = self.block_size
        if size < MIN_BLOCK_SIZE or size & (size - 1):
            raise WeightFormatError(f"weight block size must be a power of two >= {MIN_BLOCK_SIZE}, not {size}")

    @property
    def name(self) -> str:
        return f"q{self.bits}b{self.block_size}"


def parse_weight_format(name: str) -> WeightFormat | None:
    """The format a name stands for; None for ``native`` (keep the GGUF's blocks)."""
    if name == NATIVE:
        return None
    match = _FORMAT.fullmatch(name)
    if match is None:
        raise WeightFormatError(
            f"weight format must be {NATIVE!r} or q<bits>b<block_size> (e.g. q4b128, q2b32), not {name!r}"
        )
    return WeightFormat(int(match[1]), int(match[2]))


def requantize(weight: Weight, fmt: WeightFormat) -> BlockQuantized:
    """A [N, K] weight in any form, quantized again in ``fmt``."""
    return quantize_asymmetric(dense_weight(weight), fmt.bits, fmt.block_size)


def _requantize_layer(layer: LayerTensors, fmt: WeightFormat) -> LayerTensors:
    return replace(
        layer,
        qkv=[requantize(w, fmt) for w in layer.qkv],
        o=requantize(layer.o, fmt),
        gate_up=[requantize(w, fmt) for w in layer.gate_up],
        down=requantize(layer.down, fmt),
    )


def requantize_layers(tensors: ModelTensors, fmt: WeightFormat | None) -> ModelTensors:
    """Every layer matrix re-quantized in ``fmt`` (embedding, norms and LM head untouched); None keeps them."""
    if fmt is None:
        return tensors
    return replace(tensors, layers=[_requantize_layer(layer, fmt) for layer in tensors.layers])
