"""GlobalRouter: one per cluster; picks a worker for each new request, never touches tokens.

The ingress asks `pick(model)` and gets a `WorkerPick` (worker_id, handle), then streams from
`handle.generate` itself, and calls `release(worker_id, model)` when the request ends.
So the router sits on one call per request, not on the per-token path.

State: the worker handles, each worker's latest `WorkerStats` (polled every
`poll_interval_s`; its measured decode step time is what "SLO headroom" is computed from),
the requests dispatched and not yet released (`LoadTracker`), and the PlacementPlan pushed
by the PlacementService. The decision itself is `scheduler.routing.RoutingPolicy`. What
goes in and out is typed (cluster/status.py, scheduler/messages.py): LoadReport to placement, PlacementPlan
from it, DecodeTarget to a prefill worker, RouterStatus to operators.

A worker whose stats call fails with RayActorError (it died) is removed from routing; one
that merely stops answering for `max_missed` polls is skipped until it answers again.

A router that dies is restarted by Ray (max_restarts) with an empty table; the topology's
supervisor gives it the live workers again (cluster/supervisor.py), so its view and load
come back from the workers themselves. Until the first worker is back, `pick` waits up to
`rebuild_wait_s` instead of refusing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from actors.heap import freeze_heap
from cluster.control_metrics import RouterMetrics
from scheduler.messages import ROUTER_NAME, DecodeTarget, WorkerStats
from cluster.status import LoadReport, RouterStatus
from scheduler.placement import PlacementPlan, observed_load
from scheduler.routing import LoadTracker, NoWorkerError, RoutingConfig, RoutingPolicy, WorkerView
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

REBUILD_WAIT_S = 10.0


@dataclass(frozen=True)
class WorkerPick:
    """The worker chosen for a new request (producer: GlobalRouter.pick): the caller streams from
    `handle` itself and releases the request's count at the router when it ends."""

    worker_id: str
    handle: Any


@dataclass
class _Worker:
    handle: Any
    node_id: str
    stats: WorkerStats | None = None
    missed: int = 0


@ray.remote(num_cpus=0, max_restarts=-1)
class GlobalRouter:
    def __init__(self, routing_config: RoutingConfig | None = None, poll_interval_s: float = 0.5,
                 stats_timeout_s: float = 2.0, max_missed: int = 10, hot_trigger_interval_s: float = 1.0):
        if poll_interval_s <= 0 or stats_timeout_s <= 0 or max_missed < 1:
            raise ValueError("poll_interval_s and stats_timeout_s must be > 0, max_missed >= 1")
        self._policy = RoutingPolicy(routing_config)
        self._poll_interval_s = poll_interval_s
        self._stats_timeout_s = stats_timeout_s
        self._max_missed = max_missed
        self._hot_trigger_interval_s = hot_trigger_interval_s
        self._workers: dict[str, _Worker] = {}
        self._tracker = LoadTracker()
        self._picked: dict[str, tuple[str, str]] = {}   # request id -> (worker, model) it is counted on
        self._plan: PlacementPlan | None = None
        self._placement = None              # PlacementService handle, told when a model runs hot
        self._last_hot_trigger: dict[str, float] = {}
        self._poller: asyncio.Task | None = None
        self._metrics = RouterMetrics()
        self._has_workers: asyncio.Event | None = None   # made on the actor's loop (see _workers_added)
        freeze_heap()   # every request passes through here: no long collector pauses (actors/heap.py)

    # ---- membership ------------------------------------------------------------------

    async def add_worker(self, worker_id: str, handle, node_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        self._ensure_poller()
        self._workers[worker_id] = _Worker(handle=handle, node_id=node_id)
        # Routable at once, with real stats; a worker still starting up gets longer to answer.
        await self._refresh(worker_id, timeout_s=max(self._stats_timeout_s, 30.0))
        if self._workers[worker_id].stats is not None:
            self._workers_added().set()
        logger.info("router: worker %s on node %s added", worker_id, node_id)
        self._ask_replan()

    async def remove_worker(self, worker_id: str) -> bool:
        return self._remove(worker_id, "removed")

    async def report_failure(self, worker_id: str) -> bool:
        """The caller saw a call to this worker fail; check it now. True if it was removed."""
        if worker_id not in self._workers:
            return False
        await self._refresh(worker_id)
        return worker_id not in self._workers

    # ---- routing ---------------------------------------------------------------------

    async def pick(self, model: str, slo: SLO | None = None, request_id: str | None = None) -> WorkerPick:
        """Worker for a new request of `model`. Raises NoWorkerError.

        With `request_id` the count is the request's: a second pick for it (the caller retried a
        call that had run here but whose answer was lost, as ActorUnavailableError allows around
        a restart) moves its one count instead of adding one, and `release` with the same id
        drops it once. Without, every pick counts until a release."""
        self._ensure_poller()
        if not any(w.stats for w in self._workers.values()):   # just (re)started: workers are coming back
            try:
                await asyncio.wait_for(self._workers_added().wait(), REBUILD_WAIT_S)
            except asyncio.TimeoutError:
                pass
        views = self._views()
        try:
            worker_id = self._policy.pick(model, views, slo, self._plan)
        except NoWorkerError:
            self._metrics.no_worker(model)
            raise
        handle = self._workers[worker_id].handle
        self._metrics.dispatched(model, worker_id)
        self._maybe_scale_out(model, views)
        # counted last: nothing after it can raise, so a count is never left without a caller to release it
        if request_id is not None:
            previous = self._picked.pop(request_id, None)
            if previous is not None:
                self._tracker.released(*previous)
            self._picked[request_id] = (worker_id, model)
        self._tracker.dispatched(worker_id, model, time.monotonic())
        return WorkerPick(worker_id, handle)

    async def pick_decode(self, model: str, slo: SLO | None = None) -> DecodeTarget:
        """Decode worker to hand a prefilled request's KV to (the KV handoff target)."""
        worker_id = self._policy.pick_decode(model, self._views(), slo, self._plan)
        entry = self._workers[worker_id]
        return DecodeTarget(worker_id, entry.node_id, entry.handle)

    async def inflight_requests(self) -> dict[str, tuple[str, str]]:
        """Request id -> (worker, model) of the requests picked by id and not released yet."""
        return dict(self._picked)

    async def release(self, worker_id: str, model: str, request_id: str | None = None) -> None:
        if request_id is not None:
            counted = self._picked.pop(request_id, None)
            if counted is None:   # released already, or its worker was forgotten: nothing to drop
                return
            worker_id, model = counted
        if not self._tracker.released(worker_id, model):
            logger.debug("router: release of %s on %s with nothing in flight", model, worker_id)

    # ---- placement -------------------------------------------------------------------

    async def set_plan(self, plan: PlacementPlan) -> None:
        self._plan = plan

    async def plan(self) -> PlacementPlan | None:
        return self._plan

    async def attach_placement(self, handle) -> None:
        self._placement = handle

    async def worker_handles(self) -> dict[str, Any]:
        return {wid: w.handle for wid, w in self._workers.items()}

    async def load_report(self) -> LoadReport:
        """What the PlacementService plans from: worker views and per-model load."""
        views = self._views()
        now = time.monotonic()
        queued: dict[str, int] = {}
        running: dict[str, int] = {}
        for entry in self._workers.values():
            if entry.stats is None:
                continue
            for counts, acc in ((entry.stats.engine.queue_depth, queued), (entry.stats.engine.running, running)):
                for m, n in counts.items():
                    acc[m] = acc.get(m, 0) + int(n)
        return LoadReport(tuple(views), observed_load(queued, running, self._tracker, now))

    async def status(self) -> RouterStatus:
        views = self._views()
        return RouterStatus({v.worker_id: v for v in views}, self._tracker.pending(),
                            tuple(self._policy.servable(views, self._plan)),
                            self._plan.version if self._plan else None)

    # ---- internals -------------------------------------------------------------------

    def _views(self) -> list[WorkerView]:
        cached_on_node: dict[str, set[str]] = {}
        for entry in self._workers.values():
            if entry.stats is not None:
                cached_on_node.setdefault(entry.node_id, set()).update(entry.stats.engine.registered)
        views = []
        for wid, entry in self._workers.items():
            if entry.stats is None:
                continue
            views.append(WorkerView.from_stats(
                entry.stats, host_cached=cached_on_node.get(entry.node_id, ()),
                extra_load=self._tracker.inflight(wid), alive=entry.missed < self._max_missed,
                node_id=entry.node_id))
        return views

    def _maybe_scale_out(self, model: str, views: list[WorkerView]) -> None:
        if self._placement is None or not self._policy.is_hot(model, views, self._plan):
            return
        now = time.monotonic()
        if now - self._last_hot_trigger.get(model, -1e9) >= self._hot_trigger_interval_s:
            self._last_hot_trigger[model] = now
            logger.info("router: every worker of %s is hot; asking placement to replan", model)
            self._ask_replan()

    def _remove(self, worker_id: str, why: str) -> bool:
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return False
        lost = self._tracker.forget_worker(worker_id)
        self._picked = {rid: c for rid, c in self._picked.items() if c[0] != worker_id}
        logger.warning("router: worker %s %s (in flight there: %s)", worker_id, why, lost or "none")
        self._ask_replan()   # its models may now have no worker left
        return True

    def _ask_replan(self) -> None:
        if self._placement is not None:
            self._placement.replan.remote()   # fire and forget: the new plan comes back via set_plan

    async def _refresh(self, worker_id: str, timeout_s: float | None = None) -> None:
        entry = self._workers.get(worker_id)
        if entry is None:
            return
        try:
            stats = await asyncio.wait_for(entry.handle.stats.remote(), timeout_s or self._stats_timeout_s)
        except (asyncio.TimeoutError, ActorUnavailableError):
            entry.missed += 1
            return
        except RayActorError:
            if self._workers.get(worker_id) is entry:
                self._remove(worker_id, "died")
            return
        if self._workers.get(worker_id) is entry:
            entry.stats, entry.missed = stats, 0

    def _workers_added(self) -> asyncio.Event:
        if self._has_workers is None:
            self._has_workers = asyncio.Event()
        return self._has_workers

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._refresh(wid) for wid in list(self._workers)))
                self._metrics.inflight(self._tracker, list(self._workers))
            except Exception:   # never let one bad poll end polling
                logger.exception("router: stats poll failed")
            await asyncio.sleep(self._poll_interval_s)


def get_or_create_router(detached: bool = False, **kwargs):
    """The cluster's router: the named actor if it exists, else a new one."""
    options = {"name": ROUTER_NAME, "get_if_exists": True}   # restarted by Ray when it dies (max_restarts)
    if detached:
        options["lifetime"] = "detached"
    return GlobalRouter.options(**options).remote(**kwargs)


__all__ = ["GlobalRouter", "NoWorkerError", "ROUTER_NAME", "WorkerPick", "get_or_create_router"]
