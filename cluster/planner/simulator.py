"""Fleet-scale simulator: the real control plane and the real per-worker policies on a virtual clock.

Every decision is made by the code the live cluster runs:

    placement   scheduler.placement.PlacementPolicy: which workers hold which models, roles
                (prefill / decode / mixed); replanned every `replan_interval_s` from the
                load the router would report (`observed_load` over a routing.LoadTracker),
                and applied as the PlacementService applies it (`plan_changes`)
    routing     scheduler.routing.RoutingPolicy: `pick` for each arrival, `pick_decode` for
                the KV handoff of a request prefilled on a prefill worker
    workers     one SimWorker per device (cluster/planner/sim_worker.py): the policy registry's
                token / request / dedicated policy over real block accounting

Only the devices' time is simulated: steps, weight swap-ins and KV swaps are priced from
the model types' profiles and the device spec (cluster/planner/cost_model.py, devices.py), and
a KV handoff costs its bytes over the node's device-to-device link (the network across
nodes) plus a fixed latency. Events (arrivals, step ends, handoffs, replans) run in time
order; a worker that goes idle sleeps until something is added to it.

The first plan is made from a demand estimate (per-model arrival rates, what a capacity
planner is given), as if the fleet had been running; from then on placement sees only
what the live router would.

`give_up_after` ends a run early once that many requests have certainly missed their SLO
(no first token by arrival + TTFT SLO: a miss by the strict and the goodput measures):
an overloaded fleet's answer is known long before its backlog drains. Requests left then
are recorded as errors, so the attainment reported is a lower estimate (flagged in stats).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.planner.devices import DeviceLayout
from cluster.planner.marketplace import Marketplace
from cluster.planner.metrics import RequestRecord, Turn
from cluster.planner.sim_worker import SimWorker
from cluster.planner.workloads import Workload
from scheduler.kv_blocks import blocks_for_tokens
from scheduler.placement import (ModelInfo, ModelLoad, PlacementConfig, PlacementPlan, PlacementPolicy,
                                 observed_load, plan_changes)
from scheduler.policy import SchedulerConfig
from scheduler.policy_registry import check_policy_name
from scheduler.request import Request, RequestStatus
from scheduler.routing import LoadTracker, NoWorkerError, RoutingConfig, RoutingPolicy
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

_ARRIVAL, _HANDOFF, _STEP, _REPLAN, _RETRY = range(5)   # order of events at the same time
RETRY_S = 0.01          # an idle worker with unfinished requests looks again after this long
MAX_IDLE_RETRIES = 1000  # ... at most this many times in a row (10 s) before it waits for an event


@dataclass(frozen=True)
class FleetConfig:
    num_workers: int
    layout: DeviceLayout
    policy: str = "token"             # a name in scheduler.policy_registry.POLICIES
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=10.0, tbt_s=0.1))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    replan_interval_s: float = 2.0     # the PlacementService's interval; 0 = keep the first plan
    handoff_latency_s: float = 1e-3    # per KV handoff, on top of its bytes over the link

    def __post_init__(self) -> None:
        check_policy_name(self.policy)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.replan_interval_s < 0 or self.handoff_latency_s < 0:
            raise ValueError("replan_interval_s and handoff_latency_s must be >= 0")


@dataclass
class SimResult:
    records: list[RequestRecord]
    turns: list[Turn]
    plans: list[PlacementPlan]          # every plan that changed something, in order
    stats: dict


def model_infos(market: Marketplace, workload: Workload) -> dict[str, ModelInfo]:
    """What placement is told about each model: bytes, and step costs at the workload's
    mean prompt and context lengths (from its type's profile fit)."""
    n = max(1, len(workload))
    mean_in = sum(r.input_len for r in workload) / n
    mean_ctx = mean_in + sum(r.output_len for r in workload) / n / 2
    infos = {}
    for m, t in market.types.items():
        fit = market.fits[m]
        d1 = fit.decode_s(1, int(mean_ctx))
        d8 = fit.decode_s(8, int(8 * mean_ctx))
        infos[m] = ModelInfo(t.weight_bytes, t.kv_bytes_per_token * t.tensor_parallel, decode_step_s=d1,
                             decode_step_per_request_s=max(0.0, (d8 - d1) / 7),
                             prefill_s=fit.prefill_prompts_s([max(1, round(mean_in))]),
                             tensor_parallel=t.tensor_parallel)
    return infos


def simulate(workload: Workload, market: Marketplace, fleet: FleetConfig,
             demand: Mapping[str, float] | None = None, give_up_after: int | None = None) -> SimResult:
    """Replay `workload` on the fleet; `demand` (model -> arrivals per second) seeds the first plan."""
    return _Simulation(workload, market, fleet, demand, give_up_after).run()


class _Simulation:
    def __init__(self, workload: Workload, market: Marketplace, fleet: FleetConfig,
                 demand: Mapping[str, float] | None, give_up_after: int | None = None):
        unknown = sorted({r.model for r in workload} - set(market.types))
        if unknown:
            raise ValueError(f"workload asks for models the marketplace does not serve: {unknown[:5]}")
        self.workload, self.market, self.fleet = workload, market, fleet
        per_node = fleet.layout.device.devices_per_node
        self.workers = [SimWorker(f"w{i:03d}", f"n{i // per_node}", fleet.layout, market, fleet.policy,
                                  fleet.scheduler) for i in range(fleet.num_workers)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.placement = PlacementPolicy(fleet.placement)
        self.routing = RoutingPolicy(fleet.routing)
        self.tracker = LoadTracker()
        self.infos = model_infos(market, workload)
        self.slos = {m: fleet.slo for m in market.types}
        self.demand = dict(demand or {})
        self.plan: PlacementPlan | None = None
        self.plans: list[PlacementPlan] = []
        self.events: list = []
        self._seq = itertools.count()
        self.records: dict[str, RequestRecord] = {}
        self.requests: dict[str, Request] = {}     # latest object of each request (a handoff makes a new one)
        self.dispatched_to: dict[str, str] = {}
        self.idle_retries = {w.worker_id: 0 for w in self.workers}
        self.num_handoffs = self.num_recomputed_handoffs = self.num_steps = 0
        self.give_up_after = give_up_after
        self.ttft_due: list[tuple[float, str]] = []   # (arrival + TTFT SLO, request id), a heap
        self.num_certain_misses = 0
        self.stopped_at: float | None = None

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        self._replan(0.0, {m: ModelLoad(rate_rps=r) for m, r in self.demand.items() if m in self.infos})
        for i, tr in enumerate(self.workload):
            self._push(tr.arrival_s, _ARRIVAL, i)
        if self.fleet.replan_interval_s > 0:
            self._push(self.fleet.replan_interval_s, _REPLAN, None)
        pending_arrivals = len(self.workload)
        while self.events:
            now, kind, _, data = heapq.heappop(self.events)
            if self.give_up_after is not None and self._gave_up(now):
                self.stopped_at = now
                break
            if kind == _ARRIVAL:
                pending_arrivals -= 1
                self._arrive(now, data)
            elif kind == _STEP:
                self._step_done(now, self.by_id[data])
            elif kind == _HANDOFF:
                self._handoff_done(now, *data)
            elif kind == _RETRY:
                self._wake(now, self.by_id[data], retry=True)
            elif kind == _REPLAN:
                self._replan(now)
                if pending_arrivals or any(w.policy.has_unfinished() for w in self.workers):
                    self._push(now + self.fleet.replan_interval_s, _REPLAN, None)
        return self._result(time.perf_counter() - started)

    def _gave_up(self, now: float) -> bool:
        due = self.ttft_due
        while due and due[0][0] < now:
            _, request_id = heapq.heappop(due)
            if self.requests[request_id].first_token_time is None:
                self.num_certain_misses += 1
        return self.num_certain_misses > self.give_up_after

    def _push(self, t: float, kind: int, data) -> None:
        heapq.heappush(self.events, (t, kind, next(self._seq), data))

    def _wake(self, now: float, worker: SimWorker, retry: bool = False) -> None:
        if worker.step is not None:
            return
        end = worker.start_step(now)
        if end is not None:
            end = self._as_group(worker, now, end)
            self.idle_retries[worker.worker_id] = 0
            self._push(end, _STEP, worker.worker_id)
        elif worker.policy.has_unfinished() and self.idle_retries[worker.worker_id] < MAX_IDLE_RETRIES:
            # nothing runnable now (e.g. a prefill waiting for KV room held by a handoff)
            self.idle_retries[worker.worker_id] += 1
            self._push(now + RETRY_S, _RETRY, worker.worker_id)
        elif not retry:
            self.idle_retries[worker.worker_id] = 0

    def _as_group(self, leader: SimWorker, now: float, end: float) -> float:
        """The end of the step `leader` just started, run by its model's whole TP group: it
        starts once every member is free and has its share resident, and holds each member
        until it ends (the group's turn counts on every device it occupies)."""
        model = leader.step.output.model
        members = [self.by_id[w] for w in self.plan.group_of(model)[1:]] if self.plan is not None else []
        if not members:
            return end
        start = max([now] + [m.free_at(now) for m in members])
        swap = max(m.load_share(model, start) for m in members)
        end = max(end, start + swap + leader.step.run_s)
        leader.busy_until = max(leader.busy_until, end)   # its step ends with the group's, not before
        for m in members:
            m.join_group_step(model, start, end)
        return end

    # -- events ---------------------------------------------------------------------------

    def _arrive(self, now: float, i: int) -> None:
        tr = self.workload[i]
        request_id = f"sim-{i}"
        record = self.records[request_id] = RequestRecord(request_id, tr.model, tr.arrival_s,
                                                          num_prompt_tokens=tr.input_len)
        limit = self.market.types[tr.model].max_context
        if tr.input_len + tr.output_len > limit:
            record.error = (f"prompt + output of {tr.input_len + tr.output_len} tokens exceed the "
                            f"{limit}-token context of {tr.model}")
            return
        try:
            worker_id = self.routing.pick(tr.model, self._views(now, tr.model), self.fleet.slo, self.plan)
        except NoWorkerError as e:
            record.error = str(e)
            return
        worker = self.by_id[worker_id]
        request = Request(request_id, tr.model, [1] * tr.input_len,
                          SamplingParams(max_tokens=tr.output_len, ignore_eos=True), self.fleet.slo,
                          arrival_time=tr.arrival_s)
        try:
            worker.policy.add_request(request)
        except ValueError as e:   # e.g. longer than the whole KV pool
            record.error = str(e)
            return
        record.worker_id = worker_id
        self.requests[request_id] = request
        self.dispatched_to[request_id] = worker_id
        self.tracker.dispatched(worker_id, tr.model, now)
        if self.give_up_after is not None:
            heapq.heappush(self.ttft_due, (tr.arrival_s + self.fleet.slo.ttft_s, request_id))
        self._wake(now, worker)

    def _step_done(self, now: float, worker: SimWorker) -> None:
        output, finished = worker.finish_step(now)
        self.num_steps += 1
        for r in finished:
            self.tracker.released(self.dispatched_to[r.request_id], r.model)
        if output.is_prefill and worker.role == "prefill":
            for r in output.requests:
                if worker.policy.requests.get(r.request_id) is r and r.status is RequestStatus.RUNNING:
                    self._hand_off(now, worker, r)
        self._wake(now, worker)

    def _hand_off(self, now: float, src: SimWorker, request: Request) -> None:
        """After its first token a prefill worker hands the request's KV to a decode worker."""
        try:
            dst_id = self.routing.pick_decode(request.model, self._views(now, request.model), self.fleet.slo,
                                              self.plan)
        except NoWorkerError:
            return   # no decode worker: it decodes here
        if dst_id == src.worker_id:
            return
        src.policy.detach_request(request.request_id)   # its blocks stay held until the copy is done
        dst = self.by_id[dst_id]
        nbytes = len(request.block_ids) * self.market.types[request.model].device_kv_shape.block_bytes
        device = self.fleet.layout.device
        bandwidth = device.d2d_bytes_per_s if dst.node_id == src.node_id else device.net_bytes_per_s
        self.num_handoffs += 1
        self._push(now + self.fleet.handoff_latency_s + nbytes / bandwidth, _HANDOFF, (src, dst, request))

    def _handoff_done(self, now: float, src: SimWorker, dst: SimWorker, request: Request) -> None:
        shape = self.market.types[request.model].device_kv_shape
        if request.model not in dst.policy.models:   # placement moved it meanwhile: decode at the source
            src.policy.reattach_request(request)
            self._wake(now, src)
            return
        copy = Request(request.request_id, request.model, request.prompt_token_ids, request.sampling_params,
                       request.slo, request.arrival_time, output_token_ids=list(request.output_token_ids),
                       first_token_time=request.first_token_time, token_times=list(request.token_times))
        n = request.num_computed_tokens
        ids = dst.policy.block_manager.allocate(shape, blocks_for_tokens(n))
        if ids is None:   # no room there now: it queues and recomputes its prefix (as the engine does)
            dst.policy.add_request(copy)
            self.num_recomputed_handoffs += 1
        else:
            dst.policy.adopt_request(copy, ids, n)
        src.policy.block_manager.free(shape, request.block_ids)
        request.block_ids = []
        self.requests[request.request_id] = copy
        self._wake(now, dst)
        self._wake(now, src)

    # -- the control plane ------------------------------------------------------------------

    def _views(self, now: float, model: str):
        """Views of the workers the plan lets hold `model` and of its TP group (routing only
        looks at those); all of them when there are none, so a NoWorkerError lists what can be served."""
        ids = self.plan.workers_for(model) + self.plan.group_of(model) if self.plan is not None else ()
        workers = [self.by_id[w] for w in ids if w in self.by_id] or self.workers
        return [w.view(now) for w in workers]

    def _replan(self, now: float, load: Mapping[str, ModelLoad] | None = None) -> None:
        views = [w.view(now) for w in self.workers]
        if load is None:
            queued: dict[str, int] = {}
            running: dict[str, int] = {}
            for w in self.workers:
                q, r = w.queue_counts()
                for m, n in q.items():
                    queued[m] = queued.get(m, 0) + n
                for m, n in r.items():
                    running[m] = running.get(m, 0) + n
            load = observed_load(queued, running, self.tracker, now)
        plan = self.placement.plan(views, self.infos, load, self.slos, now=now)
        if self.plan is not None and plan.version == self.plan.version:
            return
        changes = plan_changes(plan, views)
        for worker_id, model in changes.register:
            self.by_id[worker_id].register(model)
        for worker_id, role in changes.roles:
            self.by_id[worker_id].role = role
        self.plan = plan
        self.plans.append(plan)
        for worker_id, model in changes.unregister:
            self.by_id[worker_id].unregister(model)

    # -- results ----------------------------------------------------------------------------

    def _result(self, wall_s: float) -> SimResult:
        for request_id, request in self.requests.items():
            record = self.records[request_id]
            record.token_times = list(request.token_times)
            record.first_token_time = request.first_token_time
            record.num_output_tokens = len(request.token_times)
            record.end = request.token_times[-1] if request.token_times else None
            if not request.is_finished and record.error is None:
                record.error = ("not finished: the run stopped once the SLO target was out of reach"
                                if self.stopped_at is not None else
                                "not finished when the simulation ran out of events")
        for i in range(len(self.records), len(self.workload)):   # arrivals a stopped run never reached
            tr = self.workload[i]
            self.records[f"sim-{i}"] = RequestRecord(f"sim-{i}", tr.model, tr.arrival_s, num_prompt_tokens=tr.input_len,
                                                     error="not run: the run stopped before it arrived")
        records = [self.records[f"sim-{i}"] for i in range(len(self.workload))]
        stats = {"wall_s": wall_s, "num_steps": self.num_steps, "num_plans": len(self.plans),
                 "stopped_early_at_s": self.stopped_at, "num_certain_misses": self.num_certain_misses,
                 "num_handoffs": self.num_handoffs, "num_recomputed_handoffs": self.num_recomputed_handoffs,
                 "num_weight_swaps": sum(w.num_swaps for w in self.workers),
                 "num_preemptions": sum(w.policy.num_preemptions for w in self.workers),
                 "models_per_worker": {w.worker_id: len(w.registered) for w in self.workers},
                 "roles": {w.worker_id: w.role for w in self.workers}}
        return SimResult(records, [t for w in self.workers for t in w.turns], self.plans, stats)

