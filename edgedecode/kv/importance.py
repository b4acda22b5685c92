"""Token importance for tier assignment: attention from an observation window (SnapKV-style), or a
position-only prior for comparison.

The prefill side runs the prompt's last w tokens as their own pass with query outputs
(``prefill.pipeline.prefill_observed``) and scores every cached token by the softmax attention those queries
give it, summed over query heads and window queries, per layer. Sinks and the window itself are
pinned by the policy, not here.
"""

from __future__ import annotations

import numpy as np

from edgedecode.model.rope import apply_rope
from edgedecode.model.spec import ModelSpec

OBSERVATION_WINDOW = 32


def attention_importance(
    spec: ModelSpec, queries: np.ndarray, query_positions: np.ndarray, keys: np.ndarray, key_positions: np.ndarray
) -> np.ndarray:
    """Attention mass [layers, n] that each cached token receives from the observation queries.

    queries: pre-RoPE [layers, w, heads*head_dim] at ``query_positions`` [w]; keys: post-RoPE
    [layers, kv_heads, n, head_dim] at ``key_positions`` [n]. A query attends only to keys at or
    before its own position, exactly as in the forward pass.
    """
    n_layers, w, _ = queries.shape
    group = spec.n_heads // spec.n_kv_heads
    hidden = key_positions[None, :] > query_positions[:, None]  # [w, n]
    scores = np.empty((n_layers, keys.shape[2]), np.float32)
    for layer in range(n_layers):
        q = queries[layer].astype(np.float32).reshape(w, spec.n_heads, spec.head_dim).transpose(1, 0, 2)
        q = apply_rope(q, query_positions, spec.rope_inv_freq(layer)).reshape(spec.n_kv_heads, group * w, spec.head_dim)
        logits = q @ keys[layer].astype(np.float32).transpose(0, 2, 1) * spec.attention_scale  # [kvh, g*w, n]
        logits = logits.reshape(spec.n_kv_heads, group, w, -1)
        logits[..., hidden] = -np.inf
        logits -= logits.max(axis=-1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= logits.sum(axis=-1, keepdims=True)
        scores[layer] = logits.sum(axis=(0, 1, 2))
    return scores


def position_importance(positions: np.ndarray, *, sinks: int = 4, half_life: float | None = None) -> np.ndarray:
    """A position-only prior [n]: attention sinks first, then recency with exponential decay.

    The half-life defaults to a quarter of the span, so the oldest non-sink tokens score lowest.
    """
    span = max(int(positions[-1]) + 1, 1) if len(positions) else 1
    age = (span - 1 - positions).astype(np.float64)
    decay = np.exp2(-age / (half_life or max(span / 4, 1.0)))
    return np.where(positions < sinks, 2.0, decay).astype(np.float32)


def relative_importance(scores: np.ndarray) -> np.ndarray:
    """float32 [n]: ``scores`` scaled to mean 1, as a payload carries them (EDKV ``importance``): a
    token at 2 drew twice the average token's attention, whatever the prompt's length or the model."""
    scores = np.asarray(scores, np.float32)
    mean = float(scores.mean()) if len(scores) else 0.0
    return scores / mean if mean > 0 else np.ones_like(scores)


def drop_ranking(given: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float32 [n]: what the memory ladder ranks a stored conversation's tokens by (higher is kept
    longer): the importance that came with their KV (``relative_importance``: attention from the
    prefill side), where any did; tokens without one (computed or generated on this box) rank as
    an average token (1). A conversation with none at all ranks by ``position_importance``.

    Measured (tools/study/drop_quality.py, docs/memory.md): dropping a quarter of a 512-token context by
    attention costs about half the KL of dropping by position, and avoids its worst cases."""
    given = np.asarray(given, np.float32)
    known = ~np.isnan(given)
    if not known.any():
        return position_importance(positions)
    return np.where(known, given, np.float32(1.0))
