"""Rotary position embedding (RoPE) in numpy, rotate-half order: the rotation the graphs apply to queries and keys."""

from __future__ import annotations

import numpy as np


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x [heads, S, head_dim] with frequencies ``inv_freq`` [head_dim / 2]
    (``ModelSpec.rope_inv_freq``: a layer's own base and scaling)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(np.float64) * np.asarray(inv_freq, np.float64)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
