"""The two small fits the planner's tools need, in numpy alone (scipy is only a test requirement:
`ultrascale calibrate` and `ultrascale sweep` run on `requirements.txt`).

- `efficiency_curve`: rate(F) = peak * F / (F + half) through measured (size, rate) points, in
  relative (log) error, so that the small sizes weigh as much as the large ones;
- `efficiency_surface`: the same times d / (d + half_dim), d a GEMM's smallest dimension;
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
    shapes = log_f[None, :] - np.logaddexp(log_f[None, :], grid[:, None])  # every trial at once
    residuals = log_r[None, :] - shapes
    errors = np.sum((residuals - residuals.mean(axis=1, keepdims=True)) ** 2, axis=1)
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


_HALF_DIM_GRID = 41  # trial half-rate dimensions, log-spaced, for `efficiency_surface`
_HALF_DIM_GOLDEN_STEPS = 30  # then refined as `efficiency_curve` refines its half size


def efficiency_surface(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(peak, half, half_dim) of rate = peak * F / (F + half) * d / (d + half_dim) through the
    points (F, d, rate), d the GEMM's smallest dimension, in relative (log) error: for each trial
    half_dim (log-spaced from 1/100 of the smallest d to 100 times the largest, refined around
    the best; and 0) the `efficiency_curve` of the rates divided by the dimension factor; the
    trial of least error.
    Square GEMMs alone cannot tell the two factors apart: the points should hold GEMMs of one
    size with different smallest dimensions."""
    import numpy as np

    f = np.array([p[0] for p in points], dtype=np.float64)
    d = np.array([p[1] for p in points], dtype=np.float64)
    r = np.array([p[2] for p in points], dtype=np.float64)
    def fit(log_half_dim: float | None) -> tuple[float, float, float, float]:
        half_dim = 0.0 if log_half_dim is None else math.exp(log_half_dim)
        narrow = d / (d + half_dim)
        peak, half = efficiency_curve(list(zip(f, r / narrow)))
        error = float(np.sum((np.log(peak * f / (f + half) * narrow) - np.log(r)) ** 2))
        return error, peak, half, half_dim

    grid = list(np.linspace(math.log(d.min() / 100), math.log(d.max() * 100), _HALF_DIM_GRID))
    errors = [fit(u)[0] for u in grid]
    i = int(np.argmin(errors))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(_HALF_DIM_GOLDEN_STEPS):
        c, e = b - golden * (b - a), a + golden * (b - a)
        if fit(c)[0] <= fit(e)[0]:
            b = e
        else:
            a = c
    best = min(fit(None), fit((a + b) / 2))  # no dimension factor at all, or the best one
    return best[1], best[2], best[3]


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
