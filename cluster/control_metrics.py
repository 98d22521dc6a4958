"""Metrics of the control plane: what the router dispatched and what placement changed.

The router records one counter per request it routes (not per token) and, each stats
poll, the requests in flight; the placement service records each plan it applies as the
difference to the one before (models added to or removed from a worker, role changes).
Both go straight to Ray metrics (actors/metrics.py): they are called at most a few times
per request, on actors that never touch a token.
"""
from __future__ import annotations

from actors.metrics import MetricsExporter


class RouterMetrics:
    def __init__(self, exporter: MetricsExporter | None = None):
        self.exporter = exporter or MetricsExporter()
        self._inflight_seen: set[tuple[str, str]] = set()

    def dispatched(self, model: str, worker_id: str) -> None:
        self.exporter.inc("tokenmux_router_requests_total", 1, {"model": model, "worker": worker_id})

    def no_worker(self, model: str) -> None:
        self.exporter.inc("tokenmux_router_no_worker_total", 1, {"model": model})

    def inflight(self, tracker, worker_ids) -> None:
        """Gauge of requests in flight per (model, worker); series that drained read 0."""
        now = {(m, w): n for w in worker_ids for m, n in tracker.inflight(w).items() if n}
        for key in self._inflight_seen | set(now):
            self.exporter.set("tokenmux_router_inflight_requests", now.get(key, 0),
                              {"model": key[0], "worker": key[1]})
        self._inflight_seen |= set(now)


class PlacementMetrics:
    def __init__(self, exporter: MetricsExporter | None = None):
        self.exporter = exporter or MetricsExporter()

    def plan_applied(self, before, after) -> dict[str, int]:
        """Record `after` (a PlacementPlan) against `before` (None at the start); returns the counts."""
        old = _pairs(before)
        new = _pairs(after)
        counts = {"added": 0, "removed": 0, "role": 0}
        for change, pairs in (("added", new - old), ("removed", old - new)):
            for model, worker in pairs:
                self.exporter.inc("tokenmux_placement_changes_total", 1,
                                  {"model": model, "worker": worker, "change": change})
                counts[change] += 1
        old_roles = dict(before.roles) if before is not None else {}
        for worker, role in after.roles.items():
            if old_roles.get(worker, "mixed") != role:
                self.exporter.inc("tokenmux_placement_changes_total", 1,
                                  {"model": "all", "worker": worker, "change": f"role_{role}"})
                counts["role"] += 1
        for model, workers in after.assignments.items():
            self.exporter.set("tokenmux_placement_replicas", len(workers), {"model": model})
        for model in _models(before) - _models(after):
            self.exporter.set("tokenmux_placement_replicas", 0, {"model": model})
        self.exporter.set("tokenmux_placement_plan_version", after.version, {})
        return counts


def _pairs(plan) -> set[tuple[str, str]]:
    if plan is None:
        return set()
    return {(m, w) for m, ws in plan.assignments.items() for w in ws}


def _models(plan) -> set[str]:
    return set(plan.assignments) if plan is not None else set()
