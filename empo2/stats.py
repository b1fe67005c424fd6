"""Uncertainty for the numbers the project reports: percentile bootstrap intervals (pure, seeded)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def bootstrap_ci(samples: Sequence[float] | np.ndarray, stat: Callable[[np.ndarray], float] = np.mean,
                 level: float = 0.95, n_resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(statistic, low, high): the statistic of `samples` and its percentile bootstrap interval.

    samples: (n,) values, or (n, k) rows resampled together (paired measurements of one unit, e.g. an
    instance's tip-free and with-tips scores; `stat` then maps an (n, k) array to a float). Resamples are
    drawn with a seeded generator, so a report is reproducible. One sample gives a zero-width interval.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    data = np.asarray(samples, dtype=float)
    if len(data) == 0:
        raise ValueError("bootstrap_ci needs at least one sample")
    point = float(stat(data))
    idx = np.random.default_rng(seed).integers(0, len(data), size=(n_resamples, len(data)))  # (R, n)
    values = np.array([stat(data[i]) for i in idx])
    alpha = (1 - level) / 2
    low, high = np.quantile(values, [alpha, 1 - alpha])
    return point, float(low), float(high)
