"""Small-sample statistics for quality reports: Wilson intervals and t-intervals of a mean."""

from __future__ import annotations

import math

import numpy as np

# Two-sided 95 % Student-t quantiles by degrees of freedom (df > 30 uses the normal 1.96).
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t (interpolated down to the nearest tabulated df)."""
    if df > 30:
        return 1.96
    return _T975[max(k for k in _T975 if k <= df)]


def mean_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95 % t-interval over independent samples."""
    x = np.asarray(values, np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half
