import math

import numpy as np
import pytest

from empo2.algo.stats import bootstrap_ci


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


# ---------------------------------------------------------------------------------------- like-for-like memory
def test_memory_gain_pairs_tips_with_tip_free_rollouts_of_the_same_group_only():
    from empo2.algo.stats import memory_gain

    # group 0: tips 60, 40 | tip-free 10, 30 | a memory-mode rollout that found no tip, 0  -> 50 - 20 = +30
    # group 1: tips 20 | tip-free 50                                                    -> 20 - 50 = -30 ... and
    # group 2: tip-free only (no pair); group 3: tips only (no pair); group 4: only a rollout that found nothing
    values = [60, 40, 10, 30, 0, 20, 50, 70, 70, 90, 5]
    groups = [0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 4]
    carried = [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    wanted = [1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    gain, n = memory_gain(values, groups, [bool(c) for c in carried], [bool(w) for w in wanted])
    assert (gain, n) == (0.0, 2)  # (+30 + -30) / 2, each group once whatever its size
    # the rollout that found nothing is never tip-free: counting it so would make group 0's tip-free mean 40/3
    wanted[4] = 0
    gain_if_miscounted, _ = memory_gain(values, groups, [bool(c) for c in carried], [bool(w) for w in wanted])
    assert gain_if_miscounted == pytest.approx(((50 - 40 / 3) + -30) / 2)


def test_memory_gain_of_groups_that_are_all_one_kind_is_none():
    from empo2.algo.stats import memory_gain

    gain, n = memory_gain([1.0, 2.0, 3.0], [0, 0, 1], [False] * 3, [False] * 3)  # GRPO: every rollout tip-free
    assert math.isnan(gain) and n == 0
    gain, n = memory_gain([1.0, 2.0], [0, 0], [True, False], [True, True])  # p = 1: tips or nothing found
    assert math.isnan(gain) and n == 0
    # invariant under relabelling the groups and reordering the rollouts
    values, groups, c, w = [9.0, 1.0, 4.0, 2.0], [3, 3, 7, 7], [True, False, True, False], [True, False, True, False]
    assert memory_gain(values, groups, c, w) == (5.0, 2)  # (9 - 1 + 4 - 2) / 2
    assert memory_gain(values[::-1], [0, 0, 1, 1], c[::-1], w[::-1]) == (5.0, 2)


def test_first_visit_gain_sets_later_visits_with_tips_against_the_same_instances_first_visit():
    from empo2.algo.stats import first_visit_gain

    # instance a: first drawn at iteration 0 (10, 20 tip-free), again at 2 (with tips 50, 70) -> 60 - 15 = +45
    # instance b: first drawn at 1 (40), again at 3 with tips 30, and a later visit that found nothing (0, left
    #             out)                                                                          -> 30 - 40 = -10
    # instance c: drawn once (no later visit) -> no pair
    rows = [("a", 0, 10, False), ("a", 0, 20, False), ("b", 1, 40, False), ("c", 1, 99, False),
            ("a", 2, 50, True), ("a", 2, 70, True), ("b", 3, 30, True), ("b", 3, 0, False)]
    inst, its, vals, carried = zip(*rows)
    assert first_visit_gain(inst, its, vals, carried) == (17.5, 2)
    shuffled = [rows[i] for i in (7, 3, 5, 0, 6, 2, 4, 1)]  # the order of the records does not matter
    assert first_visit_gain(*zip(*shuffled)) == (17.5, 2)
    gain, n = first_visit_gain(["a", "a"], [0, 0], [1.0, 2.0], [False, False])  # a single visit: nothing to set
    assert math.isnan(gain) and n == 0


# ------------------------------------------------------------------------------------------------ intervals
def test_t_interval_matches_the_textbook_values():
    from empo2.algo.stats import t_interval

    # 1..5: mean 3, s = sqrt(2.5), se = s / sqrt(5) = 0.7071; t_{0.975, 4} = 2.776 (every t table)
    mean, low, high = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and (low, high) == pytest.approx((3 - 2.776 * 0.70711, 3 + 2.776 * 0.70711), abs=2e-3)
    # Student's sleep data (Cushny & Peebles; R's `sleep`): the 10 paired differences, mean 1.58, 95% interval
    # [0.700, 2.460] (t = 4.062, df = 9; R: t.test(extra ~ group, paired = TRUE))
    diffs = [1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4]
    mean, low, high = t_interval(diffs)
    assert mean == pytest.approx(1.58) and (low, high) == pytest.approx((0.700, 2.460), abs=1e-3)
    # 90%: t_{0.95, 9} = 1.833
    _, low90, high90 = t_interval(diffs, level=0.9)
    se = np.std(diffs, ddof=1) / np.sqrt(10)
    assert (low90, high90) == pytest.approx((1.58 - 1.833 * se, 1.58 + 1.833 * se), abs=1e-3)


def test_t_interval_of_one_seed_is_undefined_and_of_equal_seeds_has_no_width():
    from empo2.algo.stats import t_interval

    mean, low, high = t_interval([4.0])
    assert mean == 4.0 and math.isnan(low) and math.isnan(high)
    assert t_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="at least one"):
        t_interval([])
    with pytest.raises(ValueError, match="level"):
        t_interval([1.0, 2.0], level=0.0)


def test_t_interval_is_wider_than_the_percentile_bootstrap_over_five_seeds():
    from empo2.algo.stats import t_interval

    seeds = [3.0, -8.0, 12.0, 15.0, 5.0]  # five per-seed paired differences
    _, tl, th = t_interval(seeds)
    _, bl, bh = bootstrap_ci(seeds)
    # the percentile bootstrap behaves like z * s * sqrt((n-1)/n) / sqrt(n); t_{0.975,4} / (1.96 * sqrt(0.8)) = 1.58
    assert (th - tl) / (bh - bl) == pytest.approx(1.58, rel=0.15)


def test_two_level_bootstrap_has_the_two_stage_variance():
    from empo2.algo.stats import two_level_bootstrap

    rng = np.random.default_rng(2)
    a, b = 10, 48
    units = [rng.normal(mu, 10.0, b) for mu in rng.normal(30.0, 5.0, a)]  # 10 seeds x 48 instances
    means = np.array([u.mean() for u in units])
    s_between = means.var()  # plug-in (divisor a)
    s_within = np.mean([u.var() for u in units])  # plug-in (divisor b)
    sd = np.sqrt((s_between + s_within / b) / a)  # the bootstrap sd of the mean of seed means
    mean, low, high = two_level_bootstrap(units, n_resamples=20_000)
    assert mean == pytest.approx(means.mean())
    # percentile interval of a near-normal statistic: mean -/+ 1.96 sd
    assert (high - low) / 2 == pytest.approx(1.96 * sd, rel=0.05)
    assert low < mean < high
    assert two_level_bootstrap(units, seed=3) == two_level_bootstrap(units, seed=3)


def test_two_level_bootstrap_with_no_spread_within_seeds_is_the_seed_level_bootstrap():
    from empo2.algo.stats import two_level_bootstrap

    seed_means = [3.0, -8.0, 12.0, 15.0, 5.0, 1.0]
    units = [[m] * 7 for m in seed_means]  # every instance of a seed scores alike: only the seeds vary
    _, low, high = two_level_bootstrap(units, n_resamples=20_000)
    _, bl, bh = bootstrap_ci(seed_means, n_resamples=20_000)
    assert (low, high) == pytest.approx((bl, bh), abs=0.3)
    assert two_level_bootstrap([[1.0, 1.0], [1.0]]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="at least one"):
        two_level_bootstrap([[1.0], []])
