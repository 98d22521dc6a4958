"""One simulated device: the real scheduling policy and block accounting; only time is simulated.

A SimWorker holds what a DeviceWorker holds: a SchedulingPolicy from the policy registry
(token, request or dedicated) over a BlockManager for its KV pool and one for its host KV
swap space, and weight slots. Each step is the policy's own `schedule(now)`; the device's
part is priced instead of run:

    wait   weights of the step's model not in a slot yet: copied in (host -> device), or the
           rest of a prefetch the previous step started; one copy at a time on the link
    swaps  KV blocks the step swaps out and in (host KV), at the host link's bandwidth
    step   prefill: the model type's fit at (new tokens, attention term); decode: at
           (batch, context tokens) (cluster/planner/cost_model.py)

then `update(...)` with one token per request at the step's end. `prefetch_model` starts a
background copy into the least recently used slot that is neither running nor being
filled, as actors/weight_slots.py does.

A tensor-parallel model is scheduled by its group's leader alone (the requests go there);
the simulator has each other member `join_group_step`: the member puts its share of the
weights in a slot of its own and is busy until the group's step ends, so the group's turn
counts on every device it occupies (and shows in each member's turns). A worker's KV pool
and slots hold one device's share of a TP model (cluster/planner/marketplace.py); the
members' KV shares are not debited from their pools (the leader's pool stands for them).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cluster.planner.cost_model import ProfiledEstimator
from cluster.planner.devices import DeviceLayout
from cluster.planner.marketplace import Marketplace
from cluster.planner.metrics import Turn
from scheduler.kv_blocks import BlockManager
from scheduler.policy import SchedulerConfig
from scheduler.policy_registry import make_policy
from scheduler.request import Request, RequestStatus
from scheduler.routing import WorkerView
from scheduler.scheduler_output import SchedulerOutput, StepResult

SAMPLED_TOKEN = 7   # every simulated token; requests run to their trace length (ignore_eos)
STEP_EMA = 0.2      # smoothing of the step time the worker reports, as a DeviceWorker does


@dataclass
class _Step:
    output: SchedulerOutput
    start: float
    wait_s: float
    run_s: float
    copy_s: float | None = None   # the swap-in that brought the step's model (None: it was there)


class SimWorker:
    def __init__(self, worker_id: str, node_id: str, layout: DeviceLayout, market: Marketplace,
                 policy: str, scheduler: SchedulerConfig | None = None):
        self.worker_id, self.node_id, self.layout, self.market = worker_id, node_id, layout, market
        slab = layout.slab_bytes
        self.policy = make_policy(
            policy, BlockManager(layout.kv_bytes // slab, slab),
            BlockManager(layout.host_kv_bytes // slab, slab) if layout.host_kv_bytes >= slab else None,
            ProfiledEstimator(market.fits, layout.device.h2d_bytes_per_s), scheduler)
        self.role = "mixed"
        self.slots: OrderedDict[str, float] = OrderedDict()   # model -> time its weights are ready, LRU first
        self._link_free = 0.0            # the host link copies one thing at a time
        self._copy_s: dict[str, float] = {}   # swapped in, not run since: its copy time
        self._running_model: str | None = None
        self.step: _Step | None = None   # the step in flight
        self.step_time_ema = 0.0
        self.busy_until = 0.0            # a group step of a TP model holds this device until then
        self.turns: list[Turn] = []
        self.num_swaps = 0

    # -- models ----------------------------------------------------------------------------

    def register(self, model: str) -> None:
        t = self.market.types[model]
        self.policy.add_model(model, t.device_kv_shape, t.device_weight_bytes)

    def unregister(self, model: str) -> None:
        self.policy.remove_model(model)
        self.slots.pop(model, None)

    @property
    def registered(self) -> frozenset[str]:
        return frozenset(self.policy.models)

    # -- one step --------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Ask the policy for a step and price it; the time it ends, or None when idle."""
        if self.step is not None:
            raise RuntimeError(f"{self.worker_id}: a step is already running")
        output = self.policy.schedule(now)
        if output is None:
            return None
        held = max(0.0, self.busy_until - now)   # the device runs a TP group's step until then
        wait = max(self._ensure_resident(output.model, now), held)
        if output.prefetch_model and output.prefetch_model != output.model \
                and output.prefetch_model in self.policy.models:
            self._prefetch(output.prefetch_model, now)
        run = self._kv_swap_s(output) + self._compute_s(output)
        self.step = _Step(output, now + held, wait - held, run, self._copy_s.pop(output.model, None))
        return now + wait + run

    def finish_step(self, now: float) -> tuple[SchedulerOutput, list[Request]]:
        """Apply the step that ends at `now`: (its output, the requests that finished)."""
        step, self.step = self.step, None
        live = [r for r in step.output.requests if self.policy.requests.get(r.request_id) is r]
        sampled = {r.request_id: SAMPLED_TOKEN for r in live}
        finished = self.policy.update(step.output, StepResult(sampled, now, step.run_s, step.wait_s, step.copy_s))
        self.policy.set_resident(m for m, ready in self.slots.items() if ready <= now)
        duration = now - step.start
        self.step_time_ema = duration if not self.step_time_ema else (
            self.step_time_ema + STEP_EMA * (duration - self.step_time_ema))
        model = step.output.model
        if self.turns and self.turns[-1].model == model and self.turns[-1].end >= step.start - 1e-12:
            self.turns[-1] = Turn(self.worker_id, model, self.turns[-1].start, now)
        else:
            self.turns.append(Turn(self.worker_id, model, step.start, now))
        return step.output, finished

    def free_at(self, now: float) -> float:
        """When this device could start a group's step: after its step in flight and any group step."""
        end = self.step.start + self.step.wait_s + self.step.run_s if self.step is not None else now
        return max(now, end, self.busy_until)

    def load_share(self, model: str, start: float) -> float:
        """As a member of `model`'s group: its share of the weights into a slot by `start`; the wait."""
        running, wait = self._running_model, self._ensure_resident(model, start)
        self._running_model = running
        return wait

    def join_group_step(self, model: str, start: float, end: float) -> None:
        """As a member of `model`'s group: the device runs the group's step from `start` to `end`."""
        self.busy_until = max(self.busy_until, end)
        self.turns.append(Turn(self.worker_id, model, start, end))

    # -- what the router sees ----------------------------------------------------------------

    def view(self, now: float) -> WorkerView:
        policy = self.policy
        load = {m: n for m in policy.models if (n := len(policy.waiting[m]) + len(policy.running[m]))}
        bm = policy.block_manager
        return WorkerView(
            worker_id=self.worker_id, node_id=self.node_id, registered=frozenset(policy.models),
            resident=frozenset(m for m, ready in self.slots.items() if ready <= now),
            host_cached=frozenset(policy.models), load_by_model=load,
            kv_free_frac=bm.num_free_slabs / bm.num_slabs if bm.num_slabs else 0.0,
            role=self.role, num_slots=self.layout.num_slots, slot_bytes=self.layout.slot_bytes,
            step_time_s=self.step_time_ema)

    def queue_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(waiting, running) requests per model, as a worker's stats report them."""
        queued, running = {}, {}
        for r in self.policy.requests.values():
            target = running if r.status is RequestStatus.RUNNING else queued
            target[r.model] = target.get(r.model, 0) + 1
        return queued, running

    # -- the device ---------------------------------------------------------------------------

    def _switch_s(self, model: str) -> float:
        return self.market.types[model].device_weight_bytes / self.layout.device.h2d_bytes_per_s

    def _ensure_resident(self, model: str, now: float) -> float:
        if model not in self.slots:
            if len(self.slots) >= self.layout.num_slots:
                self.slots.popitem(last=False)   # least recently used
            start = max(now, self._link_free)
            self.slots[model] = self._link_free = start + self._switch_s(model)
            self._copy_s[model] = self._switch_s(model)
            self.num_swaps += 1
        self.slots.move_to_end(model)
        self._running_model = model
        return max(0.0, self.slots[model] - now)

    def _prefetch(self, model: str, now: float) -> None:
        if model in self.slots:
            return
        if len(self.slots) >= self.layout.num_slots:
            victim = next((m for m, ready in self.slots.items()
                           if m != self._running_model and ready <= now), None)
            if victim is None:
                return   # every slot is running or being filled
            del self.slots[victim]
        start = max(now, self._link_free)
        self.slots[model] = self._link_free = start + self._switch_s(model)
        self._copy_s[model] = self._switch_s(model)
        self.slots.move_to_end(model)
        self.slots.move_to_end(self._running_model)   # the running model stays most recent
        self.num_swaps += 1

    def _kv_swap_s(self, output: SchedulerOutput) -> float:
        """Swapped blocks (a victim may be of another model) over the host link."""
        if not output.swap_out and not output.swap_in:
            return 0.0
        nbytes = 0
        for copy in (*output.swap_out, *output.swap_in):
            request = self.policy.requests.get(copy.request_id)
            if request is not None:
                nbytes += len(copy.src) * self.market.types[request.model].device_kv_shape.block_bytes
        return nbytes / self.layout.device.h2d_bytes_per_s

    def _compute_s(self, output: SchedulerOutput) -> float:
        fit = self.market.fits[output.model]
        if output.is_prefill:
            tokens = attention = 0
            for r in output.requests:
                n = output.num_scheduled_tokens[r.request_id]
                tokens += n
                attention += n * (n + 2 * r.num_computed_tokens)
            return fit.prefill_s(tokens, attention)
        return fit.decode_s(len(output.requests), sum(r.num_tokens for r in output.requests))
