#!/usr/bin/env python3
"""A GGUF of a real model's shape with random weights, for speed and memory measurements only.

Decode and prefill speed depend on the tensors' shapes and types, never on their values, so a file
with the exact dimensions of a model people run measures what that model would cost, without the
model hub. Never report quality from these files: their weights are noise.

Shapes (dimensions as published in each model's config.json): ``smollm2-135m``, ``qwen2.5-0.5b``,
``llama3.2-1b``, ``llama3.2-3b``. All are written as the ``llama`` architecture (what both engines
run today): the Qwen shape keeps Qwen2.5's dimensions but not its QKV biases (3 small vectors a
layer), and the Llama 3.2 shapes leave out RoPE scaling, which changes no cost. Every projection
matrix is --type (Q4_0 or Q4_1); the token embedding, tied to the LM head as in all four models,
is Q8_0, as in SmolLM2's published Q4_1 file. The vocabulary is SmolLM2's tokenizer (from the
default model's GGUF), padded with unused tokens up to the shape's vocabulary size, so prompts
tokenize alike in both engines.

    python tools/synth_gguf.py --shape llama3.2-1b --type Q4_0 --out llama1b-q4_0.gguf [--seed 0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from edgedecode.model.registry import resolve_model


@dataclass(frozen=True)
class Shape:
    """The dimensions that decide a llama-architecture model's cost."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_base: float
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49_160, rope_base=10_000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49_152, rope_base=100_000.0),
    "qwen2.5-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151_936, rope_base=1e6),
    "llama3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128_256, rope_base=500_000.0),
    "llama3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128_256, rope_base=500_000.0),
}
WEIGHT_TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges", "tokenizer.chat_template")


def write_synthetic(path: Path, shape: Shape, weight_type: str, tokenizer_from: Path, seed: int = 0) -> None:
    """Write a GGUF of ``shape`` with random weights (``weight_type`` projections, Q8_0 embedding)
    and the tokenizer of the GGUF at ``tokenizer_from``, padded to the shape's vocabulary."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    _metadata(writer, shape, weight_type)
    _tokenizer(writer, gguf.GGUFReader(tokenizer_from), shape.vocab)
    qtype = WEIGHT_TYPES[weight_type]

    def matrix(name: str, rows: int, columns: int, kind: gguf.GGMLQuantizationType) -> None:
        weights = (rng.standard_normal((rows, columns), np.float32) * 0.02).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(weights, kind), raw_dtype=kind)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, np.float32))

    matrix("token_embd.weight", shape.vocab, shape.hidden, gguf.GGMLQuantizationType.Q8_0)
    norm("output_norm.weight", shape.hidden)
    kv = shape.kv_heads * shape.head_dim
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        norm(f"{block}.attn_norm.weight", shape.hidden)
        norm(f"{block}.ffn_norm.weight", shape.hidden)
        for name, rows, columns in (
            ("attn_q", shape.hidden, shape.hidden),
            ("attn_k", kv, shape.hidden),
            ("attn_v", kv, shape.hidden),
            ("attn_output", shape.hidden, shape.hidden),
            ("ffn_gate", shape.ffn, shape.hidden),
            ("ffn_up", shape.ffn, shape.hidden),
            ("ffn_down", shape.hidden, shape.ffn),
        ):
            matrix(f"{block}.{name}.weight", rows, columns, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _metadata(writer: gguf.GGUFWriter, shape: Shape, weight_type: str) -> None:
    writer.add_name(f"synthetic {weight_type} (random weights: speed and memory only)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if weight_type == "Q4_0" else gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader, vocab: int) -> None:
    """``source``'s tokenizer, its vocabulary padded with unused tokens to ``vocab`` entries."""
    tokens = [
        bytes(source.fields["tokenizer.ggml.tokens"].parts[i]) for i in source.fields["tokenizer.ggml.tokens"].data
    ]
    types = [
        int(source.fields["tokenizer.ggml.token_type"].parts[i][0])
        for i in source.fields["tokenizer.ggml.token_type"].data
    ]
    if vocab < len(tokens):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    padding = vocab - len(tokens)
    writer.add_token_list(tokens + [f"<|unused_{i}|>".encode() for i in range(padding)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * padding)
    fields = source.fields
    writer.add_tokenizer_model(_string(fields["tokenizer.ggml.model"]))
    writer.add_tokenizer_pre(_string(fields["tokenizer.ggml.pre"]))
    writer.add_token_merges(
        [bytes(fields["tokenizer.ggml.merges"].parts[i]) for i in fields["tokenizer.ggml.merges"].data]
    )
    writer.add_chat_template(_string(fields["tokenizer.chat_template"]))
    for key, add in (
        ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
        ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
    ):
        add(int(fields[key].parts[fields[key].data[0]][0]))
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def _string(field: gguf.ReaderField) -> str:
    return bytes(field.parts[field.data[0]]).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", choices=sorted(WEIGHT_TYPES), default="Q4_0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_synthetic(args.out, SHAPES[args.shape], args.type, resolve_model(None).gguf_path, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / (1 << 20):.0f} MiB)")


if __name__ == "__main__":
    main()
