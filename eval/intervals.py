"""Confidence intervals for accuracies the reports print."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default). Unlike the normal approximation
    (acc +- z * stderr, what lm-eval's stderr gives) it stays inside [0, 1] and is not empty at 0 or n
    successes, which matters for accuracies near chance or near 0 on a few hundred questions.
    ``successes`` may be fractional (an accuracy times n)."""
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 (or n) successes the bound is exactly 0 (or 1); the formula leaves rounding dust there
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi
