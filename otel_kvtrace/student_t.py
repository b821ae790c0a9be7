"""Student's t quantiles (tables to 30 degrees of freedom): the one home for the what-if verdicts' one-sided
95 % bounds and the experiment analysis's two-sided 95 % noise (no SciPy dependency for two tables)."""

from __future__ import annotations

import math

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042)


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile (table to 30 degrees of freedom, then the normal 1.96)."""
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
"""One-sided 95% quantiles of Student's t for 1..30 degrees of freedom."""


def t95(df: float) -> float:
    """One-sided 95% quantile of Student's t with ``df`` degrees of freedom (beyond 30: the first-order
    Cornish-Fisher expansion around the normal's 1.645, within 0.002 of the exact value). A fractional
    ``df`` (Welch-Satterthwaite) is rounded down: the larger quantile, the conservative side."""
    z = 1.6448536
    if df < 1:
        return float("inf")
    if math.isinf(df):
        return z
    df = math.floor(df)
    if df <= len(_T95):
        return _T95[df - 1]
    return z + (z ** 3 + z) / (4 * df)
