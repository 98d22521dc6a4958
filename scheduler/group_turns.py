"""The turns a tensor-parallel group takes on a device whose policy does not decide them.

A member of a group (actors/tp_member.py) runs each of the leader's steps between its own, so
the group's decode steps occupy its device like one more batch of its round, although its
policy never schedules them. Counted as such a batch, with its step time measured here and
its TBT SLO, the group takes its share of the round in the quota rule (scheduler/quota.py):
alpha counts it (S grows by step / TBT of the group) and the device's own batches' quotas
still come from their own TBT SLOs, so both stay within their SLOs together, or overload
control holds the device's own batches (the group's are not this policy's to hold).

A group is counted while it steps here: until `ACTIVE_TBTS` of its TBT SLOs have passed
since its latest decode step (its batch ended, or it is held by its leader's overload control).
The leader needs none of this: the group is a batch of its own round, and a step that waits
for a member busy with its own models is measured as a longer step there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.overload import BatchLoad

ACTIVE_TBTS = 10.0     # a group whose latest decode step is older than this many TBT SLOs is not counted
STEP_EMA_WEIGHT = 0.2  # of the newest step: follows a change of the group's batch within ~5 steps


@dataclass
class _Group:
    tbt_slo_s: float
    step_s: float
    last_step: float


class GroupTurns:
    """Decode steps of the tensor-parallel groups this device follows, per model."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}

    def stepped(self, model: str, tbt_slo_s: float, step_s: float, now: float) -> None:
        """One decode step of `model`'s group ran here for `step_s`, its batch's tightest TBT
        SLO `tbt_slo_s`, ending at `now`."""
        if not (tbt_slo_s > 0 and step_s > 0 and math.isfinite(now)):
            raise ValueError(f"group {model!r}: TBT SLO and step time must be > 0 and now finite, "
                             f"got {tbt_slo_s!r}, {step_s!r}, {now!r}")
        group = self._groups.get(model)
        if group is None:
            self._groups[model] = _Group(tbt_slo_s, step_s, now)
            return
        group.tbt_slo_s = tbt_slo_s
        group.step_s += STEP_EMA_WEIGHT * (step_s - group.step_s)
        group.last_step = max(group.last_step, now)

    def forget(self, model: str) -> None:
        """`model` is no longer followed here (unregistered)."""
        self._groups.pop(model, None)

    def loads(self, now: float, switch_s) -> list[BatchLoad]:
        """The active groups as batches of this device's next round: `switch_s(model)` is
        what a swap-in of the group's weights costs here. Their slack is -inf: a round never
        holds them (their leader decides their turns)."""
        return [BatchLoad(m, g.tbt_slo_s, g.step_s, switch_s(m), -math.inf)
                for m, g in sorted(self._groups.items())
                if now - g.last_step <= ACTIVE_TBTS * g.tbt_slo_s]

    def active(self, now: float) -> tuple[str, ...]:
        """The groups counted in a round that starts at `now`."""
        return tuple(b.model for b in self.loads(now, lambda m: 0.0))
