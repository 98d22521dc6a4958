"""Topology bring-up on the session Ray (4 virtual GPUs): one worker per device, models
placed by the placement service, a request routed and streamed end to end."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

MiB = 1 << 20
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
          "host_kv_bytes": 4 * MiB}
MODELS = ("llama-tiny-a", "qwen2-tiny-b")


def reference_greedy(path, prompt: list[int], max_tokens: int) -> list[int]:
    """Single-worker greedy output: one Engine in this process, the request alone."""
    from actors.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(**ENGINE))
    engine.register_model("m", path)
    engine.add_request(GenerateRequest("ref", "m", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    tokens = []
    while engine.has_unfinished():
        for frame in engine.step():
            tokens += frame.token_ids
    return tokens


def test_config_rejects_bad_input(tmp_path, zoo_model):
    from cluster.topology import TopologyConfig

    good = {"m": str(zoo_model("llama-tiny-a"))}
    with pytest.raises(ValueError, match="non-empty dict"):
        TopologyConfig(models={})
    with pytest.raises(ValueError, match="does not exist"):
        TopologyConfig(models={"m": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="devices_per_node"):
        TopologyConfig(models=good, devices_per_node=0)
    with pytest.raises(ValueError, match="must be an EngineConfig"):   # kwargs are built into one by the caller
        TopologyConfig(models=good, engine={"kv_bytes": 1})
    with pytest.raises(ValueError, match="scale_in_load"):
        TopologyConfig(models=good, placement={"scale_in_load": 100.0})


def test_bring_up_without_ray_is_a_clear_error(zoo_model):
    # in a fresh process: this one is connected to the session's Ray
    code = ("from cluster.topology import TopologyConfig, bring_up\n"
            "try:\n"
            f"    bring_up(TopologyConfig(models={{'m': {str(zoo_model('llama-tiny-a'))!r}}}))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert "ValueError:" in out.stdout and "connect_or_start" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.fixture(scope="module")
def topology(ray_session, zoo_model):
    from actors.engine import EngineConfig
    from cluster.topology import TopologyConfig, bring_up

    config = TopologyConfig(models={m: str(zoo_model(m)) for m in MODELS}, engine=EngineConfig(**ENGINE),
                            threads_per_worker=1, slo=SLO(ttft_s=5.0, tbt_s=0.5), watch_interval_s=None,
                            placement_interval_s=60.0)
    topo = bring_up(config)
    yield topo
    topo.shutdown()


def test_one_worker_per_virtual_device_and_every_model_placed(topology, ray_session):
    from tests.conftest import NUM_VIRTUAL_GPUS

    assert len(topology.workers) == NUM_VIRTUAL_GPUS
    node = ray_session.get_runtime_context().get_node_id()
    assert sorted(topology.workers) == [f"{node[:8]}-gpu{i}" for i in range(NUM_VIRTUAL_GPUS)]
    status = topology.status()
    assert status.alive() == status.workers and all(w.node_id == node for w in status.workers.values())
    assert set(status.plan.assignments) == set(MODELS)
    for model, holders in status.plan.assignments.items():
        assert holders and all(model in status.workers[w].engine.registered for w in holders)
    assert sorted(status.router.servable) == sorted(MODELS)


def test_request_through_router_streams_the_single_worker_greedy_output(topology, ray_session, zoo_model):
    ray = ray_session
    prompt = [11, 400, 77, 1234, 9, 18, 600, 5, 42, 300, 17, 88, 1500, 3, 71, 20, 19]   # crosses a block

    async def run(model: str, rid: str) -> tuple[str, list]:
        picked = await topology.router.pick.remote(model)
        wid, handle = picked.worker_id, picked.handle
        frames = []
        try:
            req = GenerateRequest(rid, model, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
            async for ref in handle.generate.remote(req):
                frames.append(await ref)
        finally:
            await topology.router.release.remote(wid, model)
        return wid, frames

    for i, model in enumerate(MODELS):
        wid, frames = asyncio.run(run(model, f"t{i}"))
        assert wid in ray.get(topology.placement.plan.remote()).assignments[model]
        tokens = [t for f in frames for t in f.token_ids]
        assert tokens == reference_greedy(zoo_model(model), prompt, 20)
        assert frames[-1].finish_reason == "length" and all(f.worker_id == wid for f in frames)
    assert ray.get(topology.router.status.remote()).pending == {}


def test_unknown_model_is_refused_naming_the_servable_ones(topology, ray_session):
    from scheduler.routing import NoWorkerError

    with pytest.raises(NoWorkerError, match="llama-tiny-a, qwen2-tiny-b"):
        ray_session.get(topology.router.pick.remote("nope"))


def test_connect_existing_sees_the_same_cluster(topology):
    from cluster.topology import connect_existing

    other = connect_existing()
    assert set(other.workers) == set(topology.workers)
    other.shutdown()   # leaves the cluster running
    assert len(topology.status().workers) == len(topology.workers)
