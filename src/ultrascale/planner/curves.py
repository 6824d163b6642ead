"""The two small fits the planner's tools need, in numpy alone (scipy is only a test requirement:
`ultrascale calibrate` and `ultrascale sweep` run on `requirements.txt`).

- `efficiency_curve`: rate(F) = peak * F / (F + half) through measured (size, rate) points, in
  relative (log) error, so that the small sizes weigh as much as the large ones;
- `spearman`: the rank correlation of two lists (ties share their mean rank).
"""

from __future__ import annotations

import math

# The half-rate size is searched between these multiples of the smallest and largest sizes
# measured: a curve whose half lies beyond them is not identified by the points anyway.
_HALF_RANGE = (1e-9, 1e6)
_GRID = 2001  # log-spaced trial half sizes before the golden-section refinement
_GOLDEN_STEPS = 100  # each shrinks the bracket by 0.618: far below float precision at the end


def _peak_and_error(log_f, log_r, log_half: float) -> tuple[float, float]:
    """For a fixed half size the best log(peak) is the mean residual: (log peak, squared error)."""
    import numpy as np

    shape = log_f - np.logaddexp(log_f, log_half)  # log(F / (F + half))
    log_peak = float(np.mean(log_r - shape))
    return log_peak, float(np.sum((log_peak + shape - log_r) ** 2))


def efficiency_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(peak, half) of rate = peak * F / (F + half) through the points (F, rate). Where the rates
    do not level off within the sizes measured (the fitted peak beyond 4x the best measured rate),
    the curve is not identified: (best rate, 0.0)."""
    import numpy as np

    f = np.array([p[0] for p in points], dtype=np.float64)
    r = np.array([p[1] for p in points], dtype=np.float64)
    log_f, log_r = np.log(f), np.log(r)
    lo = math.log(f.min() * _HALF_RANGE[0])
    hi = math.log(f.max() * _HALF_RANGE[1])
    grid = np.linspace(lo, hi, _GRID)
    errors = [_peak_and_error(log_f, log_r, u)[1] for u in grid]
    i = int(np.argmin(errors))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, _GRID - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(_GOLDEN_STEPS):  # the error is unimodal within one grid step of its minimum
        c, d = b - golden * (b - a), a + golden * (b - a)
        if _peak_and_error(log_f, log_r, c)[1] <= _peak_and_error(log_f, log_r, d)[1]:
            b = d
        else:
            a = c
    log_half = (a + b) / 2
    log_peak, _ = _peak_and_error(log_f, log_r, log_half)
    peak, half, best = math.exp(log_peak), math.exp(log_half), float(r.max())
    if peak > 4 * best:
        return best, 0.0
    return peak, half


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):  # a run of ties shares the mean of its positions
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (nan where one list is
    constant, as scipy.stats.spearmanr answers)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2 each")
    a, b = _ranks(list(xs)), _ranks(list(ys))
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else float("nan")
