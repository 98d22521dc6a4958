"""Supervision on the session Ray, with real actors killed for real: a DeviceWorker killed
mid-stream (its requests resume on the other worker, greedy and seeded output unchanged), a
worker whose engine loop stopped (reported unhealthy, replaced), the router killed (a new
one rebuilt from the live workers, requests served again within seconds).

One topology of two virtual devices for the module; its watcher ticks every 0.5 s.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO
from tests.polling import wait_until

MiB = 1 << 20
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
          "host_kv_bytes": 4 * MiB}
MODELS = ("llama-tiny-a", "qwen2-tiny-b")
MODEL = MODELS[0]
PROMPT = (11, 400, 77, 1234, 9, 18, 600, 5, 42, 300)


@pytest.fixture(scope="module")
def topology(ray_session, zoo_model):
    from actors.engine import EngineConfig
    from cluster.topology import TopologyConfig, bring_up

    config = TopologyConfig(models={m: str(zoo_model(m)) for m in MODELS}, engine=EngineConfig(**ENGINE),
                            devices_per_node=2, threads_per_worker=1, slo=SLO(ttft_s=5.0, tbt_s=0.5),
                            watch_interval_s=0.5)
    topo = bring_up(config)
    yield topo
    topo.shutdown()


def _client(topology):
    from deploy.serve_app.cluster_engine import ClusterEngineClient

    async def current_router():
        return topology.router

    return ClusterEngineClient(topology.router, dict(topology.config.models), router_source=current_router)


def _request(rid: str, max_tokens: int, **sampling) -> GenerateRequest:
    params = {"temperature": 0.0, **sampling}
    return GenerateRequest(rid, MODEL, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


async def _run(client, req, kill_after_frames: int | None = None, kill=None):
    frames = []
    async for frame in client.generate(req):
        frames.append(frame)
        if kill_after_frames is not None and len(frames) == kill_after_frames:
            kill(frame.worker_id)
    return frames


def _tokens(frames) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def _wait_for_routable(topology, timeout_s: float = 60.0) -> None:
    """Until both workers are live and every model has one."""
    import ray

    def ready() -> bool:
        views = [v for v in ray.get(topology.router.status.remote()).workers.values() if v.alive]
        return len(views) == 2 and all(any(m in v.registered for v in views) for m in MODELS)

    wait_until(ready, timeout_s, 0.2, what="two live workers and every model placed")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_worker_killed_mid_stream_resumes_elsewhere_with_the_undisturbed_output(topology, sampling):
    import ray

    _wait_for_routable(topology)
    client = _client(topology)
    undisturbed = _tokens(asyncio.run(_run(client, _request(f"calm-{len(sampling)}", 60, **sampling))))
    killed = []

    def kill(worker_id):
        killed.append(worker_id)
        ray.kill(topology.workers[worker_id])

    frames = asyncio.run(_run(client, _request(f"storm-{len(sampling)}", 60, **sampling), 1, kill))
    assert frames[-1].finish_reason == "length", frames[-1].error
    assert _tokens(frames) == undisturbed
    assert client.num_resumed == 1 and frames[-1].worker_id != killed[0]


def test_a_dead_worker_is_replaced_and_its_shared_memory_freed(topology):
    import ray

    _wait_for_routable(topology)
    victim = sorted(topology.workers)[0]
    pid = ray.get(topology.workers[victim].stats.remote()).pid
    t0 = time.monotonic()
    ray.kill(topology.workers[victim])
    wait_until(lambda: any(r.worker_id == victim and r.replacement_id for r in topology.status().replacements),
               60, 0.2, what=f"a replacement of {victim}")
    record = next(r for r in topology.status().replacements if r.worker_id == victim)
    assert record.replacement_id.startswith(victim.split("-r")[0]) and "died" in record.reason
    assert record.replaced_s <= time.monotonic() - t0
    assert not list(Path("/dev/shm").glob(f"tokenmux-kv-{pid}-*"))
    _wait_for_routable(topology)   # the replacement holds the model per placement and takes requests
    frames = asyncio.run(_run(_client(topology), _request("after-replace", 8)))
    assert frames[-1].finish_reason == "length" and len(_tokens(frames)) == 8


def test_a_worker_whose_engine_loop_stopped_is_unhealthy_and_replaced(topology):
    import ray

    _wait_for_routable(topology)
    victim = sorted(topology.workers)[-1]
    ray.get(topology.workers[victim].close.remote())   # the actor lives on; its engine loop does not
    health = ray.get(topology.workers[victim].health.remote()) if victim in topology.workers else None
    assert health is None or (not health.healthy and "stopped" in health.reason)
    wait_until(lambda: any(r.worker_id == victim and r.replacement_id for r in topology.status().replacements),
               60, 0.2, what=f"a replacement of the wedged {victim}")
    record = next(r for r in topology.status().replacements if r.worker_id == victim)
    assert "stopped" in record.reason
    status = topology.status()
    assert victim not in status.workers and record.replacement_id in status.workers
    assert "replaced" in _format(status)


def _format(status) -> str:
    from deploy.cli.commands import format_status

    return format_status(status)


@pytest.mark.parametrize("restart", [False, True], ids=["killed-for-good", "restarted-by-ray"])
def test_a_killed_router_is_rebuilt_from_the_live_workers(topology, restart):
    import ray

    _wait_for_routable(topology)
    old = topology.router
    live = set(topology.workers)
    # for good: the supervisor makes a new router; restarted in place by Ray: it comes back empty
    ray.kill(old, no_restart=not restart)
    frames = asyncio.run(_run(_client(topology), _request("after-router", 8)))
    assert frames[-1].finish_reason == "length", frames[-1].error

    def router_lists(workers: set[str]) -> bool:
        try:   # the handle may point at a router Ray is still restarting: it answers once back
            return set(ray.get(topology.router.status.remote(), timeout=5).workers) == workers
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorDiedError):   # dead for good until the supervisor's next tick replaces it
            return False

    wait_until(lambda: router_lists(live), 20, 0.25, what="the router to list every live worker")


def test_the_watchdog_names_a_step_past_its_bound_and_a_stopped_loop(zoo_model):
    """In process, a real Engine: a step running longer than the bound (here 0 s: any step) is
    reported, and once the loop has stopped every call fails at once instead of hanging."""
    from actors.engine import Engine, EngineConfig
    from actors.worker import EngineLoop

    engine = Engine(EngineConfig(**ENGINE))
    engine.register_model(MODEL, str(zoo_model(MODEL)))
    loop = EngineLoop(engine, deliver=lambda frames: None)
    try:
        assert loop.problem(step_bound_s=60.0) is None
        loop.call(engine.add_request, _request("long", 400)).result(timeout=30)
        wait_until(lambda: (loop.problem(step_bound_s=0.0) or "").startswith("one engine step has run"),
                   30, 0.0005, what="a step past a 0 s bound")
        assert loop.problem(step_bound_s=60.0) is None
    finally:
        loop.stop()
    assert loop.problem(step_bound_s=60.0) == "the engine loop has stopped"
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(engine.stats).result(timeout=1)
