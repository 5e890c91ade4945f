"""Error bars: bootstrap intervals over evaluation windows, Wilson intervals for retrieval accuracy."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000


def resample_indices(n: int, seed: int = 0, resamples: int = RESAMPLES) -> np.ndarray:
    """``[resamples, n]`` indices drawn with replacement: one shared draw makes every figure's interval paired."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_interval(values, statistic=np.mean, indices: np.ndarray | None = None,
                       level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over the first axis of ``values`` (one entry per window).

    ``statistic`` takes ``[resamples, n, ...]`` and reduces axis 1. With few
    windows (8 here) percentile intervals run somewhat narrow; they show the
    spread between windows of one text, not between texts.
    """
    values = np.asarray(values, dtype=np.float64)
    if indices is None:
        indices = resample_indices(len(values))
    estimates = statistic(values[indices], axis=1)
    if estimates.ndim > 1:
        estimates = estimates.reshape(len(estimates), -1).mean(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(estimates, [tail, 1.0 - tail])
    return float(low), float(high)


def perplexity_interval(nll, indices: np.ndarray | None = None, level: float = LEVEL) -> tuple[float, float]:
    """Interval of ``exp(mean NLL)`` over windows (each window's NLL a mean over the same token count)."""
    low, high = bootstrap_interval(nll, np.mean, indices, level)
    return math.exp(low), math.exp(high)


def wilson_interval(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; ``(0, 1)`` for no trials."""
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1.0 - (1.0 - level) / 2)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)

