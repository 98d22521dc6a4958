"""Fleet-scale capacity simulator: the real scheduler code on a virtual clock.

Each simulated worker runs the same SchedulingPolicy the DeviceWorker runs (token-level,
request-level or dedicated), with the same block accounting. Only the device is simulated:
a step takes the time a StepLatencyEstimator fitted to measured GPU profiles predicts
(../shared/data/profiles: prefill and decode latencies of real models on H20/H100/...), and
a model switch costs its weight bytes over the host-to-device bandwidth, hidden when the
switch was announced early enough to be prefetched. It answers "how many GPUs does this
marketplace need at this SLO?" for fleets far larger than this machine.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from load_tests.metrics import RequestRecord, Turn, summarize
from load_tests.workloads import Workload
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BlockManager, KVShape
from scheduler.policy_registry import check_policy_name, make_policy
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

GiB = 1 << 30
NOT_EOS = 7   # every simulated token; requests run to their trace length (ignore_eos)


@dataclass(frozen=True)
class SimConfig:
    num_workers: int
    profile_dir: str                  # e.g. .../profiles/qwen2_5_7b/H20: the device and model cost
    weight_bytes: int                 # per model (every marketplace model of this size)
    kv_shape: KVShape                 # per model
    policy: str = "token"             # a name in scheduler.policy_registry.POLICIES
    num_slots: int = 2                # models whose weights fit on a device at once
    kv_bytes: int = 40 * GiB          # the device's KV pool
    slab_bytes: int = 64 << 20
    host_kv_bytes: int = 64 * GiB
    h2d_bytes_per_s: float = 25e9     # effective PCIe bandwidth for weight swaps

    def __post_init__(self) -> None:
        check_policy_name(self.policy)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.h2d_bytes_per_s <= 0 or self.weight_bytes <= 0:
            raise ValueError("h2d_bytes_per_s and weight_bytes must be > 0")


@dataclass
class _Worker:
    name: str
    policy: object
    truth: StepLatencyEstimator
    slots: OrderedDict = field(default_factory=OrderedDict)   # model -> time its weights are ready
    clock: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    def load(self) -> int:
        return self.policy.num_unfinished()

    def switch_wait(self, model: str, now: float, cost: float, num_slots: int) -> float:
        """Seconds the step waits for `model`'s weights (0 when resident or prefetched in time)."""
        if model not in self.slots:
            self._admit(model, now + cost, num_slots)
        self.slots.move_to_end(model)   # most recently used last
        return max(0.0, self.slots[model] - now)

    def prefetch(self, model: str, running: str, now: float, cost: float, num_slots: int) -> None:
        """Start copying `model` in the background; never evicts the running model."""
        if model in self.slots or num_slots < 2:
            return
        self._admit(model, now + cost, num_slots)
        self.slots.move_to_end(running)

    def _admit(self, model: str, ready: float, num_slots: int) -> None:
        while len(self.slots) >= num_slots:
            self.slots.popitem(last=False)   # least recently used
        self.slots[model] = ready


def simulate(workload: Workload, config: SimConfig, slo: SLO) -> tuple[list[RequestRecord], list[Turn]]:
    """Replay `workload` on `config.num_workers` simulated devices; per-request token times out."""
    models = workload.models
    workers = [_make_worker(f"w{i}", models, config) for i in range(config.num_workers)]
    switch_cost = config.weight_bytes / config.h2d_bytes_per_s
    arrivals = sorted(workload, key=lambda r: r.arrival_s)
    records: dict[str, RequestRecord] = {}
    requests: dict[str, Request] = {}
    next_arrival = 0
    ready = [(0.0, i) for i in range(len(workers))]   # (time the worker is free, index)
    heapq.heapify(ready)
    home = {m: i for i, m in enumerate(models)}   # dedicated: model i on worker i, if there is one
    while ready:
        now, index = heapq.heappop(ready)
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            _dispatch(arrivals[next_arrival], next_arrival, workers, home, config, slo, records, requests)
            next_arrival += 1
        worker = workers[index]
        output = worker.policy.schedule(now)
        if output is None:
            if next_arrival < len(arrivals):
                heapq.heappush(ready, (max(now, arrivals[next_arrival].arrival_s), index))
            elif any(w.policy.has_unfinished() for w in workers):
                heapq.heappush(ready, (now + 1e-3, index))
            continue
        wait = worker.switch_wait(output.model, now, switch_cost, config.num_slots)
        if output.prefetch_model and output.prefetch_model != output.model:
            worker.prefetch(output.prefetch_model, output.model, now, switch_cost, config.num_slots)
        step = _step_time(worker.truth, output)
        end = now + wait + step
        worker.policy.update(output, {r.request_id: NOT_EOS for r in output.requests}, end, step, wait)
        worker.policy.set_resident(set(worker.slots))
        worker.turns.append(Turn(worker.name, output.model, now, end))
        heapq.heappush(ready, (end, index))
    for request_id, request in requests.items():
        record = records[request_id]
        record.token_times = list(request.token_times)
        record.first_token_time = request.first_token_time
        record.num_output_tokens = len(request.token_times)
        record.end = request.token_times[-1] if request.token_times else None
    return list(records.values()), [t for w in workers for t in w.turns]


def workers_needed(workload: Workload, config: SimConfig, slo: SLO, target: float = 0.9,
                   max_workers: int = 256) -> int | None:
    """Fewest workers whose strict SLO attainment reaches `target` (None if max_workers don't)."""
    def attainment(n: int) -> float:
        records, _ = simulate(workload, _with_workers(config, n), slo)
        return summarize(records, slo)["attainment_strict"]

    low, high = 1, 1
    while attainment(high) < target:
        if high >= max_workers:
            return None
        low, high = high + 1, min(max_workers, high * 2)
    while low < high:   # attainment grows with workers: binary search the first that meets target
        mid = (low + high) // 2
        if attainment(mid) >= target:
            high = mid
        else:
            low = mid + 1
    return high


def _make_worker(name: str, models: list[str], config: SimConfig) -> _Worker:
    truth = StepLatencyEstimator(switch_bandwidth_bytes_s=config.h2d_bytes_per_s)
    estimator = StepLatencyEstimator(switch_bandwidth_bytes_s=config.h2d_bytes_per_s)
    blocks = BlockManager(config.kv_bytes // config.slab_bytes, config.slab_bytes)
    host = BlockManager(config.host_kv_bytes // config.slab_bytes, config.slab_bytes)
    policy = make_policy(config.policy, blocks, host, estimator)
    for model in models:
        for est in (truth, estimator):
            est.register_model(model, config.weight_bytes)
            est.seed_from_profile(model, config.profile_dir)
        if config.policy != "dedicated":
            policy.add_model(model, config.kv_shape, config.weight_bytes)
    return _Worker(name, policy, truth)


def _dispatch(trace_request, i, workers, home, config, slo, records, requests) -> None:
    request_id = f"sim-{i}"
    model = trace_request.model
    records[request_id] = RequestRecord(request_id, model, trace_request.arrival_s,
                                        num_prompt_tokens=trace_request.input_len)
    if config.policy == "dedicated":
        if home[model] >= len(workers):
            records[request_id].error = f"no dedicated device for model {model!r}"
            return
        worker = workers[home[model]]
        if model not in worker.policy.models:
            worker.policy.add_model(model, config.kv_shape, config.weight_bytes)
    else:
        # token-level scaling across devices: prefer a worker with the weights, then the least loaded
        worker = min(workers, key=lambda w: (model not in w.slots, w.load()))
    request = Request(request_id, model, [1] * trace_request.input_len,
                      SamplingParams(max_tokens=trace_request.output_len, ignore_eos=True), slo,
                      arrival_time=trace_request.arrival_s)
    try:
        worker.policy.add_request(request)
    except ValueError as e:
        records[request_id].error = str(e)
        return
    records[request_id].worker_id = worker.name
    requests[request_id] = request


def _step_time(truth: StepLatencyEstimator, output) -> float:
    if output.is_prefill:
        return truth.predict_prefill(output.model, output.num_new_tokens, len(output.requests))
    context = sum(r.num_tokens for r in output.requests)
    return truth.predict_decode(output.model, len(output.requests), context)


def _with_workers(config: SimConfig, n: int) -> SimConfig:
    from dataclasses import replace

    return replace(config, num_workers=n)
