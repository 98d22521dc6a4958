"""How much prefill the token-level policy's rounds can take, and which prefill fits it.

A round of alpha < 1 leaves its decoding streams a prefill budget T0 x (1 / alpha - 1)
(scheduler/overload.py). The policy keeps it as a token bucket, `credit_s`: each decode step
adds its share (1 / alpha - 1) x its time, up to one round's budget; each prefill spends its
time. Under overload control a waiting request is admitted (prefilled) only while its model's
batch still fits the next round with `SchedulerConfig.admission_alpha` to spare and its
prefill fits the credit (one request of a full bucket may exceed it, never a group).

Chunked prefill (`SchedulerConfig.chunked_prefill`). While streams decode, a prefill step
whose predicted time exceeds both a round's budget and one TBT SLO of theirs is cut to the
tokens that fit (the request that crosses it gets a chunk, and a decode turn runs before its
next chunk). Near capacity the round's budget is a sliver: splitting every prompt into
block-sized chunks there cost each chunk a step's fixed cost and its request a decode turn
per chunk (token-level's goodput on the bursty load test at 0.72 req/s: 0.86 split at the
sliver, 0.96 with the TBT floor; 6 seeds each).
"""
from __future__ import annotations

import math

from scheduler.batch_loads import BatchLoads
from scheduler.kv_blocks import BLOCK_SIZE
from scheduler.overload import admits
from scheduler.policy_view import PolicyView
from scheduler.request import Request
from scheduler.round_planner import RoundPlanner


class PrefillBudget:
    def __init__(self, view: PolicyView, loads: BatchLoads, planner: RoundPlanner) -> None:
        self.view = view
        self.loads = loads
        self.planner = planner
        self.credit_s = 0.0  # prefill time the rounds can take now
        self.cap_s = math.inf  # a round's prefill budget: the bucket's size
        self._rate = math.inf  # prefill time a second of decode earns

    # -- the bucket ----------------------------------------------------------------------

    def start_round(self, budget_s: float, alpha: float) -> None:
        """A new round: its prefill budget caps the bucket, and its alpha sets the earn rate."""
        self.cap_s = budget_s
        self._rate = 1.0 / alpha - 1.0 if alpha < 1 else 0.0
        self.credit_s = min(self.credit_s, self.cap_s)

    def spend(self, prefill_s: float) -> None:
        self.credit_s -= prefill_s

    def earn(self, decode_s: float) -> None:
        self.credit_s = min(self.cap_s, self.credit_s + self._rate * decode_s)

    # -- what fits -----------------------------------------------------------------------

    def admissible(self, model: str, now: float) -> list[str]:
        """The longest run of `model`'s waiting requests (in `deadlines.serving_order`) the next
        round can take."""
        p, loads = self.view, self.loads
        held = self.planner.held
        decoding = [m for m in p.models if m != model and loads.decoding(m) and m not in held]
        if not decoding and not loads.decoding(model) and not held:
            # an idle device: nothing to keep on time; the decode that follows earns credit anew
            self.credit_s = 0.0
            return [r.request_id for r in loads.serving_order(model, now, p.config.max_prefill_group)]
        others = [loads.load(m, now) for m in decoding]
        rule = loads.rule()
        chosen: list[Request] = []
        for request in loads.serving_order(model, now, p.config.max_prefill_group):
            trial = chosen + [request]
            prefill_s = p.estimator.predict_prefill(model, sum(r.num_new_tokens for r in trial), len(trial))
            batch = loads.load(model, now, extra=trial)
            # a full bucket lets ONE request exceed it (a long prompt must not wait forever), never a
            # group: a group of 8 long prompts in one prefill stalled every stream 30-120 ms
            if not admits(others + [batch], rule, prefill_s, self.credit_s,
                          first_prefill=not chosen and self.credit_s >= self.cap_s,
                          max_alpha=p.admission_alpha):
                break
            chosen = trial
        return [r.request_id for r in chosen]

    def within_credit(self, model: str, ids: list[str]) -> list[str]:
        """The longest prefix of a reserved group (the round took it in) whose prefill fits the
        credit; its first request always goes. The rest wait queued and join their model's
        turn as the decode steps earn credit."""
        p = self.view
        requests = [p.requests[rid] for rid in ids]
        n, tokens = 1, requests[0].num_new_tokens
        while n < len(requests):
            tokens += requests[n].num_new_tokens
            if p.estimator.predict_prefill(model, tokens, n + 1) > self.credit_s:
                break
            n += 1
        return ids[:n]

    def chunk_tokens(self, model: str, tokens: int, limit_s: float = math.inf) -> int | None:
        """The token budget of a prefill step of `model` that would compute `tokens`, while
        streams decode: None (whole prompts) when its predicted time fits a round's prefill
        budget or the decoding streams' tightest TBT SLO, whichever is longer (and `limit_s`,
        a strategy's cap: smooth streams' rotation of slices), else the tokens that do (at
        least a block). None as well when nothing decodes (nobody to keep on time) or with
        chunked prefill off."""
        p = self.view
        held = self.planner.held
        decoding = [m for m in p.models if self.loads.decoding(m) and m not in held]
        if not p.config.chunked_prefill or not decoding:
            return None
        # a prefill no longer than one token's budget of the decoding streams is not split:
        # they absorb that gap like any other, and each chunk would pay a step's fixed cost
        tbt = min(r.slo.tbt_s for m in decoding for r in p.running[m])
        cap = min(max(self.cap_s, tbt), limit_s)
        if not math.isfinite(cap):
            return None
        predict = p.estimator.predict_prefill
        if predict(model, tokens) <= cap:
            return None
        low, high = BLOCK_SIZE, tokens   # the largest budget whose prefill fits, at least a block
        while high - low > 1:
            mid = (low + high) // 2
            if predict(model, mid) <= cap:
                low = mid
            else:
                high = mid
        return low
