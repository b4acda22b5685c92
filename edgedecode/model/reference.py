"""A plain numpy fp32 forward pass of the decoder, every supported architecture: the oracle the graphs are tested
against.

It runs the same dequantized weights the graphs are built from and returns every position's logits
and the post-RoPE KV in the decoder's layout, so it can also stand in for a "remote" prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.model.rope import apply_rope
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import ModelTensors, dense_weight


@dataclass
class ReferenceOutput:
    logits: np.ndarray  # [S, vocab] float32
    keys: np.ndarray  # [layers, kv_heads, S, head_dim], post-RoPE, rotate-half order
    values: np.ndarray  # [layers, kv_heads, S, head_dim]
    queries: np.ndarray  # [layers, S, heads * head_dim], pre-RoPE, after any QK-norm (the graphs' queries.{i})


def _rms_norm(x: np.ndarray, gamma: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; x unchanged where the architecture has no such norm (gamma None)."""
    if gamma is None:
        return x
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def _activation(gate: np.ndarray, kind: str) -> np.ndarray:
    if kind == "gelu_tanh":
        return 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)))
    return gate / (1.0 + np.exp(-gate))


def _mask(n: int, window: int | None, blocked: np.ndarray | None) -> np.ndarray:
    """Additive [S, S] mask: causal, keys at most ``window - 1`` positions back, and ``blocked`` hidden."""
    offsets = np.arange(n)[:, None] - np.arange(n)[None, :]
    hidden = (offsets < 0) | (window is not None and offsets >= window) | (blocked if blocked is not None else False)
    return np.where(hidden, -np.inf, 0.0).astype(np.float32)


def _heads(x: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """[S, heads * head_dim] -> [heads, S, head_dim]."""
    return x.reshape(len(x), n_heads, head_dim).transpose(1, 0, 2)


def reference_forward(
    spec: ModelSpec, tensors: ModelTensors, token_ids: list[int], blocked: np.ndarray | None = None
) -> ReferenceOutput:
    """Run the whole prompt from position 0 with causal attention, in float32.

    ``blocked`` (bool [S, S]) additionally hides key j from query i where True: what a decoder that
    dropped some tokens' KV computes for the queries after the drop.
    """
    s, traits = spec, spec.traits
    n = len(token_ids)
    positions = np.arange(n)
    table = dense_weight(tensors.embedding)  # [vocab, hidden]; dequantized once, for a tied head too
    x = table[np.asarray(token_ids)]
    if traits.embedding_scale:
        x = x * np.float32(np.sqrt(s.hidden_size))
    keys = np.empty((s.n_layers, s.n_kv_heads, n, s.head_dim), np.float32)
    values = np.empty_like(keys)
    queries = np.empty((s.n_layers, n, s.n_heads * s.head_dim), np.float32)
    group = s.n_heads // s.n_kv_heads
    widths = np.cumsum([s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim])
    for i, layer in enumerate(tensors.layers):
        h = _rms_norm(x, layer.attn_norm, s.norm_eps)
        qkv = np.concatenate([h @ dense_weight(w).T for w in layer.qkv], axis=-1)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q, k, v = np.split(qkv, widths, axis=-1)
        q, k = _heads(q, s.n_heads, s.head_dim), _heads(k, s.n_kv_heads, s.head_dim)
        q, k = _rms_norm(q, layer.q_norm, s.norm_eps), _rms_norm(k, layer.k_norm, s.norm_eps)
        queries[i] = q.transpose(1, 0, 2).reshape(n, -1)
        inv_freq = s.rope_inv_freq(i)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        keys[i], values[i] = k, _heads(v, s.n_kv_heads, s.head_dim)
        k_rep, v_rep = np.repeat(k, group, axis=0), np.repeat(values[i], group, axis=0)
        window = s.sliding_window if s.is_sliding(i) else None
        scores = q @ k_rep.transpose(0, 2, 1) * s.attention_scale + _mask(n, window, blocked)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v_rep
        out = attn.transpose(1, 0, 2).reshape(n, -1) @ dense_weight(layer.o).T
        x = x + _rms_norm(out, layer.post_attn_norm, s.norm_eps)
        h = _rms_norm(x, layer.ffn_norm, s.norm_eps)
        gate, up = (h @ dense_weight(w).T for w in layer.gate_up)
        out = (_activation(gate, traits.activation) * up) @ dense_weight(layer.down).T
        x = x + _rms_norm(out, layer.post_ffn_norm, s.norm_eps)
    head = table if tensors.lm_head is None else dense_weight(tensors.lm_head)
    logits = _rms_norm(x, tensors.output_norm, s.norm_eps) @ head.T
    return ReferenceOutput(logits.astype(np.float32), keys, values, queries)
