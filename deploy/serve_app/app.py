"""The Serve application: `deploy.serve_app.app:build_app` is the import path of `serve run|deploy`.

    TokenmuxIngress  (N replicas, HTTP + handle)  --- ClusterEngineClient ---> router, workers
         |  router handle, model table at start
    TokenmuxCluster  (1 replica)  owns the topology: router, placement, one worker per device

Lifetimes. The topology's actors are *owned* (not detached) by the one TokenmuxCluster
replica that brings them up: Ray kills an actor whose owner dies, so whatever ends that
replica — `serve delete`, `serve shutdown`, `tokenmux shutdown`, a crash — takes the
router, the placement service and every DeviceWorker with it, and the next deploy starts
from a clean cluster. A graceful end (`__del__`) also stops the node watcher and kills
them at once. Ingress replicas come and go freely: they only hold handles. The topology's
named actors live in the namespace of the Serve app's job (replicas inherit it from
whoever started Serve), so callers reach them through the app (`cluster_status`,
`TokenmuxCluster.worker_handles`), not by name; a stale topology left in that namespace
by anything else (e.g. a detached bring-up) is replaced, since one Serve app owns the
tokenmux cluster.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

from ray import serve
from ray.serve.config import BackpressureConfig

from actors.heap import freeze_heap
from deploy.serve_app.app_args import (AppArgs, check_local_sources, check_model_fits, parse_app_args,
                                       resolve_model_sources)
from cluster.status import ClusterStatus
from deploy.openai_api.protocol import IngressRequest

if TYPE_CHECKING:
    from deploy.openai_api.admission import AdmissionConfig

logger = logging.getLogger(__name__)

APP_NAME = "tokenmux"
CLUSTER_DEPLOYMENT = "TokenmuxCluster"
# Ingress places kept free of generation (Serve would queue beyond max_ongoing_requests, unbounded).
RESERVED_INGRESS_SLOTS = 8


def _kill_stale_topology() -> None:
    import ray

    from cluster.topology import connect_existing

    try:
        stale = connect_existing()
    except ValueError:
        return
    logger.warning("replacing a tokenmux topology left in this namespace (%d workers)", len(stale.workers))
    for handle in [*stale.workers.values(), stale.placement, stale.router]:
        try:
            ray.kill(handle)
        except Exception:  # already gone
            pass


def topology_config(args: AppArgs, models: dict[str, str]):
    from cluster.topology import TopologyConfig
    from scheduler.slo import SLO

    return TopologyConfig(models=models, engine=args.engine_config(), devices_per_node=args.devices_per_node,
                          threads_per_worker=args.threads_per_worker, engine_nice=args.engine_nice,
                          slo=SLO(args.slo.ttft_s, args.slo.tbt_s), tensor_parallel=dict(args.tensor_parallel))


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64,
                  graceful_shutdown_timeout_s=30, health_check_period_s=10)
class TokenmuxCluster:
    """Owns the topology (one replica per app); answers the ingress and `tokenmux status`."""

    async def __init__(self, args: dict) -> None:
        from cluster.topology import bring_up

        self.args = parse_app_args(args)
        self._topology = None
        self._models = await asyncio.to_thread(resolve_model_sources, self.args.models)
        check_local_sources(self._models)   # one line naming path and cause, before any worker starts
        try:   # `tokenmux serve` refuses this up front; a deployed app serves the rest and says why
            check_model_fits(self.args, self._models)
        except ValueError as e:
            logger.warning("%s; placement lists it as unplaceable until then", e)
        config = topology_config(self.args, self._models)
        await asyncio.to_thread(_kill_stale_topology)
        self._topology = await asyncio.to_thread(bring_up, config)
        self._catalog = live_catalog(self._topology, config.slo)
        freeze_heap()
        logger.info("tokenmux cluster up: %d workers, models %s", len(self._topology.workers), sorted(self._models))

    def router(self) -> Any:
        return self._topology.router

    def models(self) -> dict[str, str]:
        """Name -> checkpoint dir of the models served now (the live catalog's current versions)."""
        return {name: e.path for name, e in self._catalog.catalog().entries.items()}

    def catalog(self) -> dict:
        """The live catalog (scheduler/catalog.py ModelCatalog.to_dict)."""
        return self._catalog.catalog().to_dict()

    async def change_catalog(self, op: str, kwargs: dict) -> dict:
        """add | update | remove on the live catalog; the result, or {"error": {message, field, status}}."""
        return await asyncio.to_thread(catalog_change, self._catalog, op, kwargs)

    def worker_handles(self) -> dict[str, Any]:
        return dict(self._topology.workers)

    def namespace(self) -> str:
        """Where the topology's named actors are (for cleanup after the app is gone)."""
        import ray

        return ray.get_runtime_context().namespace

    async def status(self) -> ClusterStatus:
        status = await asyncio.to_thread(self._topology.status)
        return dataclasses.replace(status, models=self.models(), policy=self.args.policy)

    def __del__(self) -> None:
        topology, self._topology = getattr(self, "_topology", None), None
        if topology is not None:
            logger.info("tokenmux cluster: shutting the topology down")
            topology.shutdown()


@serve.deployment(graceful_shutdown_timeout_s=10)
@serve.ingress()
class TokenmuxIngress:
    """OpenAI-compatible HTTP, plus `generate_frames` / `list_models` for Serve handles."""

    async def __init__(self, args: dict, cluster: Any) -> None:
        from deploy.openai_api.admin import add_admin_routes
        from deploy.openai_api.ingress import build_ingress_app
        from deploy.openai_api.config import IngressConfig
        from scheduler.slo import SLO

        self.args = parse_app_args(args)
        self.cluster = cluster
        router = await cluster.router.remote()
        self.catalog = await catalog_engine(cluster, router, self._fresh_router)
        self.engine = self.catalog
        self.config = IngressConfig(max_tokens_cap=self.args.max_tokens_cap,
                                    default_max_tokens=self.args.default_max_tokens,
                                    default_slo=SLO(self.args.slo.ttft_s, self.args.slo.tbt_s),
                                    max_body_bytes=self.args.max_body_bytes,
                                    api_keys=api_keys(self.args),
                                    admission=admission_config(self.args),
                                    stall_timeout_s=self.args.stall_timeout_s)
        await self.engine.read_workers()   # admission knows the engines' speed before the first request
        self._openai_app = build_ingress_app(self.engine, self.config)  # `app` is taken by Serve
        add_admin_routes(self._openai_app, ClusterCatalogAdmin(cluster, self.catalog), keyed=bool(self.config.api_keys))
        self.core = self._openai_app.state.ingress
        freeze_heap()   # the edge streams every token: no long collector pauses (actors/heap.py)

    async def _fresh_router(self) -> Any:
        return await self.cluster.router.remote()

    def __serve_build_asgi_app__(self):
        return self._openai_app

    async def generate_frames(self, request: IngressRequest) -> AsyncIterator[dict]:
        async for chunk in self.core.generate_frames(request):
            yield chunk

    def list_models(self) -> dict:
        return self.core.list_models()

    async def cluster_status(self) -> ClusterStatus:
        return await self.cluster.status.remote()


def live_catalog(topology, slo):
    from cluster.catalog_store import CatalogStore
    from cluster.live_catalog import LiveCatalog

    return LiveCatalog(topology, CatalogStore(), slo)


def catalog_change(catalog, op: str, kwargs: dict) -> dict:
    """One change of a LiveCatalog as a value: the entry (add, update), the removal, or the refusal."""
    from scheduler.catalog import CatalogError

    verbs = {"add": catalog.add, "update": catalog.update, "remove": catalog.remove}
    if op not in verbs:
        return {"error": {"message": f"op must be one of {sorted(verbs)}, got {op!r}", "field": "op", "status": 400}}
    try:
        result = verbs[op](**kwargs)
    except CatalogError as exc:
        return {"error": {"message": str(exc), "field": exc.field, "status": exc.status}}
    return result if isinstance(result, dict) else result.to_dict()


async def catalog_engine(cluster, router, router_source):
    """The edge's cluster client behind the live catalog (deploy/serve_app/catalog_client.py),
    refreshed from the GCS in the background."""
    from cluster.catalog_store import CatalogStore
    from deploy.serve_app.catalog_client import CatalogEngineClient
    from deploy.serve_app.cluster_engine import ClusterEngineClient, served_models
    from deploy.serve_app.request_meter import RequestMeter
    from scheduler.catalog import ModelCatalog

    catalog = ModelCatalog.from_dict(await cluster.catalog.remote())
    store = CatalogStore(await cluster.namespace.remote())
    inner = ClusterEngineClient(router, await asyncio.to_thread(served_models, catalog.placed()),
                                router_source=router_source, meter=RequestMeter())
    client = CatalogEngineClient(inner, catalog, load=store.load)
    client.start_refreshing()
    return client


class ClusterCatalogAdmin:
    """The admin routes' catalog (deploy/openai_api/admin.py): the cluster deployment's LiveCatalog,
    and this edge's view of it refreshed at once after a change made here."""

    def __init__(self, cluster, client) -> None:
        self.cluster = cluster
        self.client = client

    async def catalog(self) -> dict:
        return await self.cluster.catalog.remote()

    async def change(self, op: str, **kwargs) -> dict:
        result = await self.cluster.change_catalog.remote(op, kwargs)
        await self.client.refresh()
        return result


def admission_config(args: AppArgs) -> "AdmissionConfig":
    """Admission of one ingress replica. Serve queues what exceeds max_ongoing_requests before
    our code sees it (without a bound), so the edge refuses a little earlier: a few places stay
    for /health, /v1/models and the 429s themselves."""
    from deploy.openai_api.admission import AdmissionConfig

    return AdmissionConfig(max_waiting=args.max_waiting_per_model, ttft_slo_multiple=args.ttft_slo_multiple,
                           max_active=max(1, args.max_ongoing_requests - RESERVED_INGRESS_SLOTS))


def api_keys(args: AppArgs) -> tuple[str, ...]:
    """The keys the HTTP edge takes: the args' and $TOKENMUX_API_KEYS (set on the nodes, e.g.
    from a Kubernetes Secret); ValueError when `require_api_key` finds none."""
    from deploy.openai_api.auth import ENV_VAR, key_digests, keys_from_env

    keys = key_digests([*args.api_keys, *keys_from_env()])
    if args.require_api_key and not keys:
        raise ValueError(f"require_api_key is set but no API key was given: set api_keys in the app args "
                         f"or ${ENV_VAR} on every node")
    return keys


def build_app(args: "dict | AppArgs") -> serve.Application:
    """The Serve application for `args` (see deploy/app_args.py); nothing starts until deployed."""
    parsed = parse_app_args(args)
    plain = parsed.model_dump(mode="json", exclude_unset=True)   # unset fields (scheduler's too) keep their defaults
    cluster = TokenmuxCluster.bind(plain)
    ingress = TokenmuxIngress.options(
        num_replicas=parsed.num_ingress_replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        # Past max_ongoing_requests Serve's proxy queues, before admission sees anything: bounded,
        # that queue sheds with a 429 of its own, so a refusal never waits behind the overload.
        max_queued_requests=parsed.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        ray_actor_options={"num_cpus": parsed.ingress_num_cpus},
    )
    return ingress.bind(plain, cluster)


__all__ = ["APP_NAME", "CLUSTER_DEPLOYMENT", "TokenmuxCluster", "TokenmuxIngress", "admission_config", "api_keys",
           "build_app",
           "topology_config"]
