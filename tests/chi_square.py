"""Chi-square tests without scipy (not in the venv), for the sampling tests: the exact tail
for an integer number of degrees of freedom, goodness of fit and two-sample statistics.
Checked against table values in tests/unit/test_chi_square.py."""
from __future__ import annotations

import math

import numpy as np

ALPHA = 1e-4  # each goodness-of-fit test fails a correct sampler with probability <= 1e-4
MIN_EXPECTED = 5.0  # cells below this expected count are pooled (the usual chi-square rule)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), df a positive integer (exact closed forms).

    even df = 2m:  exp(-x/2) * sum_{i<m} (x/2)^i / i!
    odd df:        erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2) * sum_{r=1}^{(df-1)/2} x^(r-1)/(2r-1)!!
    Terms are built by recurrence from exp(-x/2) (no overflow for the sizes used here).
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if x <= 0:
        return 1.0
    half = x / 2.0
    if df % 2 == 0:
        term = total = math.exp(-half)
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return min(1.0, total)
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(2.0 * x / math.pi) * math.exp(-half)  # r = 1: x^0 / 1!!
    for r in range(1, (df - 1) // 2 + 1):
        if r > 1:
            term *= x / (2 * r - 1)
        total += term
    return min(1.0, total)


def gof_statistic(observed: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of `observed` counts [V] against
    `expected_probs` [V]. A token with probability 0 must never be observed (asserted);
    cells with expected count < MIN_EXPECTED are pooled into one."""
    n = observed.sum()
    impossible = expected_probs <= 0
    assert observed[impossible].sum() == 0, (
        f"tokens {np.nonzero(impossible & (observed > 0))[0].tolist()} have probability 0 "
        f"but were emitted: counts {observed.tolist()}, p {expected_probs.tolist()}")
    obs, exp = observed[~impossible].astype(float), n * expected_probs[~impossible]
    small = exp < MIN_EXPECTED
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] < MIN_EXPECTED and len(exp) > 1:  # still too small: merge with the next
            obs = np.append(obs[:-2], obs[-2:].sum())
            exp = np.append(exp[:-2], exp[-2:].sum())
    if len(exp) < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def two_sample_statistic(a: dict, b: dict, min_count: int = 10) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of the 2 x C contingency table of two
    samples' counts over outcomes (dicts outcome -> count). Outcomes seen fewer than
    `min_count` times in both samples together are pooled into one column."""
    keys = sorted(set(a) | set(b), key=repr)
    cols = [(a.get(k, 0), b.get(k, 0)) for k in keys]
    big = [c for c in cols if c[0] + c[1] >= min_count]
    rest = [c for c in cols if c[0] + c[1] < min_count]
    if rest:
        pooled = (sum(c[0] for c in rest), sum(c[1] for c in rest))
        if sum(pooled) >= min_count or not big:
            big.append(pooled)
        else:  # too small on its own: add it to the smallest column
            i = min(range(len(big)), key=lambda j: sum(big[j]))
            big[i] = (big[i][0] + pooled[0], big[i][1] + pooled[1])
    table = np.array(big, dtype=float).T  # [2, C]
    if table.shape[1] < 2:
        return 0.0, 0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1
