"""The token-level policy's round planning: which decode batches a round serves, in what
order, with what quotas, and when a switch to a model with no decode batch is due.

A round: the decode batches that have work, each given its time quota by the quota rule
(scheduler/quota.py): first the batches started (prefilled) since the last round, in the
order they started, then the batch whose decode turn was longest ago (round-robin while every
batch is served; a batch that just had its turn waits for the others, and one that just had
its first token does not: its next is due a TBT later).

Under overload control (scheduler/overload.py) a round whose alpha exceeds 1 serves the
largest set of batches that fits, least slack first, and holds the rest; waiting groups of
models not decoding compete for it too, and those it takes are `reserved` (prefilled first,
their batches decoding from the next round).

A tensor-parallel group this device follows (a member's: its leader decides the group's
turns) is one more batch of each round (scheduler/group_turns.py): counted in alpha, the
quotas and T0, never in the turn order nor held.

TTFT slack (scheduler/ttft_slack.py): a switch away from the running batches is due once a
waiting group would otherwise miss its TTFT, given what the device runs before the policy
can act again (this round T0, a multi-step run) and a round with the group's batch in it
(T1), and then only for the groups that must start now (`due_models`). Always when nothing
decodes.
"""
from __future__ import annotations

import logging
import math
from collections import deque

from scheduler.batch_loads import BatchLoads
from scheduler.overload import BatchLoad, RoundPlan, RoundRule, plan_round, select_round
from scheduler.policy_view import PolicyView
from scheduler.ttft_slack import PendingGroup, due_groups, planned_deadline

logger = logging.getLogger(__name__)


class RoundPlanner:
    def __init__(self, view: PolicyView, loads: BatchLoads) -> None:
        self.view = view
        self.loads = loads
        self._order: deque[str] = deque()  # batches still to take a turn in this round
        self._quotas: dict[str, float] = {}
        self._reserved: dict[str, list[str]] = {}  # waiting groups the round took in: model -> ids
        self.held: tuple[str, ...] = ()  # decoding models held out of the latest round
        self.alpha: float | None = None  # alpha of the latest round (mean TBT / TBT SLO)
        self.alpha_all: float | None = None  # alpha had every batch been served (overload signal)
        self.num_held_rounds = 0  # rounds that held at least one batch
        self.decode_s = 0.0  # the latest round's decode time T0 (switches + quotas)
        # what the latest plan weighed: the batches (decoding and waiting) and the slack guard
        self.candidates: tuple[BatchLoad, ...] = ()
        self.guard_s = 0.0
        # model -> (0 while its batch has had no decode turn since it started, 1 after; the number
        # of the output that started it or of its latest decode turn): the round order's key
        self._served: dict[str, tuple[int, int]] = {}
        self._num_outputs = 0
        self._due: tuple[float, frozenset[str]] | None = None  # (now, the due models then): due_models' cache

    # -- the round -----------------------------------------------------------------------

    @property
    def order(self) -> tuple[str, ...]:
        """The batches still to take a turn in this round, in turn order."""
        return tuple(self._order)

    @property
    def quotas(self) -> dict[str, float]:
        """Decode time quota of each model in the current round, seconds (inf: a batch alone)."""
        return dict(self._quotas)

    def quota(self, model: str) -> float:
        return self._quotas.get(model, math.inf)

    @property
    def reserved(self) -> tuple[str, ...]:
        """Models whose waiting groups the round took in, not yet prefilled (`pop_reserved`)."""
        return tuple(self._reserved)

    def next_turn(self) -> str | None:
        """The next batch of the round to take its turn (it leaves the round), or None."""
        return self._order.popleft() if self._order else None

    def requeue(self, model: str) -> None:
        """`model` takes another turn at the end of this round (a slice of its quota is left)."""
        self._order.append(model)

    def pop_reserved(self) -> tuple[str, list[str]] | None:
        """The first reserved group, which leaves the reservations, or None."""
        if not self._reserved:
            return None
        model = next(iter(self._reserved))
        return model, self._reserved.pop(model)

    def ran(self, model: str, prefill: bool = False, starts: bool = False) -> None:
        """An output of `model` was scheduled: a decode turn puts its batch after the others in
        the round order, and a prefill that `starts` its batch (the model had none) puts it
        first, after the batches started before it. A prefill that joins a batch moves nothing."""
        self._num_outputs += 1
        if not prefill:
            self._served[model] = (1, self._num_outputs)
        elif starts:
            self._served[model] = (0, self._num_outputs)

    def plan(self, now: float) -> RoundPlan | None:
        """Start a new round: choose its batches (all of them unless overloaded), order them
        (batches just started, then by their latest decode turn, longest ago first) and give
        each its quota. None: nothing decodes."""
        p, loads_of = self.view, self.loads
        names = list(p.models)
        models = [m for m in names if loads_of.decoding(m)]
        self._reserved = {}
        if not models:
            self._order, self.held = deque(), ()
            return None
        followed = loads_of.group_loads(now)   # a group this device follows takes its share of the round
        loads = [loads_of.load(m, now) for m in models] + followed
        rule = loads_of.rule()
        everyone = plan_round(loads, rule)
        self.alpha_all = everyone.alpha
        if p.config.overload_control:
            # waiting requests of models not decoding compete for the round too: a batch that
            # has banked slack (ran ahead of its TBT) can sit out a round for one whose first
            # token is due
            due = self.due_models(now)
            groups = {m: loads_of.serving_order(m, now, p.config.max_prefill_group)
                      for m in names if p.waiting[m] and m not in models and m in due}
            prospective = [loads_of.waiting_load(m, now, g) for m, g in groups.items()]
            # a decoding batch sits out a round for a waiting one only with two rounds of slack
            guard = 2 * everyone.decode_s
            self.candidates, self.guard_s = tuple(loads + prospective), guard
            plan = select_round(loads + prospective, rule, p.admission_alpha, guard)
            self._reserved = {m: [r.request_id for r in groups[m]] for m in plan.models if m in groups}
        else:
            self.candidates, self.guard_s = tuple(loads), 0.0
            plan = everyone
        plan = _with_followed(plan, followed, self.candidates, rule)
        if plan.held:
            self.num_held_rounds += 1
        self.held = tuple(m for m in plan.held if m in models)
        served = [m for m in models if m in plan.models]
        if self._reserved and served:   # quotas of the batches decoding now; reserved ones start next round
            plan = plan_round([b for b in loads if b.model in served] + followed, rule)
        # a batch just started goes first, then the one whose decode turn was longest ago:
        # round-robin while every batch is served; a batch that just had its turn waits for the
        # others, and one that just had its first token (prefill) does not wait a whole round
        self._order = deque(sorted(served, key=self._turn_key))
        self._quotas = {m: q for m, q in zip(plan.models, plan.quota.quotas_s)
                        if m not in {b.model for b in followed}}
        self.decode_s = plan.decode_s
        self._due = None
        self.alpha = plan.alpha
        logger.debug("new round %s held %s reserved %s alpha=%.3f (all: %.3f) quotas=%s", list(self._order),
                     self.held, list(self._reserved), plan.alpha, everyone.alpha, plan.quota.quotas_s)
        return plan

    def next_batch_after(self, current: str) -> str | None:
        """The decoding batch expected to run after `current`'s turn: the next of this round,
        else the one the next round starts with (`_turn_key`)."""
        for model in self._order:
            if model != current and self.loads.decoding(model):
                return model
        others = [m for m in self.view.models if m != current and self.loads.decoding(m)]
        return min(others, key=self._turn_key) if others else None

    def _turn_key(self, model: str) -> tuple[int, int]:
        """A batch's place in the round order, smallest first (see `ran`)."""
        return self._served.get(model, (0, 0))

    # -- TTFT slack (scheduler/ttft_slack.py) ---------------------------------------------

    def forget_due(self) -> None:
        """Arrivals and finished requests since the last schedule call change what is due."""
        self._due = None

    def switch_due(self, now: float) -> bool:
        """May a model with no decode batch start one now (a switch away from the running
        batches)? Always when nothing decodes; else once a waiting group would otherwise miss
        its TTFT (scheduler/ttft_slack.py)."""
        return bool(self.due_models(now))

    def due_models(self, now: float) -> frozenset[str]:
        """The models with no decode batch whose waiting groups may start now: every waiting
        one when nothing decodes (or without TTFT slack), else those of the groups that must
        start now for every group to meet its TTFT (ttft_slack.due_groups); the rest wait."""
        if self._due is not None and self._due[0] == now:
            return self._due[1]
        p, config = self.view, self.view.config
        decoding = self.loads.decoding_models()
        waiting = frozenset(m for m, q in p.waiting.items() if q and m not in decoding)
        due = waiting
        if decoding and config.ttft_slack and waiting:
            groups = self.pending_groups(set(decoding), now)
            run_s = config.max_decode_steps * max(self.loads.predict_decode(m) for m in decoding)
            margin = self.decode_s + run_s + self._joined_round_s(groups, now)
            due = frozenset(g.model for g in due_groups(groups, now, margin))
        self._due = (now, due)
        return due

    def pending_groups(self, decoding: set[str], now: float) -> list[PendingGroup]:
        """The waiting requests of models not decoding, in the groups they would be prefilled in
        (on time first, deadlines.serving_order)."""
        p = self.view
        size = p.config.max_prefill_group
        per_token = p.config.per_token
        groups = []
        for model, queue in p.waiting.items():
            if not queue or model in decoding:
                continue
            switch = 0.0 if model in p.resident else p.estimator.predict_switch(model)
            requests = self.loads.serving_order(model, now)
            for i in range(0, len(requests), size):
                group = requests[i: i + size]
                prefill = p.estimator.predict_prefill(model, sum(r.num_new_tokens for r in group), len(group))
                deadline = min(planned_deadline(r.arrival_time, r.slo.ttft_s, per_token) for r in group)
                groups.append(PendingGroup(model, deadline, switch + prefill))
        return groups

    def _joined_round_s(self, groups: list[PendingGroup], now: float) -> float:
        """A round's length once the most urgent group's batch has joined the decoding ones:
        its tokens' deadlines (arrival + TTFT + k x TBT) hold only if it starts that much
        before its TTFT deadline, since a round may pass before each of its turns."""
        first = min(groups, key=lambda g: (g.deadline_s, g.model)).model
        size = self.view.config.max_prefill_group
        loads = [self.loads.load(m, now) for m in self.loads.decoding_models()] + self.loads.group_loads(now)
        loads.append(self.loads.load(first, now, extra=self.loads.serving_order(first, now, size)))
        return plan_round(loads, self.loads.rule()).decode_s


def _with_followed(plan: RoundPlan, followed: list[BatchLoad], candidates: tuple[BatchLoad, ...],
                   rule: RoundRule) -> RoundPlan:
    """`plan` with every followed group in it: a round may not hold them (their leader decides
    their turns), so one overload control held is counted in its round all the same."""
    names = {b.model for b in followed}
    if not names & set(plan.held):
        return plan
    served = [b for b in candidates if b.model in plan.models or b.model in names]
    again = plan_round(served, rule)
    return RoundPlan(again.models, tuple(m for m in plan.held if m not in names), again.quota, again.decode_s)
