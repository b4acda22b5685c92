"""Float matrices written as GGUF tensor types: the inverse of tensor_types' unpacking, for synthetic files.

``gguf.quants.quantize`` writes the 32-element block types and BF16; the K-quants (Q4_K, Q5_K,
Q6_K) it only reads, so ``encode`` packs those itself with a plain min/max quantizer per sub-block
(not llama.cpp's search, which only changes which codes are chosen, not how they are stored). Its
bytes are held to gguf's own ``dequantize`` in tests/test_tensor_types.py. Used by the tests'
synthetic models and tools/bench/synth_gguf.py; the runtime only reads GGUFs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize


def _pack_fields(values: np.ndarray, width: int, group: int) -> np.ndarray:
    """Inverse of tensor_types._fields: field i of byte j in each run of ``group`` bytes is element i·group + j."""
    runs = values.astype(np.uint8).reshape(*values.shape[:-1], -1, 8 // width, group)
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    packed = np.bitwise_or.reduce(runs << shifts, axis=-2)
    return packed.reshape(*values.shape[:-1], -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    """x / by, and 0 where by is 0."""
    safe = np.where(by == 0, 1, by)
    return np.where(by == 0, 0, x / safe)


def _pack_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes (the inverse of gguf's Q4_K.get_scale_min)."""
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=-1).astype(np.uint8)


def _encode_k_asymmetric(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) super-blocks: ``d·sc·q − dmin·m`` per 32, sc and m 6-bit."""
    x = w.reshape(-1, 8, 32).astype(np.float32)
    top = (1 << bits) - 1
    lo = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - lo) / top, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint(_divide(x + offset[..., None], step[..., None])), 0, top).astype(np.uint8).reshape(-1, 256)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m)]
    if bits == 5:
        parts.append(_pack_fields(q >> 4, 1, 32))
    parts.append(_pack_fields(q & 0x0F, 4, 32))
    return np.concatenate(parts, axis=-1)


def _encode_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks: ``d·sc·(q − 32)`` per 16, sc int8 of either sign (as llama.cpp's can be)."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = extreme / -32  # the extreme element gets code 0
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), -127, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_divide(x, step[..., None])) + 32, 0, 63).astype(np.uint8).reshape(-1, 256)
    parts = [_pack_fields(q & 0x0F, 4, 64), _pack_fields(q >> 4, 2, 32), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate(parts, axis=-1)


_K_ENCODERS: dict[QType, Callable[[np.ndarray], np.ndarray]] = {
    QType.Q4_K: lambda w: _encode_k_asymmetric(w, 4),
    QType.Q5_K: lambda w: _encode_k_asymmetric(w, 5),
    QType.Q6_K: _encode_q6_k,
}


def encode(weight: np.ndarray, kind: QType) -> np.ndarray:
    """A float [N, K] matrix as GGUFWriter.add_tensor takes it in ``kind`` (raw bytes [N, row bytes] if quantized)."""
    weight = np.asarray(weight, np.float32)
    if kind in _K_ENCODERS:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        rows = _K_ENCODERS[kind](weight)
        return rows.reshape(weight.shape[0], weight.shape[1] // block * block_bytes)
    return quantize(weight, kind)


def add_matrix(writer: GGUFWriter, name: str, weight: np.ndarray, kind: QType) -> None:
    """Write ``weight`` as tensor ``name`` of type ``kind``."""
    data = encode(weight, kind)
    writer.add_tensor(name, data, raw_dtype=None if kind in (QType.F32, QType.F16) else kind)
