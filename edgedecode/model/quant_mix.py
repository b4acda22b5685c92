"""Which tensor type llama.cpp's quantizer gives each tensor of a llama-family model, per preset.

The main rules of ``llama_tensor_get_type`` in llama.cpp's src/llama-quant.cpp (not its special
cases for Falcon, mixtures of experts, 70B models or the IQ/Q2/Q3 presets):

* Q4_K_M / Q5_K_M: every matrix Q4_K / Q5_K, except ``attn_v`` and ``ffn_down`` on the
  ``use_more_bits`` layers (the first and last eighth and every third in between), which get Q6_K,
  and the output head, which gets Q6_K. A tied token embedding (no ``output.weight``) is the head,
  so it gets the head's type; an untied one keeps the preset's base type.
* Q6_K, Q8_0, BF16 (and the other single types): every matrix in that type.
* Last, a K-quant tensor whose rows are not whole 256-element super-blocks falls back to the
  32-element type of at least its bits (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0); the head, whose
  rows do not split into super-blocks, gets Q8_0 outright.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gguf import GGMLQuantizationType as QType

K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
K_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}
K_MIXES = {"Q4_K_M": QType.Q4_K, "Q5_K_M": QType.Q5_K}  # the presets whose types vary by tensor
SUPER_BLOCK = 256

TypeChoice = Callable[[str, int], QType]  # (tensor name, row length K) -> its type


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that get more bits: the first and last eighth, and every third in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _is_head(name: str, tied_embedding: bool) -> bool:
    return name == "output.weight" or (tied_embedding and name == "token_embd.weight")


def _mix_type(base: QType, name: str, k: int, n_layers: int, tied_embedding: bool) -> QType:
    """A K-mix preset's type for one tensor, before the super-block fallback."""
    if _is_head(name, tied_embedding):
        return QType.Q6_K if k % SUPER_BLOCK == 0 else QType.Q8_0
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), n_layers):
        return QType.Q6_K
    return base


def llama_cpp_mix(
    preset: str, n_layers: int, overrides: dict[str, QType] | None = None, *, tied_embedding: bool = False
) -> TypeChoice:
    """Tensor types as llama.cpp's quantizer picks them for ``preset`` (see the module docstring).

    ``overrides`` maps a regular expression to the type of the tensors whose names it matches, as
    llama-quantize's ``--tensor-type`` and ``--token-embedding-type`` do; ``tied_embedding``: the
    model has no ``output.weight``, so ``token_embd.weight`` is quantized as the head.
    """
    base = K_MIXES.get(preset) or QType[preset]
    patterns = [(re.compile(pattern), kind) for pattern, kind in (overrides or {}).items()]

    def choose(name: str, k: int) -> QType:
        kind = _mix_type(base, name, k, n_layers, tied_embedding) if preset in K_MIXES else base
        kind = next((override for pattern, override in patterns if pattern.search(name)), kind)
        if kind in K_FALLBACK and k % SUPER_BLOCK:
            kind = K_FALLBACK[kind]
        return kind

    return choose
