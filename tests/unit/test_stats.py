import numpy as np
import pytest

from empo2.stats import bootstrap_ci


def test_the_interval_holds_the_statistic_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    small, large = rng.normal(5, 2, 20), rng.normal(5, 2, 2000)
    m, lo, hi = bootstrap_ci(small)
    assert m == pytest.approx(small.mean()) and lo < m < hi
    m2, lo2, hi2 = bootstrap_ci(large)
    assert hi2 - lo2 < (hi - lo) / 4  # width shrinks like 1/sqrt(n): 100x the samples, ~1/10 the width
    # the normal-theory interval of the mean, 1.96 standard errors either side
    se = large.std(ddof=1) / np.sqrt(len(large))
    assert lo2 == pytest.approx(m2 - 1.96 * se, abs=0.3 * se) and hi2 == pytest.approx(m2 + 1.96 * se, abs=0.3 * se)


def test_constant_and_single_samples_give_zero_width_and_seeds_reproduce():
    assert bootstrap_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)
    assert bootstrap_ci([7.0]) == (7.0, 7.0, 7.0)
    x = np.random.default_rng(0).normal(size=15)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3) != bootstrap_ci(x, seed=4)


def test_paired_rows_are_resampled_together():
    # every row has b = a + 10: any resample of whole rows gives a mean difference of exactly 10
    a = np.arange(30.0)
    pairs = np.stack([a, a + 10], axis=1)  # (n, 2)
    diff = bootstrap_ci(pairs, stat=lambda d: float(np.mean(d[:, 1] - d[:, 0])))
    assert diff == pytest.approx((10.0, 10.0, 10.0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([1.0, 2.0], level=1.5)
