"""Small statistics the experiments' verdict and reading scripts share (no experiment imports).

Each verdict module imports from here, never from another verdict or reading module, so the
imports run one way: runner -> verdict -> reading -> stats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def welch_one_sided_p(a: Sequence[float], b: Sequence[float]) -> float:
    """p of H1: mean(a) < mean(b) (Welch's t-test, one-sided); 0/1 when both have no spread."""
    from scipy import stats

    a, b = np.asarray(a, float), np.asarray(b, float)
    if np.ptp(a) == 0 and np.ptp(b) == 0:  # exact: std() of equal floats may not be 0
        return 0.0 if a.mean() < b.mean() else 1.0
    return float(stats.ttest_ind(a, b, equal_var=False, alternative="less").pvalue)


def paired_one_sided_p(a: Sequence[float], b: Sequence[float]) -> float:
    """p of H1: mean(a - b) < 0, a paired t-test over seeds (the same warm start and key)."""
    from scipy import stats

    return float(stats.ttest_rel(a, b, alternative="less").pvalue)


def zero_event_upper_bound(n: int, confidence: float = 0.95) -> float:
    """The exact (Clopper-Pearson) upper bound on an event's probability after 0 of n."""
    return 1.0 - (1.0 - confidence) ** (1.0 / n)


def t_interval(x: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): Student's t interval of the mean of `x` (n >= 2)."""
    from scipy import stats

    x = np.asarray(x, float)
    m, n = float(x.mean()), len(x)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * x.std(ddof=1) / np.sqrt(n))
    return m, m - half, m + half


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95):
    """Welch's interval of mean(a) - mean(b) (unequal variances), as (lo, hi)."""
    from scipy import stats

    r = stats.ttest_ind(np.asarray(a, float), np.asarray(b, float), equal_var=False)
    ci = r.confidence_interval(confidence)
    return float(ci.low), float(ci.high)
