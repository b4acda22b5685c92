"""Synthetic GGUFs for the tests, in every tensor type the builder reads, written with the gguf package.

``gguf.quants.quantize`` writes the 32-element block types and BF16; the K-quants (Q4_K, Q5_K,
Q6_K) it only reads, so ``encode`` packs those itself with a plain min/max quantizer per sub-block
(not llama.cpp's search, which only changes which codes are chosen, not how they are stored). Its
bytes are held to gguf's own ``dequantize`` in test_tensor_types.py.

``write_tiny_llama`` writes a small model with chosen types, of any supported architecture (llama,
llama with llama3 RoPE factors, qwen2, qwen3, gemma3: ``ARCH_EXTRAS``); ``requantized_copy`` rewrites a
real GGUF's matrices into other types, keeping its metadata; ``llama_cpp_mix`` picks types the way
llama.cpp's quantizer does for its Q4_K_M / Q5_K_M / Q6_K / Q8_0 / BF16 presets (simplified).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
# llama.cpp's fallback for a K-quant tensor whose rows are not whole 256-element super-blocks
K_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}


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


@dataclass(frozen=True)
class TinyLlama:
    """Dimensions of a synthetic llama model (hidden and ffn multiples of 256 so every type fits)."""

    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 96
    layers: int = 2
    key_length: int | None = None  # head_dim where it is not hidden / heads (written as attention.key_length)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads

    def matrix_shapes(self) -> dict[str, tuple[int, int]]:
        """Each layer matrix's [N, K] by its GGUF name inside ``blk.{i}.``."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "attn_q": (q, self.hidden),
            "attn_k": (kv, self.hidden),
            "attn_v": (kv, self.hidden),
            "attn_output": (self.hidden, q),
            "ffn_gate": (self.ffn, self.hidden),
            "ffn_up": (self.ffn, self.hidden),
            "ffn_down": (self.hidden, self.ffn),
        }


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class ArchExtras:
    """What a synthetic file of one architecture adds to the plain llama one."""

    gguf_arch: str
    rope_freq_base: float = 10000.0
    rope_freqs: bool = False  # llama3: a rope_freqs.weight tensor of per-frequency factors
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    sliding_window: int | None = None


ARCH_EXTRAS = {
    "llama": ArchExtras("llama"),
    "llama3": ArchExtras("llama", 500000.0, rope_freqs=True),
    "qwen2": ArchExtras("qwen2", 1e6, qkv_bias=True),
    "qwen3": ArchExtras("qwen3", 1e6, qk_norm=True),
    "gemma3": ArchExtras("gemma3", 1e6, qk_norm=True, post_norms=True, sliding_window=5),
}


def write_tiny_llama(
    path: Path,
    types: dict[str, QType],
    dims: TinyLlama = TinyLlama(),
    seed: int = 0,
    tied: bool = False,
    arch: str = "llama",
) -> Path:
    """A tiny GGUF of architecture ``arch`` (an ARCH_EXTRAS key): ``types`` maps "token_embd", "output" and
    the layer matrix names to tensor types.

    Weights are random (rows scaled by 1/sqrt(K)); norms, biases and RoPE factors are F32; ``tied``
    leaves out output.weight.
    """
    extras = ARCH_EXTRAS[arch]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), extras.gguf_arch)
    writer.add_block_count(dims.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    if dims.key_length:
        writer.add_key_length(dims.key_length)
        writer.add_value_length(dims.key_length)
    writer.add_rope_freq_base(extras.rope_freq_base)
    if extras.sliding_window:
        writer.add_sliding_window(extras.sliding_window)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([f"t{i}" for i in range(dims.vocab)])
    writer.add_token_types([1] * dims.vocab)
    writer.add_token_merges([])
    writer.add_eos_token_id(dims.vocab - 1)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int = dims.hidden) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    add_matrix(writer, "token_embd.weight", matrix(dims.vocab, dims.hidden), types["token_embd"])
    if not tied:
        add_matrix(writer, "output.weight", matrix(dims.vocab, dims.hidden), types["output"])
    writer.add_tensor("output_norm.weight", norm())
    if extras.rope_freqs:  # llama3's shape: low frequencies slowed down (factor 8), high ones kept
        writer.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, dims.head_dim // 2).astype(np.float32))
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if extras.post_norms else [])
    shapes = dims.matrix_shapes()
    for layer in range(dims.layers):
        for name in norms:
            writer.add_tensor(f"blk.{layer}.{name}.weight", norm())
        if extras.qk_norm:
            for name in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{name}.weight", norm(dims.head_dim))
        if extras.qkv_bias:
            for name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{layer}.{name}.bias", rng.standard_normal(shapes[name][0]).astype(np.float32))
        for name, shape in shapes.items():
            add_matrix(writer, f"blk.{layer}.{name}.weight", matrix(*shape), types[name])
    _finish(writer)
    return path


TypeChoice = Callable[[str, int], QType | None]  # (tensor name, row length K) -> new type; None keeps it


def requantized_copy(reader: GGUFReader, path: Path, choose: TypeChoice) -> Path:
    """Write ``reader``'s model to ``path`` with each matrix dequantized and re-encoded in the type ``choose`` gives.

    Metadata is copied field by field; vectors (norms) and matrices ``choose`` returns None for keep their bytes.
    """
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        current = QType(tensor.tensor_type)
        shape = [int(n) for n in tensor.shape]
        target = choose(tensor.name, shape[0]) if len(shape) == 2 else None
        if target is None or target == current:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=current)
        else:
            dense = np.asarray(dequantize(tensor.data, current), np.float32).reshape(shape[1], shape[0])
            add_matrix(writer, tensor.name, dense, target)
    _finish(writer)
    return path


def _gets_q6_k(name: str, n_layers: int) -> bool:
    """Q4_K_M / Q5_K_M: the output head, and attn_v and ffn_down on llama.cpp's use_more_bits layers
    (the first and last eighth of the layers and every third in between)."""
    if name == "output.weight":
        return True
    if not name.endswith(("attn_v.weight", "ffn_down.weight")):
        return False
    layer = int(name.split(".")[1])
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def llama_cpp_mix(preset: str, n_layers: int, overrides: dict[str, QType] | None = None) -> TypeChoice:
    """Tensor types as llama.cpp's quantizer picks them for a preset (its main rules, not every special case).

    Q4_K_M / Q5_K_M: Q4_K / Q5_K matrices, Q6_K for the output head and for attn_v and ffn_down on
    the use_more_bits layers. Q6_K, Q8_0, BF16: every matrix in that type. ``overrides`` maps a
    regular expression to the type of the tensors whose names it matches, as llama-quantize's
    ``--tensor-type`` and ``--token-embedding-type`` do. Last, a K-quant tensor whose rows are not
    whole 256-element super-blocks falls back to Q5_0 / Q5_1 / Q8_0.
    """
    base = {"Q4_K_M": QType.Q4_K, "Q5_K_M": QType.Q5_K}.get(preset) or QType[preset]
    patterns = [(re.compile(pattern), kind) for pattern, kind in (overrides or {}).items()]

    def choose(name: str, k: int) -> QType:
        kind = QType.Q6_K if preset in ("Q4_K_M", "Q5_K_M") and _gets_q6_k(name, n_layers) else base
        kind = next((override for pattern, override in patterns if pattern.search(name)), kind)
        if kind in K_FALLBACK and k % 256:
            kind = K_FALLBACK[kind]
        return kind

    return choose
