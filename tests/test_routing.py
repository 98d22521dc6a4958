"""RoutingPolicy and LoadTracker with plain WorkerView snapshots (no Ray)."""
from __future__ import annotations

import collections

import pytest

from scheduler.placement import ModelInfo, ModelLoad, PlacementConfig, PlacementPlan, PlacementPolicy
from scheduler.messages import EngineStats, WorkerStats
from scheduler.routing import LoadTracker, NoWorkerError, RoutingConfig, RoutingPolicy, WorkerView
from scheduler.slo import SLO

GB = 1 << 30


def view(wid, node="n0", registered=("a",), resident=(), load=None, **kw):
    return WorkerView(worker_id=wid, node_id=node, registered=frozenset(registered),
                      resident=frozenset(resident), load_by_model=load or {}, slot_bytes=4 * GB, **kw)


def plan_of(assignments, roles=None, weights=None):
    ws = {w for ids in assignments.values() for w in ids}
    return PlacementPlan(assignments={m: tuple(ids) for m, ids in assignments.items()},
                         roles=roles or {w: "mixed" for w in ws},
                         models={m: ModelInfo((weights or {}).get(m, GB))
                                 for m in assignments})


def test_resident_worker_preferred_over_host_cached_and_cold():
    policy = RoutingPolicy()
    views = [view("w0", registered=("a",)), view("w1", registered=("a",), resident=("a",)),
             view("w2", registered=())]
    plan = plan_of({"a": ["w0", "w1", "w2"]})
    assert policy.pick("a", views, SLO(ttft_s=10), plan) == "w1"
    # Without the resident one, the host-cached copy beats a cold load.
    assert policy.pick("a", views[0:1] + views[2:], SLO(ttft_s=10), plan) == "w0"


def test_host_cache_of_the_node_counts_for_every_worker_on_it():
    policy = RoutingPolicy()
    views = [view("w0", node="n0", registered=()),
             view("w1", node="n1", registered=(), host_cached=frozenset({"a"}))]
    assert policy.pick("a", views, SLO(), plan_of({"a": ["w0", "w1"]})) == "w1"


def test_start_rate_adds_up_the_workers_that_prefill_the_model_at_their_known_speed():
    policy = RoutingPolicy(RoutingConfig(default_step_s=0.05))
    views = [view("w0", step_time_s=0.01), view("w1"),                # 100 + 20 (no step measured yet) a second
             view("w2", role="decode", step_time_s=0.01),              # decodes only: starts nothing
             view("w3", step_time_s=0.01, alive=False),                # dead
             view("w4", registered=("b",), step_time_s=0.01)]          # holds another model
    assert policy.start_rate("a", views) == pytest.approx(120.0)
    assert policy.start_rate("a", [views[2]]) == pytest.approx(100.0)  # only decoders: they prefill too
    assert policy.start_rate("c", views) == 0.0


def test_only_workers_in_the_plan_are_candidates():
    policy = RoutingPolicy()
    views = [view("w0", resident=("a",)), view("w1")]
    assert policy.pick("a", views, SLO(), plan_of({"a": ["w1"]})) == "w1"
    # Without a plan, the registered models decide.
    assert policy.pick("a", [view("w0", registered=("b",)), view("w1")], SLO()) == "w1"


def test_unknown_model_raises_no_worker_error_listing_servable_models():
    policy = RoutingPolicy()
    views = [view("w0", registered=("a", "b")), view("w1", registered=("c",))]
    with pytest.raises(NoWorkerError) as err:
        policy.pick("zzz", views, SLO())
    assert err.value.servable == ["a", "b", "c"]
    assert "'zzz'" in str(err.value) and "a, b, c" in str(err.value)
    with pytest.raises(NoWorkerError, match="models that can be served: a"):
        policy.pick("b", views, SLO(), plan_of({"a": ["w0"]}))


def test_dead_workers_are_never_picked():
    policy = RoutingPolicy()
    views = [view("w0", resident=("a",), alive=False), view("w1")]
    assert policy.pick("a", views, SLO()) == "w1"
    with pytest.raises(NoWorkerError, match="none"):
        policy.pick("a", [views[0]], SLO())


def test_load_spreads_across_workers_holding_the_model():
    policy, tracker = RoutingPolicy(), LoadTracker()
    plan = plan_of({"a": ["w0", "w1", "w2"]})
    picks = collections.Counter()
    for i in range(30):
        views = [view(w, resident=("a",), load=tracker.inflight(w)) for w in ("w0", "w1", "w2")]
        wid = policy.pick("a", views, SLO(ttft_s=100), plan)
        tracker.dispatched(wid, "a", now=float(i))
        picks[wid] += 1
    assert max(picks.values()) - min(picks.values()) <= 1


def test_slo_headroom_moves_work_off_an_overloaded_resident_worker():
    policy = RoutingPolicy(RoutingConfig(default_step_s=0.1))
    plan = plan_of({"a": ["w0", "w1"]}, weights={"a": GB // 8})
    views = [view("w0", resident=("a",), load={"a": 40}), view("w1", registered=("a",))]
    # 40 requests x 0.1 s = 4 s of queueing: over half of a 2 s TTFT, so the swap-in wins.
    assert policy.pick("a", views, SLO(ttft_s=2.0), plan) == "w1"
    # With a loose SLO the resident weights win (no switch needed).
    assert policy.pick("a", views, SLO(ttft_s=60.0), plan) == "w0"


def test_a_burst_spreads_onto_a_replica_that_has_not_measured_a_step_yet():
    """The replica placement just added has never decoded, so it reports no step time. Priced at
    the default step (25x the measured one here) it looked loaded after one request, and the
    burst stayed on the worker that had run before; priced at its peers' measured step, the
    burst splits between the two."""
    policy, tracker = RoutingPolicy(), LoadTracker()
    plan = plan_of({"a": ["old", "new"]}, weights={"a": 4 << 20})
    measured = policy.config.default_step_s / 25
    picks = collections.Counter()
    for i in range(16):
        views = [view("old", resident=("a",), step_time_s=measured, load=tracker.inflight("old")),
                 view("new", load=tracker.inflight("new"))]   # registered, host-cached, no step yet
        wid = policy.pick("a", views, SLO(ttft_s=5 * measured, tbt_s=0.5), plan)
        tracker.dispatched(wid, "a", now=float(i))
        picks[wid] += 1
    assert abs(picks["new"] - picks["old"]) <= 2, picks
    # with no worker measured yet, the default prices them all alike
    assert RoutingPolicy.peer_step_s([view("w0"), view("w1")]) is None
    assert RoutingPolicy.peer_step_s([view("w0", step_time_s=0.01), view("w1", step_time_s=0.03),
                                      view("w2", step_time_s=0.5, alive=False)]) == pytest.approx(0.02)


def test_a_worker_with_a_full_kv_pool_is_avoided():
    policy = RoutingPolicy(RoutingConfig(default_step_s=0.1))
    views = [view("w0", resident=("a",), load={"a": 10}, kv_free_frac=0.01),
             view("w1", resident=("a",), load={"a": 20})]
    assert policy.pick("a", views, SLO(ttft_s=2.0)) == "w1"


def test_when_nothing_has_headroom_the_lowest_predicted_delay_wins():
    policy = RoutingPolicy(RoutingConfig(default_step_s=0.1))
    views = [view("w0", resident=("a",), load={"a": 50}), view("w1", resident=("a",), load={"a": 30})]
    assert policy.pick("a", views, SLO(ttft_s=0.5)) == "w1"


def test_new_requests_go_to_prefill_workers_and_decode_picks_decode_workers():
    policy = RoutingPolicy()
    plan = plan_of({"a": ["p0", "d0"]}, roles={"p0": "prefill", "d0": "decode"})
    views = [view("p0", role="prefill"), view("d0", role="decode", resident=("a",))]
    assert policy.pick("a", views, SLO(), plan) == "p0"
    assert policy.pick_decode("a", views, SLO(), plan) == "d0"
    # If the prefill worker died, the decode worker still takes the request.
    assert policy.pick("a", [views[1]], SLO(), plan) == "d0"


def test_is_hot_only_when_every_worker_of_the_model_is_above_threshold():
    policy = RoutingPolicy(RoutingConfig(hot_load=4))
    views = [view("w0", load={"a": 9}), view("w1", load={"a": 5})]
    assert policy.is_hot("a", views)
    assert not policy.is_hot("a", views + [view("w2", load={"a": 1})])
    assert not policy.is_hot("zzz", views)


def test_from_stats_reads_worker_stats_and_router_dispatches():
    engine = EngineStats(registered=("a", "b"), resident=("a",), num_slots=2, slot_bytes=5, budget_bytes=10,
                         queue_depth={"a": 2}, running={"a": 1, "b": 1}, kv_free_frac=0.5, decode_step_s=0.02)
    stats = WorkerStats("w0", "n0", engine, role="decode")
    v = WorkerView.from_stats(stats, host_cached={"c"}, extra_load={"b": 4})
    assert v.load_by_model == {"a": 3, "b": 4} and v.load == 7
    assert v.residency("a") < v.residency("b") == v.residency("c") < v.residency("zzz")
    assert (v.role, v.num_slots, v.slot_bytes, v.step_time_s) == ("decode", 2, 5, 0.02)
    assert v.to_dict()["resident"] == ["a"]


@pytest.mark.parametrize("kw, match", [
    ({"worker_id": ""}, "worker_id"), ({"role": "boss"}, "role"),
    ({"kv_free_frac": 1.5}, "kv_free_frac"), ({"num_slots": 0}, "num_slots"),
    ({"load_by_model": {"a": -1}}, "load_by_model"),
])
def test_worker_view_rejects_bad_values(kw, match):
    base = {"worker_id": "w0", "node_id": "n0"} | kw
    with pytest.raises(ValueError, match=match):
        WorkerView(**base)


def test_routing_config_rejects_bad_values():
    with pytest.raises(ValueError, match="headroom_frac"):
        RoutingConfig(headroom_frac=0)


def test_load_tracker_counts_inflight_and_windowed_rate():
    t = LoadTracker(window_s=10.0)
    for i in range(20):
        t.dispatched("w0" if i % 2 else "w1", "a", now=float(i))
    assert t.pending() == {"a": 20}
    assert t.rate("a", now=19.0) == pytest.approx(11 / 10)   # arrivals at t >= 9
    assert t.rate("a", now=100.0) == 0.0
    assert t.released("w0", "a") and not t.released("w9", "a")
    assert t.forget_worker("w1") == {"a": 10}
    assert t.pending() == {"a": 9}


def test_router_and_placement_together_scale_a_burst_out_and_back_in():
    """A burst of model `a` grows its replica set; when it ends the set shrinks back."""
    policy = RoutingPolicy(RoutingConfig(hot_load=4))
    placement = PlacementPolicy(PlacementConfig(scale_out_load=4, scale_in_load=1, cooldown_s=5,
                                                split_load=1000, merge_load=999))
    tracker = LoadTracker()
    workers = [view(f"w{i}", registered=()) for i in range(4)]
    models = {"a": ModelInfo(GB), "b": ModelInfo(GB)}
    now = 0.0
    plan = placement.plan(workers, models, {}, now=now)
    assert len(plan.workers_for("a")) == 1
    for _ in range(40):   # the burst: requests arrive and do not finish yet
        views = [view(w.worker_id, load=tracker.inflight(w.worker_id)) for w in workers]
        tracker.dispatched(policy.pick("a", views, SLO(), plan), "a", now)
        plan = placement.plan(workers, models, {m: ModelLoad(queued=n) for m, n in tracker.pending().items()}, now=now)
        now += 0.1
    assert len(plan.workers_for("a")) == 4
    busy = {w for w in plan.workers_for("a") if tracker.inflight(w)}
    assert len(busy) >= 3   # requests really went to the added workers
    for w in list(plan.workers_for("a")):   # the burst ends
        while tracker.released(w, "a"):
            pass
    for _ in range(40):
        plan = placement.plan(workers, models, {m: ModelLoad(queued=n) for m, n in tracker.pending().items()}, now=now)
        now += 1.0
    assert len(plan.workers_for("a")) == 1
