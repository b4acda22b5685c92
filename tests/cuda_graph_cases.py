"""The synthetic models the CUDA decode graph of the own ops is held to the numpy reference on: on the host
emulator in tests/test_graph_cuda.py, on the card in tests/test_gpu.py."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from synthetic_gguf import DIMS, MIXES, TinyLlama, write_tiny_llama

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.spec import ModelSpec

CUDA_OWN = GraphOptions.for_device("decode", "cuda", kernels="gguf")
# The logits of these models lie within ±5, where float16's step is 2^-8 to 2^-6: the graph rounds every node's
# output to float16, so a few steps of drift through the layers (measured 0.003-0.006 on the emulator); a weight,
# norm or residual read wrong moves them by a tenth or more (test_graph_cuda's guard: 2.0).
FLOAT16_LOGITS_ATOL = 0.03
PROMPT_TOKENS = 15  # one run (the M > 1 kernels), then single decode steps (M = 1) up to IDS_COUNT
IDS_COUNT = 19
# The other architectures (test_architectures' dimensions) in the Gemma 3 270M file's mix of types.
ARCH_TYPES = {
    "attn_q": QType.Q4_K, "attn_k": QType.Q5_0, "attn_v": QType.Q8_0, "attn_output": QType.Q5_0,
    "ffn_gate": QType.Q4_K, "ffn_up": QType.Q4_K, "ffn_down": QType.Q6_K, "token_embd": QType.Q8_0,
    "output": QType.Q6_K,
}  # fmt: skip
ARCHS = {  # arch -> (dimensions, tied)
    "qwen2": (TinyLlama(), False),
    "qwen3": (TinyLlama(key_length=128), True),
    "gemma3": (TinyLlama(key_length=128, kv_heads=1, layers=6), True),
}
CASES = [*MIXES, *ARCHS]


def write_cases(folder: Path) -> dict[str, tuple[Path, GGUFReader, ModelSpec]]:
    """name -> (path, reader, spec) of every case: the type mixes (synthetic_gguf.MIXES, llama), then one model of
    each other architecture."""
    out = {}
    for i, (name, types) in enumerate(MIXES.items()):
        out[name] = _written(folder / f"mix{i}.gguf", types, DIMS, i, "output" not in types, "llama")
    for i, (arch, (dims, tied)) in enumerate(ARCHS.items()):
        out[arch] = _written(folder / f"{arch}.gguf", ARCH_TYPES, dims, 20 + i, tied, arch)
    return out


def _written(path: Path, types, dims: TinyLlama, seed: int, tied: bool, arch: str):
    write_tiny_llama(path, types, dims, seed=seed, tied=tied, arch=arch)
    reader = open_gguf(path)
    return path, reader, ModelSpec.from_gguf(reader, path.stem)
