"""Token-level multiplexing (Aegaeon): models take turns on the device between decode steps.

Prefill: per-model queues, grouped FCFS. At a turn boundary, if requests wait, the model
whose queue head arrived first gets a group of up to `max_prefill_group` of its waiting
requests (one switch amortised over the group); the group may take several steps when it
exceeds the prefill token budget. One group per boundary, then the next decode turn, so
neither TTFT nor TBT can starve the other.

TTFT slack (`SchedulerConfig.ttft_slack`, scheduler/ttft_slack.py). A group of a model that
has no decode batch (a switch away from the running batches) starts only once a waiting
group would otherwise miss its TTFT: EDF's latest start of the waiting groups, less what the
device runs before the policy can act again (a round and a run). Until then the running
batches keep decoding, as request-level's do; a waiting request of a decoding model still
joins its batch. When nothing decodes, or at a tight TTFT, the switch is due at once.

Chunked prefill (`SchedulerConfig.chunked_prefill`). While streams decode, a prefill step
whose predicted time exceeds both a round's prefill budget (what the decoding streams' TBT
SLOs leave, scheduler/overload.py) and one TBT SLO of theirs is cut to the tokens that fit:
the request that crosses the budget gets a chunk, and a decode turn runs before its next
chunk. The runner takes a chunk like any other (it attends over the positions already
cached); the request stays WAITING, holding its prompt's blocks, and no token comes out
until its last chunk.

Decode: one batch per model (all its running requests), served in rounds, the batch that
ran longest ago first. At the start of a round each batch gets a time quota from the quota
rule (scheduler/quota.py); a turn runs its batch until the next step would overrun the quota
(judged from `now` and the estimator), at least one step. A batch alone runs until other
work arrives. During a turn, a waiting request of the running model joins without a switch
(a prefill step inside the turn), unless another model's request has waited longer: FCFS
holds across models.

Smooth streams (`SchedulerConfig.smooth_streams`, off by default). With every model of the
round resident and room to spare (alpha <= SMOOTH_ALPHA), the quotas run in slices,
round-robin (a slice: the steps that amortise the engine's cost of a turn, often one), and
prefill is spread between them: after each prefill step every decoding batch runs a slice,
no prefill step is longer than a rotation of slices, and a batch that starts decoding joins
at once. A stream's gap is then about a rotation plus one prefill chunk instead of the other
batches' whole turns plus every prefill that arrived meanwhile (agents that send their turns
together); the price is TTFT and throughput (chunks and one-step runs cost more per token).

Overload control (`SchedulerConfig.overload_control`, scheduler/overload.py). When the
quota rule's alpha exceeds 1 the round serves the largest set of batches that fits, least
slack first, and holds the others (KV kept, or swapped under memory pressure) until a
round has room; waiting groups of models not decoding compete for the round as well and
the ones it takes are reserved (prefilled first, decoding from the next round). Between
rounds, new requests are admitted (prefilled) in order of their TTFT deadline (late ones
last), each only if its model's batch still fits the next round with `admit_alpha` to spare
and its prefill fits the round's prefill budget; a request that does not fit waits queued,
and one that does may pass it (a request of a model already decoding costs its batch
little). So under overload the admitted streams keep their TBT and the rest wait for room,
instead of every stream stalling. Step predictions include the measured per-step time
outside the forward (scheduling, sampling, emitting), a real share of a small model's step.

`prefetch_model` names the model expected after this step (the next prefill group's, or
the next batch of the round), so the engine can copy its weights in the background.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, replace

from scheduler.estimator import OnlineLinearFit
from scheduler.kv_blocks import BLOCK_SIZE
from scheduler.overload import BatchLoad, RoundPlan, RoundRule, admits, plan_round, select_round
from scheduler.policy import SchedulerOutput, SchedulingPolicy
from scheduler.request import Request
from scheduler.ttft_slack import PendingGroup, switch_due

logger = logging.getLogger(__name__)

_EPS = 1e-9  # seconds: float noise must not cost a turn its last step
_OVERHEAD_EWMA = 0.05  # weight of each new per-step overhead sample
_OVERHEAD_MAX_S = 0.05  # a longer gap between steps is a pause (GC, commands), not overhead
SMOOTH_ALPHA = 0.5  # smooth streams: rounds up to this alpha run in slices and spread prefill (_slice, _spacing)
LATE_AGE = 0.5  # a late waiting request goes last until it is late by this x its TTFT SLO (overload.py)


@dataclass
class _Turn:
    model: str
    deadline: float  # time after which no further step of this turn starts (inf: runs alone)
    last_run: bool = False  # its latest run was sized to take what the quota had left


class TokenLevelPolicy(SchedulingPolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._turn: _Turn | None = None
        self._group: tuple[str, list[str]] | None = None  # (model, request ids) being prefilled
        self._round: deque[str] = deque()  # models still to take a turn in this round
        self._quotas: dict[str, float] = {}
        self._left: dict[str, float] = {}  # quota left to a batch whose turn ran a slice of it (_slice)
        # smooth streams in this round (every model resident, room to spare): prefill is spread (_spacing)
        self._spread = False
        self._free_round = False  # and more than one batch: quotas run in slices
        self._rotation_s = math.inf  # a free round's slices, one of each batch
        self._owed: set[str] = set()  # batches to run a slice before the next prefill (_spacing)
        self._served: dict[str, int] = {}  # model -> number of the latest output that ran it (round order)
        self._num_outputs = 0
        # Prefill time the rounds can take (a token bucket): each decode step adds its share
        # (1 / alpha - 1) x its time, up to one round's budget; each prefill spends its time.
        self._prefill_credit_s = 0.0
        self._prefill_cap_s = math.inf
        self._prefill_rate = math.inf
        # (schedule time, forward + switch s, steps, a decode run)
        self._last_step: tuple[float, float, int, bool] | None = None
        self.step_overhead_s = 0.0  # EWMA of a step's wall time outside the forward and switch
        # a decode run's time outside its forward: a fixed cost of the run + a cost per step
        self._run_overhead = OnlineLinearFit(2)
        self._planned_steps = 1  # steps the latest output allowed
        self._ran_all = False  # the previous output ran all of them
        self.last_alpha: float | None = None  # alpha of the latest round (mean TBT / TBT SLO)
        self.last_alpha_all: float | None = None  # alpha had every batch been served (overload signal)
        self.held: tuple[str, ...] = ()  # models held out of the latest round
        self._reserved: dict[str, list[str]] = {}  # waiting groups the round took in: model -> ids
        self._chunked = False  # the latest output was a chunk of a split prefill
        self.num_held_rounds = 0  # rounds that held at least one batch
        self._round_s = 0.0  # the latest round's decode time T0 (switches + quotas)
        self._due: tuple[float, bool] | None = None  # (now, a switch is due then): _switch_due's cache

    @property
    def quotas(self) -> dict[str, float]:
        """Decode time quota of each model in the current round, seconds (inf: a batch alone)."""
        return dict(self._quotas)

    def _choose(self, now: float) -> SchedulerOutput | None:
        self._ran_all = self._observe_overhead(now)
        self._due = None   # arrivals and finished requests since the last call change what is due
        if self._chunked or self._owed:   # a decode turn before the next prefill (see _spacing)
            output = (
                self._continue_turn(now)
                or self._start_turn(now)
                or self._continue_group(now)
                or self._start_group(now)
            )
        else:
            output = (
                self._continue_group(now)
                or self._continue_turn(now)
                or self._start_group(now)
                or self._start_turn(now)
            )
        self._chunked = output is not None and bool(output.partial)
        if output is not None:
            self._spacing(output, now)
            self._num_outputs += 1
            self._served[output.model] = self._num_outputs
            output.prefetch_model = self._expected_next(output.model, now)
            self._last_step = (now, 0.0, 0, not output.is_prefill)
            self._planned_steps = output.num_steps
        return output

    def update(self, output, sampled, now, step_time_s=0.0, switch_time_s=0.0, copy_time_s=None, observe=True):
        spent = step_time_s + switch_time_s
        if self._last_step is not None:   # the steps of a multi-step run add up
            start, busy, steps, decode = self._last_step
            self._last_step = (start, busy + spent, steps + 1, decode)
        if output.is_prefill:
            self._prefill_credit_s -= spent
        elif output.requests:
            self._prefill_credit_s = min(self._prefill_cap_s, self._prefill_credit_s + self._prefill_rate * spent)
        finished = super().update(output, sampled, now, step_time_s, switch_time_s, copy_time_s, observe)
        if not self.requests:  # the device goes idle: the next gap is not a step's overhead
            self._last_step = None
        return finished

    @property
    def _controlled(self) -> bool:
        return self.config.overload_control

    # -- prefill groups ------------------------------------------------------------------

    def _start_group(self, now: float) -> SchedulerOutput | None:
        group = self._next_group(now)
        if group is None:
            return None
        self._group = group
        self._turn = None
        return self._continue_group(now)

    def _next_group(self, now: float) -> tuple[str, list[str]] | None:
        """The group to prefill next: (model, request ids), or None."""
        if not self._reserved and not any(self.waiting.values()):   # most calls: nothing waits
            return None
        due = self._switch_due(now)
        if not self._controlled:
            model = self._oldest_waiting_model() if due else self._oldest_joining_model()
            if model is None:
                return None
            return model, [r.request_id for r in list(self.waiting[model])[: self.config.max_prefill_group]]
        while self._reserved:   # the round made room for these: they go first
            model = next(iter(self._reserved))
            queued = {r.request_id for r in self.waiting.get(model, ())}
            ids = [rid for rid in self._reserved.pop(model) if rid in queued]
            if ids:
                return model, self._within_credit(model, ids)
        # by TTFT deadline, those already late last until they are aged (see overload.priority)
        heads = sorted((q[0] for m, q in self.waiting.items() if q and (due or self._has_decode_work(m))),
                       key=lambda r: (self._goes_last(r, now), self._ttft_key(r)))
        for head in heads:
            members = self._admissible(head.model, now)
            if members:
                return head.model, members
        return None

    def _admissible(self, model: str, now: float) -> list[str]:
        """The longest run of `model`'s waiting requests (oldest first) the next round can take."""
        decoding = [m for m in self.models if m != model and self._has_decode_work(m) and m not in self.held]
        if not decoding and not self._has_decode_work(model) and not self.held:
            # an idle device: nothing to keep on time; the decode that follows earns credit anew
            self._prefill_credit_s = 0.0
            return [r.request_id for r in list(self.waiting[model])[: self.config.max_prefill_group]]
        others = [self._load(m, now) for m in decoding]
        rule = self._rule()
        chosen: list[Request] = []
        for request in list(self.waiting[model])[: self.config.max_prefill_group]:
            trial = chosen + [request]
            prefill_s = self.estimator.predict_prefill(
                model, sum(r.num_new_tokens for r in trial), len(trial))
            batch = self._load(model, now, extra=trial)
            # a full bucket lets ONE request exceed it (a long prompt must not wait forever), never a
            # group: a group of 8 long prompts in one prefill stalled every stream 30-120 ms
            if not admits(others + [batch], rule, prefill_s, self._prefill_credit_s,
                          first_prefill=not chosen and self._prefill_credit_s >= self._prefill_cap_s,
                          max_alpha=self.config.admit_alpha):
                break
            chosen = trial
        return [r.request_id for r in chosen]

    def _within_credit(self, model: str, ids: list[str]) -> list[str]:
        """The longest prefix of a reserved group (the round took it in) whose prefill fits the
        round's prefill credit; its first request always goes. The rest wait queued and join
        their model's turn as the decode steps earn credit (`_joining`)."""
        requests = [self.requests[rid] for rid in ids]
        n, tokens = 1, requests[0].num_new_tokens
        while n < len(requests):
            tokens += requests[n].num_new_tokens
            if self.estimator.predict_prefill(model, tokens, n + 1) > self._prefill_credit_s:
                break
            n += 1
        return ids[:n]

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
            step = self._predict_decode(model)
            over = now + step > turn.deadline + _EPS
        if over:
            self._turn = None
            return None
        if self.waiting[model] and not self._chunked and not self._owed:
            joining = self._joining(model, now)
            if joining:
                output = self._prefill_step(model, *self._chunked_group(model, joining))
                if output is not None:
                    return output
        return self._turn_run(turn, now, step)

    def _chunked_group(self, model: str, ids: list[str]) -> tuple[list[Request], int | None]:
        """The requests of a prefill step and its chunk budget (see _chunk_tokens)."""
        requests = [self.requests[rid] for rid in ids]
        tokens = sum(r.num_new_tokens for r in requests[: self.config.max_prefill_group])
        return requests, self._chunk_tokens(model, min(tokens, self.config.max_prefill_tokens))

    def _chunk_tokens(self, model: str, tokens: int) -> int | None:
        """The token budget of a prefill step of `model` that would compute `tokens`, while
        streams decode: None (whole prompts) when its predicted time fits a round's prefill
        budget or the decoding streams' tightest TBT SLO, whichever is longer (and, in a free
        round, a rotation of slices), else the tokens that do (at least a block). A prompt
        longer than that is split into chunks with a decode turn between them (`_choose`), so
        no prefill step holds the decoding streams longer than their TBT SLOs leave a round for
        prefill (scheduler/overload.py) or one token's budget, however long the prompt. Near
        capacity the round's budget is a sliver: splitting every prompt into block-sized chunks
        there cost each chunk a step's fixed cost and its request a decode turn per chunk
        (token-level's goodput on the bursty load test at 0.72 req/s: 0.86 split at the
        sliver, 0.96 with this floor; 6 seeds each).
        None as well when nothing decodes (nobody to keep on time) or with chunked prefill off."""
        decoding = [m for m in self.models if self._has_decode_work(m) and m not in self.held]
        if not self.config.chunked_prefill or not decoding:
            return None
        # a prefill no longer than one token's budget of the decoding streams is not split:
        # they absorb that gap like any other, and each chunk would pay a step's fixed cost
        tbt = min(r.slo.tbt_s for m in decoding for r in self.running[m])
        cap = min(max(self._prefill_cap_s, tbt), self._rotation_s)
        if not math.isfinite(cap):
            return None
        predict = self.estimator.predict_prefill
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
                any(m != model and self.waiting[m] for m in self.models) and self._switch_due(now))
            return self._decode_step(model, 1 if busy else most)
        step = self._predict_decode(turn.model) if step is None else step
        steps = max(1, round((turn.deadline - now) / step)) if step > 0 else 1
        output = self._decode_step(turn.model, min(most, steps))
        turn.last_run = output is not None and output.num_steps == steps
        return output

    def _joining(self, model: str, now: float) -> list[str]:
        """Waiting requests of the running model that join its turn without a switch: FCFS
        across models without overload control; with it, those the next round can take (a
        request that does not fit may be passed, see the module docstring)."""
        if not self._controlled:
            first = self._oldest_waiting_model() if self._switch_due(now) else self._oldest_joining_model()
            return [r.request_id for r in self.waiting[model]] if first == model else []
        return self._admissible(model, now)

    def _others_busy(self, model: str, now: float) -> bool:
        if any(m != model and self.running[m] for m in self.models):
            return True
        waiting = any(m != model and self.waiting[m] for m in self.models) and self._switch_due(now)
        if not waiting or not self._controlled:
            return waiting
        group = self._next_group(now)
        return group is not None and group[0] != model

    def _start_turn(self, now: float) -> SchedulerOutput | None:
        for _ in range(2):  # the current round, then a fresh one
            while self._round:
                model = self._round.popleft()
                if model not in self.models or not self._has_decode_work(model):
                    continue
                # the quota counts decode time only: a switch paid first extends the turn
                switch = 0.0 if model in self.resident else self.estimator.predict_switch(model)
                turn = _Turn(model, now + switch + self._slice(model))
                output = self._turn_run(turn, now + switch)
                if output is not None:
                    self._turn = turn
                    return output
            self._new_round(now)
            if not self._round:   # nothing decodes this round; it may have made room for prefills
                return self._start_group(now) if self._reserved else None
        return None

    def _slice(self, model: str) -> float:
        """The part of `model`'s quota its turn takes now. With smooth streams, a round whose
        switches are free (every model resident) runs each quota in slices, round-robin: a
        slice is as many steps as amortise the engine's cost of a turn (`turn_overhead_frac`,
        at least one step), and the rest of the quota comes back at the end of the round. The
        round's quotas, alpha and prefill budget stay what the rule planned; only the order of
        the steps changes, so a stream waits for the other batches' slices rather than their
        whole quotas."""
        quota = self._left.pop(model, self._quotas.get(model, math.inf))
        if not self._free_round or not math.isfinite(quota):
            return quota
        piece = self._slice_s(model, quota)
        if piece < quota:
            self._left[model] = quota - piece
            self._round.append(model)
        return piece

    def _slice_s(self, model: str, quota: float) -> float:
        """One slice of a `quota` of `model`'s in a free round: the steps that amortise a turn's
        cost, all of the quota when less than half a step would be left."""
        step = self._predict_decode(model)
        if not step > 0:
            return quota
        steps = max(1, int(self.turn_cost_s / self.config.turn_overhead_frac / step))
        return quota if quota - steps * step < step / 2 else steps * step

    def _spacing(self, output: SchedulerOutput, now: float) -> None:
        """Prefill while resident streams decode on time (a free round, or a batch alone): after
        a prefill step (a group's, a chunk, a join) every decoding batch of the round runs a
        slice before the next one, and no step prefills for longer than a rotation of slices
        (`_chunk_tokens`). So while streams decode, prefill takes at most about half the
        device, and a stream's gap holds one prefill step rather than a burst of them (agents
        that send their turns together)."""
        if not output.is_prefill:
            self._owed.discard(output.model)
            return
        if not self._spread:
            return
        if output.model not in self._quotas and len(output.partial) < len(output.requests):
            # a batch starts decoding: a new round takes it in at once (LRU order puts it last),
            # rather than after every slice of this one
            self._new_round(now)
        self._owed = {m for m in self._quotas if self._has_decode_work(m)}

    def _new_round(self, now: float) -> None:
        """Choose the round's batches (all of them unless overloaded), order them by when each
        last ran (longest ago first) and give each its quota."""
        names = list(self.models)
        models = [m for m in names if self._has_decode_work(m)]
        self._reserved = {}
        if not models:
            self._round, self.held = deque(), ()
            return
        loads = [self._load(m, now) for m in models]
        everyone = plan_round(loads, self._rule())
        self.last_alpha_all = everyone.alpha
        if self._controlled:
            # waiting requests of models not decoding compete for the round too: a batch that
            # has banked slack (ran ahead of its TBT) can sit out a round for one whose first
            # token is due
            due = self._switch_due(now)
            groups = {m: list(self.waiting[m])[: self.config.max_prefill_group]
                      for m in names if self.waiting[m] and m not in models and due}
            prospective = [replace(self._load(m, now, extra=g), waiting=True,
                                   aged=any(self._aged(r, now) for r in g)) for m, g in groups.items()]
            # a decoding batch sits out a round for a waiting one only with two rounds of slack
            guard = 2 * everyone.decode_s
            plan: RoundPlan = select_round(loads + prospective, self._rule(), self.config.admit_alpha, guard)
            self._reserved = {m: [r.request_id for r in groups[m]] for m in plan.models if m in groups}
        else:
            plan = everyone
        if plan.held:
            self.num_held_rounds += 1
        self.held = tuple(m for m in plan.held if m in models)
        served = [m for m in models if m in plan.models]
        if self._reserved and served:   # quotas of the batches decoding now; reserved ones start next round
            plan = plan_round([b for b in loads if b.model in served], self._rule())
        # the batch that ran longest ago goes first: round-robin while every batch is served, and
        # a batch that just had its prefill (its first token) or its turn waits for the others
        models = sorted(served, key=lambda m: self._served.get(m, 0))
        self._round = deque(models)
        self._quotas = dict(zip(plan.models, plan.quota.quotas_s))
        self._left = {}
        # slices and spread prefill only in a round with room to spare: near the device's
        # capacity, and under overload, the round's batches are chosen by their slack
        # (overload.py), judged over whole turns and whole prefills
        self._spread = (self.config.smooth_streams and set(models) <= self.resident
                        and plan.alpha <= SMOOTH_ALPHA and not self.held
                        and self.config.turn_overhead_frac is not None)
        self._free_round = self._spread and len(models) > 1
        self._rotation_s = sum(self._slice_s(m, self._quotas[m]) for m in models) if self._spread else math.inf
        self._owed = self._owed & set(models) if self._spread else set()
        self._prefill_cap_s = plan.prefill_budget_s
        self._round_s = plan.decode_s
        self._due = None
        self._prefill_rate = 1.0 / plan.alpha - 1.0 if plan.alpha < 1 else 0.0
        self._prefill_credit_s = min(self._prefill_credit_s, self._prefill_cap_s)
        self.last_alpha = plan.alpha
        logger.debug("new round %s held %s reserved %s alpha=%.3f (all: %.3f) quotas=%s", models, self.held,
                     list(self._reserved), plan.alpha, everyone.alpha, plan.quota.quotas_s)

    # -- TTFT slack (scheduler/ttft_slack.py) ---------------------------------------------

    def _switch_due(self, now: float) -> bool:
        """May a model with no decode batch start one now (a switch away from the running
        batches)? Always when nothing decodes; else once a waiting group would otherwise miss
        its TTFT (scheduler/ttft_slack.py)."""
        if self._due is not None and self._due[0] == now:
            return self._due[1]
        decoding = [m for m in self.models if self._has_decode_work(m)]
        due = True
        if decoding and self.config.ttft_slack:
            groups = self._pending_groups(set(decoding))
            if groups:
                run_s = self.config.max_decode_steps * max(self._predict_decode(m) for m in decoding)
                due = switch_due(groups, now, self._round_s + run_s + self._joined_round_s(groups, now))
        self._due = (now, due)
        return due

    def _joined_round_s(self, groups: list[PendingGroup], now: float) -> float:
        """A round's length once the most urgent group's batch has joined the decoding ones:
        its tokens' deadlines (arrival + TTFT + k x TBT) hold only if it starts that much
        before its TTFT deadline, since a round may pass before each of its turns."""
        first = min(groups, key=lambda g: (g.deadline_s, g.model)).model
        size = self.config.max_prefill_group
        loads = [self._load(m, now) for m in self.models if self._has_decode_work(m)]
        loads.append(self._load(first, now, extra=list(self.waiting[first])[:size]))
        return plan_round(loads, self._rule()).decode_s

    def _pending_groups(self, decoding: set[str]) -> list[PendingGroup]:
        """The waiting requests of models not decoding, in the groups they would be prefilled in."""
        size = self.config.max_prefill_group
        groups = []
        for model, queue in self.waiting.items():
            if not queue or model in decoding:
                continue
            switch = 0.0 if model in self.resident else self.estimator.predict_switch(model)
            requests = list(queue)
            for i in range(0, len(requests), size):
                group = requests[i: i + size]
                prefill = self.estimator.predict_prefill(model, sum(r.num_new_tokens for r in group), len(group))
                deadline = min(r.arrival_time + r.slo.ttft_s for r in group)
                groups.append(PendingGroup(model, deadline, switch + prefill))
        return groups

    def _oldest_joining_model(self) -> str | None:
        """The decoding model whose waiting queue head is oldest (a join: no switch)."""
        heads = [q[0] for m, q in self.waiting.items() if q and self._has_decode_work(m)]
        return min(heads, key=self._age_key).model if heads else None

    # -- predictions ---------------------------------------------------------------------

    def _rule(self) -> RoundRule:
        c = self.config
        return RoundRule(c.quota_max_s, c.min_quota_steps, c.quota_switch_factor, frozenset(self.resident),
                         c.max_decode_steps, self.turn_cost_s, c.turn_overhead_frac)

    def _load(self, model: str, now: float, extra: list[Request] = ()) -> BatchLoad:
        """`model`'s batch for the next round, with `extra` (waiting) requests joining it."""
        batch = self.running[model][: self.config.max_batch_size] + list(extra)
        step = self.estimator.predict_decode(model, len(batch), sum(r.num_tokens for r in batch))
        step += self.step_overhead_s
        lost = not extra and all(self._lost(r, now, step) for r in batch)
        aged = lost and any(r.token_times and now - r.token_times[-1] > (1.0 + LATE_AGE) * r.slo.ttft_s
                            for r in batch)
        return BatchLoad(model, min(r.slo.tbt_s for r in batch), step, self.estimator.predict_switch(model),
                         min(self._slack(r, now) for r in batch), lost=lost, aged=aged)

    def _goes_last(self, request: Request, now: float) -> bool:
        """A waiting request already late, not yet aged: it yields to those still on time."""
        return self._slack(request, now) < 0 and not self._aged(request, now)

    @staticmethod
    def _aged(request: Request, now: float) -> bool:
        """Waiting and late by LATE_AGE x its TTFT SLO: back in deadline order (first)."""
        return request.first_token_time is None and \
            now - request.arrival_time > (1.0 + LATE_AGE) * request.slo.ttft_s

    @staticmethod
    def _slack(request: Request, now: float) -> float:
        """Until the request's next token is due: its first by arrival + TTFT; token k after
        that by first + k * TBT (the mean-TPOT budget, which a fast first token does not
        widen). Time a stream has banked by running ahead of its TBT is its slack."""
        if request.first_token_time is None:
            return request.arrival_time + request.slo.ttft_s - now
        return request.first_token_time + request.num_output_tokens * request.slo.tbt_s - now

    @staticmethod
    def _lost(request: Request, now: float, step_s: float) -> bool:
        """A stream whose mean TPOT misses whatever the rounds do from now (overload.py): late
        at full speed (`step_s` a token) whether it ends with its next token or at max_tokens.
        Its laxity is linear in where it ends, so those two are its best cases. Never a request
        with no token yet (`_last_slack` is inf)."""
        next_token = TokenLevelPolicy._slack(request, now) - step_s
        return max(next_token, TokenLevelPolicy._last_slack(request, now, step_s)) < 0

    @staticmethod
    def _last_slack(request: Request, now: float, step_s: float) -> float:
        """A stream's laxity were it to run to max_tokens: its last token is due at first +
        (max_tokens - 1) * TBT, and its remaining tokens take `step_s` each at full speed.
        inf for a request with no token yet (not a stream)."""
        if request.first_token_time is None:
            return math.inf
        n = request.sampling_params.max_tokens
        left = n - request.num_output_tokens
        return request.first_token_time + (n - 1) * request.slo.tbt_s - now - left * step_s

    def _ttft_key(self, request: Request) -> tuple[float, int]:
        return (request.arrival_time + request.slo.ttft_s, self._order[request.request_id])

    def _predict_decode(self, model: str) -> float:
        batch = self.running[model][: self.config.max_batch_size]
        step = self.estimator.predict_decode(model, max(len(batch), 1), sum(r.num_tokens for r in batch))
        return step + self.step_overhead_s

    def _observe_overhead(self, now: float) -> bool:
        """A step's wall time (this schedule call - the last one) minus its forward and switch:
        scheduling, sampling, emitting and the worker's own work between steps (a multi-step
        run's, shared by its steps). True when the last output ran all its steps."""
        last, self._last_step = self._last_step, None
        if last is None or not last[2]:
            return False
        start, busy, steps, decode = last
        total = now - start - busy
        sample = total / steps
        if 0.0 <= sample <= _OVERHEAD_MAX_S:
            self.step_overhead_s += _OVERHEAD_EWMA * (sample - self.step_overhead_s)
            if decode:
                self._run_overhead.observe((1.0, float(steps)), total)
        return steps >= self._planned_steps

    @property
    def turn_cost_s(self) -> float:
        """What a decode run costs outside its forward beyond its steps' own share (scheduling
        it, emitting its frames): the intercept of the runs' overhead against their steps."""
        coef = self._run_overhead.coef
        return max(0.0, coef[0]) if coef else 0.0

    # -- prefetch ------------------------------------------------------------------------

    def _expected_next(self, current: str, now: float) -> str | None:
        """The model most likely to run after `current`'s turn or group."""
        if self._group is not None and self._group[0] != current:
            return self._group[0]
        waiting = self._oldest_waiting_model() if self._switch_due(now) else self._oldest_joining_model()
        if waiting is not None and waiting != current:
            return waiting
        for model in self._round:
            if model != current and self._has_decode_work(model):
                return model
        # the round after this one starts with the batch that ran longest ago (_new_round)
        others = [m for m in self.models if m != current and self._has_decode_work(m)]
        return min(others, key=lambda m: self._served.get(m, 0)) if others else None
