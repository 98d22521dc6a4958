"""How each measured point is driven: the run settings, and a workload time-scaled to a rate.

Sustained points (`settings.sustain`, load_tests/sustained.py) offer each rate for a warm-up
and a scored window of its own length, arrivals drawn from the trace's process and
time-scaled to the rate. Burst points (no `sustain`), the older form kept for the published
presets: rate sweeps replay the same requests time-scaled: the first `max_requests` of a seed's
workload (arrival times, models, lengths) are sent at every rate, compressed by
rate / base_rate, so rates differ only in how close together the requests come (bursts
keep their shape: workloads.Gamma never puts two arrivals at one instant). A pause between
points (`settle_s`) keeps one point from leaking into the next. The experiments that use
this are in load_tests/experiment.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from cluster.planner.workloads import Workload
from load_tests.sustained import SustainSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    """How each point is driven; the same for every contender."""

    max_requests: int = 60
    duration_s: float | None = None  # cut each point's arrivals at this many seconds
    request_timeout_s: float = 60.0
    settle_s: float = 1.0  # pause between points
    vocab_size: int = 2048  # prompts are token ids below this
    seed: int = 0
    progress: bool = False
    idle_skip_s: float | None = None  # skip idle stretches longer than this (driver.run)
    sustain: SustainSpec | None = None  # sustained points (load_tests/sustained.py); None: bursts of max_requests

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if self.idle_skip_s is not None and not self.idle_skip_s > 0:
            raise ValueError(f"idle_skip_s must be > 0 or None, got {self.idle_skip_s!r}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s!r}")


def base_rate(workload: Workload) -> float:
    """Arrivals per second of a workload: (n - 1) gaps over its span."""
    if len(workload) < 2 or workload.duration_s <= 0:
        raise ValueError("a workload needs at least two requests at distinct times to have a rate")
    return (len(workload) - 1) / (workload.duration_s - workload[0].arrival_s)


def at_rate(workload: Workload, rate: float, settings: RunSettings) -> Workload:
    """The first max_requests requests of `workload`, the first at time 0, time-scaled to
    `rate` arrivals/s ((n - 1) gaps over the span)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if not workload.requests:
        raise ValueError("an empty workload has no rate")
    head = workload.window(workload[0].arrival_s, None, settings.max_requests)
    scaled = head.time_scaled(rate / base_rate(head))
    return scaled.window(0.0, settings.duration_s) if settings.duration_s else scaled
