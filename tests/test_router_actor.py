"""GlobalRouter and PlacementService as Ray actors, with small fake DeviceWorkers.

The fakes below stand in for the DeviceWorker only (stats/register/unregister/set_role);
the router and the placement service under test are the real actors.
"""
from __future__ import annotations

import time

import pytest

from polling import poll_until
from scheduler.messages import EngineStats, RegisteredModel, WorkerStats
from scheduler.placement import PlacementConfig
from scheduler.routing import NoWorkerError
from scheduler.slo import SLO

GB = 1 << 30


def _fake_worker_class(ray):
    @ray.remote(num_cpus=0)
    class FakeWorker:
        def __init__(self, worker_id, node_id, slot_bytes=4 * GB, registered=(), resident=()):
            self.worker_id, self.node_id, self.slot_bytes = worker_id, node_id, slot_bytes
            self.reset(registered, resident)

        def reset(self, registered=(), resident=()):
            self.registered, self.resident = set(registered), set(resident)
            self.queue, self.role, self.calls = {}, "mixed", []

        def stats(self):   # the worker's own message type: a fake cannot invent keys
            engine = EngineStats(registered=tuple(sorted(self.registered)), resident=tuple(sorted(self.resident)),
                                 num_slots=2, slot_bytes=self.slot_bytes, budget_bytes=2 * self.slot_bytes,
                                 queue_depth=dict(self.queue), decode_step_s=0.01)
            return WorkerStats(self.worker_id, self.node_id, engine, role=self.role)

        def register_model(self, name, path):
            self.calls.append(("register", name, path))
            self.registered.add(name)
            return RegisteredModel(name, path, "LlamaForCausalLM", 256, GB, 1024)

        def unregister_model(self, name, evict_host=False):
            self.calls.append(("unregister", name))
            self.registered.discard(name)
            self.resident.discard(name)

        def set_role(self, role):
            self.calls.append(("role", role))
            self.role = role

        def hang(self, seconds):   # a sync actor answers nothing else meanwhile
            time.sleep(seconds)

        def set_queue(self, model, n):
            self.queue[model] = n

        def get_calls(self):
            return list(self.calls)

    return FakeWorker


INITIAL = {"w0": (("a", "b"), ("a",)), "w1": (("a",), ()), "w2": (("a", "c"), ())}   # registered, resident
NODE = {"w0": "n0", "w1": "n0", "w2": "n1"}


@pytest.fixture(scope="module")
def fake_workers(ray_session):
    """Three fake workers on two nodes, shared by the module (actor start-up is slow here)."""
    FakeWorker = _fake_worker_class(ray_session)
    workers = {wid: FakeWorker.remote(wid, NODE[wid]) for wid in INITIAL}
    yield workers
    for handle in workers.values():
        ray_session.kill(handle)


@pytest.fixture
def cluster(ray_session, fake_workers):
    """A fresh router (fast polling) over the fake workers, reset to their initial models, and no
    stored catalog (a PlacementService adopts its namespace's; these tests give it their own models)."""
    ray = ray_session
    from cluster.catalog_store import CatalogStore
    from cluster.router import GlobalRouter

    CatalogStore().clear()

    ray.get([h.reset.remote(*INITIAL[wid]) for wid, h in fake_workers.items()])
    router = GlobalRouter.remote(poll_interval_s=0.1, stats_timeout_s=2.0)
    ray.get([router.add_worker.remote(wid, h, NODE[wid]) for wid, h in fake_workers.items()])
    yield ray, router, fake_workers
    ray.kill(router)


def test_pick_prefers_resident_worker_and_release_clears_pending(cluster):
    ray, router, workers = cluster
    picked = ray.get(router.pick.remote("a"))
    wid, handle = picked.worker_id, picked.handle
    assert wid == "w0"
    assert ray.get(handle.stats.remote()).worker_id == "w0"   # the handle is the worker's own
    assert ray.get(router.status.remote()).pending == {"a": 1}
    ray.get(router.release.remote("w0", "a"))
    assert ray.get(router.status.remote()).pending == {}


def test_a_pick_repeated_for_the_same_request_is_counted_once(cluster):
    """A caller that retries a pick whose answer it lost (ActorUnavailableError around a router
    restart) must not leave a count nobody releases: counted by request id, released once."""
    ray, router, _ = cluster
    for _ in range(3):
        wid = ray.get(router.pick.remote("a", None, "req-1")).worker_id
    ray.get(router.pick.remote("a", None, "req-2"))
    assert ray.get(router.status.remote()).pending == {"a": 2}
    ray.get(router.release.remote(wid, "a", "req-1"))
    ray.get(router.release.remote(wid, "a", "req-1"))   # a second release drops nothing
    assert ray.get(router.status.remote()).pending == {"a": 1}
    ray.get(router.release.remote(wid, "a", "req-2"))
    assert ray.get(router.status.remote()).pending == {}


def test_unknown_model_raises_no_worker_error_naming_servable_models(cluster):
    ray, router, _ = cluster
    with pytest.raises(NoWorkerError, match="a, b, c"):
        ray.get(router.pick.remote("nope"))


def test_load_spreads_when_the_resident_worker_is_busy(cluster):
    ray, router, workers = cluster
    ray.get(workers["w0"].set_queue.remote("a", 200))   # 200 x 10 ms queue: no TTFT headroom left
    assert poll_until(lambda: ray.get(router.status.remote()).workers["w0"].load == 200)
    picked = [ray.get(router.pick.remote("a", SLO(ttft_s=2.0, tbt_s=0.1))).worker_id for _ in range(6)]
    assert "w0" not in picked and set(picked) == {"w1", "w2"}


def test_killed_worker_is_removed_and_requests_go_to_the_others(cluster):
    ray, router, workers = cluster
    doomed = _fake_worker_class(ray).remote("w3", "n1", registered=("a", "e"), resident=("a",))
    ray.get(router.add_worker.remote("w3", doomed, "n1"))
    ray.get(workers["w0"].set_queue.remote("a", 3))   # so w3 (resident, idle) is the best for `a`
    assert poll_until(lambda: ray.get(router.status.remote()).workers["w0"].load == 3)
    assert ray.get(router.pick.remote("a")).worker_id == "w3"
    ray.kill(doomed)
    assert poll_until(lambda: "w3" not in ray.get(router.status.remote()).workers)
    status = ray.get(router.status.remote())
    assert status.pending == {}          # its in-flight request is forgotten with it
    assert "e" not in status.servable    # only w3 held it
    picked = {ray.get(router.pick.remote("a")).worker_id for _ in range(5)}
    assert picked and picked <= {"w0", "w1", "w2"}
    with pytest.raises(NoWorkerError, match="a, b, c"):
        ray.get(router.pick.remote("e"))


def test_report_failure_removes_a_dead_worker_at_once(ray_session, fake_workers):
    ray = ray_session
    from cluster.router import GlobalRouter

    ray.get(fake_workers["w1"].reset.remote(("a",)))
    router = GlobalRouter.remote(poll_interval_s=60.0)   # no poll will notice in time
    doomed = _fake_worker_class(ray).remote("w3", "n0", registered=("a",), resident=("a",))
    try:
        ray.get([router.add_worker.remote("w3", doomed, "n0"),
                 router.add_worker.remote("w1", fake_workers["w1"], "n0")])
        assert ray.get(router.pick.remote("a")).worker_id == "w3"
        ray.kill(doomed)
        assert poll_until(lambda: ray.get(router.report_failure.remote("w3")) or
                           "w3" not in ray.get(router.status.remote()).workers)
        assert all(ray.get(router.pick.remote("a")).worker_id == "w1" for _ in range(3))
        assert not ray.get(router.report_failure.remote("w1"))
    finally:
        ray.kill(router)


def test_placement_service_registers_plans_and_scales_a_hot_model_out_and_in(cluster):
    ray, router, workers = cluster
    from cluster.placement_service import PlacementService

    models = {m: {"path": f"/models/{m}", "weight_bytes": GB} for m in ("a", "b", "c", "d")}
    config = {"scale_out_load": 8, "scale_in_load": 2, "cooldown_s": 0.0, "split_load": 1e6, "merge_load": 1e5}
    placement = PlacementService.remote(models=models, config=PlacementConfig(**config), interval_s=60.0,
                                        router=router)
    try:
        plan = ray.get(placement.replan.remote())
        assert set(plan.assignments) == {"a", "b", "c", "d"}
        assert ray.get(router.plan.remote()).version == plan.version
        # Each worker now holds exactly the models the plan gives it (registered or unregistered to match).
        for wid, handle in workers.items():
            want = {m for m, ws in plan.assignments.items() if wid in ws}
            assert set(ray.get(handle.stats.remote()).engine.registered) == want
        d_holder = plan.assignments["d"][0]
        assert ("register", "d", "/models/d") in ray.get(workers[d_holder].get_calls.remote())
        # The router routes by the plan: `d` goes to its planned worker.
        assert poll_until(lambda: sorted(ray.get(router.status.remote()).workers[d_holder].registered).count("d") == 1)
        assert ray.get(router.pick.remote("d")).worker_id == d_holder
        ray.get(router.release.remote(d_holder, "d"))

        # Burst on `a`: its queue grows on its worker; the next replan gives it the replicas its
        # demand needs at once (40 in flight / scale_out_load 8 -> 5, capped at the 3 workers), and
        # the replans after keep them.
        a_holder = plan.assignments["a"][0]
        ray.get(workers[a_holder].set_queue.remote("a", 40))
        assert poll_until(lambda: ray.get(router.status.remote()).workers[a_holder].load == 40)
        sizes = [len(ray.get(placement.replan.remote()).assignments["a"]) for _ in range(3)]
        assert sizes == [3, 3, 3]
        assert all("a" in ray.get(h.stats.remote()).engine.registered for h in workers.values())
        # Burst over: it shrinks back to one worker.
        ray.get(workers[a_holder].set_queue.remote("a", 0))
        assert poll_until(lambda: ray.get(router.status.remote()).workers[a_holder].load == 0)
        sizes = [len(ray.get(placement.replan.remote()).assignments["a"]) for _ in range(3)]
        assert sizes[-1] == 1
        assert list(ray.get(placement.plan.remote()).assignments["a"]) == [a_holder]
    finally:
        ray.kill(placement)


def test_placement_service_splits_roles_under_load(cluster):
    ray, router, workers = cluster
    from cluster.placement_service import PlacementService

    models = {"a": {"path": "/models/a", "weight_bytes": GB}}
    placement = PlacementService.remote(models=models, config=PlacementConfig(split_load=10, merge_load=1),
                                        router=router)
    try:
        assert not ray.get(placement.replan.remote()).split
        ray.get(workers["w0"].set_queue.remote("a", 30))
        assert poll_until(lambda: ray.get(router.status.remote()).workers["w0"].load == 30)
        plan = ray.get(placement.replan.remote())
        assert plan.split
        roles = {wid: ray.get(h.stats.remote()).role for wid, h in workers.items()}
        assert roles == plan.roles and set(roles.values()) == {"prefill", "decode"}
        # New requests go to a prefill worker, the KV handoff target is a decode worker.
        assert poll_until(lambda: {v.role for v in ray.get(router.status.remote()).workers.values()}
                           == {"prefill", "decode"})
        wid = ray.get(router.pick.remote("a")).worker_id
        assert plan.roles[wid] == "prefill"
        assert plan.roles[ray.get(router.pick_decode.remote("a"))[0]] == "decode"
    finally:
        ray.kill(placement)


def test_unresponsive_worker_is_skipped_until_it_answers_again(ray_session, fake_workers):
    ray = ray_session
    from cluster.router import GlobalRouter

    ray.get(fake_workers["w1"].reset.remote(("a",)))
    router = GlobalRouter.remote(poll_interval_s=0.1, stats_timeout_s=0.2, max_missed=2)
    slow = _fake_worker_class(ray).remote("w3", "n0", registered=("a",), resident=("a",))
    try:
        ray.get([router.add_worker.remote("w3", slow, "n0"),
                 router.add_worker.remote("w1", fake_workers["w1"], "n0")])
        assert ray.get(router.pick.remote("a")).worker_id == "w3"
        hung = slow.hang.remote(4.0)
        assert poll_until(lambda: not ray.get(router.status.remote()).workers["w3"].alive)
        assert ray.get(router.pick.remote("a")).worker_id == "w1"
        ray.get(hung)
        assert poll_until(lambda: ray.get(router.status.remote()).workers["w3"].alive)
        assert ray.get(router.pick.remote("a")).worker_id == "w3"
    finally:
        for h in (router, slow):
            ray.kill(h)


def test_started_placement_replans_by_itself_and_follows_a_burst(cluster):
    ray, router, workers = cluster
    from cluster.placement_service import PlacementService

    models = {m: {"path": f"/models/{m}", "weight_bytes": GB} for m in ("a", "b")}
    config = {"scale_out_load": 4, "scale_in_load": 1, "cooldown_s": 0.0, "split_load": 1e6, "merge_load": 1e5}
    placement = PlacementService.remote(models=models, config=PlacementConfig(**config), interval_s=0.2,
                                        router=router)
    try:
        ray.get(placement.start.remote())
        assert poll_until(lambda: ray.get(router.plan.remote()) is not None)   # no replan was asked for
        a_holder = ray.get(router.plan.remote()).assignments["a"][0]
        ray.get(workers[a_holder].set_queue.remote("a", 30))
        assert poll_until(lambda: len(ray.get(router.plan.remote()).assignments["a"]) == 3)
        ray.get(workers[a_holder].set_queue.remote("a", 0))
        assert poll_until(lambda: len(ray.get(router.plan.remote()).assignments["a"]) == 1)
    finally:
        ray.kill(placement)
