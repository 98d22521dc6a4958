"""Means with CIs, threshold crossings and ratios that say when they are only bounds."""
import math

import pytest

from load_tests.search import SearchPlan, doubling_grid, find_max_rate
from load_tests.stats import (LOWER_BOUND, MEASURED, UNDEFINED, UPPER_BOUND, Estimate, MeanCI, max_rate,
                              mean_ci, not_below, not_below_points, paired_ratio, rate_ratio)


def test_mean_ci_is_student_t_over_seeds():
    ci = mean_ci([0.9, 0.95, 1.0])
    assert ci.mean == pytest.approx(0.95)
    # sd 0.05, t(0.975, 2) = 4.303: half-width 4.303 * 0.05 / sqrt(3)
    assert ci.hi - ci.mean == pytest.approx(4.303 * 0.05 / math.sqrt(3), rel=1e-3)
    assert ci.lo == pytest.approx(2 * ci.mean - ci.hi)
    assert mean_ci([0.7]) == MeanCI(0.7, 0.7, 0.7, 1)
    with pytest.raises(ValueError):
        mean_ci([])


def pts(**by_rate):
    return {float(k[1:].replace("_", ".")): MeanCI(m, lo, hi, 3) for k, (m, lo, hi) in by_rate.items()}


def test_max_rate_reads_the_mean_and_the_bands():
    curve = pts(r1=(1.0, 0.98, 1.0), r2=(0.95, 0.85, 1.0), r4=(0.85, 0.8, 0.92), r8=(0.2, 0.1, 0.3))
    e = max_rate(curve, 0.9)
    assert e.kind == MEASURED and e.value == pytest.approx(3.0)   # 2 + (0.95 - 0.9) / 0.1 * 2
    assert e.lo == pytest.approx(1 + 0.08 / 0.13)                   # lower band crosses between 1 and 2
    assert e.hi == pytest.approx(4 + 0.02 / 0.62 * 4)               # upper band between 4 and 8
    never_below = max_rate(pts(r1=(1, 1, 1), r2=(0.97, 0.95, 0.99)), 0.9)
    assert never_below.kind == LOWER_BOUND and never_below.value == 2.0 and "highest" in never_below.note
    below = max_rate(pts(r2=(0.5, 0.4, 0.6), r4=(0.3, 0.2, 0.4)), 0.9)
    assert below.kind == UPPER_BOUND and below.value == 2.0 and "never reaches 90% even at 2" in below.note
    # a noisy recovery after the first fall does not count
    assert max_rate(pts(r1=(1, 1, 1), r2=(0.8, 0.7, 0.9), r3=(0.95, 0.9, 1)), 0.9).value == pytest.approx(1.5)


def test_a_band_that_never_crosses_is_a_bound_not_a_closed_interval():
    # the mean crosses 90% between 2 and 4, but the upper band is still above it at 8, the
    # highest rate tested: the CI's upper end is only "at least 8"
    curve = pts(r2=(0.95, 0.92, 1.0), r4=(0.85, 0.7, 0.99), r8=(0.8, 0.6, 0.95))
    e = max_rate(curve, 0.9)
    assert e.kind == MEASURED and e.hi == 8.0 and e.hi_open and not e.lo_open
    assert e.describe().endswith(", >= 8]") and "[<=" not in e.describe()
    # the lower band already below at the lowest rate: the lower end is "at most 2"
    low = max_rate(pts(r2=(0.95, 0.8, 1.0), r4=(0.5, 0.4, 0.6)), 0.9)
    assert low.lo == 2.0 and low.lo_open and not low.hi_open and low.describe().split("[")[1].startswith("<= 2")
    # a ratio against an open end is open there too, and says so
    r = rate_ratio(Estimate(4.0, 3.0, 5.0, MEASURED), e)
    assert r.lo is None and r.lo_open and r.hi == pytest.approx(5.0 / e.lo) and "open" in r.describe()
    both_crossed = max_rate(pts(r1=(1.0, 0.98, 1.0), r2=(0.95, 0.85, 1.0), r8=(0.2, 0.1, 0.3)), 0.9)
    assert not both_crossed.lo_open and not both_crossed.hi_open


def test_paired_ratio_bootstraps_the_same_seeds_for_both():
    # token crosses 90% near 4 req/s on every seed, request near 2: the ratio is about 2
    token = {s: {1.0: 1.0, 2.0: 0.98, 4.0: 0.9 + 0.01 * s, 8.0: 0.5} for s in range(5)}
    request = {s: {1.0: 0.97, 2.0: 0.9 + 0.005 * s, 4.0: 0.6, 8.0: 0.2} for s in range(5)}
    r = paired_ratio(token, request, 0.9, reps=400)
    assert r["kind"] == MEASURED and 1.5 < r["value"] < 3.5 and r["lo"] <= r["value"] <= r["hi"]
    assert not r["lo_open"] and not r["hi_open"] and r["seeds"] == [0, 1, 2, 3, 4]
    assert set(r["per_seed"]) == {"0", "1", "2", "3", "4"}
    assert all(1.5 < e["value"] < 3.5 for e in r["per_seed"].values())
    # token never misses at the rates tested on one seed: some draws are lower bounds, so the
    # interval's upper end is only "at least"
    token[2] = {1.0: 1.0, 2.0: 1.0, 4.0: 1.0, 8.0: 1.0}
    r = paired_ratio(token, request, 0.9, reps=400)
    assert r["hi_open"] and r["per_seed"]["2"]["kind"] == LOWER_BOUND and r["censored_draws"] > 0
    with pytest.raises(ValueError, match="seeds"):
        paired_ratio({0: {1.0: 1.0}}, {1: {1.0: 1.0}})


def test_not_below_on_point_estimates_allows_a_small_tolerance():
    ok, rows = not_below_points({1.0: 0.90, 2.0: 0.70}, {1.0: 0.92, 2.0: 0.72, 4.0: 0.1}, tolerance=0.03)
    assert ok and [r["rate"] for r in rows] == [1.0, 2.0]
    ok, rows = not_below_points({1.0: 0.90, 2.0: 0.60}, {1.0: 0.92, 2.0: 0.72}, tolerance=0.03)
    assert not ok and [r["below"] for r in rows] == [False, True]
    assert not not_below_points({1.0: 1.0}, {2.0: 1.0})[0]   # nothing shared: no verdict to give


def test_ratios_carry_intervals_and_censoring():
    tok = Estimate(8.0, 6.0, 10.0, MEASURED)
    req = Estimate(2.0, 1.5, 2.5, MEASURED)
    r = rate_ratio(tok, req)
    assert (r.value, r.lo, r.hi, r.kind) == (4.0, 6.0 / 2.5, 10.0 / 1.5, MEASURED)
    never = Estimate(1.0, None, None, UPPER_BOUND, "never reaches 90% even at 1")
    r = rate_ratio(tok, never)
    assert r.kind == LOWER_BOUND and r.value == 8.0 and r.lo == 6.0 and r.hi is None
    assert "never reaches" in r.note
    open_top = Estimate(16.0, 12.0, None, LOWER_BOUND)
    r = rate_ratio(open_top, req)
    assert r.kind == LOWER_BOUND and r.value == 8.0 and r.lo == pytest.approx(12 / 2.5)
    assert rate_ratio(req, open_top).kind == UPPER_BOUND
    assert rate_ratio(never, never).kind == UNDEFINED
    assert rate_ratio(open_top, open_top).kind == UNDEFINED
    assert rate_ratio(never, req).kind == UPPER_BOUND


def test_not_below_compares_shared_rates_beyond_the_intervals():
    token = pts(r1=(0.9, 0.85, 0.95), r2=(0.5, 0.4, 0.6))
    request = pts(r1=(0.95, 0.9, 1.0), r2=(0.7, 0.65, 0.75), r4=(0.1, 0.0, 0.2))
    ok, rows = not_below(token, request)
    # at 1 req/s token is lower but the intervals overlap; at 2 it is below beyond them
    assert not ok and [r["below_beyond_ci"] for r in rows] == [False, True]
    assert [r["rate"] for r in rows] == [1.0, 2.0]   # 4 req/s was not measured for both
    assert not_below(request, token)[0]


def test_search_brackets_then_bisects_to_the_resolution():
    true_max = 5.3
    seen = []

    def measure(rate):
        seen.append(rate)
        return 1.0 if rate <= true_max else 0.5

    res = find_max_rate(measure, SearchPlan(start=1.0, resolution=1.1))
    assert res.lo <= true_max < res.hi and res.hi / res.lo <= 1.1 * 1.001
    assert seen[:4] == [1.0, 2.0, 4.0, 8.0]
    assert len(seen) == len(set(seen))   # nothing measured twice
    # starting above it, the search halves down; known rates are reused
    known = {8.0: 0.5}
    res = find_max_rate(measure, SearchPlan(start=8.0, min_rate=1.0), known=known)
    assert res.lo <= true_max < res.hi and 8.0 not in seen[-6:]
    # a contender that never meets the threshold: an upper bound at the lowest rate tried
    res = find_max_rate(lambda r: 0.0, SearchPlan(start=2.0))
    assert (res.lo, res.hi, res.visited) == (None, 2.0, (2.0,))
    # one that always meets it: capped by max_rate
    res = find_max_rate(lambda r: 1.0, SearchPlan(start=1.0, max_rate=10.0))
    assert res.lo == 8.0 and res.hi is None
    with pytest.raises(ValueError, match="resolution"):
        SearchPlan(start=1.0, resolution=1.0)


def test_a_missed_start_can_step_down_once_by_a_larger_factor():
    # the Serve peer's plan: one jump to start / 4, never the halving points between
    seen = []

    def never(rate):
        seen.append(rate)
        return 0.5

    res = find_max_rate(never, SearchPlan(start=0.8, min_rate=0.2, down_factor=4.0))
    assert seen == [0.8, 0.2] and (res.lo, res.hi) == (None, 0.2)
    # met down there: the bracket [start / 4, start] is bisected to the resolution
    res = find_max_rate(lambda r: 1.0 if r <= 0.5 else 0.0,
                        SearchPlan(start=0.8, min_rate=0.2, down_factor=4.0))
    assert res.lo <= 0.5 < res.hi and res.hi / res.lo <= 1.1 * 1.001
    with pytest.raises(ValueError, match="down_factor"):
        SearchPlan(start=1.0, down_factor=1.0)


def test_doubling_grid_reaches_the_top():
    assert doubling_grid(1.5, 10.0) == [1.5, 3.0, 6.0, 12.0]
    assert doubling_grid(2.0, 2.0) == [2.0]
