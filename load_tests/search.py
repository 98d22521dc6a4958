"""Where a contender's attainment falls below the threshold: bracket, then bisect.

Start at `start`. If the mean attainment there meets the threshold, multiply the rate by
`factor` until it does not (or `max_rate` is passed: the answer is then only a lower
bound); if it already misses, divide (by `down_factor`, default `factor`) until it meets
(or `min_rate` is passed: "never reaches the threshold even at the lowest rate tried").
Then bisect the bracket geometrically until its ends are within `resolution` of each other
(1.1: the max rate is known to 10%). Rates already measured (`known`) are reused, never measured twice.

`measure(rate)` runs every seed at that rate and returns their mean attainment; the caller
keeps the records. Pure logic: the same search drives real runs and its unit tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SearchPlan:
    start: float  # req/s
    threshold: float = 0.9
    factor: float = 2.0  # bracketing step
    resolution: float = 1.1  # stop when hi / lo <= this
    min_rate: float | None = None  # lowest rate to go down to (None: the start)
    max_rate: float | None = None  # highest rate to go up to (None: unbounded)
    down_factor: float | None = None  # step when dividing down from a missed start (None: factor)

    def __post_init__(self) -> None:
        if not self.start > 0:
            raise ValueError(f"start must be > 0, got {self.start!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if not self.factor > 1:
            raise ValueError(f"factor must be > 1, got {self.factor!r}")
        if not 1 < self.resolution <= self.factor:
            raise ValueError(f"resolution must be in (1, factor], got {self.resolution!r}")
        if self.min_rate is not None and not 0 < self.min_rate <= self.start:
            raise ValueError(f"min_rate must be in (0, start], got {self.min_rate!r}")
        if self.max_rate is not None and not self.max_rate >= self.start:
            raise ValueError(f"max_rate must be >= start, got {self.max_rate!r}")
        if self.down_factor is not None and not self.down_factor > 1:
            raise ValueError(f"down_factor must be > 1, got {self.down_factor!r}")


@dataclass(frozen=True)
class SearchResult:
    lo: float | None  # highest rate that met the threshold (None: none did)
    hi: float | None  # lowest rate above lo that missed it (None: none did)
    visited: tuple[float, ...]  # in the order measured (known rates included when used)


def find_max_rate(measure: Callable[[float], float], plan: SearchPlan,
                  known: dict[float, float] | None = None) -> SearchResult:
    seen = {} if known is None else known
    visited: list[float] = []

    def ok(rate: float) -> bool:
        rate = _round(rate)
        if rate not in seen:
            seen[rate] = float(measure(rate))
        visited.append(rate)
        return seen[rate] >= plan.threshold

    eps = 1e-9
    rate = plan.start
    lo = hi = None
    if ok(rate):
        lo = rate
        while True:
            up = rate * plan.factor
            if plan.max_rate is not None and up > plan.max_rate * (1 + eps):
                return SearchResult(_round(lo), None, tuple(visited))
            if not ok(up):
                hi = up
                break
            lo = rate = up
    else:
        hi = rate
        floor = plan.min_rate if plan.min_rate is not None else plan.start
        while True:
            down = rate / (plan.down_factor or plan.factor)
            if down < floor * (1 - eps):
                return SearchResult(None, _round(hi), tuple(visited))
            if ok(down):
                lo = down
                break
            hi = rate = down
    while hi / lo > plan.resolution * (1 + eps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(_round(lo), _round(hi), tuple(visited))


def doubling_grid(start: float, top: float, factor: float = 2.0) -> list[float]:
    """start, start * factor, ... up to and including the first rate >= top."""
    if not start > 0 or not top >= start or not factor > 1:
        raise ValueError(f"need 0 < start <= top and factor > 1, got {start}, {top}, {factor}")
    rates = [start]
    while rates[-1] < top * (1 - 1e-9):
        rates.append(rates[-1] * factor)
    return [_round(r) for r in rates]


def _round(rate: float) -> float:
    # rates are keys of records and JSON: 4 significant digits keep them stable across runs
    return float(f"{rate:.4g}")
