"""Synthetic GGUFs for the tests, in every tensor type the builder reads, written with the gguf package.

``write_tiny_llama`` writes a small model with chosen types, of any supported architecture (llama,
llama with llama3 RoPE factors, qwen2, qwen3, gemma3: ``ARCH_EXTRAS``); ``requantized_copy`` rewrites a
real GGUF's matrices into other types, keeping its metadata. Both write matrices with
edgedecode.model.tensor_encode; edgedecode.model.quant_mix picks types as llama.cpp's presets do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.spec import ModelSpec
from edgedecode.model.tensor_encode import add_matrix

TypeChoice = Callable[[str, int], QType | None]  # (tensor name, row length K) -> new type; None keeps it


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


DIMS = TinyLlama()  # the mixes' dimensions
LAYERS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Models mixing the types, each with its embedding and head in a different form; q/k/v and gate/up
# mix types on purpose, so fused matmuls split into runs of one form.
MIXES = {
    "legacy": dict(
        zip(LAYERS, [QType.F16, QType.Q4_0, QType.Q8_0, QType.F32, QType.Q4_1, QType.Q4_1, QType.Q4_0]),
        token_embd=QType.F16,
        output=QType.Q4_0,
    ),
    "k-quants": dict(
        zip(LAYERS, [QType.Q4_K, QType.Q4_K, QType.Q6_K, QType.Q5_K, QType.Q4_K, QType.Q6_K, QType.Q4_K]),
        token_embd=QType.Q4_K,
        output=QType.Q6_K,
    ),
    "5-bit, tied Q6_K": dict(
        zip(LAYERS, [QType.Q5_0, QType.Q5_1, QType.Q5_1, QType.BF16, QType.Q5_K, QType.Q5_0, QType.Q8_0]),
        token_embd=QType.Q6_K,
    ),
    "tied 4-bit with offsets": dict(zip(LAYERS, [QType.Q4_K] * 7), token_embd=QType.Q4_1),
    "tied 8-bit with offsets": dict(zip(LAYERS, [QType.Q6_K] * 7), token_embd=QType.Q5_K),
}


def write_mixes(folder: Path) -> dict[str, tuple[GGUFReader, ModelSpec]]:
    """name -> (reader, spec) of each of MIXES written to a GGUF in ``folder``."""
    models = {}
    for i, (name, types) in enumerate(MIXES.items()):
        path = write_tiny_llama(folder / f"mix{i}.gguf", types, DIMS, seed=i, tied="output" not in types)
        reader = open_gguf(path)
        models[name] = reader, ModelSpec.from_gguf(reader, f"mix{i}")
    return models


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
