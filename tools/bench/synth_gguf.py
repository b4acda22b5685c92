#!/usr/bin/env python3
"""A GGUF of a real model's shape with random weights, for speed and memory measurements only.

Decode and prefill speed depend on the tensors' shapes and types, never on their values, so a file
with the exact dimensions of a model people run measures what that model would cost, without the
model hub. Never report quality from these files: their weights are noise.

Shapes (dimensions as published in each model's config.json): ``smollm2-135m``, ``qwen2.5-0.5b``,
``llama3.2-1b``, ``llama3.2-3b``. All are written as the ``llama`` architecture (what both engines
run today): the Qwen shape keeps Qwen2.5's dimensions but not its QKV biases (3 small vectors a
layer), and the Llama 3.2 shapes leave out RoPE scaling, which changes no cost. With --type Q4_0 or
Q4_1 every projection matrix is that type and the token embedding, tied to the LM head as in all
four models, is Q8_0, as in SmolLM2's published Q4_1 file; Q4_K_M mixes types as llama.cpp's
quantizer does for that preset (Q4_K, Q6_K for attn_v and ffn_down on half the layers and for the
tied embedding, and the 32-element fallbacks Q5_0 / Q8_0 for rows that are not whole 256-element
super-blocks, as Qwen2.5-0.5B's 896-wide ones). The vocabulary is SmolLM2's tokenizer (from the
default model's GGUF), padded with unused tokens up to the shape's vocabulary size, so prompts
tokenize alike in both engines.

    python tools/bench/synth_gguf.py --shape llama3.2-1b --type Q4_0 --out llama1b-q4_0.gguf [--seed 0]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from edgedecode.model.quant_mix import K_MIXES, TypeChoice, llama_cpp_mix
from edgedecode.model.registry import resolve_model
from edgedecode.model.tensor_encode import add_matrix
from tools.common import cli


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
    # for the tests: rows of whole 256-element super-blocks, so Q4_K_M holds K-quants
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=49_160, rope_base=10_000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49_152, rope_base=100_000.0),
    "qwen2.5-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151_936, rope_base=1e6),
    "llama3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128_256, rope_base=500_000.0),
    "llama3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128_256, rope_base=500_000.0),
}
WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q4_K_M")
FILE_TYPES = {
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


def tensor_types(shape: Shape, weight_type: str) -> TypeChoice:
    """The type of each matrix: Q4_0 / Q4_1 layers with a Q8_0 embedding (as SmolLM2's published
    files), or llama.cpp's Q4_K_M mix for a model with a tied embedding (edgedecode.model.quant_mix)."""
    if weight_type in K_MIXES:
        return llama_cpp_mix(weight_type, shape.layers, tied_embedding=True)
    layers = QType[weight_type]
    return lambda name, k: QType.Q8_0 if name == "token_embd.weight" else layers


def matrix_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """Every matrix's [N, K] by tensor name, in file order."""
    kv = shape.kv_heads * shape.head_dim
    per_layer = {
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (kv, shape.hidden),
        "attn_v": (kv, shape.hidden),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_gate": (shape.ffn, shape.hidden),
        "ffn_up": (shape.ffn, shape.hidden),
        "ffn_down": (shape.hidden, shape.ffn),
    }
    shapes = {"token_embd.weight": (shape.vocab, shape.hidden)}
    for layer in range(shape.layers):
        shapes.update({f"blk.{layer}.{name}.weight": dims for name, dims in per_layer.items()})
    return shapes


def write_synthetic(path: Path, shape: Shape, weight_type: str, tokenizer_from: Path, seed: int = 0) -> None:
    """Write a GGUF of ``shape`` with random weights, its matrices typed per ``tensor_types``, and the
    tokenizer of the GGUF at ``tokenizer_from``, padded to the shape's vocabulary."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    _metadata(writer, shape, weight_type)
    _tokenizer(writer, gguf.GGUFReader(tokenizer_from), shape.vocab)
    choose = tensor_types(shape, weight_type)
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(shape.layers) for n in ("attn", "ffn")]
    for name in norms:
        writer.add_tensor(name, np.ones(shape.hidden, np.float32))
    for name, (rows, columns) in matrix_shapes(shape).items():
        weights = rng.standard_normal((rows, columns), np.float32) * np.float32(0.02)
        add_matrix(writer, name, weights, choose(name, columns))
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
    writer.add_file_type(FILE_TYPES[weight_type])
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


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", choices=WEIGHT_TYPES, default="Q4_0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_synthetic(args.out, SHAPES[args.shape], args.type, resolve_model(None).gguf_path, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / (1 << 20):.0f} MiB)")


if __name__ == "__main__":
    cli.run(main)
