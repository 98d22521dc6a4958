"""LiveCatalog: add, update and remove models on a running cluster, with no request lost.

    add(name, path)     check the checkpoint -> placement places the key -> workers register it
                        -> the router routes it -> the catalog (stored) lists it
    update(name, path)  the new version placed beside the old (key name@vN) -> the entry
                        switches -> the old key retires once its requests are done
    remove(name)        the entry goes (new requests: 404 at the edge) -> in-flight requests
                        finish, or after drain_s end with an explicit error -> placement drops
                        the key -> every worker frees its slot, KV view and host-cache entry

One change at a time (a lock); each ends with the catalog saved in the GCS (CatalogStore), which
is what a restarted placement service reads back. An add (or update) whose worker dies while it
loads the model is placed again on the live workers (and on the dead one's replacement) within
READY_TIMEOUT_S, rather than refused. Nothing changes when a check fails: a bad
checkpoint, an unknown name, weights that fit no device's slot are CatalogErrors naming the
field, raised before anything is placed, and a key placement could not place is withdrawn.
Blocking calls (`ray.get`): run it off an event loop (the Serve app does, in a thread).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from actors.metrics import MetricsExporter
from cluster.catalog_store import CatalogStore
from cluster.placement_service import REGISTRATION_FAILED
from scheduler.catalog import CatalogEntry, CatalogError, ModelCatalog, check_name, serving_key
from scheduler.slo import SLO
from scheduler.tp_groups import device_share

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0      # an added key must be registered and routable within this
UNPLACE_TIMEOUT_S = 60.0    # a retired key must have left every worker within this
UPDATE_DRAIN_S = 600.0      # an old version's requests get this long before they are cut
POLL_S = 0.1
REPLACE_WAIT_S = 0.5        # between plans while a worker lost during an add is dropped or replaced


class LiveCatalog:
    def __init__(self, topology: Any, store: CatalogStore, default_slo: SLO,
                 exporter: MetricsExporter | None = None) -> None:
        """topology: a cluster.topology.Topology (its router and placement handles are read at each
        use: the supervisor may replace them)."""
        self.topology = topology
        self.store = store
        self.default_slo = default_slo
        self.exporter = exporter or MetricsExporter()
        self._lock = threading.Lock()
        self._retiring: dict[str, threading.Thread] = {}

    # ---- reading -------------------------------------------------------------------------

    def catalog(self) -> ModelCatalog:
        return self.store.load() or ModelCatalog()

    # ---- changes ---------------------------------------------------------------------------

    def add(self, name: str, path: str, ttft_s: float | None = None, tbt_s: float | None = None,
            tensor_parallel: int = 1) -> CatalogEntry:
        """Serve `name` from the checkpoint at `path`; tensor_parallel > 1: over a group of that
        many devices of one node (placement gives it the group, the topology forms it)."""
        with self._lock:
            catalog = self.catalog()
            check_name(name)
            if name in catalog.entries:
                raise CatalogError(f"model {name!r} is already served (version {catalog.entries[name].version}); "
                                   f"update it instead", "name", 409)
            version = _free_version(catalog, name, 1)
            entry = CatalogEntry(name, str(path), version, ttft_s, tbt_s, tensor_parallel)
            self._check_checkpoint(entry.path, entry.tensor_parallel)
            workers = self._place(entry)
            catalog = self.catalog().with_entry(entry, "add").logged("placed", entry.key, ", ".join(workers))
            self._save(catalog, "add")
            return entry

    def update(self, name: str, path: str) -> CatalogEntry:
        """Switch `name` to the checkpoint at `path` with no gap; returns the new entry. The old
        version's requests finish on it (or end with an error after UPDATE_DRAIN_S)."""
        with self._lock:
            catalog = self.catalog()
            old = catalog.entry(check_name(name))
            entry = dataclasses.replace(old, path=str(path), version=_free_version(catalog, name, old.version + 1))
            self._check_checkpoint(entry.path, entry.tensor_parallel)
            workers = self._place(entry)
            catalog = self.catalog().with_entry(entry, "update").logged("placed", entry.key, ", ".join(workers))
            self._save(catalog, "update")
        self._retire_in_background(old.key, UPDATE_DRAIN_S)
        return entry

    def remove(self, name: str, drain_s: float | None = None) -> dict:
        """Stop serving `name`: no new request reaches it from now; the requests in flight finish
        (after `drain_s`, if given, they are cut with an error naming the removal); then its memory
        is freed on every worker. Returns {"model", "cut"} once it is freed."""
        if drain_s is not None and (isinstance(drain_s, bool) or not isinstance(drain_s, (int, float))
                                    or not 0 <= drain_s <= 3600):
            raise CatalogError(f"drain_s must be a number of seconds in [0, 3600], got {drain_s!r}", "drain_s")
        with self._lock:
            catalog = self.catalog()
            entry = catalog.entry(check_name(name))
            self._save(catalog.without(name), "remove")
        return {"model": name, "key": entry.key, "cut": self.retire(entry.key, drain_s)}

    def retire(self, key: str, drain_s: float | None) -> int:
        """Drain `key` (cut what is left after drain_s), withdraw it from placement, wait until no
        worker holds it, and drop it from the catalog's retiring keys. Returns the requests cut."""
        deadline = None if drain_s is None else time.monotonic() + drain_s
        cut = 0
        while self._inflight(key):
            if deadline is not None and time.monotonic() >= deadline:
                cut = self._cut(key, f"model {key!r} was removed from the catalog and its drain of "
                                     f"{drain_s:g} s ran out")
                break
            time.sleep(POLL_S)
        self._call(self.topology.placement.remove_model.remote(key), missing_ok=True)
        deadline_free = time.monotonic() + UNPLACE_TIMEOUT_S
        while self._holders(key) and time.monotonic() < deadline_free:
            time.sleep(0.5)   # a worker whose last request just ended unregisters at the next replan
            self._call(self.topology.placement.replan.remote(), missing_ok=True)
        holders = self._holders(key)
        with self._lock:
            catalog = self.catalog().retired(key)
            if holders:
                catalog = catalog.logged("failed", key, f"still registered on {holders} after "
                                                        f"{UNPLACE_TIMEOUT_S:g} s")
            elif cut:
                catalog = catalog.logged("cut", key, f"{cut} request(s) cut after the drain")
            self.store.save(catalog)
        logger.info("catalog: %s retired (%d cut)", key, cut)
        return cut

    def wait_retired(self, timeout_s: float) -> bool:
        """Wait for the background retirements (old versions of updated models); True if none is left."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._retiring.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._retiring.values())

    # ---- steps -------------------------------------------------------------------------------

    def _check_checkpoint(self, path: str, tensor_parallel: int = 1) -> None:
        """The checkpoint must read, be of a supported architecture, split `tensor_parallel` ways
        over the devices of one node, and its share fit some device's slot."""
        from actors.model_spec import CheckpointError, ModelSpec
        from actors.tensor_parallel import TPShard

        try:
            spec = ModelSpec.from_dir(path)
        except (CheckpointError, ValueError, OSError) as exc:
            raise CatalogError(f"path: {exc}", "path") from None
        status = self._call(self.topology.router.status.remote())
        live = [v for v in status.workers.values() if v.alive]
        if tensor_parallel > 1:
            per_node = collections.Counter(v.node_id for v in live)
            most = max(per_node.values(), default=0)
            if tensor_parallel > most:
                raise CatalogError(f"tensor_parallel {tensor_parallel} needs that many devices on one node; the "
                                   f"most a node has live is {most}", "tensor_parallel", 422)
            try:
                TPShard(0, tensor_parallel).check(spec)
            except ValueError as exc:
                raise CatalogError(f"tensor_parallel: {exc}", "tensor_parallel", 422) from None
        slots = [v.slot_bytes for v in live if v.slot_bytes]
        share = device_share(spec.weight_bytes, tensor_parallel)
        if slots and share > max(slots):
            raise CatalogError(f"path: the weights of {path} take {share} bytes per device (tensor_parallel "
                               f"{tensor_parallel}), more than any device's weight slot ({max(slots)} bytes)",
                               "path", 422)

    def _place(self, entry: CatalogEntry) -> list[str]:
        """Place the entry's key and wait until a live worker has it registered and the router
        routes it; withdrawn again (CatalogError) when it cannot be."""
        slo = SLO(entry.ttft_s or self.default_slo.ttft_s, entry.tbt_s or self.default_slo.tbt_s)
        known = set(self._call(self.topology.router.worker_handles.remote()))
        source = {"path": entry.path, "tensor_parallel": entry.tensor_parallel}
        plan = self._call(self.topology.placement.add_model.remote(entry.key, source, slo))
        why = plan.unplaceable.get(entry.key)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # a worker that died while it loaded the model fails its registration: the next plans place
        # the model on the live ones (and on the dead one's replacement), until READY_TIMEOUT_S
        while why is not None and why.startswith(REGISTRATION_FAILED) and time.monotonic() < deadline \
                and self._lost_a_worker(known):
            logger.info("catalog: %s lost a worker while registering (%s); placing it again", entry.key, why)
            time.sleep(REPLACE_WAIT_S)
            plan = self._call(self.topology.placement.replan.remote())
            why = plan.unplaceable.get(entry.key)
        while why is None:
            status = self._call(self.topology.router.status.remote())
            plan = self._call(self.topology.router.plan.remote())
            workers = plan.workers_for(entry.key) if plan is not None else ()
            ready = [w for w in workers if w in status.workers and status.workers[w].alive
                     and entry.key in status.workers[w].registered]
            if ready and entry.key in status.servable:
                logger.info("catalog: %s placed on %s", entry.key, ready)
                return ready
            if time.monotonic() >= deadline:
                why = f"no worker had it registered within {READY_TIMEOUT_S:g} s"
                break
            time.sleep(POLL_S)
            if plan is not None and entry.key in plan.unplaceable:
                why = plan.unplaceable[entry.key]
        self._call(self.topology.placement.remove_model.remote(entry.key), missing_ok=True)
        self.exporter.inc("tokenmux_catalog_changes_total", 1, {"kind": "failed"})
        raise CatalogError(f"path: model {entry.name!r} could not be placed: {why}", "path", 422)

    def _retire_in_background(self, key: str, drain_s: float) -> None:
        thread = threading.Thread(target=self._retire_logged, args=(key, drain_s), name=f"retire-{key}", daemon=True)
        self._retiring[key] = thread
        thread.start()

    def _retire_logged(self, key: str, drain_s: float) -> None:
        try:
            self.retire(key, drain_s)
        except Exception:
            logger.exception("catalog: retiring %s failed; it stays placed", key)

    def _lost_a_worker(self, workers: set[str]) -> bool:
        """Whether one of `workers` has left the router's list, or one it lists is dead (its health
        call, answered off its engine thread, fails with RayActorError)."""
        import ray

        handles = self._call(self.topology.router.worker_handles.remote())
        if workers - set(handles):
            return True
        refs = [h.health.remote() for h in handles.values()]
        for ref in refs:
            try:
                ray.get(ref, timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                return True
            except ray.exceptions.GetTimeoutError:   # alive but slow: not a lost worker
                continue
        return False

    def _inflight(self, key: str) -> int:
        picked = self._call(self.topology.router.inflight_requests.remote())
        return sum(model == key for _, model in picked.values())

    def _holders(self, key: str) -> list[str]:
        status = self._call(self.topology.router.status.remote())
        return sorted(w for w, v in status.workers.items() if v.alive and key in v.registered)

    def _cut(self, key: str, reason: str) -> int:
        import ray

        handles = self._call(self.topology.router.worker_handles.remote())
        refs = [h.cut_model.remote(key, reason) for w, h in handles.items() if w in self._holders(key)]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        cut = 0
        for ref in done:
            try:
                cut += ray.get(ref)
            except Exception as exc:   # a worker that died meanwhile has nothing left to cut
                logger.info("catalog: cutting %s on a worker failed: %s", key, exc)
        return cut

    def _save(self, catalog: ModelCatalog, kind: str) -> None:
        self.store.save(catalog)
        self.exporter.inc("tokenmux_catalog_changes_total", 1, {"kind": kind})
        logger.info("catalog: %s (revision %d)", catalog.events[-1].detail if catalog.events else kind,
                    catalog.revision)

    @staticmethod
    def _call(ref, missing_ok: bool = False):
        import ray

        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayTaskError as exc:
            if missing_ok and isinstance(exc.cause, ValueError):   # placement never had the key
                return None
            raise


def _free_version(catalog: ModelCatalog, name: str, first: int) -> int:
    """The first version from `first` whose key is not still retiring (a draining old version)."""
    version = first
    while serving_key(name, version) in catalog.retiring:
        version += 1
    return version
