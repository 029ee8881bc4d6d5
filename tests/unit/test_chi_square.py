"""The chi-square helpers of tests/chi_square.py against table values and wrong samples."""
from __future__ import annotations

import numpy as np
import pytest

from tests.chi_square import ALPHA, chi2_sf, gof_statistic, two_sample_statistic

V = 6


@pytest.mark.parametrize("x, df, p", [
    (3.841, 1, 0.05), (6.635, 1, 0.01), (15.137, 1, 1e-4),
    (5.991, 2, 0.05), (18.421, 2, 1e-4),
    (7.815, 3, 0.05), (16.266, 3, 0.001),
    (11.070, 5, 0.05), (23.209, 10, 0.01), (29.588, 10, 0.001),
    (31.410, 20, 0.05), (124.342, 100, 0.05),
])
def test_chi2_sf_matches_table_values(x: float, df: int, p: float) -> None:
    assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


def test_gof_helpers_flag_a_wrong_distribution() -> None:
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    counts = np.bincount(rng.choice(V, size=5000, p=p), minlength=V)
    stat, df = gof_statistic(counts, p)
    assert df == 3 and chi2_sf(stat, df) > ALPHA
    stat, df = gof_statistic(counts, np.array([0.35, 0.35, 0.2, 0.1, 0.0, 0.0]))
    assert chi2_sf(stat, df) < ALPHA
    with pytest.raises(AssertionError, match="probability 0"):
        gof_statistic(counts, np.array([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]))
    same = dict(enumerate(np.bincount(rng.choice(V, size=5000, p=p), minlength=V)))
    stat, df = two_sample_statistic(dict(enumerate(counts)), same)
    assert df == 3 and chi2_sf(stat, df) > ALPHA
    other = dict(enumerate(np.bincount(rng.choice(V, size=5000, p=[.3, .3, .3, .1, 0, 0]))))
    assert chi2_sf(*two_sample_statistic(dict(enumerate(counts)), other)) < ALPHA
