"""The numpy model of the CUDA ops (edgedecode/kernels/cuda) that tests/test_gpu*.py hold them to.

MatMulGGUF and FusedMatMulGGUF on CUDA take float16 activations, sum in float32 and write float16, so a correct
output is the exact float64 value (``kernel_oracle.weights``) rounded once to float16, give or take the float32
rounding of the sum (kernel_oracle's textbook bound) and of the float32 norm and activation: the allowed error per
output is half a float16 ulp of the exact value plus those bounds. A code, scale or offset read wrong is off by far
more (one code step of one weight is ~d·|x|, thousands of float32 ulps of the sum).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from kernel_oracle import UNIT, weights

SILU, GELU_TANH = 1, 2


def rms_normalized(x: np.ndarray, gamma: np.ndarray | None, eps: float) -> np.ndarray:
    """float64 rows of x (float16 [M, K]) times 1/sqrt(mean(x²) + eps) times gamma; x itself without gamma."""
    x64 = np.asarray(x, np.float64)
    if gamma is None:
        return x64
    inverse = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return x64 * inverse * np.asarray(gamma, np.float64)


def _activation(g: np.ndarray, gate: int) -> np.ndarray:
    if gate == SILU:
        return g / (1.0 + np.exp(-g))
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def fused(
    x: np.ndarray,
    matrices: list[tuple[np.ndarray, QType]],
    gamma: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    gate: int = 0,
    eps: float = 1e-6,
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """FusedMatMulGGUF exactly (float64) and the error a float32-summing, float16-writing kernel may add."""
    a = rms_normalized(x, gamma, eps)
    k = a.shape[-1]
    products, sizes = [], []
    for data, kind in matrices:
        w = weights(data, kind)
        products.append(a @ w.T)
        sizes.append((k + 3) * UNIT * (np.abs(a) @ np.abs(w).T))
    relative = 8 * UNIT if gamma is not None else 0.0  # the float32 norm factor: a few roundings of a factor
    if gate:
        g, u = products
        act = _activation(g, gate)
        exact = act * u
        slope = np.abs(_activation(g + 1e-3, gate) - _activation(g - 1e-3, gate)) / 2e-3  # |act'(g)|, numerically
        bound = np.abs(act) * (sizes[1] + relative * np.abs(u)) + np.abs(u) * (
            slope * (sizes[0] + relative * np.abs(g)) + 16 * UNIT * np.abs(act)
        )
    else:
        exact = np.concatenate(products, -1)
        bound = np.concatenate(sizes, -1) + relative * np.abs(exact)
        if bias is not None:
            exact = exact + np.asarray(bias, np.float64)
            bound = bound + UNIT * np.abs(exact)
    if residual is not None:
        exact = exact + np.asarray(residual, np.float64)
        bound = bound + UNIT * np.abs(exact)
    return exact, bound


def assert_float16_close(y: np.ndarray, model: tuple[np.ndarray, np.ndarray]) -> None:
    """y (float16) is the exact value rounded to float16, within the float32 bound."""
    exact, bound = model
    assert y.dtype == np.float16 and y.shape == exact.shape, (y.dtype, y.shape, exact.shape)
    assert np.abs(exact).max() < 65504, "the test's values overflow float16: scale its data down"
    half_ulp = 0.5 * np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    excess = np.abs(y.astype(np.float64) - exact) - (half_ulp + bound)
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.size} outputs beyond float16 rounding; worst at {worst}: "
        f"{float(y[worst])} vs {exact[worst]:.6g} (allowed {half_ulp[worst] + bound[worst]:.3g})"
    )
