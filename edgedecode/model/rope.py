"""Rotary position embedding (RoPE) in numpy, rotate-half order: the rotation the graphs apply to queries and keys."""

from __future__ import annotations

import numpy as np


def apply_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on x [heads, S, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(0, x.shape[-1], 2, dtype=np.float64) / x.shape[-1])
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
