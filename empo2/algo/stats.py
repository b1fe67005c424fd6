"""Estimates and their uncertainty for the numbers the project reports: the like-for-like memory estimates
(`memory_gain`, `first_visit_gain`) and intervals that match the design (seeds are the unit of replication:
`t_interval` over seeds; `two_level_bootstrap` where instances vary within each seed; `bootstrap_ci`, a
percentile bootstrap of one level, for the calibration records). Pure functions, seeded where random."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import scipy.stats

# How each interval was made, as `empo2 compare` prints it beside every interval
T_SEEDS = "t over seeds"
TWO_LEVEL = "two-level bootstrap (seeds, then instances)"


def memory_gain(values: Sequence[float], group_ids: Sequence[int], carried: Sequence[bool],
                wanted: Sequence[bool]) -> tuple[float, int]:
    """(gain, groups): what carrying tips adds, like for like. A group is one instance played in one iteration
    by one set of weights; in each group that holds both rollouts that carried tips and rollouts drawn tip-free,
    mean(values with tips) - mean(values tip-free), then the mean over those groups, each counting once.

    values, group_ids, carried, wanted: per rollout, (R,). `wanted`: drawn in memory mode at some step it played;
    `carried`: some prompt of it held a tip. A rollout that wanted tips and found none (its instance had no tip
    yet, or none passed `min_sim`) is neither: it is not tip-free by design, and it is mostly an instance's first
    draw, by the least-trained weights. NaN with no group holding both kinds."""
    diffs = []
    by_group: dict[int, tuple[list[float], list[float]]] = {}
    for v, g, c, w in zip(values, group_ids, carried, wanted):
        if c or not w:  # carried tips, or drawn tip-free
            by_group.setdefault(int(g), ([], []))[0 if c else 1].append(float(v))
    for with_tips, tip_free in by_group.values():
        if with_tips and tip_free:
            diffs.append(np.mean(with_tips) - np.mean(tip_free))
    return (float(np.mean(diffs)) if diffs else math.nan), len(diffs)


def first_visit_gain(instances: Sequence[Hashable], iterations: Sequence[int], values: Sequence[float],
                     carried: Sequence[bool]) -> tuple[float, int]:
    """(gain, instances): the estimate that fits p = 1, where no group holds a tip-free rollout. Per instance,
    mean(values of its later visits that carried tips) - mean(values of its first visit's rollouts that carried
    none), then the mean over the instances that have both. The first visit is the first iteration the instance
    was drawn in: its memory was empty, so its rollouts ran tip-free. Without updates (memory only) both sides
    are played by the same weights; with updates the later visits are also played by later weights.

    instances, iterations, values, carried: per rollout of a run, (R,). NaN with no instance holding both."""
    first: dict[Hashable, int] = {}
    for inst, it in zip(instances, iterations):
        first[inst] = min(first.get(inst, it), it)
    sides: dict[Hashable, tuple[list[float], list[float]]] = {inst: ([], []) for inst in first}
    for inst, it, v, c in zip(instances, iterations, values, carried):
        if it == first[inst] and not c:
            sides[inst][1].append(float(v))
        elif it > first[inst] and c:
            sides[inst][0].append(float(v))
    diffs = [np.mean(later) - np.mean(at_first) for later, at_first in sides.values() if later and at_first]
    return (float(np.mean(diffs)) if diffs else math.nan), len(diffs)


def t_interval(values: Sequence[float] | np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` (one per seed) and its Student-t interval, mean -/+
    t_{(1+level)/2, n-1} * s / sqrt(n) (`scipy.stats.ttest_1samp`). For a paired difference pass the per-seed
    differences. NaN interval for a single value; zero width for equal values."""
    _check_level(level)
    data = np.asarray(values, dtype=float)
    if len(data) == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(data.mean())
    if len(data) < 2:
        return mean, math.nan, math.nan
    if np.all(data == data[0]):  # no spread: scipy would divide 0 by 0
        return mean, mean, mean
    ci = scipy.stats.ttest_1samp(data, 0.0).confidence_interval(level)
    return mean, float(ci.low), float(ci.high)


def two_level_bootstrap(units: Sequence[Sequence[float]], level: float = 0.95, n_resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean over seeds of each seed's mean over its instances, and its percentile interval
    from resampling seeds, then instances within each drawn seed. units: per seed, its per-instance values (for a
    paired difference, the per-instance differences of that seed).

    `scipy.stats.bootstrap` resamples one level only, hence the loop here. With replacement at both levels the
    within-seed spread is counted about twice (the seed means already carry it: Davison & Hinkley 1997, sec. 3.8),
    so the interval errs wide; the bootstrap variance of the statistic is (S_B + S_W / b) / a for a seeds of b
    instances, S_B and S_W the plug-in between- and within-seed variances."""
    _check_level(level)
    groups = [np.asarray(u, dtype=float) for u in units]
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("two_level_bootstrap needs at least one seed, each with at least one value")
    point = float(np.mean([g.mean() for g in groups]))
    rng = np.random.default_rng(seed)
    picked = rng.integers(0, len(groups), size=(n_resamples, len(groups)))  # (R, a): the seeds drawn
    inner = np.empty(picked.shape)  # (R, a): each drawn seed's mean over its resampled instances
    for j, g in enumerate(groups):
        where = picked == j
        draws = rng.integers(0, len(g), size=(int(where.sum()), len(g)))  # (times seed j was drawn, b_j)
        inner[where] = g[draws].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(inner.mean(axis=1), [alpha, 1 - alpha])
    return point, float(low), float(high)


def bootstrap_ci(samples: Sequence[float] | np.ndarray, stat: Callable[[np.ndarray], float] = np.mean,
                 level: float = 0.95, n_resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(statistic, low, high): the statistic of `samples` and its percentile bootstrap interval.

    samples: (n,) values, or (n, k) rows resampled together (paired measurements of one unit, e.g. an
    instance's tip-free and with-tips scores; `stat` then maps an (n, k) array to a float). Resamples are
    drawn with a seeded generator, so a report is reproducible. One sample gives a zero-width interval.
    """
    _check_level(level)
    data = np.asarray(samples, dtype=float)
    if len(data) == 0:
        raise ValueError("bootstrap_ci needs at least one sample")
    point = float(stat(data))
    idx = np.random.default_rng(seed).integers(0, len(data), size=(n_resamples, len(data)))  # (R, n)
    values = np.array([stat(data[i]) for i in idx])
    alpha = (1 - level) / 2
    low, high = np.quantile(values, [alpha, 1 - alpha])
    return point, float(low), float(high)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
