"""Token-level multiplexing (Aegaeon): models take turns on the device between decode steps.

The policy composes small objects and runs the turn:

  RoundPlanner (round_planner.py)   plans the round: its batches, order, quotas and alpha
                                    (quota.py, overload.py), and when a switch is due (ttft_slack.py)
  PrefillBudget (prefill_budget.py) how much prefill the round takes: admission and chunks
  WholeTurns / SmoothStreams (smooth_streams.py)   how quotas become turns
  choice_order (turn_choice.py)     what is tried next: the prefill group or the decode turn
  BatchLoads, StepOverhead          what the next round would see of each batch; measured overhead

Prefill: per-model queues, grouped FCFS. At a turn boundary, if requests wait, the model
whose queue head arrived first gets a group of up to `max_prefill_group` of its waiting
requests (one switch amortised over the group); the group may take several steps when it
exceeds the prefill token budget. One group per boundary, then the next decode turn, so
neither TTFT nor TBT can starve the other. A group of a model with no decode batch (a switch
away from the running batches) starts only once the planner says a switch is due (TTFT
slack); until then the running batches keep decoding, and a waiting request of a decoding
model still joins its batch. A chunk of a split prefill (prefill_budget.py) is followed by a
decode turn before the next chunk.

Decode: one batch per model (all its running requests), served in the planner's rounds. A
turn runs its batch until the next step would overrun its quota (judged from `now` and the
estimator), at least one step. A batch alone runs until other work arrives. During a turn, a
waiting request of the running model joins without a switch (a prefill step inside the
turn), unless another model's request has waited longer: FCFS holds across models. Under
overload control (`SchedulerConfig.overload_control`), the round's reserved groups go first,
then waiting requests by TTFT deadline (late ones last), each only if the prefill budget
admits it; one that does not fit waits queued, and one that does may pass it.

`prefetch_model` names the model expected after this step (the next prefill group's, or
the next batch of the round), so the engine can copy its weights in the background.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import scheduler.deadlines as deadlines
from scheduler.batch_loads import BatchLoads
from scheduler.policy import SchedulingPolicy
from scheduler.prefill_budget import PrefillBudget
from scheduler.request import Request
from scheduler.round_planner import RoundPlanner
from scheduler.scheduler_output import SchedulerOutput, StepResult
from scheduler.smooth_streams import SmoothStreams, WholeTurns
from scheduler.step_overhead import StepOverhead
from scheduler.turn_choice import Choice, choice_order

_EPS = 1e-9  # seconds: float noise must not cost a turn its last step


@dataclass
class _Turn:
    model: str
    deadline: float  # time after which no further step of this turn starts (inf: runs alone)
    last_run: bool = False  # its latest run was sized to take what the quota had left


class TokenLevelPolicy(SchedulingPolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.overhead = StepOverhead()
        view = self.view()
        self.loads = BatchLoads(view, self.overhead)
        self.planner = RoundPlanner(view, self.loads)
        self.prefill = PrefillBudget(view, self.loads, self.planner)
        self.turns = (SmoothStreams(view, self.loads, self.overhead, self.planner)
                      if self.config.smooth_streams else WholeTurns())
        self._turn: _Turn | None = None
        self._group: tuple[str, list[str]] | None = None  # (model, request ids) being prefilled
        self._chunked = False  # the latest output was a chunk of a split prefill
        self._ran_all = False  # the previous output ran all its steps
        self._try: dict[Choice, Callable[[float], SchedulerOutput | None]] = {
            Choice.CONTINUE_GROUP: self._continue_group, Choice.CONTINUE_TURN: self._continue_turn,
            Choice.START_GROUP: self._start_group, Choice.START_TURN: self._start_turn}

    @property
    def quotas(self) -> dict[str, float]:
        """Decode time quota of each model in the current round, seconds (inf: a batch alone)."""
        return self.planner.quotas

    def _choose(self, now: float) -> SchedulerOutput | None:
        self._ran_all = self.overhead.observe(now)
        self.planner.forget_due()
        output = None
        for choice in choice_order(after_chunk=self._chunked, decode_owed=self.turns.decode_first):
            output = self._try[choice](now)
            if output is not None:
                break
        self._chunked = output is not None and bool(output.partial)
        if output is not None:
            self.turns.after(output, now, self._new_round)
            # a prefill starts a batch when every running request of its model is in it
            starts = output.is_prefill and {r.request_id for r in self.running[output.model]} <= {
                r.request_id for r in output.requests}
            self.planner.ran(output.model, output.is_prefill, starts)
            output.prefetch_model = self._expected_next(output.model, now)
            self.overhead.scheduled(now, not output.is_prefill, output.num_steps)
        return output

    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        spent = result.step_time_s + result.switch_time_s
        self.overhead.stepped(spent)
        if output.is_prefill:
            self.prefill.spend(spent)
        elif output.requests:
            self.prefill.earn(spent)
        finished = super().update(output, result)
        if not self.requests:  # the device goes idle: the next gap is not a step's overhead
            self.overhead.idle()
        return finished

    def _new_round(self, now: float) -> None:
        plan = self.planner.plan(now)
        if plan is None:
            return
        self.turns.start_round(self.planner.order, self.planner.quotas, plan.alpha, bool(self.planner.held))
        self.prefill.start_round(plan.prefill_budget_s, plan.alpha)
        self.last_alpha = plan.alpha

    # -- prefill groups ------------------------------------------------------------------

    def _start_group(self, now: float) -> SchedulerOutput | None:
        """The first step of the first group that can start: a group whose prefill finds no room
        (another model's half-prefilled request holds the blocks, say) gives way to the next, or
        the device would idle while a request that can run waits behind it (found by
        test_random_workloads_always_finish_and_free_everything: every request waiting, none
        running, and schedule() None for ever)."""
        for group in self._groups(now):
            self._group = group
            self._turn = None
            output = self._continue_group(now)
            if output is not None:
                return output
        return None

    def _groups(self, now: float) -> Iterator[tuple[str, list[str]]]:
        """The groups to prefill next, the first choice first: (model, request ids)."""
        if not self.planner.reserved and not any(self.waiting.values()):   # most calls: nothing waits
            return
        due = self.planner.due_models(now)
        if not self.config.overload_control:
            first = self._oldest_waiting_model() if due else self._oldest_joining_model()
            if first is None:
                return
            rest = sorted((q[0] for m, q in self.waiting.items() if q and m != first and due), key=self._age_key)
            for model in [first] + [r.model for r in rest]:
                yield model, [r.request_id for r in list(self.waiting[model])[: self.config.max_prefill_group]]
            return
        while (reserved := self.planner.pop_reserved()) is not None:   # the round made room for these
            model, ids = reserved
            queued = {r.request_id for r in self.waiting.get(model, ())}
            ids = [rid for rid in ids if rid in queued]
            if ids:
                yield model, self.prefill.within_credit(model, ids)
        # by TTFT deadline, those already late last (see overload.priority)
        heads = sorted((deadlines.serving_order(q, now, 1)[0] for m, q in self.waiting.items()
                        if q and (m in due or self._has_decode_work(m))),
                       key=lambda r: (deadlines.goes_last(r, now), self._ttft_key(r)))
        for head in heads:
            members = self.prefill.admissible(head.model, now)
            if members:
                yield head.model, members

    def _continue_group(self, now: float) -> SchedulerOutput | None:
        if self._group is None:
            return None
        model, members = self._group
        queue_ids = {r.request_id for r in self.waiting.get(model, ())}
        members = [rid for rid in members if rid in queue_ids]
        output = self._prefill_step(model, *self._chunked_group(model, members)) if members else None
        done = {r.request_id for r in output.requests if r.request_id not in output.partial} if output else set()
        rest = [rid for rid in members if rid not in done]
        # A group that cannot progress (no room) is dropped; its requests stay queued.
        self._group = (model, rest) if rest and output else None
        return output

    def _chunked_group(self, model: str, ids: list[str]) -> tuple[list[Request], int | None]:
        """The requests of a prefill step and its chunk budget (PrefillBudget.chunk_tokens)."""
        requests = [self.requests[rid] for rid in ids]
        tokens = sum(r.num_new_tokens for r in requests[: self.config.max_prefill_group])
        budget = self.prefill.chunk_tokens(model, min(tokens, self.config.max_prefill_tokens), self.turns.rotation_s)
        return requests, budget

    # -- decode turns --------------------------------------------------------------------

    def _continue_turn(self, now: float) -> SchedulerOutput | None:
        turn = self._turn
        if turn is None:
            return None
        model, step = turn.model, None
        if model not in self.models or not self._has_decode_work(model):
            over = True
        elif math.isinf(turn.deadline):
            over = self._others_busy(model, now)
        elif turn.last_run and self._ran_all:   # its run took what its quota had left
            over = True
        else:
            step = self.loads.predict_decode(model)
            over = now + step > turn.deadline + _EPS
        if over and math.isfinite(turn.deadline) and model in self.models and self._has_decode_work(model):
            # its quota is spent: one more run if that ends a stream on time
            step = self.loads.predict_decode(model) if step is None else step
            extra = self._finishing_steps(model, now, step)
            if extra:
                turn.deadline, turn.last_run, over = now + extra * step, False, False
        if over:
            self._turn = None
            return None
        if self.waiting[model] and not self._chunked and not self.turns.decode_first:
            joining = self._joining(model, now)
            if joining:
                output = self._prefill_step(model, *self._chunked_group(model, joining))
                if output is not None:
                    return output
        return self._turn_run(turn, now, step)

    def _turn_run(self, turn: _Turn, now: float, step: float | None = None) -> SchedulerOutput | None:
        """The next multi-step run of `turn`'s batch. Its steps: the whole number nearest to
        what the quota has left (>= 1), at most max_decode_steps; `step`: the predicted step
        time, when the caller has it. Nearest, not floor: a turn may overrun its quota by half
        a predicted step rather than leave a fraction that costs a schedule call and a run of
        its own (predictions are noisy by more than that: the fraction was a run in every
        other turn). A run that takes all the quota has left ends the turn when it ran whole
        (a request that finished early ends it sooner, and the turn goes on if time is left)."""
        most = self.config.max_decode_steps
        if most == 1:
            return self._decode_step(turn.model)
        if math.isinf(turn.deadline):   # a batch alone: a run, unless other work is waiting already
            model = turn.model
            busy = any(m != model and self.running[m] for m in self.models) or (
                any(m != model and self.waiting[m] for m in self.models) and self.planner.switch_due(now))
            return self._decode_step(model, 1 if busy else most)
        step = self.loads.predict_decode(turn.model) if step is None else step
        steps = max(1, round((turn.deadline - now) / step)) if step > 0 else 1
        output = self._decode_step(turn.model, min(most, steps))
        turn.last_run = output is not None and output.num_steps == steps
        return output

    def _finishing_steps(self, model: str, now: float, step: float) -> int:
        """Steps of one more run of `model`'s batch, at the end of its turn, that end a stream
        on time which would miss its SLO after waiting the rest of the round (0: none, or
        another batch of the round has not the slack to wait that long). A round's gap costs
        a short stream most of its budget (load test, TTFT:TPOT = 100: a stream of 16 tokens
        waited 96 ms for its last 2, and missed its mean TPOT)."""
        if not self.config.overload_control:
            return 0
        gap = max(0.0, self.planner.decode_s - self.planner.quota(model))
        streams = self.running[model][: self.config.max_batch_size]
        steps = deadlines.finishing_steps(streams, now, step, gap, self.config.max_decode_steps,
                                          self.config.per_token)
        if steps and any(self.loads.load(m, now).slack_s < steps * step
                         for m in self.planner.order if m != model and self.loads.decoding(m)):
            return 0
        return steps

    def _catch_up_s(self, model: str, now: float, quota: float) -> float:
        """Time a turn of `model` takes beyond its quota so that its streams behind their pace
        (a late first decode turn, a held round) are ahead of the gap to its next turn again:
        at most one more quota (deadlines.catch_up_steps)."""
        if not self.config.overload_control or not math.isfinite(quota):
            return 0.0
        step = self.loads.predict_decode(model)
        gap = max(0.0, self.planner.decode_s - quota)
        streams = self.running[model][: self.config.max_batch_size]
        steps = deadlines.catch_up_steps(streams, now, step, gap, quota / step, self.config.per_token)
        return min(quota, steps * step)

    def _joining(self, model: str, now: float) -> list[str]:
        """Waiting requests of the running model that join its turn without a switch: FCFS
        across models without overload control; with it, those the next round can take (a
        request that does not fit may be passed, see the module docstring)."""
        if not self.config.overload_control:
            first = self._oldest_waiting_model() if self.planner.switch_due(now) else self._oldest_joining_model()
            return [r.request_id for r in self.waiting[model]] if first == model else []
        return self.prefill.admissible(model, now)

    def _others_busy(self, model: str, now: float) -> bool:
        if any(m != model and self.running[m] for m in self.models):
            return True
        waiting = any(m != model and self.waiting[m] for m in self.models) and self.planner.switch_due(now)
        if not waiting or not self.config.overload_control:
            return waiting
        group = next(self._groups(now), None)
        return group is not None and group[0] != model

    def _start_turn(self, now: float) -> SchedulerOutput | None:
        for _ in range(2):  # the current round, then a fresh one
            while (model := self.planner.next_turn()) is not None:
                if model not in self.models or not self._has_decode_work(model):
                    continue
                # the quota counts decode time only: a switch paid first extends the turn
                switch = 0.0 if model in self.resident else self.estimator.predict_switch(model)
                quota = self.turns.turn_s(model, self.planner.quota(model))
                turn = _Turn(model, now + switch + quota + self._catch_up_s(model, now, quota))
                output = self._turn_run(turn, now + switch)
                if output is not None:
                    self._turn = turn
                    return output
            self._new_round(now)
            if not self.planner.order:   # nothing decodes this round; it may have made room for prefills
                return self._start_group(now) if self.planner.reserved else None
        return None

    # -- helpers -------------------------------------------------------------------------

    def _oldest_joining_model(self) -> str | None:
        """The decoding model whose waiting queue head is oldest (a join: no switch)."""
        heads = [q[0] for m, q in self.waiting.items() if q and self._has_decode_work(m)]
        return min(heads, key=self._age_key).model if heads else None

    def _ttft_key(self, request: Request) -> tuple[float, int]:
        return (request.arrival_time + request.slo.ttft_s, self._order[request.request_id])

    def _expected_next(self, current: str, now: float) -> str | None:
        """The model most likely to run after `current`'s turn or group."""
        if self._group is not None and self._group[0] != current:
            return self._group[0]
        due = self.planner.switch_due(now)
        waiting = self._oldest_waiting_model() if due else self._oldest_joining_model()
        if waiting is not None and waiting != current:
            return waiting
        return self.planner.next_batch_after(current)
