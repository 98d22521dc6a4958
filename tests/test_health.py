"""/health as a load balancer sees it: 200 while a live worker can serve some model (the
others listed as unservable), 503 once none can or the router is gone. The router is the
real actor; a small fake stands in for the DeviceWorker only (as in test_router_actor)."""
from __future__ import annotations

import httpx

from deploy.serve_app.cluster_engine import ClusterEngineClient
from edge_helpers import MODEL, OTHER_MODEL, running_server, wait_until, zoo_models
from test_router_actor import _fake_worker_class


def test_health_turns_503_when_no_live_worker_can_serve_and_names_the_models(ray_session):
    ray = ray_session
    from cluster.router import GlobalRouter

    router = GlobalRouter.remote(poll_interval_s=0.1, stats_timeout_s=2.0)
    worker = _fake_worker_class(ray).remote("w0", "n0", registered=[MODEL])
    ray.get(router.add_worker.remote("w0", worker, "n0"))
    engine = ClusterEngineClient(router, zoo_models())
    try:
        with running_server(engine) as url:
            healthy = httpx.get(f"{url}/health", timeout=30)
            assert healthy.status_code == 200
            assert healthy.json() == {"status": "ok", "num_models": 2, "unservable": [OTHER_MODEL]}

            ray.kill(worker)   # the only worker dies: the router drops it on its next poll
            wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout_s=30,
                       what="/health to report 503")
            down = httpx.get(f"{url}/health", timeout=30).json()
            assert down == {"status": "unavailable", "num_models": 2, "unservable": sorted([MODEL, OTHER_MODEL])}

            ray.kill(router)   # no router at all: still a clear 503, not a hang or a 500
            assert httpx.get(f"{url}/health", timeout=30).status_code == 503
    finally:
        ray.kill(router)
