"""GGUF tensors adapted once, at load time, into the two forms the graphs consume.

* ``BlockQuantized``: a weight as ``W[n, k] = scale[n, b] * (code[n, k] - 2**(bits-1)) + offset[n, b]``
  with ``b = k // block_size`` (the last block may be short). Codes minus the implicit zero point
  is exactly what onnxruntime's MatMulNBits computes on its fast path (no zero-point input);
  ``offset`` is the per-block correction that makes the asymmetric types exact
  (``d*q + m = d*(q - 8) + (m + 8d)`` for Q4_1; Q5_1, Q4_K, Q5_K alike) and any asymmetric
  re-quantization (``requant.py``), None where it is zero (Q4_0, Q5_0, Q8_0, Q6_K). Every GGUF
  quantized type maps exactly (``tensor_types.py`` unpacks them): 4-bit types to 4-bit codes,
  5-, 6- and 8-bit types to 8-bit codes (MatMulNBits has no 5- or 6-bit form).
* ``GGUFMatrix``: a quantized weight exactly as the GGUF stores it, its rows' blocks untouched, for
  edgedecode's own ``MatMulGGUF`` / ``GatherGGUF`` ops (``edgedecode/kernels``), which read the blocks
  as they are: no 8-bit widening of 5- and 6-bit types, no float32 scales, no correction.
* dense float32 ``[N, K]`` arrays for the higher-precision prefill graph and the numpy reference.

GGUF stores llama's Q and K projection rows permuted for llama.cpp's interleaved RoPE; both forms
undo that here, so every graph uses HF (rotate-half) order and the KV layout is the same everywhere.
(qwen2, qwen3 and gemma3 use llama.cpp's "neox" RoPE, whose rows are already in that order.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize, quantize

from edgedecode.model.gguf_file import ModelFileError, tensor_table
from edgedecode.model.spec import ModelSpec
from edgedecode.model.tensor_types import (
    BLOCK_TYPES,
    SUPPORTED_TENSOR_TYPES,
    Unpacked,
    check_tensor_types,
    unpack,
)

BLOCK = 32  # the block size float weights are quantized into (GGUF's own Q4_0, Q4_1 and Q8_0 size)


def n_blocks(k: int, block_size: int) -> int:
    """Blocks per row of K elements (the last one may be short, as MatMulNBits allows)."""
    return -(-k // block_size)


@dataclass(frozen=True)
class BlockQuantized:
    """A [N, K] weight in MatMulNBits' blockwise form (see module docstring)."""

    codes: np.ndarray  # uint8 [N, K], values in [0, 2**bits)
    scales: np.ndarray  # float32 [N, n_blocks(K, block_size)]
    offsets: np.ndarray | None  # float32 [N, n_blocks(K, block_size)]
    bits: int
    block_size: int = BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def _blocks(self) -> np.ndarray:
        """uint8 codes [N, blocks, block_size]; a short last block is padded with the zero-point code."""
        n, k = self.codes.shape
        width = n_blocks(k, self.block_size) * self.block_size
        codes = self.codes
        if width != k:
            codes = np.pad(codes, ((0, 0), (0, width - k)), constant_values=1 << (self.bits - 1))
        return codes.reshape(n, -1, self.block_size)

    def dequantize(self) -> np.ndarray:
        """The float32 [N, K] weight this block form represents."""
        n, k = self.codes.shape
        w = (self._blocks().astype(np.float32) - (1 << (self.bits - 1))) * self.scales[..., None]
        if self.offsets is not None:
            w += self.offsets[..., None]
        return w.reshape(n, -1)[:, :k]

    def packed(self) -> np.ndarray:
        """uint8 [N, blocks, block_size*bits/8] in MatMulNBits order: 8/bits consecutive codes a byte, first lowest."""
        blocks = self._blocks()
        per_byte = 8 // self.bits
        packed = np.zeros(blocks.shape[:-1] + (blocks.shape[-1] // per_byte,), np.uint8)
        for i in range(per_byte):
            packed |= blocks[..., i::per_byte] << (i * self.bits)
        return packed

    def zero_point_form(self) -> tuple[BlockQuantized, np.ndarray]:
        """This weight as ``scale·(code − zero_point)`` per block: MatMulNBits with a float zero point.

        Returns the codes and scales to use (``offsets`` None) and the zero points, float64
        ``[N, blocks]``: ``2**(bits-1) − offset / scale`` (``−m/d`` for Q4_1). A block of scale 0
        holds the constant ``offset``; it becomes codes 0, scale ``offset`` and zero point −1,
        which reproduces it exactly. Exact in real arithmetic; a graph stores the zero points
        rounded to its dtype.
        """
        if self.offsets is None:
            raise ValueError("a weight without offsets needs no zero points")
        scales = self.scales.astype(np.float64)
        offsets = self.offsets.astype(np.float64)
        constant = scales == 0
        safe = np.where(constant, 1.0, scales)
        zero_points = np.where(constant, -1.0, float(1 << (self.bits - 1)) - offsets / safe)
        codes = self.codes
        if constant.any():
            per_element = np.repeat(constant, self.block_size, axis=1)[:, : codes.shape[1]]
            codes = np.where(per_element, 0, codes).astype(np.uint8)
        new_scales = np.where(constant, offsets, scales).astype(np.float32)
        return BlockQuantized(codes, new_scales, None, self.bits, self.block_size), zero_points

    def with_rows(self, order: np.ndarray) -> BlockQuantized:
        """The same weight with its output rows reordered."""
        offsets = None if self.offsets is None else self.offsets[order]
        return BlockQuantized(self.codes[order], self.scales[order], offsets, self.bits, self.block_size)


@dataclass(frozen=True)
class GGUFMatrix:
    """A quantized [N, K] weight as the GGUF stores it: row n is output feature n, blocks of ``kind`` along K."""

    rows: np.ndarray  # uint8 [N, row_bytes], the file's bytes (rows may be reordered or stacked, blocks never)
    kind: QType

    @property
    def shape(self) -> tuple[int, int]:
        elements, block_bytes = GGML_QUANT_SIZES[self.kind]
        return self.rows.shape[0], self.rows.shape[1] // block_bytes * elements

    def dequantize(self) -> np.ndarray:
        """The float32 [N, K] weight these blocks hold."""
        return _graph_form(unpack(self.rows, self.kind)).dequantize()

    def with_rows(self, order: np.ndarray) -> GGUFMatrix:
        """The same weight with its output rows reordered."""
        return GGUFMatrix(self.rows[order], self.kind)


def dense_weight(weight: BlockQuantized | GGUFMatrix | np.ndarray) -> np.ndarray:
    """The float32 [N, K] values of a weight in any form."""
    if isinstance(weight, BlockQuantized | GGUFMatrix):
        return weight.dequantize()
    return np.asarray(weight, np.float32)


def concat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Stack weights of equal bit width and block size along N (fused QKV, fused gate+up)."""
    if len({(p.bits, p.block_size) for p in parts}) != 1:
        raise ValueError("cannot fuse weights of different bit widths or block sizes")
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    first = parts[0]
    return BlockQuantized(
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        offsets,
        first.bits,
        first.block_size,
    )


def stack_rows(parts: list[Weight]) -> Weight:
    """Weights of one form (quantized: one GGUF type, or one bit width and block size) stacked along N."""
    if len(parts) == 1:
        return parts[0]
    matrices = [p for p in parts if isinstance(p, GGUFMatrix)]
    blocks = [p for p in parts if isinstance(p, BlockQuantized)]
    if matrices:
        if len(matrices) != len(parts) or len({m.kind for m in matrices}) != 1:
            raise ValueError("cannot fuse GGUF matrices of different types, or with weights of another form")
        return GGUFMatrix(np.concatenate([m.rows for m in matrices]), matrices[0].kind)
    if blocks:
        if len(blocks) != len(parts):
            raise ValueError("cannot fuse block-quantized weights with dense ones")
        return concat_rows(blocks)
    return np.concatenate([np.asarray(p) for p in parts])


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns GGUF's interleaved-RoPE Q/K rows back into HF (rotate-half) order."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(n_rows)


def quantize_asymmetric(w: np.ndarray, bits: int, block_size: int = BLOCK) -> BlockQuantized:
    """Asymmetric min/max quantization of a float [N, K] weight into ``bits``-wide blocks.

    Each block maps [min, max] onto codes 0 .. 2**bits - 1, so every element is within half a step
    (``scale / 2``) of its original. A short last block takes its min/max over the elements it has.
    """
    n, k = w.shape
    width = n_blocks(k, block_size) * block_size
    # edge padding repeats real elements, so a short block's min/max are its own
    blocks = np.pad(np.asarray(w, np.float32), ((0, 0), (0, width - k)), mode="edge").reshape(n, -1, block_size)
    lo, hi = blocks.min(-1), blocks.max(-1)
    top = (1 << bits) - 1
    scale = np.where(hi > lo, (hi - lo) / float(top), 1.0).astype(np.float32)
    codes = np.clip(np.rint((blocks - lo[..., None]) / scale[..., None]), 0, top).astype(np.uint8)
    offsets = (lo + float(1 << (bits - 1)) * scale).astype(np.float32)
    return BlockQuantized(np.ascontiguousarray(codes.reshape(n, width)[:, :k]), scale, offsets, bits, block_size)


def _quantize_8bit_symmetric(w: np.ndarray) -> BlockQuantized:
    """Q8_0-style symmetric 8-bit blocks (float embedding tables, for the decode graph)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale = (np.abs(blocks).max(-1) / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    codes = (np.clip(np.rint(blocks / safe[..., None]), -127, 127) + 128).astype(np.uint8)
    return BlockQuantized(codes.reshape(n, k), scale, None, 8)


def _graph_form(matrix: Unpacked) -> BlockQuantized:
    """An unpacked GGUF matrix in the graphs' form, exactly: 4-bit codes stay 4-bit, 5- to 8-bit ones become 8-bit.

    Codes move up by ``2**(B−1) − 2**(b−1)`` (b the type's bits, B the graph's), so that
    ``code − 2**(B−1) = q − 2**(b−1)``: Q6_K's ``q − 32`` becomes MatMulNBits' implicit 8-bit zero
    point. A bias folds into ``offset = bias + 2**(b−1)·scale`` (Q4_1's ``m + 8d``), rounded once to
    float32; the symmetric types need none.
    """
    bits = 4 if matrix.bits <= 4 else 8
    shift = (1 << (bits - 1)) - (1 << (matrix.bits - 1))
    offsets = None
    if matrix.biases is not None:
        half = float(1 << (matrix.bits - 1))
        offsets = (matrix.biases.astype(np.float64) + half * matrix.scales).astype(np.float32)
    codes = (matrix.codes + np.uint8(shift)).astype(np.uint8)
    return BlockQuantized(codes, matrix.scales, offsets, bits, matrix.block_size)


def load_block_quantized(tensor: ReaderTensor) -> BlockQuantized:
    """Convert a GGUF matrix to block form: exactly for every quantized type, by 4-bit quantization for floats."""
    kind = QType(tensor.tensor_type)
    if kind in BLOCK_TYPES:
        return _graph_form(unpack(tensor.data, kind))
    return quantize_asymmetric(load_dense(tensor), 4)


def load_quantized(
    tensor: ReaderTensor, as_stored: bool, float_type: QType = QType.Q4_1
) -> BlockQuantized | GGUFMatrix:
    """A GGUF matrix in block form, or (``as_stored``) as GGUF blocks: its own where it is quantized, and
    ``float_type``'s (gguf's own quantizer, llama.cpp's rule) where it is float and its rows are whole blocks."""
    kind = QType(tensor.tensor_type)
    if as_stored and kind in BLOCK_TYPES:
        return GGUFMatrix(np.asarray(tensor.data, np.uint8).reshape(int(tensor.shape[-1]), -1), kind)
    if as_stored and int(tensor.shape[0]) % GGML_QUANT_SIZES[float_type][0] == 0:
        return GGUFMatrix(quantize(load_dense(tensor), float_type), float_type)
    return load_block_quantized(tensor)


def load_dense(tensor: ReaderTensor) -> np.ndarray:
    """Dequantize a GGUF tensor to float32 [N, K] (or [K] for vectors)."""
    kind = QType(tensor.tensor_type)
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ModelFileError(f"tensor {tensor.name!r} has unsupported type {kind.name}")
    return np.asarray(dequantize(tensor.data, kind), dtype=np.float32)


Weight: TypeAlias = BlockQuantized | GGUFMatrix | np.ndarray  # a matrix in any of the three forms


@dataclass(frozen=True)
class LayerTensors:
    """One transformer block's tensors; matrices are [N, K] with Q/K rows in HF order."""

    attn_norm: np.ndarray
    qkv: list[Weight]  # [q, k, v]
    o: Weight
    ffn_norm: np.ndarray
    gate_up: list[Weight]  # [gate, up]
    down: Weight
    qkv_bias: np.ndarray | None = None  # [q | k | v] biases, concatenated like the fused QKV's output
    q_norm: np.ndarray | None = None  # per-head RMSNorm gammas [head_dim], applied before RoPE
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # RMSNorm of the attention output before its residual add
    post_ffn_norm: np.ndarray | None = None  # RMSNorm of the MLP output before its residual add


@dataclass(frozen=True)
class ModelTensors:
    """All weights of a model in one form (block-quantized or dense)."""

    embedding: Weight  # BlockQuantized (its GGUF type's form; 8-bit for float tables) or dense [V, hidden]
    layers: list[LayerTensors]
    output_norm: np.ndarray
    lm_head: Weight | None  # None when tied to the embedding


def load_tensors(
    reader: GGUFReader,
    spec: ModelSpec,
    dense: bool,
    advance: Callable[[int], None] | None = None,
    *,
    as_stored: bool = False,
) -> ModelTensors:
    """Load every weight of the model, dense float32 or block-quantized; the architecture's traits
    (``spec.traits``) say which optional tensors (biases, QK and post norms) each layer must have.

    ``as_stored`` (block-quantized only) keeps each quantized matrix and table as the file's blocks
    (``GGUFMatrix``), and quantizes float ones into GGUF blocks as the block form would: layer matrices
    to 4 bits (Q4_1), tables to 8 (Q8_0).
    ``advance(1)`` is called as each layer is loaded (after the embedding and the LM head, first).
    """
    check_tensor_types(reader)
    table = tensor_table(reader)
    traits = spec.traits

    def get(name: str) -> ReaderTensor:
        if name not in table:
            raise ModelFileError(f"GGUF lacks tensor {name!r} (architecture {spec.architecture})")
        return table[name]

    def rows(name: str, heads: int | None) -> np.ndarray | None:
        """The order that un-permutes llama's Q/K rows; None where the file's order is already HF's."""
        return unpermute_rows(int(get(name).shape[-1]), heads) if heads and traits.qk_rows_permuted else None

    def matrix(name: str, heads: int | None = None) -> Weight:
        tensor, order = get(name), rows(name, heads)
        if dense:
            weight = load_dense(tensor)
            return weight if order is None else weight[order]
        blocks = load_quantized(tensor, as_stored)
        return blocks if order is None else blocks.with_rows(order)

    def vector(name: str, heads: int | None = None) -> np.ndarray:
        values, order = load_dense(get(name)).reshape(-1), rows(name, heads)
        return values if order is None else values[order]

    def embedding_table(name: str) -> Weight:
        tensor = get(name)
        if dense:
            return load_dense(tensor)
        if QType(tensor.tensor_type) in BLOCK_TYPES or as_stored:
            return load_quantized(tensor, as_stored, float_type=QType.Q8_0)  # float tables: 8-bit, as below
        return _quantize_8bit_symmetric(load_dense(tensor))

    def optional(name: str, present: bool) -> np.ndarray | None:
        return vector(name) if present else None

    embedding = embedding_table("token_embd.weight")
    lm_head = None if spec.tied_embeddings else embedding_table("output.weight")
    layers = []
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        heads = {"q": spec.n_heads, "k": spec.n_kv_heads, "v": None}
        layers.append(
            LayerTensors(
                attn_norm=vector(p + "attn_norm.weight"),
                qkv=[matrix(f"{p}attn_{x}.weight", n) for x, n in heads.items()],
                o=matrix(p + "attn_output.weight"),
                ffn_norm=vector(p + "ffn_norm.weight"),
                gate_up=[matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight")],
                down=matrix(p + "ffn_down.weight"),
                qkv_bias=(
                    np.concatenate([vector(f"{p}attn_{x}.bias", n) for x, n in heads.items()])
                    if traits.qkv_bias
                    else None
                ),
                q_norm=optional(p + "attn_q_norm.weight", traits.qk_norm),
                k_norm=optional(p + "attn_k_norm.weight", traits.qk_norm),
                post_attn_norm=optional(p + "post_attention_norm.weight", traits.post_norms),
                post_ffn_norm=optional(p + "post_ffw_norm.weight", traits.post_norms),
            )
        )
        if advance is not None:
            advance(1)
    return ModelTensors(embedding=embedding, layers=layers, output_norm=vector("output_norm.weight"), lm_head=lm_head)
