"""Sustained points: a rate offered long enough to say whether the system holds it.

A point of 60 requests that arrive within a few seconds is a burst: it says how a system
drains a backlog, not whether it keeps up with a rate. A sustained point offers its rate for
a warm-up (left out of the score) and then a scored window of at least `sustain_s` seconds
and at least `sustain_requests` expected requests:

    window_s(rate) = max(sustain_s, sustain_requests / rate)
    arrivals       = the trace's own process (Gamma, Poisson, on/off, or a file's gaps)
                     time-scaled from its nominal rate to `rate`, cut at warmup_s + window_s

A rate is *held* when the queue (requests arrived and not yet finished, failed ones
included) at the end of the scored window is no longer than at its start: a system that
falls behind ends the window with a longer queue than it began it with, however well the
requests it did finish were served. Scores count only requests arriving in the window.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from cluster.planner.metrics import RequestRecord
from cluster.planner.workloads import Workload


@dataclass(frozen=True)
class SustainSpec:
    """How long each measured point offers its rate (seconds, requests)."""

    sustain_s: float = 60.0  # the scored window lasts at least this long
    sustain_requests: int = 300  # ... and long enough to expect at least this many arrivals
    warmup_s: float = 10.0  # offered before the window, left out of the score

    def __post_init__(self) -> None:
        if not self.sustain_s > 0:
            raise ValueError(f"sustain_s must be > 0, got {self.sustain_s!r}")
        if self.sustain_requests < 1:
            raise ValueError(f"sustain_requests must be >= 1, got {self.sustain_requests!r}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s!r}")

    def window_s(self, rate: float) -> float:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate!r}")
        return max(self.sustain_s, self.sustain_requests / rate)

    def offered_s(self, rate: float) -> float:
        """Warm-up plus scored window: how long arrivals are sent at `rate`."""
        return self.warmup_s + self.window_s(rate)

    def workload(self, sample: Workload, rate: float, nominal_rate: float) -> Workload:
        """`sample` (drawn at `nominal_rate` over at least `draw_span(rate, self, nominal_rate)`
        seconds) time-scaled to `rate` and cut at the offered span."""
        if not nominal_rate > 0:
            raise ValueError(f"nominal_rate must be > 0, got {nominal_rate!r}")
        if not sample.requests:
            raise ValueError("an empty sample cannot be sustained")
        scaled = sample.window(sample[0].arrival_s).time_scaled(rate / nominal_rate)
        return scaled.window(0.0, self.offered_s(rate))

    def scored(self, records: Sequence[RequestRecord], rate: float) -> list[RequestRecord]:
        """The records of requests that arrived in the scored window."""
        end = self.offered_s(rate)
        return [r for r in records if self.warmup_s <= r.arrival < end]

    def held(self, records: Sequence[RequestRecord], rate: float) -> dict:
        """Queue at the start and the end of the scored window, and whether the rate was held."""
        start, end = self.warmup_s, self.offered_s(rate)
        q0, q1 = queue_at(records, start), queue_at(records, end)
        return {"queue_start": q0, "queue_end": q1, "held": q1 <= q0,
                "window_s": round(end - start, 6), "warmup_s": self.warmup_s}

    def to_dict(self) -> dict:
        return asdict(self)


def queue_at(records: Sequence[RequestRecord], t: float) -> int:
    """Requests arrived by t and not finished by t (one without an end never finished)."""
    return sum(1 for r in records if r.arrival <= t and (r.end is None or r.end > t))


def draw_span(rate: float, spec: SustainSpec, nominal_rate: float = 1.0, margin: float = 1.2) -> float:
    """Seconds of a sample drawn at `nominal_rate` that cover a sustained point at `rate`."""
    return math.ceil(margin * spec.offered_s(rate) * rate / nominal_rate) + 1.0
