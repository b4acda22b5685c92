"""Orthogonal rotations of K and V head vectors before quantization (EDKV 1.3 ``rotation``), undone at ingest.

``hadamard`` with block B: each head vector x (head_dim D, a multiple of B) of layer l, part p (keys, values) and
KV head h is sent as ``(x ⊙ s) · H`` and rebuilt as ``(x̂ · H) ⊙ s``, where H is block-diagonal: the Walsh–Hadamard
matrix of order B (Sylvester order, a power of two) over √B on each run of B channels — symmetric and its own
inverse — and ``s = signs[l, p, h]`` are ±1 drawn from the header's seed (`hadamard_signs`). The rotation spreads
a few outlier channels over their block, so a low-bit quantizer's groups see a narrower range; the quantization
error, rotated back, is spread the same way.

H is applied as float32 GEMMs over a section's rows of B values (numpy's BLAS): on one core several times faster
than the log2(B) butterfly passes of a fast Walsh–Hadamard transform written in numpy, whose early passes stride
over pairs of adjacent channels. A GEMM's cost grows with B, so B is a parameter (32 by default: on SmolLM2 it
measured as good as the whole head of 64, at half the cost; docs/kv-format.md §4a). The rows go in stacked
batches small enough (M·N·K ≤ 2^18) that OpenBLAS runs each on the calling thread: left to itself it splits a
large product over threads, which on a core shared with onnxruntime (or pinned, as bench_kv is) runs ten times
slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from edgedecode.kv.tiers import QUANTIZED_TIERS, Tier

ROTATION_KINDS = ("hadamard",)
MAX_SEED = (1 << 32) - 1
MAX_BLOCK = 1024
_SINGLE_THREAD_MNK = 1 << 18  # OpenBLAS multithreads a GEMM above this many multiply-adds (interface/gemm.c)


@dataclass(frozen=True)
class Rotation:
    """A rotation of blocks of ``block`` channels, applied to the K and V of the listed quantized ``tiers`` (any
    others travel unrotated)."""

    kind: str
    seed: int
    tiers: tuple[Tier, ...]
    block: int = 32

    def __post_init__(self) -> None:
        if self.kind not in ROTATION_KINDS:
            raise ValueError(f"unknown rotation kind {self.kind!r}; known: {', '.join(ROTATION_KINDS)}")
        if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"rotation seed must be an int in [0, {MAX_SEED}], got {self.seed!r}")
        if not self.tiers or not set(self.tiers) <= set(QUANTIZED_TIERS):
            raise ValueError(f"rotation tiers must be quantized tiers, at least one; got {self.tiers!r}")
        if not (isinstance(self.block, int) and 2 <= self.block <= MAX_BLOCK and not self.block & (self.block - 1)):
            raise ValueError(f"rotation block must be a power of two in [2, {MAX_BLOCK}], got {self.block!r}")

    def rotates(self, tier: Tier) -> bool:
        return tier in self.tiers

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError unless rows of ``head_dim`` split into whole blocks."""
        if head_dim % self.block:
            raise ValueError(f"head_dim {head_dim} is not a multiple of the rotation block {self.block}")


# The kind, seed and blocks senders use, on every tier below INT8 (INT8 is lossless without it): what the probe
# tries on each model; a model's profile keeps it on the tiers it helps (kv.policy.TierProfile.rotation).
DEFAULT_ROTATION = Rotation("hadamard", 0x5EED, (Tier.INT4, Tier.INT3, Tier.INT2), 32)


@lru_cache(maxsize=8)
def hadamard(block: int) -> np.ndarray:
    """float32 [B, B]: the Walsh–Hadamard matrix of order B (Sylvester) over √B: symmetric and orthogonal."""
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    matrix = (h / np.sqrt(block)).astype(np.float32)
    matrix.setflags(write=False)
    return matrix


@lru_cache(maxsize=8)
def hadamard_signs(seed: int, n_layers: int, n_heads: int, head_dim: int) -> np.ndarray:
    """float32 [layers, 2 (K, V), heads, D] of ±1: bit i of ``PCG64(seed)``'s uint8 stream, in C order."""
    count = n_layers * 2 * n_heads * head_dim
    draws = np.random.Generator(np.random.PCG64(seed)).integers(0, 256, -(-count // 8), np.uint8)
    bits = np.unpackbits(draws, bitorder="little")[:count]
    signs = (1.0 - 2.0 * bits).astype(np.float32).reshape(n_layers, 2, n_heads, head_dim)
    signs.setflags(write=False)
    return signs


def rotate(x: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """float32 ``(x ⊙ s) · H`` of ``x [layers, H, m, D]`` with ``signs [layers, H, D]`` (the writer's side)."""
    flipped = (x * signs[:, :, None, :]).reshape(-1, block)
    rotated = np.empty_like(flipped)
    _times_hadamard(flipped, rotated)
    return rotated.reshape(x.shape)


def unrotate_into(rotated: np.ndarray, signs: np.ndarray, block: int, out: np.ndarray, scratch: np.ndarray) -> None:
    """Write ``(rotated · H) ⊙ s`` into ``out [layers, H, m, D]`` (float32 or float16, any strides).

    ``rotated`` is C-contiguous float32 of out's shape; ``scratch`` float32 with at least ``out.size`` values
    (used unless `out` is C-contiguous float32). No other allocation.
    """
    direct = out.dtype == np.float32 and out.flags.c_contiguous
    product = out if direct else scratch[: out.size].reshape(out.shape)
    _times_hadamard(rotated.reshape(-1, block), product.reshape(-1, block))
    np.multiply(product, signs[:, :, None, :], out=out)


def _times_hadamard(rows: np.ndarray, out: np.ndarray) -> None:
    """``out = rows · H`` for C-contiguous float32 ``[r, B]`` arrays (not the same one), in stacked GEMMs that each
    stay on the calling thread."""
    r, b = rows.shape
    batch = max(1, _SINGLE_THREAD_MNK // (b * b))
    main = r // batch * batch
    h = hadamard(b)
    if main:
        np.matmul(rows[:main].reshape(-1, batch, b), h, out=out[:main].reshape(-1, batch, b))
    if main < r:
        np.matmul(rows[main:], h, out=out[main:])
