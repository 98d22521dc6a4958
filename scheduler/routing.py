"""Routing: which worker takes a new request of a model.

The GlobalRouter (cluster/router.py) keeps one `WorkerView` (scheduler/messages.py) per
worker, built from the worker's latest `WorkerStats` (its measured decode step time
included) plus what the router itself has dispatched since, and asks `RoutingPolicy.pick`. The rule, enforced in `pick`:

  1. Candidates are the live workers the placement plan lets hold the model (without a
     plan: the workers that have it registered; for a tensor-parallel model, its group's
     leader, while every member is alive). New requests go to workers that
     prefill ("prefill" or "mixed" role); `pick_decode` chooses among "decode"/"mixed".
  2. Each candidate gets a predicted delay before the request's first token:
     swap-in cost (0 if the weights are resident in a slot, a host->device copy if they
     sit in the node's host cache, a disk load if cold) + queueing (requests ahead of it
     x the worker's step time). A worker that has not measured a step yet (a replica
     placement just added) is priced at the median step its live peers measured: priced
     at the config's default instead (often many times a measured step), it looked
     loaded after one request and a burst stayed on the workers that had run before.
  3. Candidates whose predicted delay stays within `headroom_frac` of the TTFT SLO are
     preferred; among them residency wins (resident > host cache > cold), then the
     lowest load. Keeping a model on the workers that already hold it avoids switches;
     the headroom test spreads load before the SLO breaks.
  4. If no candidate has headroom, the one with the lowest predicted delay wins.

Spreading a hot model over more workers (scale out/in) is a placement decision:
`scheduler/placement.py`. The router only tells the placement service that all of a
model's workers are above the load threshold (`is_hot`).
"""
from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.messages import COLD, HOST_CACHED, RESIDENT, ROLES, WorkerView
from scheduler.slo import SLO

if TYPE_CHECKING:
    from scheduler.placement import PlacementPlan

__all__ = ["COLD", "HOST_CACHED", "LoadTracker", "NoWorkerError", "RESIDENT", "ROLES", "RoutingConfig",
           "RoutingPolicy", "WorkerView"]


class NoWorkerError(LookupError):
    """No live worker may serve the model; the message lists the models that can be served."""

    def __init__(self, model: str, servable: Iterable[str]):
        self.model = model
        self.servable = sorted(set(servable))
        listed = ", ".join(self.servable) if self.servable else "none"
        super().__init__(f"no worker can serve model {model!r}; models that can be served: {listed}")

    def __reduce__(self):   # crosses Ray actor boundaries intact
        return (NoWorkerError, (self.model, self.servable))


@dataclass(frozen=True)
class RoutingConfig:
    swap_bytes_per_s: float = 8e9     # host cache -> device slot
    load_bytes_per_s: float = 1e9     # disk -> host cache -> device (cold path)
    default_step_s: float = 0.05      # step time assumed while no live worker has measured one
    default_weight_bytes: int = 1 << 30  # weight size assumed when the plan does not say
    headroom_frac: float = 0.5        # predicted delay must stay under this share of TTFT SLO
    hot_load: int = 8                 # per-worker load of a model above which it is "hot"
    kv_full_frac: float = 0.05        # below this free KV share, new requests wait for others to end
    kv_full_penalty: float = 4.0      # ... which multiplies their queueing delay

    def __post_init__(self) -> None:
        if self.swap_bytes_per_s <= 0 or self.load_bytes_per_s <= 0:
            raise ValueError("swap_bytes_per_s and load_bytes_per_s must be > 0")
        if self.default_step_s <= 0:
            raise ValueError(f"default_step_s must be > 0, got {self.default_step_s!r}")
        if self.default_weight_bytes < 0:
            raise ValueError("default_weight_bytes must be >= 0")
        if not 0.0 < self.headroom_frac <= 1.0:
            raise ValueError(f"headroom_frac must be in (0, 1], got {self.headroom_frac!r}")
        if self.hot_load < 1:
            raise ValueError(f"hot_load must be >= 1, got {self.hot_load!r}")
        if not 0.0 <= self.kv_full_frac <= 1.0 or self.kv_full_penalty < 1.0:
            raise ValueError("need 0 <= kv_full_frac <= 1 and kv_full_penalty >= 1")


class RoutingPolicy:
    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()

    def candidates(self, model: str, views: Iterable[WorkerView],
                   plan: "PlacementPlan | None" = None) -> list[WorkerView]:
        """Live workers that may hold `model` (all roles). A TP model's is its group's leader,
        and none while a member of its group is down (the group runs every step together)."""
        live = [v for v in views if v.alive]
        if plan is not None:
            if not set(plan.group_of(model)) <= {v.worker_id for v in live}:
                return []
            allowed = set(plan.workers_for(model))
            return [v for v in live if v.worker_id in allowed]
        return [v for v in live if model in v.registered]

    def servable(self, views: Iterable[WorkerView], plan: "PlacementPlan | None" = None) -> list[str]:
        live = [v for v in views if v.alive]
        if plan is not None:
            return sorted(m for m in plan.assignments if self.candidates(m, live, plan))
        return sorted(set().union(*(v.registered for v in live))) if live else []

    def predicted_delay_s(self, model: str, view: WorkerView, weight_bytes: int | None = None,
                          unmeasured_step_s: float | None = None) -> float:
        """Seconds before a new request of `model` would start on `view`; a view without a
        measured step is priced at `unmeasured_step_s` (else the config's default)."""
        cfg = self.config
        nbytes = cfg.default_weight_bytes if weight_bytes is None else weight_bytes
        tier = view.residency(model)
        switch = 0.0 if tier == RESIDENT else nbytes / (
            cfg.swap_bytes_per_s if tier == HOST_CACHED else cfg.load_bytes_per_s)
        step = view.step_time_s or unmeasured_step_s or cfg.default_step_s
        kv_penalty = cfg.kv_full_penalty if view.kv_free_frac < cfg.kv_full_frac else 1.0
        return switch + view.load * step * kv_penalty

    def start_rate(self, model: str, views: Iterable[WorkerView], plan: "PlacementPlan | None" = None) -> float:
        """Requests of `model` the cluster starts per second when they queue, at the speed its
        workers are known to run, by the rule of `predicted_delay_s` (each request ahead costs
        one step): the sum of 1 / step time over the live workers that prefill it (0: none)."""
        cands = self.candidates(model, views, plan)
        prefilling = [v for v in cands if v.role != "decode"] or cands   # as `pick`: any holder runs both
        return sum(1.0 / (v.step_time_s or self.config.default_step_s) for v in prefilling)

    def pick(self, model: str, views: Iterable[WorkerView], slo: SLO | None = None,
             plan: "PlacementPlan | None" = None) -> str:
        """Worker id for a new request of `model` (it prefills there)."""
        return self._pick(model, list(views), slo, plan, prefill=True)

    def pick_decode(self, model: str, views: Iterable[WorkerView], slo: SLO | None = None,
                    plan: "PlacementPlan | None" = None) -> str:
        """Worker id to continue decoding a prefilled request of `model` (KV handoff target)."""
        return self._pick(model, list(views), slo, plan, prefill=False)

    @staticmethod
    def peer_step_s(views: Iterable[WorkerView]) -> float | None:
        """The median decode step the live workers measured; None if none has measured one."""
        measured = sorted(v.step_time_s for v in views if v.alive and v.step_time_s > 0)
        if not measured:
            return None
        mid = len(measured) // 2
        return measured[mid] if len(measured) % 2 else (measured[mid - 1] + measured[mid]) / 2

    def is_hot(self, model: str, views: Iterable[WorkerView], plan: "PlacementPlan | None" = None) -> bool:
        """All of the model's workers carry more than `hot_load` of its requests."""
        cands = self.candidates(model, views, plan)
        return bool(cands) and all(v.load_by_model.get(model, 0) > self.config.hot_load for v in cands)

    def _pick(self, model: str, views: list[WorkerView], slo: SLO | None,
              plan: "PlacementPlan | None", prefill: bool) -> str:
        if not model:
            raise ValueError("model must be non-empty")
        cands = self.candidates(model, views, plan)
        if not cands:
            raise NoWorkerError(model, self.servable(views, plan))
        wanted = ("prefill", "mixed") if prefill else ("decode", "mixed")
        # A missing role is no reason to fail a request: any holder can run both phases.
        cands = [v for v in cands if v.role in wanted] or cands
        slo = slo or (plan.slo_for(model) if plan is not None else None) or SLO()
        weight_bytes = plan.weight_bytes(model) if plan is not None else None
        budget = slo.ttft_s * self.config.headroom_frac
        peers = self.peer_step_s(views)
        scored = [(self.predicted_delay_s(model, v, weight_bytes, peers), v) for v in cands]
        within = [(d, v) for d, v in scored if d <= budget]
        if within:
            _, best = min(within, key=lambda dv: (dv[1].residency(model), dv[1].load, dv[0], dv[1].worker_id))
        else:
            _, best = min(scored, key=lambda dv: (dv[0], dv[1].worker_id))
        return best.worker_id


class LoadTracker:
    """What the router dispatched: in-flight requests per (worker, model) and arrival rates.

    Pure bookkeeping, fed by `dispatched`/`released`; `now` is passed in so tests and the
    simulator drive the clock.
    """

    def __init__(self, window_s: float = 10.0):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._inflight: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._arrivals: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def dispatched(self, worker_id: str, model: str, now: float) -> None:
        self._inflight[worker_id][model] += 1
        self._arrivals[model].append(now)

    def released(self, worker_id: str, model: str) -> bool:
        """False when nothing was in flight there (a duplicate or unknown release)."""
        counts = self._inflight.get(worker_id)
        if not counts or counts[model] <= 0:
            return False
        counts[model] -= 1
        if counts[model] == 0:
            del counts[model]
        return True

    def forget_worker(self, worker_id: str) -> dict[str, int]:
        """Drop a dead worker; returns what was in flight there."""
        return dict(self._inflight.pop(worker_id, {}))

    def inflight(self, worker_id: str) -> dict[str, int]:
        return dict(self._inflight.get(worker_id, {}))

    def pending(self) -> dict[str, int]:
        """In-flight requests per model, all workers together."""
        total: collections.Counter = collections.Counter()
        for counts in self._inflight.values():
            total.update(counts)
        return {m: n for m, n in total.items() if n > 0}

    def rate(self, model: str, now: float) -> float:
        """Arrivals per second of `model` over the last `window_s`."""
        q = self._arrivals.get(model)
        if not q:
            return 0.0
        while q and q[0] < now - self.window_s:
            q.popleft()
        return len(q) / self.window_s

    def models(self) -> set[str]:
        return set(self._arrivals) | set(self.pending())

