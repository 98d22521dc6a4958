"""Token-level multiplexing (Aegaeon): models take turns on the device between decode steps.

Prefill: per-model queues, grouped FCFS. At a turn boundary, if requests wait, the model
whose queue head arrived first gets a group of up to `max_prefill_group` of its waiting
requests (one switch amortised over the group); the group may take several steps when it
exceeds the prefill token budget. One group per boundary, then the next decode turn, so
neither TTFT nor TBT can starve the other.

Decode: one batch per model (all its running requests), served in rounds. At the start of
a round each batch gets a time quota from the quota rule (scheduler/quota.py); a turn runs
its batch until the next step would overrun the quota (judged from `now` and the
estimator), at least one step. A batch alone runs until other work arrives. During a turn,
a waiting request of the running model joins without a switch (a prefill step inside the
turn), unless another model's request has waited longer: FCFS holds across models.

`prefetch_model` names the model expected after this step (the next prefill group's, or
the next batch of the round), so the engine can copy its weights in the background.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from scheduler.policy import SchedulerOutput, SchedulingPolicy
from scheduler.quota import decode_quotas

logger = logging.getLogger(__name__)

_EPS = 1e-9  # seconds: float noise must not cost a turn its last step


@dataclass
class _Turn:
    model: str
    deadline: float  # time after which no further step of this turn starts (inf: runs alone)


class TokenLevelPolicy(SchedulingPolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._turn: _Turn | None = None
        self._group: tuple[str, list[str]] | None = None  # (model, request ids) being prefilled
        self._round: deque[str] = deque()  # models still to take a turn in this round
        self._quotas: dict[str, float] = {}
        self._last_model: str | None = None
        self.last_alpha: float | None = None  # alpha of the latest round (mean TBT / TBT SLO)

    @property
    def quotas(self) -> dict[str, float]:
        """Decode time quota of each model in the current round, seconds (inf: a batch alone)."""
        return dict(self._quotas)

    def _choose(self, now: float) -> SchedulerOutput | None:
        output = (
            self._continue_group()
            or self._continue_turn(now)
            or self._start_group()
            or self._start_turn(now)
        )
        if output is not None:
            self._last_model = output.model
            output.prefetch_model = self._expected_next(output.model)
        return output

    # -- prefill groups ------------------------------------------------------------------

    def _start_group(self) -> SchedulerOutput | None:
        model = self._oldest_waiting_model()
        if model is None:
            return None
        members = [r.request_id for r in list(self.waiting[model])[: self.config.max_prefill_group]]
        self._group = (model, members)
        self._turn = None
        return self._continue_group()

    def _continue_group(self) -> SchedulerOutput | None:
        if self._group is None:
            return None
        model, members = self._group
        queue_ids = {r.request_id for r in self.waiting.get(model, ())}
        members = [rid for rid in members if rid in queue_ids]
        output = self._prefill_step(model, [self.requests[rid] for rid in members]) if members else None
        done = {r.request_id for r in output.requests} if output else set()
        rest = [rid for rid in members if rid not in done]
        # A group that cannot progress (no room) is dropped; its requests stay queued.
        self._group = (model, rest) if rest and output else None
        return output

    # -- decode turns --------------------------------------------------------------------

    def _continue_turn(self, now: float) -> SchedulerOutput | None:
        turn = self._turn
        if turn is None:
            return None
        model = turn.model
        others_busy = any(
            m != model and (self.waiting[m] or self.running[m]) for m in self.models
        )
        if model not in self.models or not self._has_decode_work(model):
            over = True
        elif math.isinf(turn.deadline):
            over = others_busy
        else:
            over = now + self._predict_decode(model) > turn.deadline + _EPS
        if over:
            self._turn = None
            return None
        if self.waiting[model] and self._oldest_waiting_model() == model:
            output = self._prefill_step(model, list(self.waiting[model]))
            if output is not None:
                return output
        return self._decode_step(model)

    def _start_turn(self, now: float) -> SchedulerOutput | None:
        for _ in range(2):  # the current round, then a fresh one
            while self._round:
                model = self._round.popleft()
                if model not in self.models or not self._has_decode_work(model):
                    continue
                output = self._decode_step(model)
                if output is not None:
                    # the quota counts decode time only: a switch paid first extends the turn
                    switch = 0.0 if model in self.resident else self.estimator.predict_switch(model)
                    self._turn = _Turn(model, now + switch + self._quotas[model])
                    return output
            self._new_round()
            if not self._round:
                return None
        return None

    def _new_round(self) -> None:
        """Order the models with decode work round-robin (starting after the last model
        that ran) and give each its quota."""
        names = list(self.models)
        models = [m for m in names if self._has_decode_work(m)]
        if self._last_model in names and models:
            start = names.index(self._last_model)
            models.sort(key=lambda m: (names.index(m) - start - 1) % len(names))
        self._round = deque(models)
        if not models:
            return
        # Switch cost of the round: nothing if every model of the round stays resident;
        # otherwise each turn pays the swap-in of its model.
        resident = set(models) <= self.resident
        switch = 0.0 if resident else sum(self.estimator.predict_switch(m) for m in models)
        slos = [min(r.slo.tbt_s for r in self.running[m]) for m in models]
        steps = [self._predict_decode(m) for m in models]
        plan = decode_quotas(slos, steps, switch, self.config.quota_max_s, self.config.min_quota_steps,
                             self.config.quota_switch_factor)
        self._quotas = dict(zip(models, plan.quotas_s))
        self.last_alpha = plan.alpha
        logger.debug("new round %s alpha=%.3f quotas=%s", models, plan.alpha, plan.quotas_s)

    def _predict_decode(self, model: str) -> float:
        batch = self.running[model][: self.config.max_batch_size]
        return self.estimator.predict_decode(model, max(len(batch), 1), sum(r.num_tokens for r in batch))

    # -- prefetch ------------------------------------------------------------------------

    def _expected_next(self, current: str) -> str | None:
        """The model most likely to run after `current`'s turn or group."""
        if self._group is not None and self._group[0] != current:
            return self._group[0]
        waiting = self._oldest_waiting_model()
        if waiting is not None and waiting != current:
            return waiting
        for model in self._round:
            if model != current and self._has_decode_work(model):
                return model
        names = list(self.models)
        if current in names:  # the round after this one starts after `current`
            start = names.index(current)
            for k in range(1, len(names)):
                model = names[(start + k) % len(names)]
                if self._has_decode_work(model):
                    return model
        return None
