"""A plain numpy fp32 forward pass of the llama-family decoder: the oracle the graphs are tested against.

It runs the same dequantized weights the graphs are built from and returns every position's logits
and the post-RoPE KV in the decoder's layout, so it can also stand in for a "remote" prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.model.rope import apply_rope
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import BlockQuantized, ModelTensors


@dataclass
class ReferenceOutput:
    logits: np.ndarray  # [S, vocab] float32
    keys: np.ndarray  # [layers, kv_heads, S, head_dim], post-RoPE, rotate-half order
    values: np.ndarray  # [layers, kv_heads, S, head_dim]
    queries: np.ndarray  # [layers, S, heads * head_dim], pre-RoPE (what the graphs' queries.{i} output)


def _dense(weight) -> np.ndarray:
    return weight.dequantize() if isinstance(weight, BlockQuantized) else np.asarray(weight, np.float32)


def _rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def reference_forward(
    spec: ModelSpec, tensors: ModelTensors, token_ids: list[int], blocked: np.ndarray | None = None
) -> ReferenceOutput:
    """Run the whole prompt from position 0 with causal attention, in float32.

    ``blocked`` (bool [S, S]) additionally hides key j from query i where True: what a decoder that
    dropped some tokens' KV computes for the queries after the drop.
    """
    s = spec
    n = len(token_ids)
    positions = np.arange(n)
    x = _dense(tensors.embedding)[np.asarray(token_ids)]
    keys = np.empty((s.n_layers, s.n_kv_heads, n, s.head_dim), np.float32)
    values = np.empty_like(keys)
    queries = np.empty((s.n_layers, n, s.n_heads * s.head_dim), np.float32)
    causal = np.triu(np.full((n, n), -np.inf, np.float32), k=1)
    if blocked is not None:
        causal[blocked] = -np.inf
    group = s.n_heads // s.n_kv_heads
    for i, layer in enumerate(tensors.layers):
        h = _rms_norm(x, layer.attn_norm, s.norm_eps)
        q_w, k_w, v_w = (_dense(w) for w in layer.qkv)
        queries[i] = h @ q_w.T
        q = queries[i].reshape(n, s.n_heads, s.head_dim).transpose(1, 0, 2)
        k = (h @ k_w.T).reshape(n, s.n_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = (h @ v_w.T).reshape(n, s.n_kv_heads, s.head_dim).transpose(1, 0, 2)
        q, k = apply_rope(q, positions, s.rope_theta), apply_rope(k, positions, s.rope_theta)
        keys[i], values[i] = k, v
        k_rep, v_rep = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        scores = q @ k_rep.transpose(0, 2, 1) / np.sqrt(s.head_dim) + causal
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v_rep
        x = x + attn.transpose(1, 0, 2).reshape(n, -1) @ _dense(layer.o).T
        h = _rms_norm(x, layer.ffn_norm, s.norm_eps)
        gate, up = (h @ _dense(w).T for w in layer.gate_up)
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ _dense(layer.down).T
    head = _dense(tensors.embedding if tensors.lm_head is None else tensors.lm_head)
    logits = _rms_norm(x, tensors.output_norm, s.norm_eps) @ head.T
    return ReferenceOutput(logits.astype(np.float32), keys, values, queries)
