"""ClusterEngineClient against a real GlobalRouter and real DeviceWorkers (tiny zoo model).

The router polls rarely here (60 s), so a killed worker is still in its view: the client
itself must notice the death, report it and re-dispatch (or resume: tests/test_supervision.py).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

MiB = 1 << 20
CONFIG = {"budget_bytes": 64 * MiB, "kv_bytes": 16 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
          "host_kv_bytes": 8 * MiB}
MODEL = "llama-tiny-a"


@pytest.fixture
def cluster(ray_session, zoo_model):
    """`cluster(n)` -> (router, {worker_id: handle}, model path): fresh actors per test."""
    import ray

    from cluster.router import GlobalRouter
    from actors.engine import EngineConfig
    from actors.worker import DeviceWorker

    path = str(zoo_model(MODEL))
    actors = []

    def make(num_workers: int):
        router = GlobalRouter.remote(poll_interval_s=60.0)
        actors.append(router)
        workers = {}
        for i in range(num_workers):
            w = ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker).remote(f"w{i}", EngineConfig(**CONFIG),
                                                                        num_threads=1)
            actors.append(w)
            workers[f"w{i}"] = w
        ray.get([w.ready.remote() for w in workers.values()])
        ray.get([w.register_model.remote(MODEL, path) for w in workers.values()])
        ray.get([router.add_worker.remote(wid, w, "node-0") for wid, w in workers.items()])
        return router, workers, path

    yield make
    for actor in actors:
        ray.kill(actor)


def _request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, MODEL, (5, 17, 42, 9), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                      temperature=0.0))


async def _collect(frames):
    return [frame async for frame in frames]


def test_streams_a_whole_request_and_releases_it(cluster):
    import ray

    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    client = ClusterEngineClient(router, {MODEL: path})
    assert [m.name for m in client.models()] == [MODEL] and client.models()[0].max_context > 0
    frames = asyncio.run(_collect(client.generate(_request("r1", 12))))
    assert sum(len(f.token_ids) for f in frames) == 12, frames
    assert frames[-1].finish_reason == "length" and frames[-1].worker_id == "w0"
    deadline = time.monotonic() + 5
    while ray.get(router.status.remote()).pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(router.status.remote()).pending == {}   # released


def test_worker_killed_before_the_first_token_is_redispatched(cluster):
    import ray

    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(2)
    client = ClusterEngineClient(router, {MODEL: path})
    doomed = ray.get(router.pick.remote(MODEL)).worker_id   # the worker the router picks for this model
    ray.get(router.release.remote(doomed, MODEL))
    ray.kill(workers[doomed])
    frames = asyncio.run(_collect(client.generate(_request("r2", 10))))
    survivor = next(w for w in workers if w != doomed)
    assert client.num_redispatched == 1
    assert frames[-1].finish_reason == "length", frames[-1].error
    assert sum(len(f.token_ids) for f in frames) == 10
    assert {f.worker_id for f in frames} == {survivor}
    assert set(ray.get(router.status.remote()).workers) == {survivor}   # reported and removed


def test_worker_killed_mid_stream_with_none_left_ends_with_an_error_frame_keeping_the_tokens(cluster):
    import ray

    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    client = ClusterEngineClient(router, {MODEL: path}, recovery_s=0.5)

    async def main():
        frames = []
        async for frame in client.generate(_request("r3", 400)):
            frames.append(frame)
            if len(frames) == 1:
                assert frame.token_ids
                ray.kill(workers[frame.worker_id])
        return frames

    frames = asyncio.run(main())
    assert frames[-1].finish_reason == "error"
    assert "no worker can serve" in frames[-1].error and "tokens were sent" in frames[-1].error
    assert 0 < sum(len(f.token_ids) for f in frames) < 400
    assert client.num_redispatched == 0 and client.num_resumed == 1


def test_abort_mid_stream_frees_the_workers_kv(cluster):
    import ray

    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    client = ClusterEngineClient(router, {MODEL: path})
    worker = workers["w0"]

    async def main():
        frames = client.generate(_request("r4", 2000))
        first = await frames.__anext__()
        busy = (await worker.stats.remote()).engine
        await frames.aclose()   # the one abort path: leaving the stream early
        return first, busy

    first, busy = asyncio.run(main())
    assert first.token_ids and busy.running == {MODEL: 1} and busy.kv_free_frac < 1.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = ray.get(worker.stats.remote()).engine
        if not stats.running and not stats.queue_depth and stats.kv_free_frac == 1.0:
            break
        time.sleep(0.1)
    assert not stats.running and not stats.queue_depth and stats.kv_free_frac == 1.0


def _admission():
    from deploy.openai_api.admission import Admission, AdmissionConfig

    return Admission(AdmissionConfig(ttft_slo_multiple=0, adaptive=False))


def test_a_router_that_never_answers_ends_the_request_with_an_error_by_its_deadline(ray_session, zoo_model):
    """The worst case to an error frame is the one deadline: a router with no worker waits
    (REBUILD_WAIT_S) longer than the request's `recovery_s`, so the pick is cut there. The
    request's place at the edge comes back, and so does its count at the router once the
    abandoned pick answers."""
    import ray

    from cluster.router import GlobalRouter
    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router = GlobalRouter.remote(poll_interval_s=60.0)
    try:
        ray.get(router.status.remote())   # started: the time below is the request's alone
        recovery_s = 1.0
        client = ClusterEngineClient(router, {MODEL: str(zoo_model(MODEL))}, recovery_s=recovery_s)
        client.tokenizer(MODEL)   # loaded before: the time below is the dispatch's
        admission = _admission()
        ticket = admission.admit(MODEL, 1.0)

        async def main():
            start = time.monotonic()
            frames = await _collect(client.generate(_request("silent", 4), ticket))
            return frames, time.monotonic() - start

        frames, elapsed = asyncio.run(main())
        [error] = frames
        assert error.finish_reason == "error" and "no worker can serve model" in error.error
        assert f"deadline of {recovery_s:g} s" in error.error
        assert recovery_s <= elapsed < recovery_s + 1.0, elapsed   # the one bound, + one call's slack
        assert admission.active == 0 and admission.waiting(MODEL) == 0
        deadline = time.monotonic() + 20
        while ray.get(router.inflight_requests.remote()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.get(router.inflight_requests.remote()) == {}
    finally:
        ray.kill(router)


def test_a_router_gone_for_good_ends_the_request_with_an_error_by_its_deadline(cluster):
    """A dead router whose successor never comes: asked for again until the one deadline."""
    import ray

    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    ray.kill(router, no_restart=True)

    async def same_dead_router():
        return router

    client = ClusterEngineClient(router, {MODEL: path}, router_source=same_dead_router, recovery_s=1.0)
    client.tokenizer(MODEL)

    async def main():
        start = time.monotonic()
        frames = [f async for f in client.generate(_request("orphan", 4))]
        return frames, time.monotonic() - start

    frames, elapsed = asyncio.run(main())
    assert frames[-1].finish_reason == "error" and "no worker can serve model" in frames[-1].error
    assert 1.0 <= elapsed < 2.0, elapsed


def test_a_request_closed_before_it_ran_gives_its_place_back(cluster):
    """The request's one object holds its admission ticket: closed unread (the client left
    before the body started), the place comes back at once, not at garbage collection."""
    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    client = ClusterEngineClient(router, {MODEL: path})
    admission = _admission()
    frames = client.generate(_request("unread", 4), admission.admit(MODEL, 1.0))
    assert admission.active == 1
    asyncio.run(frames.aclose())
    assert admission.active == 0 and admission.waiting(MODEL) == 0
    assert asyncio.run(_collect(frames)) == []   # ended: nothing more comes


def test_a_ticket_is_released_once_when_the_request_finishes(cluster):
    from deploy.serve_app.cluster_engine import ClusterEngineClient

    router, workers, path = cluster(1)
    client = ClusterEngineClient(router, {MODEL: path})
    admission = _admission()
    frames = client.generate(_request("whole", 6), admission.admit(MODEL, 1.0))

    async def main():
        seen = []
        async for frame in frames:
            seen.append(frame)
            if frame.finished:   # released with the last frame, before anyone closes the stream
                assert admission.active == 0
        await frames.aclose()   # closing an ended request changes nothing
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finish_reason == "length" and admission.active == 0
    other = admission.admit(MODEL, 1.0)   # the count is right, not below zero
    assert admission.active == 1 and admission.waiting(MODEL) == 1
    other.release()
