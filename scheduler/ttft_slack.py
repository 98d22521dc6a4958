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
Once due, only the groups that must start now may: the shortest prefix of the deadline order
that holds every group k with now + margin >= D_k - sum_{j<=k} c_j (`due_groups`). The groups
after it still meet their deadlines served after it, so they wait; before, one due group let
every waiting group into the round, and a backlog that had waited out its slack started all at
once, stretching every stream's gaps. While not due, the running batches keep decoding (fewer
batches in a round: longer turns, fewer switches, as request-level); requests of models that
already decode still join their batch (no switch). When the TTFT SLO is tight, S - margin is
already past at arrival and every switch is due at once: the rule above, unchanged, is the
tight end of this one. When nothing decodes the switch is always due (the device would idle).

Per-token deadlines (`slo_measure="per_token"`, Aegaeon's measure and the planner's strict one).
There token k is due by arrival + TTFT + k x TBT, so what a stream's later tokens can absorb
(the switches and prefills of groups that arrive while it decodes) is only the lead its first
token had on its deadline. A first token planned for its deadline leaves none: the planner's
strict attainment at synth-10-0.1-1.0-1.0 fell from 0.99 to 0.91 at 2 H100s, and its answer
rose from 2 GPUs to 4. So under per-token deadlines a group plans its first token by arrival +
(1 - PER_TOKEN_RESERVE) x TTFT, banking the rest for its stream. Under mean TPOT (the default)
a late first token costs its stream nothing later, and no reserve is kept: with one, the load
test at TTFT:TPOT = 100 lost goodput (0.73 against 0.89 at 31.7 req/s, bursty), since waiting
less is how a loose TTFT is used at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

SAFETY = 2.0  # predicted switch + prefill costs are doubled (see the module docstring)
PER_TOKEN_RESERVE = 0.5  # per-token deadlines: the share of the TTFT budget a first token leaves its stream


@dataclass(frozen=True)
class PendingGroup:
    """A group of waiting requests of a model with no decode batch, as it would be prefilled."""

    model: str
    deadline_s: float  # the earliest planned first token of its requests (`planned_deadline`)
    cost_s: float  # predicted switch to its model (0 when resident) + its prefill

    def __post_init__(self) -> None:
        if not self.cost_s >= 0:
            raise ValueError(f"group of {self.model!r}: cost_s must be >= 0, got {self.cost_s!r}")


def planned_deadline(arrival_s: float, ttft_s: float, per_token: bool) -> float:
    """When a waiting request's first token is planned: its TTFT deadline, or under per-token
    deadlines PER_TOKEN_RESERVE of the budget before it (see the module docstring)."""
    return arrival_s + (1.0 - PER_TOKEN_RESERVE if per_token else 1.0) * ttft_s


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
    return bool(due_groups(groups, now, margin_s, safety))


def due_groups(groups: Iterable[PendingGroup], now: float, margin_s: float,
               safety: float = SAFETY) -> list[PendingGroup]:
    """The groups that must start now, in deadline order: the shortest EDF prefix that holds
    every group whose latest start (D_k - safety x sum_{j<=k} c_j) is now + margin or
    earlier (empty: no switch is due). The groups after it can still wait."""
    if not margin_s >= 0:
        raise ValueError(f"margin_s must be >= 0, got {margin_s!r}")
    order = sorted(groups, key=lambda g: (g.deadline_s, g.model))
    spent, end = 0.0, 0
    for k, group in enumerate(order):
        spent += safety * group.cost_s
        if now + margin_s >= group.deadline_s - spent:
            end = k + 1
    return order[:end]
