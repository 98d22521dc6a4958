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
gives an upper bound (below the lowest rate tested). A ratio of two such rates carries the
interval of both ends (lo_a / hi_b, hi_a / lo_b) and the censoring of either.
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
        ci = f" [{_fmt(self.lo)}, {_fmt(self.hi)}]" if self.lo is not None and self.hi is not None else ""
        return fmt + ci


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
    lo = lowest if lo_band == -math.inf else lo_band
    hi = highest if hi_band is None else hi_band
    return Estimate(mid, lo, hi, MEASURED)


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
        return (e.lo if e.lo is not None else e.value), (e.hi if e.hi is not None else e.value)
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
