"""The decode graph's layers on CUDA with edgedecode's own ops: four FusedMatMulGGUF nodes and attention a layer.

FusedMatMulGGUF (edgedecode/kernels, docs/cuda-kernels.md) runs an RMSNorm before a matmul, up to three matrices of
their own GGUF types, the gate's activation and the residual add after it, all in one kernel. The residual stream is
the fused nodes' own output (float16), so no norm or add node remains. A layer:

    qkv = FusedMatMulGGUF(r, Wq, Wk, Wv, γ_attn[, bias])      RMSNorm(r)·[Wq | Wk | Wv]ᵀ (+ bias)
    a   = GroupQueryAttention(qkv, ...)                       (per-head QK-norm nodes before it, where the model has it)
    r'  = FusedMatMulGGUF(a, Wo, residual=r)                  r + a·Woᵀ
    m   = FusedMatMulGGUF(r', Wgate, Wup, γ_ffn, activation)  act(RMSNorm(r')·Wgateᵀ) · RMSNorm(r')·Wupᵀ
    r'' = FusedMatMulGGUF(m, Wdown, residual=r')              r' + m·Wdownᵀ

The ends: r₀ is the embedding's GatherGGUF, and logits = FusedMatMulGGUF(r at logits_positions, table, γ_final), a
tied head reading the embedding's very initializer. The gated product needs gate and up in one type; a layer
that stores them in two (a K-quant mix may) takes the plain product of both, then Split, the activation and Mul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from edgedecode.model.onnx_builder import KERNEL_DOMAIN
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import GGUFMatrix, ModelTensors, Weight

if TYPE_CHECKING:  # graph.py imports this module
    from edgedecode.model.graph import _Emitter

# FusedMatMulGGUF's activation attribute for each gate activation of ArchitectureTraits (0: none).
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}
MAX_MATRICES = 3  # B0, B1, B2


def unfused_reason(spec: ModelSpec, tensors: ModelTensors) -> str:
    """Why the model's CUDA decode graph cannot take the fused form ("" where it can).

    FusedMatMulGGUF adds a float16 residual after the matmul and normalizes only its input, so an architecture
    whose residual stream outgrows float16 (kept in float32) or that normalizes a block's output before the
    residual add (post-norms; Gemma 3 has both) keeps MatMulGGUF with the stock norms and adds. So does a
    model with a matrix that is not in GGUF blocks (rows that are not whole blocks stay in MatMulNBits' form).
    """
    traits = spec.traits
    if not traits.float16_residual:
        return "its residual stream outgrows float16, and FusedMatMulGGUF adds the residual in float16"
    if traits.post_norms:
        return "it normalizes each block's output before the residual add, which FusedMatMulGGUF cannot"
    if traits.activation not in ACTIVATIONS:
        return f"FusedMatMulGGUF has no {traits.activation} activation"
    head = tensors.embedding if tensors.lm_head is None else tensors.lm_head
    matrices = [head, tensors.embedding] + [
        w for layer in tensors.layers for w in (*layer.qkv, layer.o, *layer.gate_up, layer.down)
    ]
    if not all(isinstance(w, GGUFMatrix) for w in matrices):
        return "a matrix is not in GGUF blocks (its rows are not whole blocks)"
    return ""


def fused_decoder_layers(
    e: _Emitter, tensors: ModelTensors, x: str, seqlens: str, total: str, advance: Callable[[int], None] | None
) -> None:
    """The layers after the embedding ``x`` (GatherGGUF's rows), the final norm and the LM head (``logits``), each
    linear layer one FusedMatMulGGUF (module docstring); ``advance(1)`` as each layer is emitted.
    ``unfused_reason`` must be "" for these tensors."""
    activation = ACTIVATIONS[e.spec.traits.activation]
    residual = x
    for i, layer in enumerate(tensors.layers):
        name = f"layers.{i}"
        qkv = fused_matmul(
            e, residual, [_rows(e, f"{name}.attn.{role}", w) for role, w in zip("qkv", layer.qkv)],
            f"{name}.attn.qkv", norm=(f"{name}.attn_norm", layer.attn_norm), bias=layer.qkv_bias,
        )  # fmt: skip
        attended = e.attend(qkv, i, layer, seqlens, total)
        o = [_rows(e, f"{name}.attn.o", layer.o)]
        residual = fused_matmul(e, attended, o, f"{name}.attn.o", residual=residual)
        gate, up = (_rows(e, f"{name}.mlp.{role}", w) for role, w in zip(("gate", "up"), layer.gate_up))
        ffn_norm = (f"{name}.ffn_norm", layer.ffn_norm)
        if gate[1].kind == up[1].kind:
            product = fused_matmul(e, residual, [gate, up], f"{name}.mlp.gate_up", norm=ffn_norm, activation=activation)
        else:  # the gated kernel reads one type: both products, then the stock gate
            product = e.gated(fused_matmul(e, residual, [gate, up], f"{name}.mlp.gate_up", norm=ffn_norm), i)
        down = [_rows(e, f"{name}.mlp.down", layer.down)]
        residual = fused_matmul(e, product, down, f"{name}.mlp.down", residual=residual)
        if advance is not None:
            advance(1)
    # Only the requested positions go through the final norm and the LM head.
    selected = e.g.op1("Gather", [residual, "logits_positions"], name="select.residual", axis=1)
    if tensors.lm_head is None and e.embed_rows is not None:  # tied: the embedding's own initializer
        head = (e.embed_rows, _matrix(tensors.embedding))
    else:
        head = _rows(e, "lm_head", tensors.embedding if tensors.lm_head is None else tensors.lm_head)
    fused_matmul(e, selected, [head], "lm_head", norm=("final_norm", tensors.output_norm), output="logits")


def _matrix(weight: Weight) -> GGUFMatrix:
    if not isinstance(weight, GGUFMatrix):
        raise TypeError(f"the fused form reads GGUF blocks only, not {type(weight).__name__} (see unfused_reason)")
    return weight


def _rows(e: _Emitter, name: str, weight: Weight) -> tuple[str, GGUFMatrix]:
    """A matrix's initializer ``{name}.rows`` (its GGUF rows) and the matrix."""
    matrix = _matrix(weight)
    return e.const(f"{name}.rows", matrix.rows), matrix


def fused_matmul(
    e: _Emitter,
    x: str,
    matrices: list[tuple[str, GGUFMatrix]],
    name: str,
    *,
    norm: tuple[str, np.ndarray] | None = None,
    residual: str | None = None,
    bias: np.ndarray | None = None,
    activation: int = 0,
    output: str | None = None,
) -> str:
    """One FusedMatMulGGUF node: ``x`` (RMSNorm'd first where ``norm`` = (name, γ) gives the initializer
    ``{name}.weight``) times each (initializer, matrix) of ``matrices``, concatenated or (``activation``) gated,
    plus ``bias`` and ``residual``; ``output`` names the result (else generated)."""
    if not 1 <= len(matrices) <= MAX_MATRICES:
        raise ValueError(f"FusedMatMulGGUF takes 1 to {MAX_MATRICES} matrices, not {len(matrices)}")
    k = matrices[0][1].shape[1]
    attrs: dict[str, int | float] = {"K": k, "epsilon": float(e.spec.norm_eps), "activation": activation}
    for s, (_, w) in enumerate(matrices):
        attrs[f"N{s}"], attrs[f"ggml_type{s}"] = w.shape[0], int(w.kind)
    attrs["N"] = matrices[0][1].shape[0] if activation else sum(w.shape[0] for _, w in matrices)
    inputs = [x, *(rows for rows, _ in matrices), *[""] * (MAX_MATRICES - len(matrices))]
    inputs += [
        "" if norm is None else e.weight(f"{norm[0]}.weight", norm[1]),
        residual or "",
        "" if bias is None else e.weight(f"{name}.bias", bias),
    ]
    while inputs[-1] == "":  # trailing optional inputs are left out
        inputs.pop()
    return e.g.op1(
        "FusedMatMulGGUF",
        inputs,
        name=name,
        domain=KERNEL_DOMAIN,
        outputs=None if output is None else [output],
        **attrs,
    )
