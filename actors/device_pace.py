"""A virtual device slower than the CPU thread that drives it (`EngineConfig.device_slowdown`).

A fleet experiment on a small host needs more devices than it has cores: 16 virtual devices
on 2 cores each get an eighth of a core, and a device that shares a core with seven others
steps at the speed of the busiest moment, not at its own. A paced device instead takes
`slowdown` x the CPU time of each forward and each blocking swap-in: the engine thread does
the work, then sleeps (slowdown - 1) x the CPU seconds the work used. Sleeping frees the core,
so k devices of slowdown >= k run on one core at the pace each would have alone, and a step's
time is set by the thread's CPU time (which other processes do not inflate) rather than by
the wall clock of a shared host.

What stays real: the scheduling, batching, KV blocks, weight slots and every token. What
is emulated: the device's speed, a constant factor on all of its compute. A weight copy
prefetched in the background is not paced (it overlaps compute, as a GPU's async copy does).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Paced:
    """What one paced span added: the seconds slept after its work."""

    extra_s: float = 0.0


class DevicePace:
    def __init__(self, slowdown: float = 1.0, cpu_clock=time.thread_time, sleep=time.sleep):
        if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown >= 1.0):
            raise ValueError(f"device_slowdown must be a finite number >= 1, got {slowdown!r}")
        self.slowdown = float(slowdown)
        self.cpu_clock, self.sleep = cpu_clock, sleep
        self.num_paced = 0
        self.slept_s = 0.0   # all the pauses so far (the share of its time the device is emulated)

    @property
    def active(self) -> bool:
        return self.slowdown > 1.0

    @contextmanager
    def paced(self):
        """Run the body, then pause (slowdown - 1) x the CPU time this thread spent in it."""
        span = Paced()
        if not self.active:
            yield span
            return
        start = self.cpu_clock()
        yield span
        span.extra_s = (self.slowdown - 1.0) * max(0.0, self.cpu_clock() - start)
        self.num_paced += 1
        self.slept_s += span.extra_s
        if span.extra_s > 0:
            self.sleep(span.extra_s)
