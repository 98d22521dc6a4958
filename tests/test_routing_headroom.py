"""Routing by real headroom: two DeviceWorkers whose engines measured different decode step
times; the router's view of each comes from its real stats(), and a request goes to the
worker that can still start it inside its TTFT SLO. A router blind to step times (every
worker assumed at the default step) would send it to the slow one."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from scheduler.messages import GenerateRequest
from scheduler.routing import RoutingPolicy, WorkerView
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

MiB = 1 << 20
ENGINE = {"budget_bytes": 160 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 512 * 1024,
          "host_kv_bytes": 0}
TARGET = "llama-tiny-a"   # the model both workers hold; the request is routed for it
QUEUED = 10               # requests of it already waiting on each worker


async def _run(worker, rid: str, model: str, max_tokens: int) -> None:
    req = GenerateRequest(rid, model, (5, 6, 7, 8), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async for ref in worker.generate.remote(req):
        await ref


@pytest.fixture(scope="module")
def workers(ray_session, zoo_model):
    ray = ray_session
    from actors.engine import EngineConfig
    from actors.worker import DeviceWorker

    make = ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker)
    config = EngineConfig(**ENGINE)
    slow, fast = make.remote("a-slow", config, num_threads=1), make.remote("b-fast", config, num_threads=1)
    ray.get([slow.register_model.remote(TARGET, str(zoo_model(TARGET))),
             slow.register_model.remote("llama-10m", str(zoo_model("llama-10m"))),
             fast.register_model.remote(TARGET, str(zoo_model(TARGET)))])
    # Both have run the target (its weights are resident on both); the slow one then ran a
    # 10x larger model, so its decode steps (what a queued request waits for) take longer.
    asyncio.run(_run(slow, "s0", TARGET, 4))
    asyncio.run(_run(slow, "s1", "llama-10m", 32))
    asyncio.run(_run(fast, "f0", TARGET, 32))
    yield ray, slow, fast
    for h in (slow, fast):
        ray.kill(h)


def test_a_request_goes_to_the_worker_with_real_headroom(workers):
    ray, slow, fast = workers
    views = [WorkerView.from_stats(ray.get(h.stats.remote()), extra_load={TARGET: QUEUED}) for h in (slow, fast)]
    slow_view, fast_view = views
    assert TARGET in slow_view.resident and TARGET in fast_view.resident
    assert slow_view.step_time_s > 1.5 * fast_view.step_time_s > 0, (slow_view.step_time_s, fast_view.step_time_s)
    policy = RoutingPolicy()
    d_slow, d_fast = (policy.predicted_delay_s(TARGET, v) for v in views)
    assert d_slow > d_fast
    # A TTFT SLO whose headroom lies between the two predicted delays: only the fast worker fits.
    slo = SLO(ttft_s=(d_slow + d_fast) / 2 / policy.config.headroom_frac, tbt_s=0.5)
    assert policy.pick(TARGET, views, slo) == "b-fast"
    blind = [dataclasses.replace(v, step_time_s=0.0) for v in views]   # what the router saw before stats had step times
    assert policy.pick(TARGET, blind, slo) == "a-slow"
