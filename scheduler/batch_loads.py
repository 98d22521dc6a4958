"""What the next round would see of each model's decode batch: its BatchLoad (TBT SLO,
predicted step, switch, slack; scheduler/overload.py), its predicted decode step, and the
quota rule's knobs. A read-only view of a policy's request tables and the measured step
overhead, shared by the token-level policy's round planner and its prefill budget; it reads
the policy through a PolicyView (scheduler/policy_view.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import scheduler.deadlines as deadlines
from scheduler.overload import BatchLoad, RoundRule
from scheduler.policy_view import PolicyView
from scheduler.request import Request
from scheduler.step_overhead import StepOverhead


class BatchLoads:
    def __init__(self, view: PolicyView, overhead: StepOverhead) -> None:
        self.view = view
        self.overhead = overhead

    def decoding(self, model: str) -> bool:
        """Has `model` a decode batch (RUNNING or SWAPPED requests)?"""
        return bool(self.view.running.get(model))

    def decoding_models(self) -> list[str]:
        return [m for m in self.view.models if self.decoding(m)]

    def rule(self) -> RoundRule:
        c = self.view.config
        return RoundRule(c.quota_max_s, c.min_quota_steps, c.quota_switch_factor, frozenset(self.view.resident),
                         c.max_decode_steps, self.overhead.turn_cost_s, c.turn_overhead_frac)

    def load(self, model: str, now: float, extra: Sequence[Request] = ()) -> BatchLoad:
        """`model`'s batch for the next round, with `extra` (waiting) requests joining it."""
        p = self.view
        batch = p.running[model][: p.config.max_batch_size] + list(extra)
        step = p.estimator.predict_decode(model, len(batch), sum(r.num_tokens for r in batch))
        step += self.overhead.step_s
        per_token = p.config.per_token
        lost = not extra and all(deadlines.lost(r, now, step, per_token) for r in batch)
        aged = lost and any(deadlines.stalled(r, now) for r in batch)
        return BatchLoad(model, min(r.slo.tbt_s for r in batch), step, p.estimator.predict_switch(model),
                         min(deadlines.slack(r, now, per_token) for r in batch), lost=lost, aged=aged)

    def group_loads(self, now: float) -> list[BatchLoad]:
        """The tensor-parallel groups this device follows, as batches of its round that it
        does not schedule (scheduler/group_turns.py)."""
        return self.view.groups.loads(now, self.view.estimator.predict_switch)

    def serving_order(self, model: str, now: float, limit: int | None = None) -> list[Request]:
        """`model`'s waiting requests in the order overload control prefills them (on time
        first), the first `limit` of them when given."""
        return deadlines.serving_order(self.view.waiting[model], now, limit)

    def waiting_load(self, model: str, now: float, requests: Sequence[Request]) -> BatchLoad:
        """`model`'s batch were its waiting `requests` prefilled to start it this round."""
        return replace(self.load(model, now, extra=requests), waiting=True)

    def predict_decode(self, model: str) -> float:
        """`model`'s next decode step, per-step overhead included."""
        p = self.view
        batch = p.running[model][: p.config.max_batch_size]
        step = p.estimator.predict_decode(model, max(len(batch), 1), sum(r.num_tokens for r in batch))
        return step + self.overhead.step_s
