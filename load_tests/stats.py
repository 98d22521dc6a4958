"""Statistics of a load test: means with confidence intervals, where a curve crosses a
threshold, and ratios of rates, each saying what kind of number it is.

A measured point is one rate run with several seeds (independent workload samples); its
attainment is the mean over seeds with a Student-t 95% interval (the seeds, not the
requests, are the independent samples: requests of one run share its bursts).

The max rate at a threshold is read off the mean curve: the first rate whose mean falls
below the threshold, interpolated linearly from the rate before it (later recoveries do
not count). Its interval comes from the band: where the lower band crosses (the rate is at
least this) and where the upper band crosses (at most this). A curve that never falls
below gives a lower bound (the highest rate tested); one already below at its lowest rate
gives an upper bound (below the lowest rate tested). An interval end whose band never
crosses inside the tested rates is itself only a bound, and says so (`hi_open`: the upper
end is at least the highest rate tested; `lo_open`: the lower end is at most the lowest):
it is never printed as a closed interval. A ratio of two such rates carries the interval of
both ends (lo_a / hi_b, hi_a / lo_b) and the censoring of either.

Ratios between two contenders measured on the same seeds (the same arrival sequences) get
their interval from a paired bootstrap over seeds (`paired_ratio`): seeds are drawn with
replacement, both contenders' mean curves are rebuilt from the same draw, and the ratio of
their crossings is taken; censored draws open the interval's end they could move.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

MEASURED = "measured"
LOWER_BOUND = "lower bound"  # the true value is at least `value`
UPPER_BOUND = "upper bound"  # the true value is below `value`
UNDEFINED = "undefined"


@dataclass(frozen=True)
class MeanCI:
    mean: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> MeanCI:
    """Mean of `values` and its Student-t interval (one value: the interval is the point)."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("mean_ci needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    n = len(v)
    mean = sum(v) / n
    if n == 1:
        return MeanCI(mean, mean, mean, 1)
    from scipy.stats import t

    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return MeanCI(mean, mean - half, mean + half, n)


def bootstrap_ci(items: Sequence[T], statistic: Callable[[list[T]], float], seed: int = 0,
                 reps: int = 2000) -> tuple[float, float]:
    """95% percentile bootstrap interval of `statistic`: `items` (e.g. the side-by-side pairs of
    a benchmark) drawn with replacement `reps` times, the statistic recomputed on each draw."""
    rng = random.Random(seed)
    n = len(items)
    draws = sorted(statistic([items[rng.randrange(n)] for _ in range(n)]) for _ in range(reps))
    return draws[int(0.025 * reps)], draws[int(0.975 * reps) - 1]


@dataclass(frozen=True)
class Estimate:
    """A rate (or a ratio of rates) with its interval and what kind of number it is."""

    value: float | None
    lo: float | None
    hi: float | None
    kind: str  # MEASURED | LOWER_BOUND | UPPER_BOUND | UNDEFINED
    note: str = ""
    lo_open: bool = False  # the interval's lower end is at most `lo` (its band never crossed above it)
    hi_open: bool = False  # the interval's upper end is at least `hi` (its band never crossed below it)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self, unit: str = "") -> str:
        if self.value is None:
            return self.note or self.kind
        fmt = _fmt(self.value) + unit
        if self.kind == LOWER_BOUND:
            return f">= {fmt} ({self.note})" if self.note else f">= {fmt}"
        if self.kind == UPPER_BOUND:
            return f"< {fmt} ({self.note})" if self.note else f"< {fmt}"
        return fmt + self.interval_text()

    def interval_text(self) -> str:
        """" [lo, hi]", an open end written as a bound ("<= lo", ">= hi", "open" when nothing
        bounds it); "" when neither end is known."""
        if (self.lo is None and not self.lo_open) or (self.hi is None and not self.hi_open):
            return ""
        lo = "open" if self.lo is None else ("<= " if self.lo_open else "") + _fmt(self.lo)
        hi = "open" if self.hi is None else (">= " if self.hi_open else "") + _fmt(self.hi)
        return f" [{lo}, {hi}]"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _first_crossing(points: Sequence[tuple[float, float]], threshold: float) -> float | None:
    """Where the piecewise-linear curve first falls below `threshold`; None if never,
    -inf if already below at the first point."""
    if points[0][1] < threshold:
        return -math.inf
    for (r_a, a_a), (r_b, a_b) in zip(points, points[1:]):
        if a_b < threshold:
            return r_a + (a_a - threshold) / (a_a - a_b) * (r_b - r_a)
    return None


def max_rate(curve: Mapping[float, MeanCI], threshold: float = 0.9) -> Estimate:
    """The highest rate whose mean attainment stays >= threshold (see the module docstring)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if not curve:
        raise ValueError("the curve has no points")
    rates = sorted(float(r) for r in curve)
    pts = {r: curve[r] for r in curve}
    lowest, highest = rates[0], rates[-1]

    def cross(attr: str) -> float | None:
        return _first_crossing([(float(r), getattr(pts[r], attr)) for r in sorted(pts, key=float)], threshold)

    mid, lo_band, hi_band = cross("mean"), cross("lo"), cross("hi")
    if mid == -math.inf:
        hi = None if hi_band is None else (lowest if hi_band == -math.inf else hi_band)
        return Estimate(lowest, None, hi, UPPER_BOUND,
                        f"never reaches {threshold:.0%} even at {lowest:.3g} req/s")
    if mid is None:
        lo = lowest if lo_band == -math.inf else (lo_band if lo_band is not None else highest)
        return Estimate(highest, lo, None, LOWER_BOUND,
                        f"still >= {threshold:.0%} at {highest:.3g} req/s, the highest tested")
    # a band that never crosses inside the tested rates bounds its end, nothing more
    lo, lo_open = (lowest, True) if lo_band == -math.inf else (lo_band, False)
    hi, hi_open = (highest, True) if hi_band is None else (hi_band, False)
    return Estimate(mid, lo, hi, MEASURED, lo_open=lo_open, hi_open=hi_open)


def rate_ratio(a: Estimate, b: Estimate) -> Estimate:
    """a / b for two max-rate estimates, censoring and interval carried through.

    Each end is an interval: a measured rate lies in [lo, hi], a lower bound in [value, inf),
    an upper bound in (0, value). The ratio's interval is [a_least / b_most, a_most / b_least];
    when one of its ends is open the ratio is a bound, labelled so."""
    if a.value is None or b.value is None:
        return Estimate(None, None, None, UNDEFINED, "a rate is missing")
    a_least, a_most = _span(a)
    b_least, b_most = _span(b)
    lo = _div(a_least, b_most)  # None: not bounded below
    hi = _div(a_most, b_least)  # None: not bounded above
    if a.kind == MEASURED and b.kind == MEASURED:
        if lo is None or hi is None:   # an open interval end: said, never a closed interval
            return Estimate(a.value / b.value, lo, hi, MEASURED, "an interval end is open",
                            lo_open=lo is None, hi_open=hi is None)
        return Estimate(a.value / b.value, lo, hi, MEASURED)
    if a.kind == UPPER_BOUND and b.kind == UPPER_BOUND:
        return Estimate(None, None, None, UNDEFINED, "neither reaches the threshold at the lowest rate tested")
    if a.kind == LOWER_BOUND and b.kind == LOWER_BOUND:
        return Estimate(None, None, None, UNDEFINED, "both still met the threshold at the highest rate tested")
    if a.kind == UPPER_BOUND or b.kind == LOWER_BOUND:  # the ratio is at most value
        why = ("the first never reaches the threshold at the lowest rate tested" if a.kind == UPPER_BOUND
               else "the second still met the threshold at the highest rate tested")
        return Estimate(a.value / b.value, None, hi, UPPER_BOUND, why)
    why = ("the first still met the threshold at the highest rate tested" if a.kind == LOWER_BOUND
           else "the second never reaches the threshold at the lowest rate tested")
    return Estimate(a.value / b.value, lo, None, LOWER_BOUND, why)


def _span(e: Estimate) -> tuple[float | None, float | None]:
    """(least, most) the true rate can be; None where it is open."""
    if e.kind == MEASURED:
        least = None if e.lo_open else (e.lo if e.lo is not None else e.value)
        most = None if e.hi_open else (e.hi if e.hi is not None else e.value)
        return least, most
    if e.kind == LOWER_BOUND:
        return (e.lo if e.lo is not None else e.value), None
    return None, e.value  # UPPER_BOUND: below value


def _div(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y not in (None, 0) else None


def not_below(a: Mapping[float, MeanCI], b: Mapping[float, MeanCI]) -> tuple[bool, list[dict]]:
    """Is curve a never below curve b beyond the intervals, at every rate both measured?
    Below beyond the intervals: a's upper band under b's lower band. Returns (verdict, the
    rates compared with both points)."""
    common = sorted(set(map(float, a)) & set(map(float, b)))
    rows = []
    for r in common:
        pa, pb = a[r], b[r]
        rows.append({"rate": r, "a": pa.mean, "a_hi": pa.hi, "b": pb.mean, "b_lo": pb.lo,
                     "below_beyond_ci": pa.hi < pb.lo})
    return (not any(row["below_beyond_ci"] for row in rows)), rows


def crossing(curve: Mapping[float, float], threshold: float = 0.9) -> Estimate:
    """max_rate of a curve of plain values (one seed, or one bootstrap draw): no bands."""
    return max_rate({r: MeanCI(v, v, v, 1) for r, v in curve.items()}, threshold)


def paired_ratio(a: Mapping[int, Mapping[float, float]], b: Mapping[int, Mapping[float, float]],
                 threshold: float = 0.9, reps: int = 2000, seed: int = 0) -> dict:
    """Ratio of a's max rate to b's, each {seed: {rate: attainment}}, over the seeds and rates
    both measured: the ratio of the mean curves' crossings, its paired-bootstrap 95% interval
    (the same seeds drawn for both) and the ratio on each seed alone.

    A draw where a crossing is censored gives a censored ratio; the interval end such draws
    could move is marked open (lower-bound draws: the upper end is at least `hi`; upper-bound
    draws: the lower end is at most `lo`; undefined draws: both)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("paired_ratio needs seeds both contenders measured")
    rates = sorted(set.intersection(*(set(side[s]) for side in (a, b) for s in seeds)))
    if not rates:
        raise ValueError("paired_ratio needs rates both contenders measured on every shared seed")

    def ratio(draw: Sequence[int]) -> Estimate:
        mean = lambda side: {r: sum(side[s][r] for s in draw) / len(draw) for r in rates}  # noqa: E731
        return rate_ratio(crossing(mean(a), threshold), crossing(mean(b), threshold))

    whole = ratio(seeds)
    per_seed = {str(s): ratio([s]).to_dict() for s in seeds}
    rng = random.Random(seed)
    draws = [ratio([seeds[rng.randrange(len(seeds))] for _ in seeds]) for _ in range(reps)]
    values = sorted(d.value for d in draws if d.value is not None)
    kinds = [d.kind for d in draws]
    lo = values[int(0.025 * len(values))] if values else None
    hi = values[max(0, int(0.975 * len(values)) - 1)] if values else None
    undefined = UNDEFINED in kinds
    return {"value": whole.value, "kind": whole.kind, "note": whole.note, "lo": lo, "hi": hi,
            "lo_open": undefined or UPPER_BOUND in kinds or lo is None,
            "hi_open": undefined or LOWER_BOUND in kinds or hi is None,
            "seeds": seeds, "rates": rates, "reps": reps, "per_seed": per_seed,
            "censored_draws": sum(k != MEASURED for k in kinds)}


def not_below_points(a: Mapping[float, float], b: Mapping[float, float], tolerance: float = 0.03
                     ) -> tuple[bool, list[dict]]:
    """Is curve a at least b - tolerance at every rate both measured, on the point estimates
    (the means)? Returns (verdict, one row per shared rate)."""
    common = sorted(set(map(float, a)) & set(map(float, b)))
    rows = [{"rate": r, "a": a[r], "b": b[r], "below": a[r] < b[r] - tolerance} for r in common]
    return (bool(rows) and not any(row["below"] for row in rows)), rows
