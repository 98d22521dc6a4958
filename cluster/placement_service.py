"""PlacementService: turns router-reported load into a placement plan and applies it.

Every `interval_s` (and on demand: `replan()`, which the router calls when all of a
model's workers run hot) it asks the router for a LoadReport (worker views and per-model
load, scheduler/messages.py), runs
`scheduler.placement.PlacementPolicy` (which keeps the hysteresis state, so it lives
here, once per cluster), and applies the plan in an order that never routes a request to
a worker without the model:

  0. while workers gain a model, push the part of the plan that needs no registration
     (`routable_now`: each model on the workers that hold it already), so a burst reaches
     those replicas without waiting for the others to load the model;
  1. register_model on workers that gain a model (a failed registration drops that
     worker from the model's list in the plan); a tensor-parallel model's group is formed
     and the model registered on all its workers at once (cluster/tp_formation.py);
  2. set_role on workers whose role changes;
  3. push the PlacementPlan to the router (routing follows it from here on);
  4. unregister_model where a model left a worker, once no request of it is in flight
     there (otherwise the next round retries).

Registering a model puts it in the node's host cache only: a cold model costs no device
memory until a request arrives and the worker swaps it into a slot.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from cluster.control_metrics import PlacementMetrics
from cluster.tp_formation import form_group
from scheduler.messages import PLACEMENT_NAME, ROUTER_NAME, WorkerView
from cluster.status import LoadReport
from scheduler.placement import (ModelInfo, PlacementConfig, PlacementPlan, PlacementPolicy, plan_changes,
                                 routable_now)
from scheduler.slo import SLO
from scheduler.tp_groups import check_tensor_parallel

logger = logging.getLogger(__name__)

REGISTRATION_FAILED = "registration failed"   # why a model every planned worker failed to register is unplaceable


def model_entry(name: str, source: Any, tensor_parallel: int = 1) -> tuple[str, ModelInfo]:
    """(path, ModelInfo) from a checkpoint path, or a dict {path, weight_bytes?, kv_bytes_per_token?,
    tensor_parallel?}; `tensor_parallel` is the degree when the dict does not give one."""
    if isinstance(source, dict):
        path = source.get("path")
        if not path:
            raise ValueError(f"model {name!r}: entry needs a 'path'")
        tensor_parallel = check_tensor_parallel(source.get("tensor_parallel", tensor_parallel), model=name)
        if "weight_bytes" in source:
            return str(path), ModelInfo.from_dict({**source, "tensor_parallel": tensor_parallel})
    else:
        path = source
    from actors.model_spec import ModelSpec   # reads headers only, no torch

    spec = ModelSpec.from_dir(path)
    kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
    return str(path), ModelInfo(spec.weight_bytes, kv_per_token,
                                tensor_parallel=check_tensor_parallel(tensor_parallel, model=name))


def without_failed(plan: PlacementPlan, failed: dict[tuple[str, str], str]) -> PlacementPlan:
    """`plan` less the (worker, model) registrations that failed (-> why): the model stays on
    its other workers, or is unplaceable with the reasons. A TP group runs every step
    together, so one member that failed takes the whole group out."""
    if not failed:
        return plan
    assignments, unplaceable = {}, dict(plan.unplaceable)
    for m, ws in plan.assignments.items():
        group_failed = any((w, m) in failed for w in plan.group_of(m))
        kept = () if group_failed else tuple(w for w in ws if (w, m) not in failed)
        if kept:
            assignments[m] = kept
        else:
            unplaceable[m] = f"{REGISTRATION_FAILED}: " + "; ".join(r for (w, mm), r in failed.items() if mm == m)
    groups = {m: g for m, g in plan.groups.items() if m in assignments}
    return replace(plan, assignments=assignments, unplaceable=unplaceable, groups=groups)


@ray.remote(num_cpus=0, max_restarts=-1)   # restarted in place; the supervisor calls start() again
class PlacementService:
    def __init__(self, models: dict[str, Any] | None = None, slos: dict[str, SLO] | None = None,
                 config: PlacementConfig | None = None, interval_s: float = 2.0, router=None,
                 tensor_parallel: dict[str, int] | None = None):
        """`tensor_parallel`: model -> devices of its group, as the app config declares them (default 1)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._policy = PlacementPolicy(config)
        self._tensor_parallel = dict(tensor_parallel or {})
        self._paths: dict[str, str] = {}
        self._infos: dict[str, ModelInfo] = {}
        for name, source in (models or {}).items():
            self._paths[name], self._infos[name] = model_entry(name, source, self._tensor_parallel.get(name, 1))
        self._slos = dict(slos or {})
        self._adopt_stored_catalog()
        self._interval_s = interval_s
        self._router = router
        self._plan: PlacementPlan | None = None
        self._lock = asyncio.Lock()
        self._loop_task: asyncio.Task | None = None
        self._metrics = PlacementMetrics()

    def _adopt_stored_catalog(self) -> None:
        """The live catalog, when one is stored, over the models this was constructed with: Ray
        restarts this actor in place with its first arguments (the deployed config's models), and
        models added, updated or removed since must not be lost or come back (cluster/catalog_store.py)."""
        from cluster.catalog_store import CatalogStore

        try:
            catalog = CatalogStore().load()
        except Exception as exc:   # no GCS to read (a test without Ray): the arguments stand
            logger.info("placement: no stored catalog read (%s); serving the configured models", exc)
            return
        if catalog is None:
            return
        placed = catalog.placed()
        degrees = {**self._tensor_parallel, **{e.key: e.tensor_parallel for e in catalog.entries.values()}}
        default = next(iter(self._slos.values()), None)
        self._paths = {k: p for k, p in self._paths.items() if k in placed}
        self._infos = {k: i for k, i in self._infos.items() if k in placed}
        for key, path in placed.items():
            if key not in self._infos:
                self._paths[key], self._infos[key] = model_entry(key, path, degrees.get(key, 1))
        for entry in catalog.entries.values():
            base = self._slos.get(entry.key) or default or SLO()
            self._slos[entry.key] = SLO(entry.ttft_s or base.ttft_s, entry.tbt_s or base.tbt_s)
        self._slos = {k: s for k, s in self._slos.items() if k in placed}

    def models(self) -> dict[str, str]:
        """Key -> checkpoint dir of every model this service places."""
        return dict(self._paths)

    async def start(self) -> None:
        """Attach to the router and start the periodic replan (idempotent)."""
        if self._loop_task is None or self._loop_task.done():
            await self._get_router().attach_placement.remote(ray.get_runtime_context().current_actor)
            self._loop_task = asyncio.get_running_loop().create_task(self._replan_forever())

    async def attach_router(self, router) -> None:
        """Plan with a new router (the old one died for good) and attach to it."""
        self._router = router
        await router.attach_placement.remote(ray.get_runtime_context().current_actor)

    async def add_model(self, name: str, source: Any, slo: SLO | None = None) -> PlacementPlan:
        if not name:
            raise ValueError("model name must be non-empty")
        self._paths[name], self._infos[name] = model_entry(name, source)
        if slo:
            self._slos[name] = slo
        return await self.replan()

    async def remove_model(self, name: str) -> PlacementPlan:
        if name not in self._infos:
            raise ValueError(f"unknown model {name!r}; known: {sorted(self._infos)}")
        del self._paths[name], self._infos[name]
        self._slos.pop(name, None)
        return await self.replan()

    async def plan(self) -> PlacementPlan | None:
        return self._plan

    async def replan(self) -> PlacementPlan:
        async with self._lock:
            router = self._get_router()
            report: LoadReport = await router.load_report.remote()
            views = list(report.workers)
            load = {m: l for m, l in report.load.items() if m in self._infos}
            plan = self._policy.plan(views, self._infos, load, self._slos, now=time.monotonic())
            handles = await router.worker_handles.remote()
            if plan_changes(plan, views).register:
                await router.set_plan.remote(routable_now(plan, views, self._plan))
            plan = await self._register(plan, views, handles)
            await self._set_roles(plan, views, handles)
            await router.set_plan.remote(plan)
            self._metrics.plan_applied(self._plan, plan)
            self._plan = plan
            await self._unregister(plan, views, handles)
            return plan

    # ---- applying a plan ---------------------------------------------------------------

    async def _register(self, plan: PlacementPlan, views: list[WorkerView], handles: dict) -> PlacementPlan:
        """Register each model where the plan adds it: a single-device model on each worker, a
        tensor-parallel model on its whole group at once (cluster/tp_formation.py)."""
        register = plan_changes(plan, views).register
        todo = [(w, m) for w, m in register if w in handles and not plan.group_of(m)]
        groups = sorted({m for _, m in register if plan.group_of(m)})
        results = await asyncio.gather(
            *(handles[w].register_model.remote(m, self._paths[m]) for w, m in todo),
            *(form_group(m, self._paths[m], plan.group_of(m), handles) for m in groups), return_exceptions=True)
        outcomes = list(zip(todo, results)) + [((w, m), result) for m, result in zip(groups, results[len(todo):])
                                               for w in plan.group_of(m)]
        failed = {}
        for (w, m), result in outcomes:
            if isinstance(result, BaseException):
                logger.warning("placement: registering %s on %s failed: %s", m, w, result)
                failed[(w, m)] = str(result).splitlines()[0] if str(result) else type(result).__name__
        return without_failed(plan, failed)

    async def _set_roles(self, plan: PlacementPlan, views: list[WorkerView], handles: dict) -> None:
        todo = [(w, r) for w, r in plan_changes(plan, views).roles if w in handles]
        results = await asyncio.gather(*(handles[w].set_role.remote(r) for w, r in todo), return_exceptions=True)
        for (w, r), result in zip(todo, results):
            if isinstance(result, BaseException):
                logger.warning("placement: set_role(%s) on %s failed: %s", r, w, result)

    async def _unregister(self, plan: PlacementPlan, views: list[WorkerView], handles: dict) -> None:
        todo = [(w, m) for w, m in plan_changes(plan, views).unregister if w in handles]
        # a model no longer placed anywhere (removed from the catalog) leaves the node's host cache too
        results = await asyncio.gather(
            *(handles[w].unregister_model.remote(m, m not in self._infos) for w, m in todo), return_exceptions=True)
        for (w, m), result in zip(todo, results):
            if isinstance(result, BaseException) and not isinstance(result, RayActorError):
                logger.info("placement: unregister_model(%s) on %s deferred: %s", m, w, result)

    def _get_router(self):
        if self._router is None:
            self._router = ray.get_actor(ROUTER_NAME)
        return self._router

    async def _replan_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.replan()
            except Exception:   # a failed round must not end the loop; the next one retries
                logger.exception("placement: replan failed")


def get_or_create_placement(detached: bool = False, **kwargs):
    """The cluster's placement service: the named actor if it exists, else a new one."""
    options = {"name": PLACEMENT_NAME, "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    return PlacementService.options(**options).remote(**kwargs)
