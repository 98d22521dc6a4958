"""What the control plane tells itself and operators: typed, one producer each.

    LoadReport        router -> placement           (cluster/router.py)
    RouterStatus      router -> status, the edge    (cluster/router.py)
    WorkerDown        a worker that did not answer a status (cluster/topology.py)
    WorkerReplacement supervisor -> status          (cluster/supervisor.py)
    ClusterStatus     topology -> `tokenmux status` (cluster/topology.py)

The messages of the data plane and of the workers (GenerateRequest, OutputFrame, WorkerStats,
WorkerView, ...) are scheduler/messages.py's: workers produce them and cannot import this layer.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from scheduler.messages import WorkerStats, WorkerView

if TYPE_CHECKING:
    from scheduler.placement import ModelLoad, PlacementPlan


@dataclass(frozen=True)
class LoadReport:
    """What the PlacementService plans from (producer: GlobalRouter.load_report)."""

    workers: tuple[WorkerView, ...]
    load: Mapping[str, "ModelLoad"]     # per model: arrival rate, queued, running


@dataclass(frozen=True)
class RouterStatus:
    """The router's state for operators (producer: GlobalRouter.status)."""

    workers: Mapping[str, WorkerView]
    pending: Mapping[str, int]          # dispatched and not released, per model
    servable: tuple[str, ...]
    plan_version: int | None = None

    def to_dict(self) -> dict:
        return {"workers": {w: v.to_dict() for w, v in self.workers.items()}, "pending": dict(self.pending),
                "servable": list(self.servable), "plan_version": self.plan_version}


@dataclass(frozen=True)
class WorkerDown:
    """A worker that did not answer `stats()` for a status."""

    error: str


@dataclass(frozen=True)
class WorkerReplacement:
    """A dead or unhealthy worker and the one started on its device in its place
    (producer: cluster/supervisor.py; shown by `tokenmux status`)."""

    worker_id: str                  # the worker that died or was killed as unhealthy
    reason: str
    noticed_at: float               # wall clock (time.time()) when the supervisor noticed
    replacement_id: str | None = None   # None: not replaced yet (starting, or its node is gone)
    replaced_s: float | None = None     # from noticing to the replacement taking requests

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.replaced_s is not None and (self.replaced_s < 0 or self.replacement_id is None):
            raise ValueError(f"replaced_s must be >= 0 and come with a replacement_id, got {self.replaced_s!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ClusterStatus:
    """Workers, the placement plan and the router of one cluster (producer: Topology.status),
    shown by `tokenmux status`."""

    workers: Mapping[str, WorkerStats | WorkerDown]
    plan: "PlacementPlan | None"
    router: RouterStatus
    models: Mapping[str, str] = field(default_factory=dict)   # name -> checkpoint dir (the Serve app adds them)
    policy: str | None = None
    replacements: tuple[WorkerReplacement, ...] = ()   # dead workers and their replacements, oldest first
    catalog: Mapping = field(default_factory=dict)   # the live catalog (scheduler/catalog.py ModelCatalog.to_dict)

    def alive(self) -> dict[str, WorkerStats]:
        return {w: s for w, s in self.workers.items() if isinstance(s, WorkerStats)}

    def to_dict(self) -> dict:
        workers = {w: ({"alive": True, **s.to_dict()} if isinstance(s, WorkerStats) else
                       {"alive": False, "error": s.error}) for w, s in self.workers.items()}
        return {"workers": workers, "plan": self.plan.to_dict() if self.plan else None,
                "router": self.router.to_dict(), "models": dict(self.models), "policy": self.policy,
                "replacements": [r.to_dict() for r in self.replacements], "catalog": dict(self.catalog)}
