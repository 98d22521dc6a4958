"""What every scheduling policy shares; the policies differ only in `_choose` (what runs next).

A step runs one model. Each request in it catches up from num_computed_tokens to num_tokens
(a prefill step: many tokens per request; a decode step: one). The base class keeps the
request table, gives every request of a step the blocks for num_tokens (decode grows by one
block at each 16-token boundary), preempts when the KV pool runs out, and applies the
sampled tokens in `update`.

Preemption. Only a decode step may preempt; a prefill waits for room (so admission can
never evict work in flight). The victim is the most recently arrived RUNNING request of any
model outside the step being built, or a split prefill (a WAITING request holding the blocks
of its first chunks, see _prefill_step; its blocks are freed and its chunks recomputed). A
RUNNING victim's KV is swapped to the host pool when there is one (exact: the bytes come
back untouched, so greedy output stays bit-identical), else it is recomputed: blocks freed,
num_computed_tokens = 0, back to the waiting queue, and a later prefill step recomputes
prompt + generated tokens in one chunk. When nothing outside the step can be evicted, the
step sheds its own newest requests. add_request refuses a request that could not fit alone
in the empty pool, so the oldest request of a step always gets its blocks: every admitted
request finishes or is aborted.

The engine applies a SchedulerOutput in this order: swap_out copies, then swap_in copies,
then the forward pass. Device blocks freed by a swap-out may be handed to a swap-in or to a
new request of the same step; host blocks freed by a swap-in are not reused in that step.

Multi-step decode. A decode output may let the engine run `num_steps` steps of its batch
back to back, calling `update` after each but `schedule` only once (vLLM's multi-step
scheduling): on a small model the scheduling, accounting and text of a step cost a real
share of its forward, and here they are paid once per run. The policy gives every request
its KV blocks for the whole run up front and caps the run at the batch's tokens left, its
turn's quota (token-level) and `max_decode_steps`; the engine ends a run early when a
request finishes or fails, and a request with stop strings (found in the text, after the
run) keeps runs of one step. New requests and aborts wait for the run's end: at most
`max_decode_steps` steps, inside the turn they would have waited for anyway.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from scheduler.estimator import StepLatencyEstimator
from scheduler.group_turns import GroupTurns
from scheduler.kv_blocks import BLOCK_SIZE, BlockManager, KVShape, blocks_for_tokens
from scheduler.policy_view import PolicyView
from scheduler.request import Request, RequestStatus
from scheduler.scheduler_config import SchedulerConfig
from scheduler.scheduler_output import KVCopy, SchedulerOutput, StepResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kv_shape: KVShape
    weight_bytes: int


class SchedulingPolicy(ABC):
    def __init__(
        self,
        block_manager: BlockManager,
        config: SchedulerConfig | None = None,
        estimator: StepLatencyEstimator | None = None,
        host_block_manager: BlockManager | None = None,
    ):
        self.block_manager = block_manager
        self.host_block_manager = host_block_manager
        self.config = config or SchedulerConfig()
        self.estimator = estimator or StepLatencyEstimator()
        self.models: dict[str, ModelEntry] = {}
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: dict[str, deque[Request]] = {}  # per model, oldest first
        self.running: dict[str, list[Request]] = {}  # per model: RUNNING or SWAPPED, oldest first
        self.resident: set[str] = set()  # models whose weights are on the device (engine's hint)
        self.num_preemptions = 0
        self.last_alpha: float | None = None  # quota rule's alpha of the latest round (policies that use it)
        self.groups = GroupTurns()  # tensor-parallel groups this device follows (their leader decides their turns)
        self._order: dict[str, int] = {}  # request id -> admission number (ties in arrival time)
        self._next_order = 0
        self._deferred_host_frees: list[tuple[KVShape, list[int]]] = []

    # -- models and requests -------------------------------------------------------------

    def add_model(self, name: str, kv_shape: KVShape, weight_bytes: int) -> None:
        if not name:
            raise ValueError("model name must be non-empty")
        if name in self.models:
            raise ValueError(f"model {name!r} is already registered")
        if self.block_manager.blocks_per_slab(kv_shape) == 0:
            raise ValueError(f"model {name!r}: one KV block does not fit in a slab of the pool")
        self.models[name] = ModelEntry(name, kv_shape, weight_bytes)
        self.waiting[name] = deque()
        self.running[name] = []
        self.estimator.register_model(name, weight_bytes)

    def remove_model(self, name: str) -> None:
        self._entry(name)
        live = len(self.waiting[name]) + len(self.running[name])
        if live:
            raise ValueError(f"model {name!r} still has {live} unfinished requests; abort them first")
        del self.models[name], self.waiting[name], self.running[name]
        self.resident.discard(name)
        self.groups.forget(name)

    def group_stepped(self, model: str, tbt_slo_s: float, step_s: float, now: float) -> None:
        """A decode step of a tensor-parallel group this device follows ran here (counted in the
        rounds of a policy that plans them: scheduler/group_turns.py)."""
        self.groups.stepped(model, tbt_slo_s, step_s, now)

    def set_resident(self, models) -> None:
        """The engine's hint after each step: models whose weights are on the device now."""
        # in place: the token-level parts read this set through their PolicyView
        models = set(models)
        self.resident.clear()
        self.resident.update(models)

    def add_request(self, request: Request) -> None:
        self._check_new(request)
        self._register(request)
        self._enqueue_waiting(request)

    def adopt_request(self, request: Request, block_ids: list[int], num_computed_tokens: int) -> None:
        """Admit a request another worker prefilled straight into RUNNING: `block_ids` (allocated
        from this policy's block manager) already hold the KV of its first num_computed_tokens."""
        self._check_new(request)
        if not 0 < num_computed_tokens < request.num_tokens:
            raise ValueError(f"request {request.request_id!r}: num_computed_tokens must be in (0, "
                             f"{request.num_tokens}), got {num_computed_tokens}")
        if len(block_ids) != blocks_for_tokens(num_computed_tokens):
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} tokens need "
                             f"{blocks_for_tokens(num_computed_tokens)} blocks, got {len(block_ids)}")
        request.block_ids, request.num_computed_tokens = list(block_ids), num_computed_tokens
        request.status = RequestStatus.RUNNING
        self._register(request)
        self._insert_running(request)

    def _check_new(self, request: Request) -> None:
        entry = self._entry(request.model)
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {request.request_id!r} must be new (WAITING, nothing computed)")
        need = blocks_for_tokens(request.max_num_tokens)
        capacity = self.block_manager.capacity_blocks(entry.kv_shape)
        if need > capacity:
            raise ValueError(
                f"request {request.request_id!r} needs {need} KV blocks for prompt + max_tokens "
                f"({request.max_num_tokens} tokens) but the pool holds {capacity} for model {request.model!r}"
            )

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._order[request.request_id] = self._next_order
        self._next_order += 1

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED):
        """Finish a request early (client gone, or a stop string found); frees its blocks."""
        if not status.is_finished:
            raise ValueError(f"abort status must be a finished status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def detach_request(self, request_id: str) -> Request:
        """Take a RUNNING request out of scheduling while its KV blocks stay allocated (a KV
        handoff in progress); the caller frees the blocks or hands it back with `reattach_request`."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running here")
        self.running[request.model].remove(request)
        del self.requests[request_id]
        self._order.pop(request_id, None)
        return request

    def reattach_request(self, request: Request) -> None:
        """Schedule again a RUNNING request taken out by `detach_request`, blocks untouched."""
        self._entry(request.model)
        if request.request_id in self.requests or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id!r} cannot be reattached ({request.status.name})")
        self._register(request)
        self._insert_running(request)

    def view(self) -> PolicyView:
        """A read-only view of this policy's tables, config and estimator, for its parts."""
        return PolicyView(self.models, self.waiting, self.running, self.requests, self.resident,
                          self.estimator, self.config, self.groups)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self, model: str | None = None) -> int:
        if model is None:
            return len(self.requests)
        return len(self.waiting.get(model, ())) + len(self.running.get(model, ()))

    # -- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput | None:
        """The next step to run, or None when there is nothing to do."""
        output = self._choose(now)
        for shape, ids in self._deferred_host_frees:
            self.host_block_manager.free(shape, ids)
        self._deferred_host_frees.clear()
        return output

    @abstractmethod
    def _choose(self, now: float) -> SchedulerOutput | None:
        """Pick the step to run next (built with _prefill_step / _decode_step)."""

    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply one step's sampled tokens; returns the requests that finished."""
        requests = self.requests
        live = [r for r in output.requests if requests.get(r.request_id) is r]
        partial = output.partial
        if partial:   # chunks of a split prefill: their KV is in, no token comes out
            for request in live:
                if request.request_id in partial:
                    request.num_computed_tokens += output.num_scheduled_tokens[request.request_id]
            live = [r for r in live if r.request_id not in partial]
        sampled, now = result.sampled, result.now
        missing = [r.request_id for r in live if r.request_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for requests {missing} of the step")
        if result.observe:
            self.observe(output, result.step_time_s, result.switch_time_s, result.copy_time_s)
        finished = []
        for request in live:
            request.num_computed_tokens = request.num_tokens
            token = int(sampled[request.request_id])
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            status = request.check_stop(token)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def observe(self, output: SchedulerOutput, step_time_s: float, switch_time_s: float = 0.0,
                copy_time_s: float | None = None, context: int | None = None) -> None:
        """Teach the estimator a step of `output`: its time, and the switch it paid. context:
        the KV tokens the step read (default: what the requests hold now, before update).

        The switch cost is learnt from the copy, not the wait: learning it from the wait made
        a well-hidden switch look free, the quota rule then gave one-step turns, the prefetch
        could no longer keep up, the waits grew and the quotas with them, and a run settled by
        chance in one of the two regimes (8 swapping models: 26 or 199 swaps)."""
        if step_time_s > 0 and output.requests:
            if output.is_prefill:
                self.estimator.observe_prefill(
                    output.model, output.num_new_tokens, len(output.requests), step_time_s)
            else:
                if context is None:
                    context = sum(r.num_tokens for r in output.requests)
                self.estimator.observe_decode(output.model, len(output.requests), context, step_time_s)
        switch_cost_s = switch_time_s if copy_time_s is None else copy_time_s
        if switch_cost_s > 0:
            self.estimator.observe_switch(output.model, switch_cost_s)

    # -- shared machinery for _choose ----------------------------------------------------

    def _prefill_step(self, model: str, candidates, chunk_tokens: int | None = None) -> SchedulerOutput | None:
        """Prefill the longest prefix of `candidates` (WAITING, oldest first) that fits the
        group size, the token budget and the free blocks. Never preempts.

        chunk_tokens: the step computes at most this many tokens; the request that crosses the
        budget gets a chunk of what is left (chunked prefill: a long prompt takes several steps,
        and other work can run between them). A split request stays WAITING, holding the blocks
        of its whole prompt, with num_computed_tokens counting its chunks; no token comes out
        until its last chunk, which moves it to RUNNING like any prefill. None: whole prompts
        (one request may exceed max_prefill_tokens)."""
        shape = self.models[model].kv_shape
        budget = self.config.max_prefill_tokens if chunk_tokens is None else chunk_tokens
        chosen, tokens, scheduled, partial = [], 0, {}, frozenset()
        for request in candidates:
            if len(chosen) == self.config.max_prefill_group:
                break
            new = request.num_new_tokens
            if chosen and tokens + new > budget and (chunk_tokens is None or tokens >= budget):
                break
            if not request.block_ids:   # a split prefill's blocks were taken with its first chunk
                ids = self.block_manager.allocate(shape, blocks_for_tokens(request.num_tokens))
                if ids is None:
                    break
                request.block_ids = ids
            chosen.append(request)
            if chunk_tokens is not None and tokens + new > budget:
                scheduled[request.request_id] = budget - tokens
                partial = frozenset((request.request_id,))
                break
            scheduled[request.request_id] = new
            tokens += new
        if not chosen:
            return None
        queue = self.waiting[model]
        for request in chosen:
            if request.request_id in partial:
                continue
            queue.remove(request)
            request.status = RequestStatus.RUNNING
            self._insert_running(request)
        return SchedulerOutput(model, chosen, True, scheduled, partial=partial)

    def _decode_step(self, model: str, max_steps: int = 1) -> SchedulerOutput | None:
        """A decode step over the model's RUNNING and SWAPPED requests (oldest first),
        swapping in and preempting as needed; the engine may run up to `max_steps` of them
        back to back (see _lookahead)."""
        output = self._decode_batch(model)
        if output is not None and max_steps > 1:
            output.num_steps = self._lookahead(output, max_steps)
        return output

    def _lookahead(self, output: SchedulerOutput, max_steps: int) -> int:
        """Steps of `output`'s batch the engine may run back to back: at most `max_steps` and
        the fewest tokens any request has left, 1 when one has stop strings; each request gets
        the blocks for the run now, without preempting (a request no free block can grow
        shortens the run to the room it has)."""
        steps = max_steps
        for r in output.requests:
            if r.sampling_params.stop:
                return 1
            steps = min(steps, r.max_num_tokens - r.num_tokens)   # tokens it has left
        if steps <= 1:
            return 1
        shape = None
        for r in output.requests:
            num_tokens = r.num_tokens
            room = len(r.block_ids) * BLOCK_SIZE - num_tokens + 1   # steps its blocks hold (>= 1)
            if room > steps:
                continue
            shape = shape or self.models[output.model].kv_shape
            have = len(r.block_ids)
            need = num_tokens + steps - 1   # the slots the run fills
            # and the next step's when the request goes on after the run: a run that ends on a
            # block boundary (its length often divides BLOCK_SIZE) then does not send the next
            # schedule down the slow path of _decode_batch
            ahead = need + 1 if need + 1 < r.max_num_tokens else need
            ids = self.block_manager.allocate(shape, blocks_for_tokens(ahead) - have)
            if ids is None and room < steps:   # not even the run's: try those alone
                ids = self.block_manager.allocate(shape, blocks_for_tokens(need) - have)
                if ids is None:   # no free block: the run shrinks to the room it has
                    steps = room
                    continue
            if ids:
                r.block_ids = r.block_ids + ids
        return steps

    def _decode_batch(self, model: str) -> SchedulerOutput | None:
        batch = self.running[model][: self.config.max_batch_size]
        # most decode steps: every request RUNNING with room for its next token in its last block
        if all(r.status is RequestStatus.RUNNING and r.num_tokens <= len(r.block_ids) * BLOCK_SIZE for r in batch):
            return SchedulerOutput.decode(model, batch) if batch else None
        shape = self.models[model].kv_shape
        pending = list(batch)
        protected = {r.request_id for r in pending}
        output = SchedulerOutput.decode(model, [])
        while pending:
            request = pending[0]
            if self._grow(request, shape, protected, output):
                output.add_decode(pending.pop(0))
                continue
            # Nothing outside the step can be evicted: shed the step's newest request.
            shed = pending.pop()
            protected.discard(shed.request_id)
            if shed.status is RequestStatus.RUNNING:
                self._preempt(shed, output)
        return output if output.requests else None

    def _grow(self, request: Request, shape: KVShape, protected: set[str], output: SchedulerOutput) -> bool:
        """Give `request` the device blocks for num_tokens, evicting others if need be."""
        swapped = request.status is RequestStatus.SWAPPED
        have = 0 if swapped else len(request.block_ids)
        need = blocks_for_tokens(request.num_tokens) - have
        if swapped:   # its host copy may hold blocks given ahead for a multi-step run: all come back
            need = max(need, len(request.host_block_ids))
        if need <= 0 and not swapped:   # most decode steps: the last block still has room
            return True
        while (ids := self.block_manager.allocate(shape, need)) is None:
            victim = self._pick_victim(protected)
            if victim is None:
                return False
            self._preempt(victim, output)
        if swapped:
            host_ids = request.host_block_ids
            output.swap_in.append(KVCopy(request.request_id, host_ids, ids[: len(host_ids)]))
            self._deferred_host_frees.append((shape, host_ids))
            request.host_block_ids = []
            request.block_ids = ids
            request.status = RequestStatus.RUNNING
        else:
            request.block_ids = request.block_ids + ids
        return True

    def _pick_victim(self, protected: set[str]) -> Request | None:
        candidates = [
            r for reqs in self.running.values() for r in reqs
            if r.status is RequestStatus.RUNNING and r.request_id not in protected
        ]
        candidates += [r for queue in self.waiting.values() for r in queue if r.block_ids]   # split prefills
        return max(candidates, key=self._age_key, default=None)

    def _preempt(self, victim: Request, output: SchedulerOutput) -> None:
        shape = self.models[victim.model].kv_shape
        self.num_preemptions += 1
        if victim.status is RequestStatus.WAITING:   # a split prefill: its chunks are recomputed
            self.block_manager.free(shape, victim.block_ids)
            victim.block_ids = []
            victim.num_computed_tokens = 0
            return
        host = self.host_block_manager
        host_ids = host.allocate(shape, len(victim.block_ids)) if host is not None else None
        if host_ids is not None:
            output.swap_out.append(KVCopy(victim.request_id, victim.block_ids, host_ids))
            self.block_manager.free(shape, victim.block_ids)
            victim.block_ids = []
            victim.host_block_ids = host_ids
            victim.status = RequestStatus.SWAPPED
            logger.debug("preempted %s by swap-out", victim.request_id)
            return
        self.block_manager.free(shape, victim.block_ids)
        victim.block_ids = []
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.running[victim.model].remove(victim)
        self._enqueue_waiting(victim)
        logger.debug("preempted %s by recompute", victim.request_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        shape = self.models[request.model].kv_shape
        if request.block_ids:
            self.block_manager.free(shape, request.block_ids)
            request.block_ids = []
        if request.host_block_ids:
            self.host_block_manager.free(shape, request.host_block_ids)
            request.host_block_ids = []
        if request.status is RequestStatus.WAITING:
            self.waiting[request.model].remove(request)
        else:
            self.running[request.model].remove(request)
        request.status = status
        del self.requests[request.request_id]
        self._order.pop(request.request_id, None)

    # -- helpers -------------------------------------------------------------------------

    def _entry(self, model: str) -> ModelEntry:
        entry = self.models.get(model)
        if entry is None:
            raise ValueError(f"model {model!r} is not registered (known: {sorted(self.models)})")
        return entry

    def _age_key(self, request: Request) -> tuple[float, int]:
        return (request.arrival_time, self._order[request.request_id])

    def _enqueue_waiting(self, request: Request) -> None:
        _insert_sorted(self.waiting[request.model], request, self._age_key)

    def _insert_running(self, request: Request) -> None:
        _insert_sorted(self.running[request.model], request, self._age_key)

    def _has_decode_work(self, model: str) -> bool:
        return bool(self.running.get(model))

    def _oldest_waiting_model(self) -> str | None:
        heads = [q[0] for q in self.waiting.values() if q]
        return min(heads, key=self._age_key).model if heads else None

    def _oldest_unfinished_model(self) -> str | None:
        oldest = min(self.requests.values(), key=self._age_key, default=None)
        return oldest.model if oldest else None


def _insert_sorted(seq, item, key) -> None:
    """Insert keeping `seq` sorted by key (new arrivals go to the end in O(1) in practice)."""
    k = key(item)
    i = len(seq)
    while i > 0 and key(seq[i - 1]) > k:
        i -= 1
    seq.insert(i, item)
