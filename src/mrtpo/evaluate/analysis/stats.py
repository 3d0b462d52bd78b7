"""Statistics for comparing runs over seeds: t intervals, paired differences, learning-curve
summaries and a trend test in the number of rewards.

Pure Python (no numpy, no scipy): the report must be reproducible from the run logs on any
install, and samples are a handful of seeds. Everything takes plain mappings:

    intervals({"gdpo": [0.59, 0.60, 0.58], "mrtpo": [0.61, 0.60, 0.62]})
    paired_interval({0: 0.61, 1: 0.60}, {0: 0.59, 1: 0.60})   # keyed by seed
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import NamedTuple

#: Steps in the trailing moving average used for threshold crossings and plots.
SMOOTH = 5
#: Last steps averaged into the "final" success rate.
FINAL_WINDOW = 10


class Interval(NamedTuple):
    """A mean and the half-width of its two-sided t interval over ``n`` finite values. ``half`` is
    NaN for n < 2 (no spread to estimate); ``mean`` is NaN for n = 0."""

    mean: float
    half: float
    n: int

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    @property
    def sign(self) -> int:
        """+1 / -1 when the interval lies wholly above / below zero, else 0 (or no interval)."""
        if math.isnan(self.mean) or math.isnan(self.half):
            return 0
        return 1 if self.lo > 0 else -1 if self.hi < 0 else 0


# ---- Student's t quantile ------------------------------------------------------------------------


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with a whole number ``df`` of degrees of freedom (a count of
    seeds): Abramowitz & Stegun 26.7.3-4, a finite sum of powers of cos θ, θ = atan(|t|/√df)."""
    if df <= 0 or df != int(df):
        raise ValueError(f"degrees of freedom must be positive and whole, got {df}")
    theta, odd = math.atan(abs(t) / math.sqrt(df)), int(df) % 2
    c2, term, total = math.cos(theta) ** 2, math.cos(theta) if odd else 1.0, 0.0
    for k in range(int(df) // 2):
        if k:
            term *= (2 * k - 1 + odd) / (2 * k + odd) * c2
        total += term
    a = 2 / math.pi * (theta + math.sin(theta) * total) if odd else math.sin(theta) * total
    return 0.5 + 0.5 * a if t >= 0 else 0.5 - 0.5 * a


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (exact to ~1e-12). Bisection
    on the CDF: slow by numerical standards, instant for a report's few calls."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---- Intervals -----------------------------------------------------------------------------------


def finite(values: Iterable[float | None]) -> list[float]:
    return [float(x) for x in values if x is not None and math.isfinite(x)]


def mean_ci(values: Iterable[float | None], level: float = 0.95) -> Interval:
    """Mean and half-width of the two-sided ``level`` t interval over the finite values
    (None and NaN are dropped: a run that produced no value is not a zero)."""
    v = finite(values)
    n = len(v)
    if n == 0:
        return Interval(math.nan, math.nan, 0)
    m = sum(v) / n
    if n < 2:
        return Interval(m, math.nan, n)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    return Interval(m, t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n), n)


def intervals(
    groups: Mapping[Hashable, Sequence[float | None]], level: float = 0.95
) -> dict[Hashable, Interval]:
    """``{group: [value per seed]}`` -> ``{group: Interval}`` (mean, half-width, n)."""
    return {g: mean_ci(vals, level) for g, vals in groups.items()}


def paired_differences(
    a: Mapping[Hashable, float], b: Mapping[Hashable, float]
) -> dict[Hashable, float]:
    """``a[s] - b[s]`` for every key (seed) in both, in ``a``'s order. Pairing by seed removes what
    two runs with the same seed share (prompts, first batch, starting policy), which is most of the
    seed-to-seed noise."""
    return {s: a[s] - b[s] for s in a if s in b}


def paired_interval(
    a: Mapping[Hashable, float], b: Mapping[Hashable, float], level: float = 0.95
) -> Interval:
    """The t interval of the paired differences ``a - b`` over the seeds both have."""
    return mean_ci(paired_differences(a, b).values(), level)


# ---- Trend in K ----------------------------------------------------------------------------------


class Trend(NamedTuple):
    """Least-squares line ``y = intercept + slope * x`` with the t interval of the slope."""

    slope: float
    half: float  # half-width of the slope's interval (NaN with fewer than 3 points)
    intercept: float
    n: int  # points
    df: int  # n - 2

    @property
    def interval(self) -> Interval:
        return Interval(self.slope, self.half, self.n)


def trend(points: Mapping[float, Sequence[float | None]], level: float = 0.95) -> Trend:
    """Does ``y`` grow with ``x``? ``{x: [y per seed]}`` (e.g. ``{K: [paired Δ AUC per seed]}``) ->
    the ordinary least-squares slope over every (x, y) point and its t interval (``n - 2`` degrees
    of freedom). Each seed's paired difference at each K is one observation: runs at different K
    come from different warm starts, so they are independent, and using every point (not the per-K
    means) lets the seed-to-seed spread set the interval."""
    xy = [(float(x), y) for x, ys in points.items() for y in finite(ys)]
    n = len(xy)
    if n < 2 or len({x for x, _ in xy}) < 2:
        return Trend(math.nan, math.nan, math.nan, n, max(0, n - 2))
    mx = sum(x for x, _ in xy) / n
    my = sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    sxy = sum((x - mx) * (y - my) for x, y in xy)
    slope = sxy / sxx
    intercept = my - slope * mx
    if n < 3:
        return Trend(slope, math.nan, intercept, n, 0)
    rss = sum((y - intercept - slope * x) ** 2 for x, y in xy)
    se = math.sqrt(rss / (n - 2) / sxx)
    return Trend(slope, t_quantile(0.5 + level / 2.0, n - 2) * se, intercept, n, n - 2)


# ---- Learning curves -----------------------------------------------------------------------------


def smooth(x: Sequence[float], w: int = SMOOTH) -> list[float]:
    """Trailing moving average (the first points average what exists)."""
    return [sum(x[max(0, i - w + 1) : i + 1]) / min(i + 1, w) for i in range(len(x))]


def steps_to_threshold(curve: Sequence[float], threshold: float, w: int = SMOOTH) -> float:
    """First 1-based step where the ``w``-step trailing mean reaches ``threshold`` (NaN: never)."""
    hit = next((i for i, v in enumerate(smooth(curve, w)) if v >= threshold), None)
    return float(hit + 1) if hit is not None else math.nan


def auc(curve: Sequence[float]) -> float:
    """Area under the curve divided by its length: the mean over all steps."""
    return sum(curve) / len(curve) if len(curve) else math.nan


def run_stats(
    success: Sequence[float],
    threshold: float,
    smooth_window: int = SMOOTH,
    final_window: int = FINAL_WINDOW,
) -> dict[str, float]:
    """One run's summary: start (mean of the first 3 steps), steps to threshold (NaN: never
    reached), final (mean of the last ``final_window`` steps), AUC, and the number of steps."""
    head, tail = success[:3], success[-final_window:]
    return {
        "start": sum(head) / max(1, len(head)),
        "steps_to_threshold": steps_to_threshold(success, threshold, smooth_window),
        "final": sum(tail) / max(1, len(tail)),
        "auc": auc(success),
        "steps": float(len(success)),
    }


def censored_steps(stats: Mapping[str, float]) -> float:
    """Steps to threshold, with a run that never reached it counted as the steps it ran (a
    lower bound: means over such runs are lower bounds too)."""
    s = stats["steps_to_threshold"]
    return stats["steps"] if math.isnan(s) else s


def value_at(curve: Sequence[float], step: int, w: int = SMOOTH) -> float:
    """The ``w``-step trailing mean of the finite values at ``step`` (1-based); NaN past the end."""
    if step < 1 or len(curve) < step:
        return math.nan
    return mean_finite(curve[max(0, step - w) : step])


def mean_finite(curve: Iterable[float | None]) -> float:
    """Mean of the finite values (NaN: none)."""
    v = finite(curve)
    return sum(v) / len(v) if v else math.nan


def early_minus_late(curve: Sequence[float], w: int = SMOOTH) -> float:
    """Mean of the first ``w`` finite values minus the mean of the last ``w``: how much a
    per-step quantity (e.g. the replayed share) fell over a run. NaN with fewer than 2w."""
    v = finite(curve)
    if len(v) < 2 * w:
        return math.nan
    return sum(v[:w]) / w - sum(v[-w:]) / w
