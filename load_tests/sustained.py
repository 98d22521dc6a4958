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
requests it did finish were served. The queue of a system that keeps up still jitters by a
request or two (one arriving just before the window ends is in service, not a backlog), so
each end is the queue's mean over a tenth of the window (HELD_PROBE_FRAC), and the end may
exceed the start by HELD_TOLERANCE requests; a backlog that grows with time exceeds both
within seconds. Scores count only requests arriving in the window.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from cluster.planner.metrics import RequestRecord
from cluster.planner.workloads import Workload

HELD_PROBE_FRAC = 0.1  # each end's queue: its mean over this share of the scored window
HELD_TOLERANCE = 1.0  # requests the end's queue may exceed the start's by (the one in service)
PROBE_SAMPLES = 20


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
        """Queue at the start and the end of the scored window (each its mean over a tenth of
        the window), and whether the rate was held (see the module docstring)."""
        start, end = self.warmup_s, self.offered_s(rate)
        probe = HELD_PROBE_FRAC * (end - start)
        q0, q1 = mean_queue(records, start, start + probe), mean_queue(records, end - probe, end)
        return {"queue_start": round(q0, 3), "queue_end": round(q1, 3), "held": q1 <= q0 + HELD_TOLERANCE,
                "window_s": round(end - start, 6), "warmup_s": self.warmup_s}

    def to_dict(self) -> dict:
        return asdict(self)


def queue_at(records: Sequence[RequestRecord], t: float) -> int:
    """Requests arrived by t and not finished by t (one without an end never finished)."""
    return sum(1 for r in records if r.arrival <= t and (r.end is None or r.end > t))


def mean_queue(records: Sequence[RequestRecord], t0: float, t1: float) -> float:
    """The queue's mean over [t0, t1], sampled at PROBE_SAMPLES evenly spaced times."""
    times = [t0 + (t1 - t0) * k / (PROBE_SAMPLES - 1) for k in range(PROBE_SAMPLES)]
    return sum(queue_at(records, t) for t in times) / len(times)


def draw_span(rate: float, spec: SustainSpec, nominal_rate: float = 1.0, margin: float = 1.2) -> float:
    """Seconds of a sample drawn at `nominal_rate` that cover a sustained point at `rate`."""
    return math.ceil(margin * spec.offered_s(rate) * rate / nominal_rate) + 1.0
