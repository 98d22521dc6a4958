"""The actor topology of one tokenmux cluster, brought up on an already connected Ray.

    bring_up(config) -> Topology
        GlobalRouter (named)          one per cluster; picks a worker per request
        PlacementService (named)      which worker may hold which model, and its role
        DeviceWorker x devices        one per device on every alive node, pinned there

`tick()` (called every second by a NodeWatcher) runs `refresh_nodes()` and the Supervisor
(cluster/supervisor.py), which replaces dead or unhealthy workers and a dead router or
placement service. A worker asks for `num_gpus=1, num_cpus=0` on its node (on a CPU host a virtual device is
one Ray GPU resource, see cluster/ray_runtime.py), so Ray's accounting is the device
inventory. Worker ids read "<node-short>-gpu<i>". The placement service registers models
on workers per its plan (every model gets at least one worker; hot ones get more).
`refresh_nodes()` (called every second by a NodeWatcher) gives a node that joined its
workers and deregisters the workers of a node that left. Nothing here starts or stops
Ray: `cluster.ray_runtime.connect_or_start` connects first.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.metrics import MetricsExporter
from cluster.catalog_store import CatalogStore
from cluster.node_watcher import NodeWatcher
from cluster.placement_service import REGISTRATION_FAILED, get_or_create_placement
from scheduler.tp_groups import check_tensor_parallel
from cluster.ray_runtime import NodeResources, alive_nodes
from cluster.router import get_or_create_router
from cluster.supervisor import Supervisor
from cluster.status import ClusterStatus, WorkerDown
from scheduler.catalog import ModelCatalog
from scheduler.messages import PLACEMENT_NAME, ROUTER_NAME, WorkerStats
from scheduler.placement import PlacementConfig
from scheduler.routing import RoutingConfig
from scheduler.slo import SLO

if TYPE_CHECKING:
    from actors.engine import EngineConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 30.0
VIRTUAL_ENGINE_NICE = 10  # a virtual device's engine thread yields the host's cores to the edge (EngineLoop)


def _default_engine() -> "EngineConfig":
    from actors.engine import EngineConfig   # torch comes with it: imported where workers start

    return EngineConfig()


@dataclass(frozen=True)
class TopologyConfig:
    models: dict[str, str]                 # name -> local checkpoint dir
    engine: "EngineConfig" = field(default_factory=_default_engine)   # every worker's, but its device (below)
    device: str | None = None              # workers' device (None: cuda on a node with a GPU, else cpu)
    devices_per_node: int | None = None    # workers per node (None: every GPU Ray sees there)
    threads_per_worker: int | None = None  # torch threads per worker (None: node cores // devices)
    slo: SLO = field(default_factory=SLO)
    placement: dict = field(default_factory=dict)  # PlacementConfig kwargs
    routing: dict = field(default_factory=dict)    # RoutingConfig kwargs
    placement_interval_s: float = 2.0
    watch_interval_s: float | None = 1.0   # node watcher period; None: no watcher
    supervise: bool = True                 # the watcher also replaces dead workers and control plane
    step_bound_s: float = 60.0             # a worker whose one engine step runs longer is unhealthy
    shared_kv: bool = True                 # CPU workers keep KV in /dev/shm (zero-copy handoff)
    engine_nice: int | None = None         # engine threads' lower CPU priority (None: 10 on a virtual device, else 0)
    detached: bool = False                 # actors outlive the driver that brought them up
    tensor_parallel: dict = field(default_factory=dict)  # model -> devices of its group (omitted: 1)

    def __post_init__(self) -> None:
        if not isinstance(self.models, dict) or not self.models:
            raise ValueError("TopologyConfig.models must be a non-empty dict of name -> checkpoint dir")
        for name, path in self.models.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"model names must be non-empty strings, got {name!r}")
            if not Path(path).is_dir():
                raise ValueError(f"model {name!r}: checkpoint dir {path!r} does not exist")
        object.__setattr__(self, "models", {n: str(p) for n, p in self.models.items()})
        for name, degree in self.tensor_parallel.items():
            if name not in self.models:
                raise ValueError(f"tensor_parallel names {name!r}, which is not among the models")
            check_tensor_parallel(degree, self.devices_per_node, model=name)
        for name in ("devices_per_node", "threads_per_worker"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"TopologyConfig.{name} must be a positive int or None, got {value!r}")
        if not isinstance(self.slo, SLO):
            raise ValueError(f"TopologyConfig.slo must be an SLO, got {self.slo!r}")
        if self.placement_interval_s <= 0:
            raise ValueError(f"placement_interval_s must be > 0, got {self.placement_interval_s!r}")
        if self.watch_interval_s is not None and self.watch_interval_s <= 0:
            raise ValueError(f"watch_interval_s must be > 0 or None, got {self.watch_interval_s!r}")
        if not self.step_bound_s > 0:
            raise ValueError(f"step_bound_s must be > 0, got {self.step_bound_s!r}")
        if self.engine_nice is not None and (not isinstance(self.engine_nice, int) or isinstance(self.engine_nice, bool)
                                             or not 0 <= self.engine_nice <= 19):
            raise ValueError(f"TopologyConfig.engine_nice must be an int in 0..19 or None, got {self.engine_nice!r}")
        from actors.engine import EngineConfig

        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"TopologyConfig.engine must be an EngineConfig, got {type(self.engine).__name__}")
        try:
            PlacementConfig(**self.placement)
            RoutingConfig(**self.routing)
        except TypeError as exc:
            raise ValueError(f"TopologyConfig: {exc}") from None


@dataclass(frozen=True)
class WorkerSpec:
    """What one DeviceWorker is started with (worker_specs; a replacement copies its device's)."""

    worker_id: str
    node_id: str
    engine: "EngineConfig"
    num_threads: int
    shared_kv: bool
    step_bound_s: float
    engine_nice: int
    device_id: str = ""   # the device it runs on, named by its first worker (a replacement keeps it)

    def __post_init__(self) -> None:
        if not self.worker_id or not self.node_id:
            raise ValueError(f"a worker needs an id and a node, got {self.worker_id!r} on {self.node_id!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.device_id:
            object.__setattr__(self, "device_id", self.worker_id)

    def replacement(self, num: int) -> "WorkerSpec":
        """The spec of the `num`th worker started on this device in place of a dead one."""
        return dataclasses.replace(self, worker_id=f"{self.device_id}-r{num}")


class Topology:
    """Handles of a running cluster. Created by bring_up (owns its actors) or connect_existing."""

    def __init__(self, router, placement, config: TopologyConfig | None = None, owned: bool = False):
        self.router = router
        self.placement = placement
        self.config = config
        self.workers: dict[str, Any] = {}        # worker_id -> DeviceWorker handle
        self.worker_nodes: dict[str, str] = {}   # worker_id -> node_id
        self.specs: dict[str, WorkerSpec] = {}   # worker_id -> what it was started with (worker_specs)
        self.vacant: dict[str, WorkerSpec] = {}  # retired worker_id -> its spec, until a replacement starts
        self._owned = owned                      # kill router/placement on shutdown
        self._lock = threading.RLock()
        self._watcher: NodeWatcher | None = None
        self.num_replaced: dict[str, int] = {}   # device id -> replacements started there
        self.supervisor = Supervisor(self) if config is not None and config.supervise else None

    # ---- membership ------------------------------------------------------------------

    def refresh_nodes(self) -> dict:
        """Workers for nodes that joined; deregister workers of nodes that left.

        Returns {"added": [worker ids], "removed": [worker ids]}.
        """
        import ray

        if self.config is None:
            raise ValueError("refresh_nodes needs a Topology made by bring_up (it knows the worker config)")
        with self._lock:
            nodes = {n.node_id: n for n in alive_nodes()}
            gone = [w for w, n in self.worker_nodes.items() if n not in nodes]
            for wid in gone:
                ray.get(self.router.remove_worker.remote(wid), timeout=CALL_TIMEOUT_S)
                self._forget(wid)
            for wid in [w for w, spec in self.vacant.items() if spec.node_id not in nodes]:
                del self.vacant[wid]
            added = []
            known = set(self.worker_nodes.values()) | {spec.node_id for spec in self.vacant.values()}
            for node in nodes.values():
                if node.node_id not in known:
                    added += self._start_node(node)
            if gone or added:
                logger.info("topology: workers added %s, removed %s", added, gone)
                ray.get(self.placement.replan.remote(), timeout=CALL_TIMEOUT_S)
            return {"added": added, "removed": gone}

    def prune_dead(self) -> list[str]:
        """Forget workers the router has dropped (they died); returns their ids."""
        import ray

        with self._lock:
            routed = ray.get(self.router.worker_handles.remote(), timeout=CALL_TIMEOUT_S)
            dead = [w for w in self.workers if w not in routed]
            for wid in dead:
                self._forget(wid)
            if dead:
                sweep_stale_kv_files()
            return dead

    def tick(self) -> None:
        """One round of the watcher: membership, then supervision. A failed refresh (a dead
        router it had to tell, say) does not skip supervision, which is what remakes that
        router: skipped, every tick failed the same way and the router stayed dead."""
        try:
            self.refresh_nodes()
        except Exception as exc:
            logger.warning("topology: refreshing the nodes failed (%s: %s); supervising anyway",
                           type(exc).__name__, exc)
        if self.supervisor is not None:
            self.supervisor.tick()

    def start_watcher(self, interval_s: float = 1.0) -> None:
        if self._watcher is None:
            self._watcher = NodeWatcher(self.tick, interval_s)

    # ---- supervision verbs (cluster/supervisor.py decides when) ------------------------

    def retire(self, worker_id: str) -> None:
        """Kill a worker and forget it; its device stays vacant until start_replacement."""
        with self._lock:
            spec = self.specs.pop(worker_id, None)
            self._forget(worker_id)
            if spec is not None:
                self.vacant[worker_id] = spec
            sweep_stale_kv_files()

    def start_replacement(self, worker_id: str) -> str | None:
        """Start a worker on the device a retired one held, under a new id; None if it did not start."""
        with self._lock:
            spec = self.vacant.get(worker_id)
            if spec is None:
                return None
            self.num_replaced[spec.device_id] = self.num_replaced.get(spec.device_id, 0) + 1
            new_spec = spec.replacement(self.num_replaced[spec.device_id])
            try:
                self._start_workers([new_spec])
            except Exception as exc:   # no resource yet (the old one still releasing it), node going away
                logger.warning("supervisor: the replacement of %s did not start: %s", worker_id, exc)
                return None
            del self.vacant[worker_id]
        self._replan()
        return new_spec.worker_id

    def rejoin(self, worker_ids: list[str]) -> None:
        """Give a router that came back empty these workers again (it asks each for its stats)."""
        import ray

        with self._lock:
            live = {w: self.workers[w] for w in worker_ids if w in self.workers}
            ray.get(self.router.attach_placement.remote(self.placement), timeout=CALL_TIMEOUT_S)
            refs = [self.router.add_worker.remote(w, h, self.worker_nodes[w]) for w, h in live.items()]
            ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        logger.warning("supervisor: the router was rebuilt from %d live worker(s)", len(live))
        self._replan()

    def replace_router(self) -> None:
        """A new router (the old one is dead for good), told to every holder of the old handle."""
        import ray

        with self._lock:
            self.router = get_or_create_router(detached=self.config.detached,
                                               routing_config=RoutingConfig(**self.config.routing))
            ray.get([h.set_router.remote(self.router) for h in self.workers.values()], timeout=CALL_TIMEOUT_S)
            ray.get(self.placement.attach_router.remote(self.router), timeout=CALL_TIMEOUT_S)
            self.rejoin(list(self.workers))

    def replace_placement(self) -> None:
        """A new placement service (the old one is dead for good), attached to the router."""
        import ray

        with self._lock:
            self.placement = start_placement(self.config, self.router)
        self._replan()

    def _replan(self) -> None:
        import ray

        try:
            ray.get(self.placement.replan.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as exc:   # its own loop retries within placement_interval_s
            logger.info("topology: replan failed: %s", exc)

    # ---- reading ---------------------------------------------------------------------

    def status(self) -> ClusterStatus:
        """Every worker's WorkerStats (or why it did not answer), the plan, the router."""
        import ray

        handles = ray.get(self.router.worker_handles.remote(), timeout=CALL_TIMEOUT_S)
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        workers: dict[str, WorkerStats | WorkerDown] = {}
        for wid, ref in refs.items():
            try:
                workers[wid] = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as exc:   # a dead or stuck worker is reported, not raised
                workers[wid] = WorkerDown(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        for wid in list(self.vacant):
            workers.setdefault(wid, WorkerDown("retired by the supervisor; its replacement is starting"))
        catalog = CatalogStore().load()
        return ClusterStatus(workers, ray.get(self.placement.plan.remote(), timeout=CALL_TIMEOUT_S),
                             ray.get(self.router.status.remote(), timeout=CALL_TIMEOUT_S),
                             replacements=self.supervisor.replacements() if self.supervisor else (),
                             catalog=catalog.to_dict() if catalog is not None else {})

    # ---- teardown --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the watcher; kill what bring_up created (workers, and router/placement if it made them)."""
        import ray

        if self.supervisor is not None:
            self.supervisor.closed = True
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.config is None:   # connect_existing: nothing here is ours
            return
        with self._lock:
            closing = [h.close.remote() for h in self.workers.values()]
            ray.wait(closing, num_returns=len(closing), timeout=10)   # unlink shared KV files first
            for handle in self.workers.values():
                _kill(ray, handle)
            self.workers.clear()
            self.worker_nodes.clear()
            self.vacant.clear()
            sweep_stale_kv_files()
            if self._owned:
                _kill(ray, self.placement)
                _kill(ray, self.router)
                _forget_catalog()   # a later cluster in this namespace starts from its own config

    # ---- internals -------------------------------------------------------------------

    def _start_node(self, node: NodeResources) -> list[str]:
        """Start, await and register the workers of one node; returns their ids."""
        return self._start_workers(worker_specs(node, self.config))

    def _start_workers(self, specs: list[WorkerSpec]) -> list[str]:
        """Start, await and register workers of one node (from worker_specs); returns their ids."""
        import ray

        if not specs:
            return []
        node_id = specs[0].node_id
        handles = {s.worker_id: _spawn(s, self.config) for s in specs}
        refs = {wid: h.ready.remote() for wid, h in handles.items()}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=READY_TIMEOUT_S)
        if pending:
            late = [wid for wid, r in refs.items() if r in pending]
            for h in handles.values():
                _kill(ray, h)
            raise RuntimeError(f"workers {late} on node {node_id} did not start within "
                               f"{READY_TIMEOUT_S:.0f}s (is a GPU resource of that node in use elsewhere?)")
        ray.get(ready)   # surface a constructor error
        ray.get([self.router.add_worker.remote(wid, h, node_id) for wid, h in handles.items()])
        for spec in specs:
            self.workers[spec.worker_id] = handles[spec.worker_id]
            self.worker_nodes[spec.worker_id] = node_id
            self.specs[spec.worker_id] = spec
        return list(handles)

    def _forget(self, worker_id: str) -> None:
        import ray

        handle = self.workers.pop(worker_id, None)
        self.worker_nodes.pop(worker_id, None)
        self.specs.pop(worker_id, None)
        if handle is not None:
            _kill(ray, handle)


def worker_specs(node: NodeResources, config: TopologyConfig) -> list[WorkerSpec]:
    """What workers a node gets: id, node, device, threads, engine config."""
    gpus = int(node.num_gpus)
    count = gpus if config.devices_per_node is None else min(config.devices_per_node, gpus)
    if config.devices_per_node is not None and config.devices_per_node > gpus:
        logger.warning("node %s declares %d GPU(s); starting %d worker(s), not %d",
                       node.node_id, gpus, count, config.devices_per_node)
    if count == 0:
        return []
    real_gpu = any(k.startswith("accelerator_type:") for k in node.resources)
    device = config.device or ("cuda" if real_gpu else "cpu")
    threads = config.threads_per_worker or max(1, int(node.num_cpus) // count)
    engine_nice = config.engine_nice if config.engine_nice is not None else VIRTUAL_ENGINE_NICE if device == "cpu" else 0
    short = node.node_id[:8]
    return [WorkerSpec(f"{short}-gpu{i}", node.node_id, dataclasses.replace(config.engine, device=device), threads,
                       shared_kv=config.shared_kv and device == "cpu", step_bound_s=config.step_bound_s,
                       engine_nice=engine_nice)
            for i in range(count)]


def _forget_catalog() -> None:
    try:
        CatalogStore().clear()
    except Exception as exc:   # the GCS is gone with Ray: nothing is left to forget
        logger.info("could not clear the stored catalog: %s", exc)


def bring_up(config: TopologyConfig) -> Topology:
    """Router, placement service and one DeviceWorker per device per alive node, wired up."""
    import ray

    if not ray.is_initialized():
        raise ValueError("bring_up needs a connected Ray; call cluster.ray_runtime.connect_or_start() first")
    owned = not (_named_exists(ray, ROUTER_NAME) or _named_exists(ray, PLACEMENT_NAME))
    if owned:   # a fresh cluster: its catalog is the config's models (deploying is adding them)
        CatalogStore().save(ModelCatalog.of_models(config.models))
        MetricsExporter().inc("tokenmux_catalog_changes_total", len(config.models), {"kind": "add"})
    router = get_or_create_router(detached=config.detached, routing_config=RoutingConfig(**config.routing))
    placement = start_placement(config, router)
    topology = Topology(router, placement, config, owned=owned)
    try:
        for node in alive_nodes():
            topology._start_node(node)
        if not topology.workers:
            raise RuntimeError("no node of the cluster offers a GPU resource; start Ray with num_gpus "
                               "(virtual devices on CPU hosts, see cluster/ray_runtime.py)")
        plan = ray.get(placement.replan.remote(), timeout=CALL_TIMEOUT_S)
        for _ in range(5):   # a replan racing the router's stats may re-register a model and fail
            if not any(REGISTRATION_FAILED in why for why in plan.unplaceable.values()):
                break
            time.sleep(1.0)
            plan = ray.get(placement.replan.remote(), timeout=CALL_TIMEOUT_S)
        if plan.unplaceable:
            logger.warning("topology: models that fit no worker: %s", dict(plan.unplaceable))
    except BaseException:
        topology.shutdown()
        raise
    if config.watch_interval_s is not None:
        topology.start_watcher(config.watch_interval_s)
    logger.info("topology up: %d workers on %d node(s)", len(topology.workers),
                len(set(topology.worker_nodes.values())))
    return topology


def start_placement(config: TopologyConfig, router):
    """The cluster's placement service (the named one, or a new one), started on `router`."""
    import ray

    placement = get_or_create_placement(detached=config.detached, models=dict(config.models),
                                        slos={m: config.slo for m in config.models},
                                        config=PlacementConfig(**config.placement),
                                        interval_s=config.placement_interval_s, router=router,
                                        tensor_parallel=dict(config.tensor_parallel))
    ray.get(placement.start.remote(), timeout=CALL_TIMEOUT_S)
    return placement


def connect_existing(namespace: str | None = None) -> Topology:
    """Handles of a cluster someone else brought up (by actor names); shutdown() leaves it running."""
    import ray

    if not ray.is_initialized():
        raise ValueError("connect_existing needs a connected Ray; call cluster.ray_runtime.connect_or_start()")
    try:
        router = ray.get_actor(ROUTER_NAME, namespace=namespace)
        placement = ray.get_actor(PLACEMENT_NAME, namespace=namespace)
    except ValueError as exc:
        raise ValueError(f"no tokenmux cluster is running in this Ray namespace: {exc}") from None
    topology = Topology(router, placement)
    topology.workers = ray.get(router.worker_handles.remote(), timeout=CALL_TIMEOUT_S)
    return topology


def _spawn(spec: WorkerSpec, config: TopologyConfig):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.worker import DeviceWorker

    options: dict = {"num_gpus": 1, "num_cpus": 0,
                     "scheduling_strategy": NodeAffinitySchedulingStrategy(spec.node_id, soft=False)}
    if config.detached:
        options["lifetime"] = "detached"
    return ray.remote(DeviceWorker).options(**options).remote(
        spec.worker_id, spec.engine, num_threads=spec.num_threads, node_id=spec.node_id,
        step_bound_s=spec.step_bound_s, engine_nice=spec.engine_nice,
        **({"shared_kv": True} if spec.shared_kv else {}))


def sweep_stale_kv_files(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink shared KV files of processes of this host that are gone (a killed worker leaves its
    region behind: kill skips cleanup). Files are named tokenmux-kv-<pid>-...; returns the removed."""
    import os

    removed = []
    for entry in Path(shm_dir).glob("tokenmux-kv-*"):
        pid = entry.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
        except PermissionError:   # alive, someone else's
            pass
    return removed


def _named_exists(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def _kill(ray, handle) -> None:
    try:
        ray.kill(handle)
    except Exception:   # already dead, or its node is gone
        pass
