"""The live catalog on a running cluster (session Ray, 4 virtual devices, tiny zoo models):
add, update and remove while requests stream, through the edge's catalog client, with the
memory freed on every worker (RSS and KV pool back to before an add + remove), the catalog kept
across a placement-service restart, and an add that loses a worker while it loads the model
still ending with the model on every worker its plan names."""
from __future__ import annotations

import asyncio
import threading

import pytest

from polling import wait_until
from scheduler.catalog import CatalogError
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

MiB = 1 << 20
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
          "host_kv_bytes": 4 * MiB}
MODELS = ("llama-tiny-a", "qwen2-tiny-b")
PROMPT = [11, 400, 77, 1234, 9, 18, 600, 5]


@pytest.fixture(scope="module")
def cluster(ray_session, zoo_model):
    from actors.engine import EngineConfig
    from cluster.catalog_store import CatalogStore
    from cluster.live_catalog import LiveCatalog
    from cluster.topology import TopologyConfig, bring_up

    config = TopologyConfig(models={m: str(zoo_model(m)) for m in MODELS}, engine=EngineConfig(**ENGINE),
                            threads_per_worker=1, slo=SLO(ttft_s=5.0, tbt_s=0.5), watch_interval_s=1.0,
                            placement_interval_s=2.0)
    topology = bring_up(config)
    yield topology, LiveCatalog(topology, CatalogStore(), config.slo)
    topology.shutdown()


def edge(topology, store):
    """The edge's clients, as the Serve app stacks them: catalog over cluster."""
    from deploy.serve_app.catalog_client import CatalogEngineClient
    from deploy.serve_app.cluster_engine import ClusterEngineClient, served_models

    catalog = store.load()
    inner = ClusterEngineClient(topology.router, served_models(catalog.placed()))
    return CatalogEngineClient(inner, catalog, load=store.load)


async def collect(client, model: str, rid: str, max_tokens: int, started: threading.Event | None = None):
    frames = []
    req = GenerateRequest(rid, model, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async for frame in client.generate(req):
        frames.append(frame)
        if started is not None:
            started.set()
    return frames


def tokens(frames) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def holders(topology, key: str) -> list[str]:
    import ray

    status = ray.get(topology.router.status.remote())
    return sorted(w for w, v in status.workers.items() if v.alive and key in v.registered)


def reference(path, max_tokens: int) -> list[int]:
    from tests.test_topology import reference_greedy

    return reference_greedy(path, PROMPT, max_tokens)


def test_bad_input_names_the_field_and_changes_nothing(cluster, tmp_path, zoo_model):
    topology, live = cluster
    before = live.catalog()
    bad_config = tmp_path / "bad"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    cases = [(("x", str(tmp_path / "missing")), "path", 400), (("x", str(bad_config)), "path", 400),
             (("llama-tiny-a", str(zoo_model("llama-tiny-b"))), "name", 409),
             (("bad name!", str(zoo_model("llama-tiny-b"))), "name", 400)]
    for (name, path), field, status in cases:
        with pytest.raises(CatalogError) as info:
            live.add(name, path)
        assert (info.value.field, info.value.status) == (field, status), info.value
    with pytest.raises(CatalogError) as info:
        live.add("x", str(zoo_model("llama-tiny-b")), ttft_s=-1)
    assert info.value.field == "ttft_s"
    for call, field in ((lambda: live.remove("nope"), "name"), (lambda: live.update("nope", "/x"), "name"),
                        (lambda: live.remove("llama-tiny-a", drain_s=-2), "drain_s")):
        with pytest.raises(CatalogError) as info:
            call()
        assert info.value.field == field
    assert live.catalog().entries == before.entries and live.catalog().retiring == before.retiring
    assert holders(topology, "x") == []


def test_an_added_model_serves_then_a_removal_cuts_its_stream_and_frees_it_everywhere(cluster, zoo_model):
    import ray

    from cluster.catalog_store import CatalogStore

    topology, live = cluster
    path = zoo_model("mistral-tiny-a")
    entry = live.add("added", str(path))
    assert entry.key == "added" and holders(topology, "added")
    client = edge(topology, CatalogStore())
    assert "added" in [m.name for m in client.models()]
    frames = asyncio.run(collect(client, "added", "a1", 12))
    assert tokens(frames) == reference(path, 12) and frames[-1].model_version == "added@v1"

    async def remove_while_streaming():
        started = threading.Event()
        stream = asyncio.ensure_future(collect(client, "added", "a2", 1900, started))
        while not started.is_set():
            await asyncio.sleep(0.01)
        result = await asyncio.to_thread(live.remove, "added", 0.2)
        await client.refresh()
        return result, await stream

    result, frames = asyncio.run(remove_while_streaming())
    assert "added" not in [m.name for m in client.models()]
    last = frames[-1]
    assert (last.finish_reason == "length" and len(tokens(frames)) == 1900) or \
        (last.finish_reason == "error" and "removed" in last.error), last
    assert holders(topology, "added") == [] and "added" not in live.catalog().placed()
    assert ray.get(topology.placement.models.remote()).keys() == set(MODELS)
    events = [e.kind for e in live.catalog().events if e.model == "added"]
    cut = ["cut"] if last.finish_reason == "error" else []
    assert events == ["add", "placed", "remove", "retired", *cut] and result["cut"] == len(cut)


def test_an_update_finishes_old_requests_on_the_old_version_and_new_ones_on_the_new(cluster, zoo_model):
    from cluster.catalog_store import CatalogStore

    topology, live = cluster
    old_path, new_path = zoo_model("llama-tiny-a"), zoo_model("llama-tiny-b")
    client = edge(topology, CatalogStore())

    async def update_while_streaming():
        started = threading.Event()
        stream = asyncio.ensure_future(collect(client, "llama-tiny-a", "u1", 1500, started))
        while not started.is_set():
            await asyncio.sleep(0.01)
        entry = await asyncio.to_thread(live.update, "llama-tiny-a", str(new_path))
        await client.refresh()
        in_flight = not stream.done()
        after = await collect(client, "llama-tiny-a", "u2", 10)
        return entry, in_flight, await stream, after

    entry, in_flight, old_frames, new_frames = asyncio.run(update_while_streaming())
    assert entry.key == "llama-tiny-a@v2" and entry.version == 2
    assert old_frames[-1].finish_reason == "length" and len(tokens(old_frames)) == 1500
    assert {f.model_version for f in old_frames} == {"llama-tiny-a@v1"}
    assert tokens(old_frames)[:10] == reference(old_path, 10)
    assert {f.model_version for f in new_frames} == {"llama-tiny-a@v2"}
    assert tokens(new_frames) == reference(new_path, 10)
    assert live.wait_retired(60)
    assert holders(topology, "llama-tiny-a") == [] and holders(topology, "llama-tiny-a@v2")
    print("old request still streaming at the switch:", in_flight)


def test_a_restarted_placement_service_keeps_the_catalog(cluster, ray_session, zoo_model):
    topology, live = cluster
    live.add("kept", str(zoo_model("qwen2-tiny-a")))
    before = _pid(ray_session, topology.placement)
    ray_session.kill(topology.placement, no_restart=False)   # restarted in place with its first arguments
    wait_until(lambda: _pid(ray_session, topology.placement) not in (None, before), 60,
               what="the placement service restarted")
    assert _placed(ray_session, topology) == live.catalog().placed().keys()
    assert "kept" in _placed(ray_session, topology)
    wait_until(lambda: holders(topology, "kept"), 30, what="the kept model registered after the restart")


def _pid(ray, actor) -> int | None:
    import os

    try:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=5)
    except Exception:   # restarting
        return None


def _placed(ray, topology) -> set[str]:
    return set(ray.get(topology.placement.models.remote(), timeout=30))


def worker_memory(topology) -> dict[str, tuple[float, float]]:
    """Each live worker's RSS in MiB (after a collection in it) and the share of its KV pool in use."""
    import ray

    out = {}
    for worker, handle in sorted(topology.workers.items()):
        ray.get(handle.__ray_call__.remote(lambda self: __import__("gc").collect()), timeout=30)
        stats = ray.get(handle.stats.remote(), timeout=30)
        with open(f"/proc/{stats.pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        out[worker] = (rss_kib / 1024, 1.0 - stats.engine.kv_free_frac)
    return out


def test_memory_returns_after_a_model_is_added_and_removed(cluster, zoo_model):
    import ray

    from cluster.catalog_store import CatalogStore

    topology, live = cluster
    path = zoo_model("qwen2-tiny-a")

    def add_serve_remove(rid: str) -> None:
        live.add("roundtrip", str(path))
        frames = asyncio.run(collect(edge(topology, CatalogStore()), "roundtrip", rid, 48))
        assert tokens(frames) == reference(path, 48)
        live.remove("roundtrip")

    add_serve_remove("warm")   # the first cycle grows allocator pools and caches that stay: not measured
    before = worker_memory(topology)
    add_serve_remove("measured")
    after = worker_memory(topology)
    print("worker (RSS MiB, KV used) before -> after:", {w: (before[w], after[w]) for w in sorted(after)})
    assert after.keys() == before.keys()
    for worker, (rss, kv_used) in after.items():
        assert abs(rss - before[worker][0]) <= 0.05 * before[worker][0], (worker, before[worker][0], rss)
        assert kv_used <= before[worker][1], (worker, before[worker][1], kv_used)   # its KV blocks went back
        stats = ray.get(topology.workers[worker].stats.remote(), timeout=30)
        assert "roundtrip" not in stats.engine.registered and "roundtrip" not in stats.engine.resident
    assert "roundtrip" not in live.catalog().placed()


def hold_registration(worker, gate_dir: str, model: str) -> None:
    """From now on, `worker` loading `model` (Engine.register_model, on its engine thread) first
    writes gate_dir/held-<worker id>, then waits until gate_dir/release exists."""
    import ray

    def install(self, gate_dir: str, model: str) -> None:
        import os
        import time

        register = self.engine.register_model

        def held_register(name, path):
            if name == model:
                open(os.path.join(gate_dir, f"held-{self.worker_id}"), "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(gate_dir, "release")) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return register(name, path)

        self.engine.register_model = held_register

    ray.get(worker.__ray_call__.remote(install, gate_dir, model), timeout=30)


def test_a_worker_killed_while_it_loads_an_added_model_still_ends_with_the_model_everywhere_placed(
        cluster, ray_session, zoo_model, tmp_path):
    """Deterministic: every worker holds the add at the point it loads the model; the first one
    the placement asks is killed there, then the hold is released."""
    from cluster.catalog_store import CatalogStore

    topology, live = cluster
    path = zoo_model("mistral-tiny-b")
    for handle in topology.workers.values():
        hold_registration(handle, str(tmp_path), "survivor")
    added, failed = [], []

    def add() -> None:
        try:
            added.append(live.add("survivor", str(path)))
        except Exception as exc:   # the assertion below names it
            failed.append(exc)

    adding = threading.Thread(target=add)
    adding.start()
    wait_until(lambda: list(tmp_path.glob("held-*")), 60, what="a worker loading the added model")
    victim = sorted(tmp_path.glob("held-*"))[0].name[len("held-"):]
    ray_session.kill(topology.workers[victim])
    (tmp_path / "release").touch()
    adding.join(120)
    assert not failed and added and added[0].key == "survivor", failed

    def everywhere_placed() -> bool:
        plan = ray_session.get(topology.router.plan.remote())
        placed = plan.workers_for("survivor") if plan else ()
        return bool(placed) and victim not in placed and set(placed) <= set(holders(topology, "survivor"))

    wait_until(everywhere_placed, 90, interval_s=0.5, what="survivor registered on every worker its plan names")
    frames = asyncio.run(collect(edge(topology, CatalogStore()), "survivor", "s1", 16))
    assert tokens(frames) == reference(path, 16) and frames[-1].finish_reason == "length"
    wait_until(lambda: victim not in topology.workers and len(topology.workers) == 4, 90, interval_s=0.5,
               what="the killed worker replaced")
