"""Multi-node scenarios on one machine, run as a script: `python tests/multinode_scenarios.py`.

A process can be connected to one Ray only, and the test session already holds one, so
tests/test_multinode.py runs this in a subprocess. It starts a `ray.cluster_utils.Cluster`
(2 nodes x 2 virtual GPUs), brings the topology up and prints one JSON object of
observations on its last stdout line; the test asserts on them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.polling import poll_until  # noqa: E402  (needs the path above)

MiB = 1 << 20
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 512 * 1024,
          "host_kv_bytes": 4 * MiB}
MODELS = ("llama-tiny-a", "qwen2-tiny-b")
PROMPT = [11, 400, 77, 1234, 9, 18, 600, 5, 42, 300, 17, 88, 1500, 3, 71, 20, 19, 33, 1200, 7]
MAX_TOKENS = 16
PLACEMENT = {"request_s": 0.5, "scale_out_load": 2.0, "scale_in_load": 1.0, "cooldown_s": 1.0,
             "split_load": 1e6, "merge_load": 1e5}
NODE = {"num_cpus": 1, "num_gpus": 2, "object_store_memory": 100 * MiB}


def reference(path, prompt, max_tokens) -> list[int]:
    from actors.engine import Engine, EngineConfig
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(**ENGINE))
    engine.register_model("m", path)
    engine.add_request(GenerateRequest("ref", "m", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for f in engine.step() for t in f.token_ids]
    return tokens


async def collect(handle, rid, model, max_tokens=MAX_TOKENS) -> list[dict]:
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    from actors.frame_stream import stream_frames

    req = GenerateRequest(rid, model, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async with stream_frames(handle.generate.remote(req)) as stream:   # follows a handoff to the decode worker
        return [frame async for frame in stream]


async def routed(router, rid, model, max_tokens=MAX_TOKENS, slo=None) -> tuple[str, list[int], str | None]:
    picked = await router.pick.remote(model, slo)
    wid, handle = picked.worker_id, picked.handle
    try:
        frames = await collect(handle, rid, model, max_tokens)
    finally:
        await router.release.remote(wid, model)
    # The worker that finished it: with prefill/decode roles the picked (prefill) worker hands
    # the request to a decode worker, whose id its last frames carry.
    return frames[-1].worker_id or wid, [t for f in frames for t in f.token_ids], frames[-1].finish_reason


def handoff(ray, topo, src, dst, model, rid) -> dict:
    """Prefill on src, decode on dst: a private router that knows only these two."""
    from cluster.router import GlobalRouter

    router = GlobalRouter.remote(poll_interval_s=0.5)
    w = topo.workers
    for wid in (src, dst):
        try:
            ray.get(w[wid].register_model.remote(model, topo.config.models[model]))
        except Exception:
            pass   # already placed there
    ray.get([w[src].set_role.remote("prefill"), w[dst].set_role.remote("decode"), w[src].set_router.remote(router)])
    ray.get([router.add_worker.remote(wid, w[wid], topo.worker_nodes[wid]) for wid in (src, dst)])
    before = ray.get(w[dst].stats.remote()).handoff.adopted
    frames = asyncio.run(collect(w[src], rid, model))
    after = ray.get(w[dst].stats.remote()).handoff.adopted
    ray.get([w[src].set_role.remote("mixed"), w[dst].set_role.remote("mixed"), w[src].set_router.remote(topo.router)])
    ray.kill(router)
    return {"tokens": [t for f in frames for t in f.token_ids], "workers": [f.worker_id for f in frames],
            "adopted": after - before, "finish": frames[-1].finish_reason}


def main() -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from actors.zoo.zoo import ensure_model
    from actors.engine import EngineConfig
    from cluster.topology import TopologyConfig, bring_up
    from scheduler.slo import SLO

    logging.basicConfig(level=logging.WARNING)
    out: dict = {"timings": {}}
    t0 = time.monotonic()
    paths = {m: str(ensure_model(m)) for m in MODELS}
    out["reference"] = {m: reference(p, PROMPT, MAX_TOKENS) for m, p in paths.items()}
    temp_dir = tempfile.mkdtemp(prefix="tmn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir   # Ray writes the cluster address under it, not /tmp/ray
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "temp_dir": temp_dir})
    cluster.add_node(**NODE)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    topo = None
    try:
        config = TopologyConfig(models=paths, engine=EngineConfig(**ENGINE), threads_per_worker=1,
                                placement=PLACEMENT, routing={"hot_load": 1}, placement_interval_s=60.0,
                                watch_interval_s=0.5,
                                supervise=False,   # step 5 watches a killed worker leave (and prune_dead)
                                slo=SLO(ttft_s=0.2, tbt_s=0.5))   # a tight SLO: load spreads early
        topo = bring_up(config)
        out["timings"]["bring_up_s"] = time.monotonic() - t0
        nodes = sorted(set(topo.worker_nodes.values()))
        out["nodes"] = len(nodes)
        out["workers_per_node"] = [sum(n == node for n in topo.worker_nodes.values()) for node in nodes]
        by_node = {n: sorted(w for w, wn in topo.worker_nodes.items() if wn == n) for n in nodes}
        a, b = nodes
        model = MODELS[0]

        # 1. prefill on node A, decode on node B (object store); 2. same node (shared memory)
        out["cross_node"] = handoff(ray, topo, by_node[a][0], by_node[b][0], model, "x1")
        out["cross_node"]["src"], out["cross_node"]["dst"] = by_node[a][0], by_node[b][0]
        out["same_node"] = handoff(ray, topo, by_node[a][0], by_node[a][1], model, "s1")
        out["same_node"]["src"], out["same_node"]["dst"] = by_node[a][0], by_node[a][1]

        # 3. a node joins at runtime: the watcher gives it workers
        cluster.add_node(**NODE)
        out["joined"] = poll_until(lambda: len(topo.workers) == 6, 90, 0.25)
        new_node = next(iter(set(topo.worker_nodes.values()) - set(nodes)), None)
        out["new_workers"] = sorted(w for w, n in topo.worker_nodes.items() if n == new_node)
        # the router routes (and placement places) only on workers whose stats it has seen
        out["joined"] &= poll_until(lambda: set(out["new_workers"]) <= set(
            ray.get(topo.router.status.remote()).workers), 30, 0.25)
        # ... and takes traffic. Placement gives a new model to the least-loaded worker with the
        # fewest models (ties by id), so one new model per model-less worker (the two of the new
        # node, and the old workers holding nothing) puts some on the new node whatever the ids.
        plan_now = ray.get(topo.placement.plan.remote()).assignments
        idle = [w for w in topo.workers if not any(w in ws for ws in plan_now.values())]
        extras = [m for m in ("mistral-tiny-a", "mistral-tiny-b", "qwen2-tiny-c", "llama-tiny-c",
                              "mistral-tiny-c", "qwen2-tiny-a") if m not in MODELS][:len(idle)]
        for extra in extras:
            ray.get(topo.placement.add_model.remote(extra, str(ensure_model(extra))))
        served = []
        for i, extra in enumerate(extras):
            wid, tokens, finish = asyncio.run(routed(topo.router, f"n{i}", extra))
            ok = tokens == reference(str(ensure_model(extra)), PROMPT, MAX_TOKENS) and finish == "length"
            served.append((wid, ok))
        new_served = [w for w, _ in served if w in out["new_workers"]]
        out["new_node_served"] = {"worker": new_served[0] if new_served else served[0][0],
                                  "ok": all(ok for _, ok in served)}
        out["timings"]["join_s"] = time.monotonic() - t0

        # 4. a burst on one model spreads it over more workers (the new node's included), then shrinks back
        # Replans are driven from here (the periodic one is slow), so roles set above stay put.
        plan = lambda: ray.get(topo.placement.replan.remote())   # noqa: E731
        out["replicas_before"] = len(plan().assignments[model])

        # A tight TTFT SLO: the router keeps a model on its resident worker while the predicted
        # delay there stays within the SLO's headroom, so only a burst that would miss it spreads.
        burst_slo = SLO(ttft_s=0.005, tbt_s=0.5)

        async def burst():
            """16 clients, 4 requests each at least; a client goes on until one of its requests
            has started after the router's plan spread the model (placement reacts within
            seconds on a busy host: a burst shorter than that has nothing to spread onto)."""
            results, spread, done = [], asyncio.Event(), asyncio.Event()
            peak, deadline = 0, time.monotonic() + 60   # a router that never spreads fails below, not here

            async def client(i):
                j = after = 0
                while j < 4 or (not after and time.monotonic() < deadline):
                    started_spread = spread.is_set()
                    results.append((started_spread, await routed(topo.router, f"b{i}-{j}", model, 24, burst_slo)))
                    j, after = j + 1, after + started_spread

            async def drive_placement():
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, len((await topo.placement.replan.remote()).assignments[model]))
                    await asyncio.sleep(0.2)

            async def watch_router():
                while not done.is_set():
                    routing_plan = await topo.router.plan.remote()
                    if routing_plan is not None and len(routing_plan.workers_for(model)) >= 2:
                        spread.set()
                    await asyncio.sleep(0.05)

            watchers = [asyncio.create_task(drive_placement()), asyncio.create_task(watch_router())]
            try:
                await asyncio.gather(*(client(i) for i in range(16)))
            finally:
                done.set()
                await asyncio.gather(*watchers)
            return results, peak

        results, peak = asyncio.run(burst())
        bad = [(wid, len(tokens), finish) for _, (wid, tokens, finish) in results
               if tokens[:MAX_TOKENS] != out["reference"][model] or finish != "length"]
        out["burst_requests"], out["burst_failed"] = len(results), bad
        out["burst_workers"] = sorted({wid for _, (wid, _, _) in results})
        out["spread_requests"] = sum(after for after, _ in results)
        out["spread_workers"] = sorted({wid for after, (wid, _, _) in results if after})
        out["replicas_peak"] = peak
        out["shrunk"] = poll_until(lambda: len(plan().assignments[model]) == 1, 30, 0.25)
        out["replicas_after"] = len(plan().assignments[model])
        out["timings"]["burst_s"] = time.monotonic() - t0

        # 5. a killed worker leaves routing; later requests still succeed
        other = MODELS[1]
        victim = ray.get(topo.placement.plan.remote()).assignments[other][0]
        ray.kill(topo.workers[victim])
        out["victim_removed"] = poll_until(lambda: victim not in ray.get(topo.router.status.remote()).workers, 20, 0.25)
        ok = []
        for i in range(3):
            for _ in range(20):   # the replan that re-places its model may still be on its way
                try:
                    wid, tokens, finish = asyncio.run(routed(topo.router, f"k{i}", other))
                    break
                except Exception:
                    time.sleep(0.25)
            else:
                wid, tokens, finish = None, [], None
            ok.append(wid != victim and wid is not None and tokens == out["reference"][other])
        out["after_kill_ok"] = ok
        out["pruned"] = topo.prune_dead()
        out["timings"]["total_s"] = time.monotonic() - t0
    finally:
        if topo is not None:
            topo.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = main()
    print(json.dumps(result))
