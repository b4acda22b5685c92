"""A numpy model of edgedecode's custom ops (edgedecode/kernels), the oracle tests/test_kernels*.py hold them to.

Weights come from ``edgedecode.model.tensor_types.unpack`` (codes, scales, biases per sub-block), the same unpacking
the reference decoder's weights go through, evaluated in float64 where every product of a float16-derived scale and
a small integer is exact. Each model also returns a bound on the float32 rounding a correct kernel may add: for a
sum of n terms computed in float32 (each term itself a product of up to three rounded factors), the textbook bound
(n + 3) · 2⁻²⁴ · Σ|term|. A kernel that reads a code or a scale wrong is off by far more than that.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

from edgedecode.model.tensor_types import unpack

TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)
K_TYPES = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K})
UNIT = 2.0**-24
# Byte offsets of the float16 fields in each type's block (d; m or dmin): every other byte may hold anything.
_F16_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}


def row_elements(kind: QType, row_bytes: int) -> int:
    """K of a row of ``row_bytes`` bytes."""
    block, size = GGML_QUANT_SIZES[kind]
    return row_bytes // size * block


def activation_block(kind: QType) -> int:
    """The activations' quantization block at accuracy level 4: the K-quants' 256, else 32."""
    return 256 if kind in K_TYPES else 32


def random_rows(kind: QType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes] of valid blocks: random bytes everywhere (every code and 6-bit or int8 scale pattern,
    -128 included) except the float16 fields, which hold finite normal values of either sign."""
    block, size = GGML_QUANT_SIZES[kind]
    rows = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[kind]:
        values = (rng.standard_normal(rows.shape[:2]) * 0.02).astype(np.float16)
        rows[..., at : at + 2] = values[..., None].view(np.uint8)
    return rows.reshape(n, -1)


def weights(data: np.ndarray, kind: QType) -> np.ndarray:
    """The exact dequantized float64 [N, K] of GGUF rows uint8 [N, row bytes]."""
    parts = unpack(data, kind)
    n = parts.codes.shape[0]
    codes = parts.codes.astype(np.float64).reshape(n, -1, parts.block_size)
    scales = parts.scales.astype(np.float64)[..., None]
    if parts.biases is None:
        values = (codes - (1 << (parts.bits - 1))) * scales
    else:
        values = codes * scales + parts.biases.astype(np.float64)[..., None]
    return values.reshape(n, -1)


def quantize_activations(a: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy level 4's rule for float32 rows [M, K]: per block, d = max|a| / 127 (float32) and
    q = round-half-even(a · (1/d)) (float32 product), 0 where d is 0. Returns int8 q [M, K], float32 d [M, K/block]."""
    x = np.asarray(a, np.float32).reshape(a.shape[0], -1, block)
    d = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(x * inverse[..., None]).astype(np.int8)
    return q.reshape(a.shape), d


def matmul_int8(a: np.ndarray, data: np.ndarray, kind: QType) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy level 4: y [M, N] = Σ over sub-blocks d_a · (scale · Σ(code − offset)·q + bias · Σq), exactly (float64),
    and the float32 rounding bound per output."""
    parts = unpack(data, kind)
    n, k = parts.codes.shape
    q, d = quantize_activations(a, activation_block(kind))
    sub = parts.block_size
    codes = parts.codes.astype(np.int64).reshape(n, -1, sub)
    if parts.biases is None:
        codes = codes - (1 << (parts.bits - 1))
    qs = q.astype(np.int64).reshape(len(a), -1, sub)  # [M, subs, sub]
    dots = np.einsum("nsi,msi->mns", codes, qs).astype(np.float64)  # exact integers
    d_sub = np.repeat(d, activation_block(kind) // sub, axis=1).astype(np.float64)  # [M, subs]
    terms = dots * parts.scales.astype(np.float64)[None] * d_sub[:, None, :]
    size = np.abs(terms)
    if parts.biases is not None:
        offsets = qs.sum(-1)[:, None, :] * parts.biases.astype(np.float64)[None] * d_sub[:, None, :]
        terms, size = terms + offsets, size + np.abs(offsets)
    count = k // sub
    return terms.sum(-1), (count + 3) * UNIT * size.sum(-1)


def matmul_float(a: np.ndarray, data: np.ndarray, kind: QType) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy level 0: y [M, N] = A · W exactly (float64), and the float32 rounding bound per output."""
    w = weights(data, kind)
    a64 = np.asarray(a, np.float64)
    return a64 @ w.T, (w.shape[1] + 3) * UNIT * (np.abs(a64) @ np.abs(w).T)
