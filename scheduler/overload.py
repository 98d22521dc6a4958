"""Overload control of the token-level scheduler: which batches a round serves, and how much
prefill it can take, when the quota rule says the device cannot keep every stream on time.

The quota rule (scheduler/quota.py) gives every decode batch of a round the same fraction
alpha of its TBT SLO as mean TBT. alpha <= 1: every stream keeps its SLO and the device is
shared among all. alpha > 1 (more batches than the device can turn over inside their TBT
budgets): sharing among all makes every stream late, every token of every request. Instead
the round serves the largest set of batches that fits, least slack first, and holds the rest
(their KV stays where it is: on the device, or swapped to the host under memory pressure)
until a round has room. A held batch's slack shrinks while it waits, so it comes first once
room appears: nothing starves while the batches it waits behind finish.

Slack is time banked against the SLO: a stream's next token is due at first + k * TBT (its
pace: the mean-TPOT budget were it to end with that token), a waiting request's first token
at arrival + TTFT. A stream whose last token would be late even were it to run at full speed
to max_tokens (first + (max_tokens - 1) * TBT, less its remaining tokens at its batch's step
time) is lost at any length: when every stream of a batch is lost the batch goes last, like
a late first token, since serving it saves no request. Waiting requests of
models not decoding compete for the round too, so a stream that ran ahead of its TBT can sit
out a round for a request whose first token is due. Two guards keep that from turning into
every stream falling behind together (EDF's domino under overload): a decoding batch with
less than `guard_s` of slack (two rounds) is never passed by a waiting one, and a waiting
request whose first token is already late goes last (rushing it saves nothing: its TTFT is
lost under either measure; it still runs once no on-time request waits). It once went back
to the front when late by 3x its TTFT SLO (`LATE_AGE`), which bounded its wait (the chaos
bench's accepted TTFT p99) but, past capacity, turned the queue into FCFS over late requests:
token-level fell below request-level on the load test (deadlines.py). A lost stream is aged
once it has gone 1.5x its TTFT SLO without a token (deadlines.STALL_AGE): its blocks are held,
and only finishing it frees them.

Prefill takes device time from the round too. A round of decode time T0 = c0 + sum q_i gives
batch i q_i / d_i tokens, so its mean TBT is alpha * TBT_i; prefill time P spent inside the
round stretches that to alpha * TBT_i * (T0 + P) / T0. Keeping it <= TBT_i leaves the round a
prefill budget of

    P <= T0 * (1 / alpha - 1)

and a new request is admitted (prefilled) only when its model's batch still fits the next
round and its prefill fits what is left of this round's budget. One request of a full budget
may exceed it (a long prompt must not wait forever), never a group of them; whatever does
not fit waits.

Everything here is a pure function of predicted step times and deadlines, so the rule is
tested on its own and the simulator runs it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scheduler.quota import QuotaPlan, decode_quotas, free_switch_alpha, switch_alpha


@dataclass(frozen=True)
class BatchLoad:
    """One model's decode batch as the next round would see it."""

    model: str
    tbt_slo_s: float  # the tightest TBT SLO among its requests
    step_s: float  # predicted decode step of the whole batch (per-step overhead included)
    switch_s: float  # swap-in time if this round has to switch it in
    slack_s: float  # until its most urgent request's next token is due (may be negative)
    waiting: bool = False  # requests not prefilled yet: the batch would start this round
    # decoding, and every request past saving: its mean TPOT misses even at full speed to max_tokens
    lost: bool = False
    aged: bool = False  # lost, and stalled long enough to go back into deadline order

    def __post_init__(self) -> None:
        if not self.tbt_slo_s > 0 or not self.step_s > 0:
            raise ValueError(f"batch {self.model!r}: TBT SLO and step time must be > 0, "
                             f"got {self.tbt_slo_s!r} and {self.step_s!r}")
        if not self.switch_s >= 0:
            raise ValueError(f"batch {self.model!r}: switch_s must be >= 0, got {self.switch_s!r}")


@dataclass(frozen=True)
class RoundRule:
    """The quota rule's knobs (SchedulerConfig's) and which models are resident now."""

    quota_max_s: float
    min_quota_steps: int
    switch_factor: float | None
    resident: frozenset[str] = frozenset()
    # longer turns when switches are free, to amortise the engine's cost of a turn (quota.py)
    max_quota_steps: int | None = None
    turn_cost_s: float = 0.0
    turn_overhead_frac: float | None = None


@dataclass(frozen=True)
class RoundPlan:
    models: tuple[str, ...]  # served this round, least slack first
    held: tuple[str, ...]  # have decode work but wait for a round with room
    quota: QuotaPlan  # of the served models, same order
    decode_s: float  # T0: the round's switches + decode quotas (a lone batch: min_quota_steps steps)

    @property
    def alpha(self) -> float:
        return self.quota.alpha

    @property
    def prefill_budget_s(self) -> float:
        """Prefill time the round can take with every served batch still inside its SLO."""
        return prefill_budget(self.decode_s, self.quota.alpha)


def prefill_budget(decode_s: float, alpha: float) -> float:
    return max(0.0, decode_s * (1.0 / alpha - 1.0)) if alpha > 0 else math.inf


def plan_round(batches: Sequence[BatchLoad], rule: RoundRule) -> RoundPlan:
    """The quota plan of serving every batch in `batches` (in that order) in one round.

    Switch cost: nothing when every batch's model stays resident; otherwise each turn pays
    its model's swap-in (as the token-level policy assumes)."""
    if not batches:
        raise ValueError("a round needs at least one batch")
    names = tuple(b.model for b in batches)
    c0 = 0.0 if set(names) <= rule.resident else sum(b.switch_s for b in batches)
    steps = [b.step_s for b in batches]
    plan = decode_quotas([b.tbt_slo_s for b in batches], steps, c0, rule.quota_max_s,
                         rule.min_quota_steps, rule.switch_factor, rule.max_quota_steps, rule.turn_cost_s,
                         rule.turn_overhead_frac)
    if math.isinf(plan.quotas_s[0]):  # a lone batch: judge it over min_quota_steps steps
        decode_s = rule.min_quota_steps * steps[0]
    else:
        decode_s = c0 + sum(plan.quotas_s)
    return RoundPlan(names, (), plan, decode_s)


def priority(batch: BatchLoad, guard_s: float = 0.0) -> float:
    """Sort key of a batch, smallest first: least slack first, with three exceptions.
    A decoding batch with less than `guard_s` of slack is never passed by a waiting one
    (it could not sit out a round without falling behind its TBT); a waiting batch whose
    first token is already late goes last (rushing it saves no request), and so does a
    decoding batch that is `lost`, until it is `aged` (then its deadline, the earliest, puts
    it first)."""
    if batch.waiting:
        return batch.slack_s if batch.slack_s >= 0 else math.inf
    if batch.lost and not batch.aged:
        return math.inf
    return -math.inf if batch.slack_s < guard_s else batch.slack_s


def select_round(batches: Sequence[BatchLoad], rule: RoundRule, admission_alpha: float = 1.0,
                 guard_s: float = 0.0) -> RoundPlan:
    """The largest set of batches whose round fits (alpha <= 1), filled in `priority` order.

    Batches are tried in order; each one joins if the round still fits with it, else it is
    held (a waiting batch, not started yet, joins only with `admission_alpha` to spare). The
    first batch is always served, even when it cannot meet its SLO alone (then nothing
    could, and holding it would only stall the device)."""
    if not batches:
        raise ValueError("a round needs at least one batch")
    order = sorted(batches, key=lambda b: (priority(b, guard_s), b.model))
    chosen = _RoundSums(rule, order[0])
    held = []
    for batch in order[1:]:
        if chosen.alpha_with(batch) <= (admission_alpha if batch.waiting else 1.0):
            chosen.add(batch)
        else:
            held.append(batch.model)
    plan = plan_round(chosen.batches, rule)
    return RoundPlan(plan.models, tuple(held), plan.quota, plan.decode_s)


class _RoundSums:
    """The sums `plan_round` reduces a round to, grown one batch at a time, so trying each
    candidate batch costs O(1) instead of a new plan (a round is chosen every few turns).
    `alpha_with` is plan_round(batches + [b]).alpha, with the same arithmetic in the same order."""

    def __init__(self, rule: RoundRule, first: BatchLoad) -> None:
        self.rule = rule
        self.batches = [first]
        self._sums = self._grown((0.0, 0.0, 0.0, math.inf, math.inf, True), first)

    def _grown(self, sums: tuple, b: BatchLoad) -> tuple:
        switch, step_sum, inv_n, min_n, min_slo, resident = sums
        n = b.tbt_slo_s / b.step_s
        return (switch + b.switch_s, step_sum + b.step_s, inv_n + 1.0 / n,
                min(min_n, n), min(min_slo, b.tbt_slo_s), resident and b.model in self.rule.resident)

    def add(self, b: BatchLoad) -> None:
        self._sums = self._grown(self._sums, b)
        self.batches.append(b)

    def alpha_with(self, b: BatchLoad) -> float:
        switch, step_sum, inv_n, min_n, min_slo, resident = self._grown(self._sums, b)
        c0 = 0.0 if resident else switch
        rule = self.rule
        if c0 == 0:
            return free_switch_alpha(step_sum, min_slo)
        return switch_alpha(c0, inv_n, min_n, rule.quota_max_s, rule.switch_factor)


def admits(batches: Sequence[BatchLoad], rule: RoundRule, prefill_s: float,
           budget_left_s: float, first_prefill: bool, max_alpha: float = 1.0) -> bool:
    """May a prefill of `prefill_s` run now, when the next round must serve `batches` (the
    running batches with the prefilled requests' batch included)? The round must fit with
    `max_alpha` <= 1 to spare (headroom for what the predictions miss)."""
    if not batches:
        return True
    plan = plan_round(batches, rule)
    if plan.alpha > max_alpha:
        return False
    return first_prefill or prefill_s <= budget_left_s
