"""mrtpo.evaluate.analysis.stats on hand-computed inputs (scipy only as a second opinion)."""

from __future__ import annotations

import math

import pytest
import scipy.stats

from mrtpo.evaluate.analysis.stats import (
    Interval,
    auc,
    censored_steps,
    intervals,
    mean_ci,
    paired_differences,
    paired_interval,
    run_stats,
    smooth,
    steps_to_threshold,
    t_cdf,
    t_quantile,
    trend,
)

T975_DF1 = 12.706204736174698  # scipy.stats.t.ppf(0.975, 1)
T975_DF2 = 4.302652729749464
T975_DF4 = 2.7764451051977934


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 29, 30, 31, 60, 200])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.95, 0.975, 0.995, 0.9995])
def test_t_quantile_matches_scipy(df, p):
    assert t_quantile(p, df) == pytest.approx(scipy.stats.t.ppf(p, df), rel=1e-9, abs=1e-11)
    assert t_quantile(1 - p, df) == pytest.approx(-t_quantile(p, df), rel=1e-12)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_t_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)


def test_mean_ci_known_sample():
    # 1..5: mean 3, sd sqrt(2.5), se sqrt(2.5)/sqrt(5) = sqrt(0.5); t(0.975, 4) = 2.7764451
    ci = mean_ci([1, 2, 3, 4, 5])
    assert ci.mean == 3.0 and ci.n == 5
    assert ci.half == pytest.approx(T975_DF4 * math.sqrt(0.5), rel=1e-12)
    assert ci.half == pytest.approx(1.9632432, abs=1e-7)
    lo, hi = scipy.stats.t.interval(0.95, 4, loc=3.0, scale=math.sqrt(0.5))
    assert (ci.lo, ci.hi) == (pytest.approx(lo, rel=1e-10), pytest.approx(hi, rel=1e-10))
    # another level: 90% uses t(0.95, 4) = 2.1318468
    assert mean_ci([1, 2, 3, 4, 5], level=0.9).half == pytest.approx(2.1318468 * 0.7071068, 1e-6)


def test_mean_ci_drops_missing_and_handles_tiny_samples():
    ci = mean_ci([1.0, None, math.nan, 3.0])  # a run without a value is not a zero
    assert ci.n == 2 and ci.mean == 2.0
    assert ci.half == pytest.approx(T975_DF1)  # sd sqrt(2), se sqrt(2) / sqrt(2) = 1
    one = mean_ci([0.4])
    assert one.mean == 0.4 and math.isnan(one.half) and one.n == 1
    none = mean_ci([])
    assert math.isnan(none.mean) and math.isnan(none.half) and none.n == 0


def test_intervals_per_group():
    out = intervals({"gdpo": [0.25, 0.375, 0.125], "mrtpo": [0.5], ("k4", "x"): []})
    # gdpo: mean 0.25, sd 0.125, se 0.125/sqrt(3); t(0.975, 2) = 4.3026527
    assert out["gdpo"].mean == pytest.approx(0.25)
    assert out["gdpo"].half == pytest.approx(T975_DF2 * 0.125 / math.sqrt(3))
    assert out["gdpo"].half == pytest.approx(0.3105172, abs=1e-7)
    assert out["mrtpo"] == (0.5, out["mrtpo"].half, 1) and math.isnan(out["mrtpo"].half)
    assert out[("k4", "x")].n == 0


def test_paired_differences_keyed_by_seed():
    a = {0: 0.6, 1: 0.5, 2: 0.7}
    b = {1: 0.5, 0: 0.5, 3: 0.9}  # seed 2 has no partner, seed 3 no counterpart
    d = paired_differences(a, b)
    assert list(d) == [0, 1]  # a's order, common seeds only
    assert d[0] == pytest.approx(0.1) and d[1] == 0.0
    ci = paired_interval(a, b)
    # differences 0.1, 0.0: mean 0.05, sd sqrt(0.005), se 0.05
    assert ci.n == 2 and ci.mean == pytest.approx(0.05)
    assert ci.half == pytest.approx(T975_DF1 * 0.05)
    assert ci.half == pytest.approx(0.6353102, abs=1e-7)
    assert paired_interval({0: 1.0}, {1: 1.0}).n == 0


def test_interval_sign():
    assert Interval(0.3, 0.1, 3).sign == 1
    assert Interval(-0.3, 0.1, 3).sign == -1
    assert Interval(0.05, 0.1, 3).sign == 0
    assert Interval(0.3, math.nan, 1).sign == 0
    assert Interval(0.3, 0.1, 3).lo == pytest.approx(0.2)


def test_trend_hand_built():
    # x = 1,1,2,2,3,3; y = 0,2,2,4,4,6: per-x means 1, 3, 5 -> slope 2, intercept -1;
    # residuals +-1 everywhere: RSS 6, Sxx 4, se = sqrt(6 / 4 / 4) = sqrt(0.375), df 4
    tr = trend({1: [0, 2], 2: [2, 4], 3: [4, 6]})
    assert tr.slope == pytest.approx(2.0) and tr.intercept == pytest.approx(-1.0)
    assert tr.n == 6 and tr.df == 4
    assert tr.half == pytest.approx(T975_DF4 * math.sqrt(0.375))
    assert tr.half == pytest.approx(1.7002185, abs=1e-7)
    ref = scipy.stats.linregress([1, 1, 2, 2, 3, 3], [0, 2, 2, 4, 4, 6])
    assert tr.half == pytest.approx(T975_DF4 * ref.stderr)
    assert tr.interval.sign == 1


def test_trend_degenerate_inputs():
    flat = trend({4: [0.1, 0.2, 0.3]})  # one K: no slope
    assert math.isnan(flat.slope) and flat.n == 3
    two = trend({2: [0.0], 4: [0.2, None]})  # two points: a slope, no interval
    assert two.slope == pytest.approx(0.1) and math.isnan(two.half) and two.n == 2


def test_smooth_and_steps_to_threshold():
    assert smooth([0, 0, 0.5, 1, 1], 5) == pytest.approx([0, 0, 1 / 6, 0.375, 0.5])
    assert smooth([1, 0, 1, 0], 2) == pytest.approx([1, 0.5, 0.5, 0.5])
    # the raw curve crosses 0.5 at step 3, the 5-step average only at step 5
    assert steps_to_threshold([0, 0, 0.5, 1, 1], 0.5) == 5.0
    assert steps_to_threshold([0, 0, 0.5, 1, 1], 0.5, w=1) == 3.0
    assert math.isnan(steps_to_threshold([0.1, 0.2, 0.3], 0.5))


def test_run_stats_and_never_reached():
    st = run_stats([0, 0, 0.5, 1, 1], threshold=0.5)
    assert st == pytest.approx(
        {"start": 0.5 / 3, "steps_to_threshold": 5.0, "final": 0.5, "auc": 0.5, "steps": 5.0}
    )
    assert run_stats([0, 0, 0.5, 1, 1], 0.5, final_window=2)["final"] == 1.0
    never = run_stats([0.1, 0.2, 0.3], threshold=0.5)
    assert math.isnan(never["steps_to_threshold"])
    assert never["auc"] == pytest.approx(0.2) and never["final"] == pytest.approx(0.2)
    # never reached counts as the steps it ran (a lower bound); a reached run as its step
    assert censored_steps(never) == 3.0 and censored_steps(st) == 5.0
    assert math.isnan(auc([]))
