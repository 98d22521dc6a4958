"""What a step costs outside its forward and switch: scheduling, sampling, emitting, and the
worker's own work between steps, measured from the gaps between schedule calls.

A step's overhead is (this schedule call - the last one - the forward and switch times the
engine reported), shared by the steps of a multi-step run. Two figures come out of it: the
per-step overhead (an EWMA, added to every predicted decode step: a real share of a small
model's step) and a decode run's fixed cost beyond its steps' share (`turn_cost_s`: the
intercept of the runs' overhead against their steps), which free-switch turns amortise
(scheduler/quota.py). A gap longer than `_OVERHEAD_MAX_S` is a pause (GC, commands), and the
gap after the device went idle is no step's overhead.
"""
from __future__ import annotations

from scheduler.estimator import OnlineLinearFit

_OVERHEAD_EWMA = 0.05  # weight of each new per-step overhead sample
_OVERHEAD_MAX_S = 0.05  # a longer gap between steps is a pause (GC, commands), not overhead


class StepOverhead:
    def __init__(self) -> None:
        self.step_s = 0.0  # EWMA of a step's wall time outside the forward and switch
        self._run_fit = OnlineLinearFit(2)  # a decode run's overhead: a fixed cost + a cost per step
        self._last: tuple[float, float, int, bool] | None = None  # (scheduled at, forward + switch s, steps, decode)
        self._planned_steps = 1  # steps the latest output allowed

    def scheduled(self, now: float, decode: bool, num_steps: int) -> None:
        """An output was scheduled at `now`, allowing `num_steps` steps."""
        self._last = (now, 0.0, 0, decode)
        self._planned_steps = num_steps

    def stepped(self, spent_s: float) -> None:
        """One of its steps ran: `spent_s` of forward and switch (a multi-step run's add up)."""
        if self._last is not None:
            start, busy, steps, decode = self._last
            self._last = (start, busy + spent_s, steps + 1, decode)

    def idle(self) -> None:
        """The device goes idle: the next gap is not a step's overhead."""
        self._last = None

    def observe(self, now: float) -> bool:
        """Learn from the gap since the last output was scheduled (the next schedule call is
        at `now`). True when that output ran all the steps it allowed."""
        last, self._last = self._last, None
        if last is None or not last[2]:
            return False
        start, busy, steps, decode = last
        total = now - start - busy
        sample = total / steps
        if 0.0 <= sample <= _OVERHEAD_MAX_S:
            self.step_s += _OVERHEAD_EWMA * (sample - self.step_s)
            if decode:
                self._run_fit.observe((1.0, float(steps)), total)
        return steps >= self._planned_steps

    @property
    def turn_cost_s(self) -> float:
        """What a decode run costs outside its forward beyond its steps' own share (scheduling
        it, emitting its frames): the intercept of the runs' overhead against their steps."""
        coef = self._run_fit.coef
        return max(0.0, coef[0]) if coef else 0.0
