"""TTFT slack: how long a switch to a waiting model can wait, as a pure function.

Aegaeon's quota rule (scheduler/quota.py) plans turns from the TBT SLO alone: a request that
arrives for a model with no decode batch is prefilled at the next turn boundary, and its
batch joins the rounds. Every batch added to a round lengthens it, and every stream's gaps
with it. When the TTFT budget is generous that switch can wait: request-level multiplexing,
which keeps one model's batch decoding until it is done, holds mean TPOT at loose TTFT SLOs
(at TTFT:TPOT = 100 it served 2.5-3x the rate token-level did). So a switch waits while the
waiting requests can still make their TTFT, and is made once one of them would not.

Derivation. Let the waiting requests of models that have no decode batch form groups (each
model's queue, oldest first, in groups of up to max_prefill_group, as they would be
prefilled), group k with TTFT deadline D_k (its earliest arrival + TTFT SLO) and cost c_k
(the switch to its model, zero when resident, plus its prefill, both from the estimator).
Served one after the other in deadline order (EDF, optimal for meeting deadlines on one
device), group k's first token comes at start + sum_{j<=k} c_j; every deadline is met when

    start <= S = min_k ( D_k - sum_{j<=k} c_j )

S is the latest start of the whole backlog. The policy only decides at turn boundaries, and
once it has decided the device runs at most a round of the current batches (the round's
switches and quotas, T0 of scheduler/overload.py) and a multi-step run before it can act.
And a first token on its deadline is not enough: token k is due by arrival + TTFT + k x TBT
(Aegaeon's per-token measure), and once the group's batch joins, a round T1 (the rounds with
it) may pass before each of its turns, so it must start a round early. The switch is due when

    now + margin >= S,   margin = T0 + one run + T1

(Without T1 the planner's strict attainment fell: synth-16-0.1-1.0-1.0 needed 4 H100s, not 3.)

Predicted costs are doubled (`SAFETY`): an estimate that misses by 2x costs one request its
TTFT, while waiting a little less costs the running batches only a slightly earlier switch.
While not due, the running batches keep decoding (fewer batches in a round: longer turns,
fewer switches, as request-level); requests of models that already decode still join their
batch (no switch). When the TTFT SLO is tight, S - margin is already past at arrival and
every switch is due at once: the rule above, unchanged, is the tight end of this one. When
nothing decodes the switch is always due (the device would idle).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

SAFETY = 2.0  # predicted switch + prefill costs are doubled (see the module docstring)


@dataclass(frozen=True)
class PendingGroup:
    """A group of waiting requests of a model with no decode batch, as it would be prefilled."""

    model: str
    deadline_s: float  # the earliest TTFT deadline of its requests (arrival + TTFT SLO)
    cost_s: float  # predicted switch to its model (0 when resident) + its prefill

    def __post_init__(self) -> None:
        if not self.cost_s >= 0:
            raise ValueError(f"group of {self.model!r}: cost_s must be >= 0, got {self.cost_s!r}")


def latest_start(groups: Iterable[PendingGroup], safety: float = SAFETY) -> float:
    """S = min_k (D_k - safety x sum_{j<=k} c_j) over the groups in deadline order: the latest
    time serving them one after another still meets every deadline (inf: no group)."""
    spent, start = 0.0, math.inf
    for group in sorted(groups, key=lambda g: (g.deadline_s, g.model)):
        spent += safety * group.cost_s
        start = min(start, group.deadline_s - spent)
    return start


def switch_due(groups: Iterable[PendingGroup], now: float, margin_s: float, safety: float = SAFETY) -> bool:
    """Must a switch to a waiting group be made now, for every group to meet its TTFT?"""
    if not margin_s >= 0:
        raise ValueError(f"margin_s must be >= 0, got {margin_s!r}")
    return now + margin_s >= latest_start(groups, safety)
