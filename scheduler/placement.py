"""Placement: which workers may hold which models, and which role each worker plays.

`PlacementPolicy.plan(workers, models, load, slos, now)` turns capacity and observed
load into a `PlacementPlan`. The PlacementService (cluster/placement_service.py) applies
it (register/unregister models, set roles) and hands it to the router, which routes a
model only to the workers the plan lists for it.

Rules, all enforced in `PlacementPolicy.plan`:

- Fit: a model goes only on a worker whose slot can hold its weights
  (weight_bytes <= slot_bytes). A model that fits nowhere is `unplaceable`, with a reason.
- Cold models cost no device: every placeable model gets at least one worker that *may*
  hold it; its weights enter a slot only when a request comes.
- Demand of a model = max(queued + running, rate x request_s) (Little's law), i.e. the
  requests it keeps in flight.
- Replicas with hysteresis: when demand per replica exceeds `scale_out_load` (all its
  workers are hot), one more worker is added per plan. A replica is removed only after
  demand with one fewer replica has stayed below `scale_in_load` (< scale_out_load) for
  `cooldown_s`, one at a time. Existing assignments are kept (sticky) so nothing moves
  without cause; new replicas go to the least-loaded fitting worker, preferring a node
  whose host cache already has the model.
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.slo import SLO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    weight_bytes: int
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.weight_bytes <= 0:
            raise ValueError(f"weight_bytes must be > 0, got {self.weight_bytes!r}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token!r}")

    @classmethod
    def of(cls, value: Any) -> "ModelInfo":
        """Accepts a ModelInfo, weight bytes, (weight_bytes, kv_bytes_per_token) or a dict."""
        if isinstance(value, ModelInfo):
            return value
        if isinstance(value, Mapping):
            return cls(int(value["weight_bytes"]), int(value.get("kv_bytes_per_token", 0)))
        if isinstance(value, (tuple, list)):
            return cls(*(int(v) for v in value))
        return cls(int(value))


@dataclass(frozen=True)
class ModelLoad:
    rate_rps: float = 0.0   # arrivals per second
    queued: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.rate_rps < 0 or self.queued < 0 or self.running < 0:
            raise ValueError(f"load figures must be >= 0, got {self!r}")

    @classmethod
    def of(cls, value: Any) -> "ModelLoad":
        if isinstance(value, ModelLoad):
            return value
        if isinstance(value, Mapping):
            return cls(float(value.get("rate_rps", 0.0)), int(value.get("queued", 0)), int(value.get("running", 0)))
        return cls(queued=int(value))  # a bare number: requests in flight


@dataclass(frozen=True)
class PlacementConfig:
    request_s: float = 5.0          # mean time a request stays on a worker
    scale_out_load: float = 8.0     # demand per replica above which one replica is added
    scale_in_load: float = 3.0      # demand per (replicas - 1) below which one is removed, after cooldown
    cooldown_s: float = 30.0
    split_load: float = 16.0        # total demand at which >= 2 workers split prefill/decode
    merge_load: float = 6.0         # total demand below which (after cooldown) all go back to mixed
    prefill_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.request_s <= 0 or self.cooldown_s < 0:
            raise ValueError("request_s must be > 0 and cooldown_s >= 0")
        if not 0 < self.scale_in_load < self.scale_out_load:
            raise ValueError(f"need 0 < scale_in_load < scale_out_load, got {self.scale_in_load}, {self.scale_out_load}")
        if not 0 <= self.merge_load < self.split_load:
            raise ValueError(f"need 0 <= merge_load < split_load, got {self.merge_load}, {self.split_load}")
        if not 0 < self.prefill_fraction < 1:
            raise ValueError(f"prefill_fraction must be in (0, 1), got {self.prefill_fraction!r}")


@dataclass(frozen=True)
class PlacementPlan:
    assignments: Mapping[str, tuple[str, ...]]   # model -> workers that may hold it
    roles: Mapping[str, str]                     # worker -> "mixed" | "prefill" | "decode"
    models: Mapping[str, ModelInfo] = field(default_factory=dict)
    slos: Mapping[str, SLO] = field(default_factory=dict)
    demand: Mapping[str, float] = field(default_factory=dict)
    unplaceable: Mapping[str, str] = field(default_factory=dict)   # model -> why
    version: int = 0

    def workers_for(self, model: str) -> tuple[str, ...]:
        return tuple(self.assignments.get(model, ()))

    def models_for(self, worker_id: str) -> list[str]:
        return sorted(m for m, ws in self.assignments.items() if worker_id in ws)

    def weight_bytes(self, model: str) -> int | None:
        info = self.models.get(model)
        return info.weight_bytes if info else None

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
            "models": {m: {"weight_bytes": i.weight_bytes, "kv_bytes_per_token": i.kv_bytes_per_token}
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
            models={m: ModelInfo.of(i) for m, i in d.get("models", {}).items()},
            slos={m: SLO(**s) for m, s in d.get("slos", {}).items()},
            demand=dict(d.get("demand", {})),
            unplaceable=dict(d.get("unplaceable", {})),
            version=int(d.get("version", 0)),
        )


class PlacementPolicy:
    """Stateful across calls: the previous plan, replica counts and cooldown timers give hysteresis."""

    def __init__(self, config: PlacementConfig | None = None):
        self.config = config or PlacementConfig()
        self._replicas: dict[str, int] = {}
        self._cool_since: dict[str, float] = {}
        self._assigned: dict[str, list[str]] = {}   # model -> workers, in the order they were added
        self._roles_prev: dict[str, str] = {}
        self._split = False
        self._merge_since: float | None = None
        self._version = 0

    def plan(self, workers: Iterable[Any], models: Mapping[str, Any],
             load: Mapping[str, Any] | None = None, slos: Mapping[str, SLO] | None = None,
             now: float = 0.0) -> PlacementPlan:
        """`workers`: WorkerView-like (worker_id, node_id, slot_bytes, alive, host_cached)."""
        cfg = self.config
        live = sorted((w for w in workers if getattr(w, "alive", True)), key=lambda w: w.worker_id)
        if len({w.worker_id for w in live}) != len(live):
            raise ValueError("worker ids must be unique")
        infos = {m: ModelInfo.of(v) for m, v in models.items()}
        loads = {m: ModelLoad.of(v) for m, v in (load or {}).items()}
        demand = {m: max(float(l.queued + l.running), l.rate_rps * cfg.request_s)
                  for m, l in loads.items() if m in infos}
        largest = max((w.slot_bytes for w in live), default=0)
        unplaceable = {}
        for m, info in infos.items():
            if not live:
                unplaceable[m] = "no live workers"
            elif info.weight_bytes > largest:
                unplaceable[m] = f"weights of {info.weight_bytes} bytes exceed the largest slot ({largest} bytes)"
        placeable = sorted((m for m in infos if m not in unplaceable), key=lambda m: (-demand.get(m, 0.0), m))

        roles = self._roles(live, sum(demand.get(m, 0.0) for m in placeable), now)
        pools = [[w for w in live if roles[w.worker_id] == r] for r in ("prefill", "decode")] \
            if self._split else [live]
        cached_on_node: dict[str, set[str]] = collections.defaultdict(set)
        for w in live:
            cached_on_node[w.node_id].update(getattr(w, "host_cached", ()))

        # One replica decision per model per plan (the pools share it), so hysteresis steps once.
        wanted = {m: self._replica_count(m, demand.get(m, 0.0), max(
            sum(w.slot_bytes >= infos[m].weight_bytes for w in pool) for pool in pools), now)
            for m in placeable}
        assignments: dict[str, list[str]] = {m: [] for m in placeable}
        for pool in pools:
            pool_load = {w.worker_id: 0.0 for w in pool}
            pool_models = collections.Counter()
            plan_order = []
            for m in placeable:
                fits = [w for w in pool if w.slot_bytes >= infos[m].weight_bytes]
                if not fits:
                    continue   # this pool cannot hold it; the other pool (or mixed) serves both phases
                n = min(wanted[m], len(fits))
                fit_ids = {w.worker_id for w in fits}
                kept = [w for w in self._assigned.get(m, []) if w in fit_ids][:n]
                plan_order.append((m, n, fits, kept))
                for w in kept:
                    pool_load[w] += demand.get(m, 0.0) / n
                    pool_models[w] += 1
            for m, n, fits, kept in plan_order:
                chosen = list(kept)
                while len(chosen) < n:
                    best = min((w for w in fits if w.worker_id not in chosen), key=lambda w: (
                        pool_load[w.worker_id], m not in cached_on_node[w.node_id],
                        pool_models[w.worker_id], w.worker_id))
                    chosen.append(best.worker_id)
                    pool_load[best.worker_id] += demand.get(m, 0.0) / n
                    pool_models[best.worker_id] += 1
                assignments[m].extend(chosen)
        for m in placeable:
            if not assignments[m]:   # cannot happen: the largest slot fits it; kept as a guard
                unplaceable[m] = "no worker fits"
                del assignments[m]

        changed = (self._assigned, self._roles_prev) != (assignments, roles)
        self._assigned, self._roles_prev = assignments, roles
        for m in list(self._replicas):
            if m not in infos:
                self._replicas.pop(m)
                self._cool_since.pop(m, None)
        if changed or self._version == 0:
            self._version += 1
        if changed:
            logger.info("placement v%d: %s roles=%s", self._version, self._assigned, roles)
        return PlacementPlan(
            assignments={m: tuple(ws) for m, ws in assignments.items()},
            roles=roles, models=infos, slos=dict(slos or {}),
            demand={m: demand.get(m, 0.0) for m in infos}, unplaceable=unplaceable,
            version=self._version,
        )

    def _replica_count(self, model: str, demand: float, max_replicas: int, now: float) -> int:
        cfg = self.config
        prev = min(max(1, self._replicas.get(model, 1)), max_replicas)
        n = prev
        if demand / prev > cfg.scale_out_load and prev < max_replicas:
            n = prev + 1
            self._cool_since.pop(model, None)
        elif prev > 1 and demand / (prev - 1) < cfg.scale_in_load:
            since = self._cool_since.setdefault(model, now)
            if now - since >= cfg.cooldown_s:
                n = prev - 1
                self._cool_since[model] = now   # the next step down waits a full cooldown too
        else:
            self._cool_since.pop(model, None)
        self._replicas[model] = n
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

