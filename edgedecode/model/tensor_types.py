"""GGUF tensor types: which the builder reads, and how a quantized type's bytes unpack into integer codes.

Every quantized type llama.cpp writes for these models stores a matrix row as blocks whose
elements are small unsigned integers ``q`` with a float scale (and, for the asymmetric types, a
float bias) per sub-block:

=====  =======  =====  =========  ===================  ==============================
type   bytes    codes  sub-block  scale                bias
=====  =======  =====  =========  ===================  ==============================
Q4_0   18/32    4-bit  32         d                    none: ``d·(q − 8)``
Q4_1   20/32    4-bit  32         d                    m
Q5_0   22/32    5-bit  32         d                    none: ``d·(q − 16)``
Q5_1   24/32    5-bit  32         d                    m
Q8_0   34/32    8-bit  32         d                    none: ``d·(q − 128)`` (int8 + 128)
Q4_K   144/256  4-bit  32         d·sc (sc 6-bit)      −dmin·m (m 6-bit)
Q5_K   176/256  5-bit  32         d·sc (sc 6-bit)      −dmin·m (m 6-bit)
Q6_K   210/256  6-bit  16         d·sc (sc int8)       none: ``d·sc·(q − 32)``
=====  =======  =====  =========  ===================  ==============================

``d``, ``m`` and ``dmin`` are float16, so each per-sub-block scale and bias is a float16 times an
integer of at most 8 bits: exactly representable in float32 (at most 19 significant bits). The
float types (F32, F16, BF16) have no blocks; ``gguf.quants.dequantize`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

from edgedecode.model.gguf_file import ModelFileError

FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})


@dataclass(frozen=True)
class Unpacked:
    """A quantized [N, K] matrix as ``scale·q + bias`` per sub-block (``scale·(q − 2**(bits−1))`` without bias).

    The sub-block of element k is ``k // block_size``; K is a whole number of sub-blocks.
    """

    codes: np.ndarray  # uint8 [N, K], values in [0, 2**bits)
    bits: int
    block_size: int
    scales: np.ndarray  # float32 [N, K / block_size]
    biases: np.ndarray | None  # float32 [N, K / block_size]; None for the symmetric types


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 [..., blocks]."""
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _fields(data: np.ndarray, width: int, group: int) -> np.ndarray:
    """Unpack ``width``-bit fields along the last axis, the way ggml lays them out.

    Within each run of ``group`` bytes, field i (bits i·width and up) of byte j is element
    ``i·group + j`` of that run: Q4_0's nibbles are (4, 16), Q4_K's (4, 32), Q5_0's high bits (1, 1).
    """
    runs = data.reshape(*data.shape[:-1], -1, 1, group)
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    return ((runs >> shifts) & ((1 << width) - 1)).reshape(*data.shape[:-1], -1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit sub-block scales and mins packed into bytes 4..15, as float32."""
    lead = raw.shape[:-1]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(raw[..., 4:16]).reshape(-1, 12))
    return sc.reshape(*lead, 8).astype(np.float32), mn.reshape(*lead, 8).astype(np.float32)


# Each unpacker takes a matrix's blocks, uint8 [N, blocks, block bytes], and returns
# (codes [N, blocks, elements], bits, sub-block size, scales [N, blocks, subs], biases or None).
_Parts = tuple[np.ndarray, int, int, np.ndarray, np.ndarray | None]


def _q4_0(raw: np.ndarray) -> _Parts:
    return _fields(raw[..., 2:18], 4, 16), 4, 32, _f16(raw, 0)[..., None], None


def _q4_1(raw: np.ndarray) -> _Parts:
    return _fields(raw[..., 4:20], 4, 16), 4, 32, _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]


def _q5_0(raw: np.ndarray) -> _Parts:
    codes = _fields(raw[..., 6:22], 4, 16) | (_fields(raw[..., 2:6], 1, 1) << 4)
    return codes, 5, 32, _f16(raw, 0)[..., None], None


def _q5_1(raw: np.ndarray) -> _Parts:
    codes = _fields(raw[..., 8:24], 4, 16) | (_fields(raw[..., 4:8], 1, 1) << 4)
    return codes, 5, 32, _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]


def _q8_0(raw: np.ndarray) -> _Parts:
    codes = (raw[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, 8, 32, _f16(raw, 0)[..., None], None


def _q4_k(raw: np.ndarray) -> _Parts:
    sc, mn = _k_scales(raw)
    codes = _fields(raw[..., 16:144], 4, 32)
    return codes, 4, 32, _f16(raw, 0)[..., None] * sc, -(_f16(raw, 2)[..., None] * mn)


def _q5_k(raw: np.ndarray) -> _Parts:
    sc, mn = _k_scales(raw)
    codes = _fields(raw[..., 48:176], 4, 32) | (_fields(raw[..., 16:48], 1, 32) << 4)
    return codes, 5, 32, _f16(raw, 0)[..., None] * sc, -(_f16(raw, 2)[..., None] * mn)


def _q6_k(raw: np.ndarray) -> _Parts:
    codes = _fields(raw[..., 0:128], 4, 64) | (_fields(raw[..., 128:192], 2, 32) << 4)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    return codes, 6, 16, _f16(raw, 208)[..., None] * sc, None


_UNPACKERS: dict[QType, Callable[[np.ndarray], _Parts]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}
BLOCK_TYPES = frozenset(_UNPACKERS)
SUPPORTED_TENSOR_TYPES = FLOAT_TYPES | BLOCK_TYPES


def unpack(data: np.ndarray, kind: QType) -> Unpacked:
    """Unpack a quantized matrix's bytes (uint8 [N, bytes per row], as GGUFReader gives them).

    Raises:
        ValueError: ``kind`` is not one of BLOCK_TYPES, or the rows are not whole blocks.
    """
    if kind not in _UNPACKERS:
        raise ValueError(f"{kind.name} is not a supported quantized type")
    block_bytes = GGML_QUANT_SIZES[kind][1]
    rows = np.asarray(data, np.uint8)
    rows = rows.reshape(-1, rows.shape[-1])
    if rows.shape[1] % block_bytes:
        raise ValueError(f"{kind.name} rows of {rows.shape[1]} bytes are not whole {block_bytes}-byte blocks")
    codes, bits, size, scales, biases = _UNPACKERS[kind](rows.reshape(rows.shape[0], -1, block_bytes))
    n = rows.shape[0]
    return Unpacked(
        codes.reshape(n, -1).astype(np.uint8),
        bits,
        size,
        scales.reshape(n, -1).astype(np.float32),
        None if biases is None else biases.reshape(n, -1).astype(np.float32),
    )


def check_tensor_types(reader: GGUFReader) -> None:
    """Raise ModelFileError naming every unsupported tensor type and the first tensor of each."""
    unsupported: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        kind = QType(tensor.tensor_type)
        if kind not in SUPPORTED_TENSOR_TYPES:
            unsupported.setdefault(kind.name, []).append(tensor.name)
    if unsupported:
        found = "; ".join(
            f"{kind} ({names[0]!r}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
            for kind, names in sorted(unsupported.items())
        )
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ModelFileError(f"unsupported tensor types: {found}; supported: {supported}")
