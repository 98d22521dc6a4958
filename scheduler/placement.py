"""Placement: which workers may hold which models, and which role each worker plays.

`PlacementPolicy.plan(workers, models, load, slos, now)` turns capacity and observed
load into a `PlacementPlan`. The PlacementService (cluster/placement_service.py) applies
it (register/unregister models, set roles) and hands it to the router, which routes a
model only to the workers the plan lists for it.

Rules, all enforced in `PlacementPolicy.plan`:

- Fit: a model goes only on a worker whose slot can hold its weights
  (weight_bytes <= slot_bytes). A model that fits nowhere is `unplaceable`, with a reason.
- Tensor parallel (scheduler/tp_groups.py): a model with `tensor_parallel` N > 1 gets a
  group of N distinct workers of one node, each slot holding its share (weight_bytes / N);
  the plan's `groups` lists them, leader first, and its `assignments` the leader alone (the
  router sends the model's requests there). One group per model (no replicas yet); it
  serves both phases whatever its members' roles. Packing then counts the group's turns
  on every member (each member runs every step of the group), so the single-device models
  that share those workers are packed around them.
- Cold models cost no device: every placeable model gets at least one worker that *may*
  hold it; its weights enter a slot only when a request comes.
- Demand of a model = max(queued + running, rate x request_s) (Little's law), i.e. the
  requests it keeps in flight. Placement follows a rise at once and a fall slowly: demand
  and rate are the larger of what is observed and their previous value decayed with time
  constant `cooldown_s`, so one quiet window does not repack the fleet (roles, which
  have a cooldown of their own, follow the demand observed now).
- SLO-aware packing (scheduler/packing.py): a worker holds a bounded set of models whose
  decode rounds fit their SLOs: the sum over its active models of step time / TBT SLO,
  plus its switch share (the quota rule's), stays <= `max_load`, and a round stays within
  `round_ttft_frac` of the TTFT SLO. Costs come from each ModelInfo (the planner fills
  them from GPU profiles); unknown ones from the workers' measured step times, else the
  config's defaults. So a model's decode stays on one worker until its own demand needs a
  replica, instead of every model spreading over every worker.
- Replicas with hysteresis: a model gets the fewest replicas a lone one of which fits a
  worker and carries at most `scale_out_load` requests in flight, at once when demand
  rises. A replica is removed only when one fewer would still do with the demand inflated
  by scale_out_load / scale_in_load (the dead band), for `cooldown_s`, one at a time.
  Existing assignments are kept (sticky) while their worker's set still fits, so nothing
  moves without cause; new replicas go to the least-loaded worker that fits, preferring a
  node whose host cache already has the model. At most `max_models_per_worker` per worker.
- Roles (Aegaeon-style disaggregation): with >= 2 live workers and total demand
  >= `split_load`, workers split into a prefill pool (`prefill_fraction` of them, at least
  one, interleaved across nodes so each node tends to have both kinds and the KV handoff
  stays on the node) and a decode pool; each model then gets replicas in both pools.
  The split is undone (all "mixed") only after total demand has stayed below `merge_load`
  for `cooldown_s`, or when fewer than 2 workers are alive. With little load every worker
  is "mixed": it prefills and decodes.
"""
from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.packing import ModelCost, PackItem, PackLimits, WorkerBin, pack, replica, replicas_needed
from scheduler.quota import QUOTA_MAX_S, QUOTA_SWITCH_FACTOR
from scheduler.slo import SLO
from scheduler.tp_groups import check_tensor_parallel, device_share, place_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """A model's size and step costs: what placement packs by (the edge's view is ServedModel)."""

    weight_bytes: int
    kv_bytes_per_token: int = 0
    # Step costs on a worker, for SLO-aware packing; 0 = unknown (measured step times or defaults).
    decode_step_s: float = 0.0              # one decode step, batch of 1
    decode_step_per_request_s: float = 0.0  # added per request in the batch
    prefill_s: float = 0.0                  # one typical prompt
    tensor_parallel: int = 1                # devices of its group, on one node (scheduler/tp_groups.py)

    def __post_init__(self) -> None:
        if self.weight_bytes <= 0:
            raise ValueError(f"weight_bytes must be > 0, got {self.weight_bytes!r}")
        check_tensor_parallel(self.tensor_parallel)
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token!r}")
        for name in ("decode_step_s", "decode_step_per_request_s", "prefill_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def device_weight_bytes(self) -> int:
        """What one device of its group holds (all of it at tensor_parallel 1)."""
        return device_share(self.weight_bytes, self.tensor_parallel)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelInfo":
        """The JSON form `PlacementPlan.to_dict` writes, and a catalog entry's: weight_bytes,
        and optionally kv_bytes_per_token, the step costs and tensor_parallel."""
        return cls(int(d["weight_bytes"]), int(d.get("kv_bytes_per_token", 0)),
                   *(float(d.get(k, 0.0)) for k in _COST_KEYS), tensor_parallel=int(d.get("tensor_parallel", 1)))


_COST_KEYS = ("decode_step_s", "decode_step_per_request_s", "prefill_s")


@dataclass(frozen=True)
class ModelLoad:
    rate_rps: float = 0.0   # arrivals per second
    queued: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.rate_rps < 0 or self.queued < 0 or self.running < 0:
            raise ValueError(f"load figures must be >= 0, got {self!r}")


def observed_load(queued: Mapping[str, int], running: Mapping[str, int], tracker: Any,
                  now: float) -> dict[str, ModelLoad]:
    """Per-model load as the router reports it to placement: queued and running summed over
    the workers' stats; requests dispatched (`tracker`, a routing.LoadTracker) that no
    worker has counted yet count as queued; the arrival rate over the tracker's window."""
    pending = tracker.pending()
    load = {}
    for m in set(queued) | set(running) | tracker.models():
        q, r = queued.get(m, 0), running.get(m, 0)
        q += max(0, pending.get(m, 0) - q - r)
        load[m] = ModelLoad(tracker.rate(m, now), q, r)
    return load


@dataclass(frozen=True)
class PlacementConfig:
    request_s: float = 5.0          # mean time a request stays on a worker
    scale_out_load: float = 8.0     # demand per replica above which one replica is added
    scale_in_load: float = 3.0      # demand per (replicas - 1) below which one is removed, after cooldown
    cooldown_s: float = 30.0
    split_load: float = 16.0        # total demand at which >= 2 workers split prefill/decode
    merge_load: float = 6.0         # total demand below which (after cooldown) all go back to mixed
    prefill_fraction: float = 0.5
    # SLO-aware packing (scheduler/packing.py)
    max_load: float = 0.9               # predicted busy share a worker's set may reach
    round_ttft_frac: float = 0.5        # a decode round within this share of the TTFT SLO
    max_models_per_worker: int = 32
    sticky_slack: float = 1.25          # a previous assignment stays while within the limits x this
    swap_bytes_per_s: float = 8e9       # host cache -> slot: prices a switch
    default_decode_step_s: float = 0.02  # when neither the model nor the workers say
    default_prefill_s: float = 0.05
    quota_max_s: float = QUOTA_MAX_S
    quota_switch_factor: float | None = QUOTA_SWITCH_FACTOR

    def __post_init__(self) -> None:
        self.pack_limits()   # validates the packing fields
        if not self.swap_bytes_per_s > 0 or not self.default_decode_step_s > 0 or self.default_prefill_s < 0:
            raise ValueError("swap_bytes_per_s and default_decode_step_s must be > 0, default_prefill_s >= 0")
        if self.request_s <= 0 or self.cooldown_s < 0:
            raise ValueError("request_s must be > 0 and cooldown_s >= 0")
        if not 0 < self.scale_in_load < self.scale_out_load:
            raise ValueError(f"need 0 < scale_in_load < scale_out_load, got {self.scale_in_load}, {self.scale_out_load}")
        if not 0 <= self.merge_load < self.split_load:
            raise ValueError(f"need 0 <= merge_load < split_load, got {self.merge_load}, {self.split_load}")
        if not 0 < self.prefill_fraction < 1:
            raise ValueError(f"prefill_fraction must be in (0, 1), got {self.prefill_fraction!r}")

    def pack_limits(self) -> PackLimits:
        return PackLimits(self.max_load, self.round_ttft_frac, self.max_models_per_worker,
                          self.quota_max_s, self.quota_switch_factor, self.sticky_slack)


@dataclass(frozen=True)
class PlacementPlan:
    assignments: Mapping[str, tuple[str, ...]]   # model -> workers that may hold it
    roles: Mapping[str, str]                     # worker -> "mixed" | "prefill" | "decode"
    models: Mapping[str, ModelInfo] = field(default_factory=dict)
    slos: Mapping[str, SLO] = field(default_factory=dict)
    demand: Mapping[str, float] = field(default_factory=dict)
    unplaceable: Mapping[str, str] = field(default_factory=dict)   # model -> why
    version: int = 0
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # TP model -> its workers, leader first

    def workers_for(self, model: str) -> tuple[str, ...]:
        """Where the model's requests go: its workers, or its group's leader alone."""
        return tuple(self.assignments.get(model, ()))

    def group_of(self, model: str) -> tuple[str, ...]:
        """The workers of a TP model's group, leader first; () for a single-device model."""
        return tuple(self.groups.get(model, ()))

    def models_for(self, worker_id: str) -> list[str]:
        """Models the worker holds (registers): routed to it, or its share as a group member."""
        return sorted(m for m, ws in self.assignments.items()
                      if worker_id in ws or worker_id in self.groups.get(m, ()))

    def weight_bytes(self, model: str) -> int | None:
        """What a switch to `model` copies onto one device (a TP model's share)."""
        info = self.models.get(model)
        return info.device_weight_bytes if info else None

    def slo_for(self, model: str) -> SLO | None:
        return self.slos.get(model)

    @property
    def split(self) -> bool:
        return any(r != "mixed" for r in self.roles.values())

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "split": self.split,
            "assignments": {m: list(ws) for m, ws in sorted(self.assignments.items())},
            "roles": dict(sorted(self.roles.items())),
            "groups": {m: list(ws) for m, ws in sorted(self.groups.items())},
            "models": {m: {"weight_bytes": i.weight_bytes, "kv_bytes_per_token": i.kv_bytes_per_token,
                           **{k: getattr(i, k) for k in _COST_KEYS if getattr(i, k)},
                           **({"tensor_parallel": i.tensor_parallel} if i.tensor_parallel > 1 else {})}
                       for m, i in sorted(self.models.items())},
            "slos": {m: {"ttft_s": s.ttft_s, "tbt_s": s.tbt_s} for m, s in sorted(self.slos.items())},
            "demand": dict(sorted(self.demand.items())),
            "unplaceable": dict(sorted(self.unplaceable.items())),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlacementPlan":
        return cls(
            assignments={m: tuple(ws) for m, ws in d.get("assignments", {}).items()},
            roles=dict(d.get("roles", {})),
            models={m: ModelInfo.from_dict(i) for m, i in d.get("models", {}).items()},
            slos={m: SLO(**s) for m, s in d.get("slos", {}).items()},
            demand=dict(d.get("demand", {})),
            unplaceable=dict(d.get("unplaceable", {})),
            version=int(d.get("version", 0)),
            groups={m: tuple(ws) for m, ws in d.get("groups", {}).items()},
        )


@dataclass(frozen=True)
class PlanChanges:
    """What applying a plan to the workers as they are takes, in the order it is done:
    register where a worker gains a model, set roles, (route by the plan), then unregister
    where a model left a worker and none of its requests is in flight there (the rest wait
    for a later round)."""

    register: tuple[tuple[str, str], ...]     # (worker, model)
    roles: tuple[tuple[str, str], ...]        # (worker, role)
    unregister: tuple[tuple[str, str], ...]   # (worker, model)


def plan_changes(plan: PlacementPlan, views: Iterable[Any]) -> PlanChanges:
    """`views`: WorkerView-like (worker_id, alive, registered, role, load_by_model)."""
    live = [v for v in views if getattr(v, "alive", True)]
    return PlanChanges(
        register=tuple((v.worker_id, m) for v in live for m in plan.models_for(v.worker_id)
                       if m not in v.registered),
        roles=tuple((v.worker_id, plan.roles[v.worker_id]) for v in live
                    if v.worker_id in plan.roles and v.role != plan.roles[v.worker_id]),
        unregister=tuple((v.worker_id, m) for v in live for m in sorted(set(v.registered) - set(
            plan.models_for(v.worker_id))) if v.load_by_model.get(m, 0) == 0))


def routable_now(plan: PlacementPlan, views: Iterable[Any], previous: PlacementPlan | None) -> PlacementPlan:
    """The part of `plan` the router may follow while its registrations are still under way:
    each model on the plan's workers that have it registered already, else (all of them are
    still registering it) on the workers `previous` gave it. Applied first, it lets a burst
    reach the replicas that hold its model at once; registering on the others (a load into a
    host cache, seconds on a busy host) used to hold the whole plan back, and the burst with it.
    A TP model's group is ready only when every member has it (the leader cannot step alone);
    until then its previous group, if it had one, keeps it."""
    registered = {v.worker_id: set(v.registered) for v in views if getattr(v, "alive", True)}
    assignments, groups = {}, {}
    for m, ws in plan.assignments.items():
        group = plan.group_of(m)
        if group:
            if all(m in registered.get(w, ()) for w in group):
                assignments[m], groups[m] = ws, group
            elif previous is not None and previous.group_of(m):
                assignments[m], groups[m] = previous.workers_for(m), previous.group_of(m)
            continue
        ready = tuple(w for w in ws if m in registered.get(w, ()))
        ready = ready or (previous.workers_for(m) if previous is not None else ())
        if ready:
            assignments[m] = ready
    return replace(plan, assignments=assignments, groups=groups)


class PlacementPolicy:
    """Stateful across calls: the previous plan, replica counts and cooldown timers give hysteresis."""

    def __init__(self, config: PlacementConfig | None = None):
        self.config = config or PlacementConfig()
        self._replicas: dict[str, int] = {}
        self._cool_since: dict[str, float] = {}
        self._assigned: dict[str, list[str]] = {}   # model -> workers, in the order they were added
        self._groups: dict[str, tuple[str, ...]] = {}   # TP model -> its group, leader first
        self._roles_prev: dict[str, str] = {}
        self._split = False
        self._merge_since: float | None = None
        self._version = 0
        self._held: dict[str, tuple[float, float, float]] = {}   # model -> (demand, rate, when), decaying

    def plan(self, workers: Iterable[Any], models: Mapping[str, ModelInfo],
             load: Mapping[str, ModelLoad] | None = None, slos: Mapping[str, SLO] | None = None,
             now: float = 0.0) -> PlacementPlan:
        """`workers`: WorkerView-like (worker_id, node_id, slot_bytes, alive, host_cached)."""
        cfg = self.config
        live = sorted((w for w in workers if getattr(w, "alive", True)), key=lambda w: w.worker_id)
        if len({w.worker_id for w in live}) != len(live):
            raise ValueError("worker ids must be unique")
        infos, loads = dict(models), dict(load or {})
        demand, rates = self._held_demand(infos, loads, now)
        largest = max((w.slot_bytes for w in live), default=0)
        cached_on_node: dict[str, set[str]] = collections.defaultdict(set)
        for w in live:
            cached_on_node[w.node_id].update(getattr(w, "host_cached", ()))
        unplaceable = {}
        for m, info in infos.items():
            if not live:
                unplaceable[m] = "no live workers"
            elif info.tensor_parallel == 1 and info.weight_bytes > largest:
                unplaceable[m] = (f"weights of {info.weight_bytes} bytes exceed the largest slot ({largest} bytes); "
                                  f"a model larger than one device needs tensor_parallel > 1")
        by_demand = sorted((m for m in infos if m not in unplaceable), key=lambda m: (-demand.get(m, 0.0), m))
        groups = place_groups(live, {m: infos[m] for m in by_demand}, cached_on_node, self._groups, unplaceable)
        placeable = [m for m in by_demand if m not in unplaceable]

        # Roles have their own cooldown: they follow the demand observed now.
        observed = sum(max(float(l.queued + l.running), l.rate_rps * cfg.request_s)
                       for m, l in loads.items() if m in placeable)
        roles = self._roles(live, observed, now)
        pools = [[w for w in live if roles[w.worker_id] == r] for r in ("prefill", "decode")] \
            if self._split else [live]

        slos = dict(slos or {})
        measured = sorted(w.step_time_s for w in live if getattr(w, "step_time_s", 0.0) > 0)
        costs = {m: self._cost(infos[m], slos.get(m) or SLO(), measured[len(measured) // 2] if measured else None)
                 for m in placeable}
        limits = cfg.pack_limits()
        band = cfg.scale_out_load / cfg.scale_in_load
        assignments: dict[str, list[str]] = {m: [] for m in placeable}
        for pool in (p for p in pools if p):
            role = roles[pool[0].worker_id]
            bins = [WorkerBin(w.worker_id, max(1, int(getattr(w, "num_slots", 1))), role, limits) for w in pool]
            by_id = {b.worker_id: b for b in bins}
            for m, group in groups.items():   # each member runs every step of its group: full demand on each
                share = replica(m, costs[m], demand.get(m, 0.0), rates.get(m, 0.0), 1)
                for wid in group:
                    if wid in by_id:
                        by_id[wid].add(share)
            pool_ids = {w.worker_id for w in pool}
            items = []
            for m in placeable:
                if m in groups:
                    continue
                fits = frozenset(w.worker_id for w in pool if w.slot_bytes >= infos[m].weight_bytes)
                if not fits:
                    continue   # this pool cannot hold it; the other pool (or mixed) serves both phases
                d, rate = demand.get(m, 0.0), rates.get(m, 0.0)
                need = replicas_needed(m, costs[m], d, rate, len(fits), role, limits, cfg.scale_out_load)
                need_in = replicas_needed(m, costs[m], d * band, rate * band, len(fits), role, limits,
                                          cfg.scale_out_load)
                n = self._replica_count((m, role), need, need_in, len(fits), now)
                cached = frozenset(w.worker_id for w in pool if m in cached_on_node[w.node_id])
                sticky = tuple(w for w in self._assigned.get(m, []) if w in pool_ids)
                items.append(PackItem(m, n, replica(m, costs[m], d, rate, n), fits, sticky, cached))
            for m, chosen in pack(bins, items).items():
                assignments[m].extend(chosen)
        for m, group in groups.items():
            assignments[m] = [group[0]]   # its requests go to the leader
        for m in placeable:
            if not assignments[m]:   # every worker whose slot fits it already holds max_models_per_worker
                unplaceable[m] = (f"every worker that fits it already holds {cfg.max_models_per_worker} "
                                  f"models (max_models_per_worker)")
                del assignments[m]

        changed = (self._assigned, self._roles_prev, self._groups) != (assignments, roles, groups)
        self._assigned, self._roles_prev, self._groups = assignments, roles, groups
        for key in list(self._replicas):
            if key[0] not in infos:
                self._replicas.pop(key)
                self._cool_since.pop(key, None)
        if changed or self._version == 0:
            self._version += 1
        if changed:
            logger.info("placement v%d: %s roles=%s", self._version, self._assigned, roles)
        return PlacementPlan(
            assignments={m: tuple(ws) for m, ws in assignments.items()},
            roles=roles, models=infos, slos=slos,
            demand={m: demand.get(m, 0.0) for m in infos}, unplaceable=unplaceable,
            version=self._version, groups=groups,
        )

    def _held_demand(self, infos: Mapping[str, ModelInfo], loads: Mapping[str, ModelLoad],
                     now: float) -> tuple[dict[str, float], dict[str, float]]:
        """Observed demand and rate per model, held: the larger of now and the previous
        value decayed with time constant cooldown_s."""
        cfg = self.config
        demand, rates = {}, {}
        for m in infos:
            load = loads.get(m, ModelLoad())
            d, r = max(float(load.queued + load.running), load.rate_rps * cfg.request_s), load.rate_rps
            if m in self._held:
                d0, r0, t0 = self._held[m]
                decay = math.exp(-max(0.0, now - t0) / cfg.cooldown_s) if cfg.cooldown_s > 0 else 0.0
                d, r = max(d, d0 * decay), max(r, r0 * decay)
            self._held[m] = (d, r, now)
            if d > 0 or m in loads:
                demand[m], rates[m] = d, r
        for m in list(self._held):
            if m not in infos:
                del self._held[m]
        return demand, rates

    def _cost(self, info: ModelInfo, slo: SLO, measured_step_s: float | None) -> ModelCost:
        cfg = self.config
        return ModelCost(
            decode_step_s=info.decode_step_s or measured_step_s or cfg.default_decode_step_s,
            decode_step_per_request_s=info.decode_step_per_request_s,
            prefill_s=info.prefill_s or cfg.default_prefill_s,
            switch_s=info.device_weight_bytes / cfg.swap_bytes_per_s, tbt_s=slo.tbt_s, ttft_s=slo.ttft_s)

    def _replica_count(self, key: tuple[str, str], needed: int, needed_in: int, max_replicas: int,
                       now: float) -> int:
        """Up to `needed` at once; down by one only when `needed_in` (the count for demand
        inflated by the dead band) has stayed below the current count for a cooldown."""
        prev = min(max(1, self._replicas.get(key, 1)), max_replicas)
        n = prev
        if needed > prev:
            n = min(needed, max_replicas)
            self._cool_since.pop(key, None)
        elif prev > 1 and needed_in < prev:
            since = self._cool_since.setdefault(key, now)
            if now - since >= self.config.cooldown_s:
                n = prev - 1
                self._cool_since[key] = now   # the next step down waits a full cooldown too
        else:
            self._cool_since.pop(key, None)
        self._replicas[key] = n
        return n

    def _roles(self, live: list, total_demand: float, now: float) -> dict[str, str]:
        cfg = self.config
        if len(live) < 2:
            self._split, self._merge_since = False, None
        elif not self._split and total_demand >= cfg.split_load:
            self._split, self._merge_since = True, None
            logger.info("placement: total demand %.1f >= %.1f, splitting prefill/decode", total_demand, cfg.split_load)
        elif self._split and total_demand < cfg.merge_load:
            if self._merge_since is None:
                self._merge_since = now
            if now - self._merge_since >= cfg.cooldown_s:
                self._split, self._merge_since = False, None
                logger.info("placement: load low for %.0fs, all workers mixed", cfg.cooldown_s)
        elif self._split:
            self._merge_since = None
        if not self._split:
            return {w.worker_id: "mixed" for w in live}
        # Interleave nodes so each node gets prefill and decode workers (KV handoff stays local).
        by_node: dict[str, list] = collections.defaultdict(list)
        for w in live:
            by_node[w.node_id].append(w)
        order, rank = [], 0
        while len(order) < len(live):
            for node in sorted(by_node):
                if rank < len(by_node[node]):
                    order.append(by_node[node][rank])
            rank += 1
        n_prefill = min(len(live) - 1, max(1, round(len(live) * cfg.prefill_fraction)))
        return {w.worker_id: ("prefill" if i < n_prefill else "decode") for i, w in enumerate(order)}

