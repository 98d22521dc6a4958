"""Supervision of one topology: the control plane and every worker kept serving.

Each tick of the topology's watcher (after `refresh_nodes`) runs `Supervisor.tick`:

  control plane  The router and the placement service are restarted in place by Ray
                 (max_restarts); one that is dead for good (`ray.kill`) is made again and
                 every holder of its handle told. A router that came back empty gets every
                 healthy worker again: its table is rebuilt from the live workers, and its
                 load from their own queues (what the worker stats report).
  workers        Each worker answers `health()` (the watchdog, actors/worker.py). One that is
                 dead, unhealthy, or silent for `max_silent` ticks is taken out of routing,
                 closed if it still answers (its /dev/shm KV region unlinked) and killed; a new
                 worker is started on the same device under a new id (`<device id>-r<n>`), and
                 placement registers models on it per its plan. Requests that were on it are
                 continued elsewhere by the ingress (deploy/serve_app/cluster_engine.py).

Every replacement is kept as a WorkerReplacement (cluster/status.py) for `tokenmux status`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from actors.worker_reports import WorkerHealth
from cluster.status import WorkerReplacement

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
MAX_RECORDS = 100


class Supervisor:
    """Decides when; the topology (cluster/topology.py) does it, through its verbs retire,
    start_replacement, rejoin, replace_router and replace_placement."""

    def __init__(self, topology: Any, max_silent: int = 3, health_timeout_s: float = HEALTH_TIMEOUT_S):
        if max_silent < 1 or health_timeout_s <= 0:
            raise ValueError(f"max_silent must be >= 1 and health_timeout_s > 0, got {max_silent}, {health_timeout_s}")
        self.topology = topology
        self.max_silent = max_silent
        self.health_timeout_s = health_timeout_s
        self._silent: dict[str, int] = {}
        self._pending: dict[str, tuple[WorkerReplacement, float]] = {}   # retired, not yet replaced
        self._records: list[WorkerReplacement] = []
        self._records_lock = threading.Lock()
        self.closed = False

    def replacements(self) -> tuple[WorkerReplacement, ...]:
        with self._records_lock:
            return tuple(self._records)

    def tick(self) -> None:
        if self.closed:
            return
        self.check_control_plane()
        self.check_workers()
        for worker_id in list(self.topology.vacant):   # a replacement that could not start before
            self._fill(worker_id)

    # ---- the control plane -------------------------------------------------------------

    def check_control_plane(self) -> None:
        """Remake a router or placement service that is dead for good; give a router that came
        back empty (restarted in place) the healthy workers again."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        topo = self.topology
        try:
            routed = ray.get(topo.router.worker_handles.remote(), timeout=self.health_timeout_s)
        except ActorDiedError:
            logger.warning("supervisor: the router is gone; starting a new one")
            topo.replace_router()   # given every worker already
            return
        except (GetTimeoutError, RayActorError) as exc:   # restarting in place, or busy: next tick
            logger.info("supervisor: the router did not answer (%s)", type(exc).__name__)
            return
        try:
            ray.get(topo.placement.start.remote(), timeout=self.health_timeout_s)   # idempotent
        except ActorDiedError:
            logger.warning("supervisor: the placement service is gone; starting a new one")
            topo.replace_placement()
        except (GetTimeoutError, RayActorError) as exc:
            logger.info("supervisor: the placement service did not answer (%s)", type(exc).__name__)
        missing = [w for w in topo.workers if w not in routed]
        if missing and not routed:   # an empty router: restarted or new. Workers it merely dropped
            topo.rejoin(missing)      # (dead ones) are check_workers' to replace.

    # ---- the workers -------------------------------------------------------------------

    def check_workers(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        handles = dict(self.topology.workers)
        refs = {wid: h.health.remote() for wid, h in handles.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.health_timeout_s)
        ready = set(ready)
        for wid, ref in refs.items():
            reason = None
            if ref not in ready:
                self._silent[wid] = self._silent.get(wid, 0) + 1
                if self._silent[wid] >= self.max_silent:
                    reason = f"did not answer health() for {self._silent[wid]} checks"
            else:
                self._silent.pop(wid, None)
                try:
                    health: WorkerHealth = ray.get(ref)
                    reason = None if health.healthy else health.reason
                except RayActorError as exc:
                    reason = f"died: {_first_line(exc)}"
                except Exception as exc:   # an older worker without health(), a bug: say so, keep it
                    logger.warning("supervisor: health() of %s failed: %s", wid, _first_line(exc))
            if reason is not None:
                self.replace(wid, reason)

    def replace(self, worker_id: str, reason: str) -> str | None:
        """Take a worker out, free what it holds, start its replacement; the new id, or None."""
        import ray

        topo = self.topology
        handle = topo.workers.get(worker_id)
        if handle is None or self.closed:
            return None
        noticed = time.time()
        t0 = time.monotonic()
        logger.warning("supervisor: worker %s is %s; replacing it", worker_id, reason)
        self._silent.pop(worker_id, None)
        try:
            ray.get(topo.router.remove_worker.remote(worker_id), timeout=self.health_timeout_s)
        except Exception as exc:   # the router is down: it will be rebuilt without this worker
            logger.info("supervisor: removing %s from the router: %s", worker_id, _first_line(exc))
        try:   # a live but unhealthy worker unlinks its shared files itself; a dead one cannot
            ray.get(handle.close.remote(), timeout=CLOSE_TIMEOUT_S)
        except Exception:
            pass
        self._pending[worker_id] = (WorkerReplacement(worker_id, reason, noticed), t0)
        self._record(self._pending[worker_id][0])
        topo.retire(worker_id)   # kills the old actor, sweeps stale /dev/shm files; its device is vacant
        return self._fill(worker_id)

    def _fill(self, worker_id: str) -> str | None:
        """Start the replacement of a retired worker; None (retried next tick) when it did not start."""
        new_id = self.topology.start_replacement(worker_id)
        if new_id is None:
            return None
        record, t0 = self._pending.pop(worker_id, (WorkerReplacement(worker_id, "vacant", time.time()),
                                                   time.monotonic()))
        done = WorkerReplacement(worker_id, record.reason, record.noticed_at, new_id, time.monotonic() - t0)
        self._record(done, instead_of=record)
        logger.warning("supervisor: %s replaced by %s in %.1f s", worker_id, new_id, done.replaced_s)
        return new_id

    def _record(self, record: WorkerReplacement, instead_of: WorkerReplacement | None = None) -> None:
        with self._records_lock:
            if instead_of is not None and instead_of in self._records:
                self._records[self._records.index(instead_of)] = record
            else:
                self._records.append(record)
            del self._records[:-MAX_RECORDS]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
