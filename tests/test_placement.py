"""PlacementPolicy: fit, replicas with hysteresis, prefill/decode roles (no Ray)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.placement import ModelInfo, ModelLoad, PlacementConfig, PlacementPlan, PlacementPolicy, routable_now
from scheduler.routing import NoWorkerError, RoutingPolicy, WorkerView
from scheduler.slo import SLO

GB = 1 << 30
NO_SPLIT = dict(split_load=1e9, merge_load=1e8)


def sized(**weight_bytes: int) -> dict[str, ModelInfo]:
    return {m: ModelInfo(b) for m, b in weight_bytes.items()}


def in_flight(**queued: int) -> dict[str, ModelLoad]:
    return {m: ModelLoad(queued=n) for m, n in queued.items()}


def workers(n, slot=4 * GB, nodes=1, **kw):
    return [WorkerView(worker_id=f"w{i}", node_id=f"n{i % nodes}", slot_bytes=slot, **kw) for i in range(n)]


def test_cold_models_get_one_worker_each_and_are_spread():
    plan = PlacementPolicy().plan(workers(3), sized(a=GB, b=GB, c=GB))
    assert all(len(plan.workers_for(m)) == 1 for m in "abc")
    assert {plan.workers_for(m)[0] for m in "abc"} == {"w0", "w1", "w2"}
    assert set(plan.roles.values()) == {"mixed"}


def test_model_never_on_a_worker_whose_slot_cannot_hold_it():
    ws = [WorkerView(worker_id="small", node_id="n0", slot_bytes=GB),
          WorkerView(worker_id="big", node_id="n0", slot_bytes=8 * GB)]
    policy = PlacementPolicy(PlacementConfig(**NO_SPLIT))
    for _ in range(5):
        plan = policy.plan(ws, sized(huge=6 * GB, tiny=GB // 2), in_flight(huge=100, tiny=100))
    assert plan.workers_for("huge") == ("big",)
    assert set(plan.workers_for("tiny")) == {"small", "big"}


def test_model_too_big_for_every_slot_is_unplaceable_with_reason():
    plan = PlacementPolicy().plan(workers(2, slot=GB), sized(huge=2 * GB, ok=GB))
    assert "huge" not in plan.assignments and "largest slot" in plan.unplaceable["huge"]
    with pytest.raises(NoWorkerError, match="ok"):
        RoutingPolicy().pick("huge", workers(2, slot=GB), SLO(), plan)


def test_dead_workers_hold_nothing():
    ws = workers(2)
    ws[0] = WorkerView(worker_id="w0", node_id="n0", slot_bytes=4 * GB, alive=False)
    plan = PlacementPolicy().plan(ws, sized(a=GB, b=GB))
    assert plan.models_for("w0") == [] and plan.models_for("w1") == ["a", "b"]
    assert "w0" not in plan.roles
    assert PlacementPolicy().plan([ws[0]], sized(a=GB)).unplaceable == {"a": "no live workers"}


def test_hot_model_scales_out_at_once_and_shrinks_back_one_per_cooldown():
    cfg = PlacementConfig(scale_out_load=8, scale_in_load=3, cooldown_s=10, **NO_SPLIT)
    policy = PlacementPolicy(cfg)
    ws, models = workers(4), sized(hot=GB, cold=GB)
    sizes = [len(policy.plan(ws, models, in_flight(hot=30), now=t).workers_for("hot")) for t in range(5)]
    assert sizes == [4, 4, 4, 4, 4]   # 30 in flight need 4 replicas of <= 8: all of them in the first plan
    assert policy.plan(ws, models, in_flight(hot=30), now=5).workers_for("cold")   # still served
    # Burst over: nothing changes before the cooldown, then one step down per cooldown.
    sizes = [len(policy.plan(ws, models, in_flight(hot=0), now=t).workers_for("hot")) for t in range(10, 60, 2)]
    assert sizes[:5] == [4] * 5
    assert sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)


def test_load_between_thresholds_does_not_flap():
    cfg = PlacementConfig(scale_out_load=8, scale_in_load=3, cooldown_s=5, **NO_SPLIT)
    policy = PlacementPolicy(cfg)
    ws = workers(4)
    for t in range(3):
        policy.plan(ws, sized(a=GB), in_flight(a=20), now=t)
    before = policy.plan(ws, sized(a=GB), in_flight(a=20), now=3)
    assert len(before.workers_for("a")) == 3
    for t in range(4, 60):   # oscillates between 10 and 14 in flight: inside the dead band
        plan = policy.plan(ws, sized(a=GB), in_flight(a=10 + 4 * (t % 2)), now=t)
        assert plan.workers_for("a") == before.workers_for("a")
    assert plan.version == before.version


def test_assignments_are_sticky_when_other_load_moves():
    policy = PlacementPolicy(PlacementConfig(**NO_SPLIT))
    ws = workers(3)
    first = policy.plan(ws, sized(a=GB, b=GB, c=GB), in_flight(a=1))
    later = policy.plan(ws, sized(a=GB, b=GB, c=GB), in_flight(b=5, c=7))
    assert all(first.workers_for(m) == later.workers_for(m) for m in "abc")


def test_new_replica_prefers_a_node_whose_host_cache_has_the_model():
    ws = [WorkerView(worker_id="w0", node_id="n0", slot_bytes=4 * GB),
          WorkerView(worker_id="w1", node_id="n0", slot_bytes=4 * GB),
          WorkerView(worker_id="w2", node_id="n1", slot_bytes=4 * GB, host_cached=frozenset({"a"}))]
    policy = PlacementPolicy(PlacementConfig(**NO_SPLIT))
    plan = policy.plan(ws, sized(a=GB), in_flight(a=0))
    assert plan.workers_for("a") == ("w2",)


def test_roles_split_under_load_and_merge_back_after_cooldown():
    cfg = PlacementConfig(split_load=16, merge_load=6, cooldown_s=10)
    policy = PlacementPolicy(cfg)
    ws, models = workers(4, nodes=2), sized(a=GB, b=GB)
    plan = policy.plan(ws, models, in_flight(a=2, b=1), now=0)
    assert set(plan.roles.values()) == {"mixed"} and not plan.split
    plan = policy.plan(ws, models, in_flight(a=12, b=8), now=1)
    assert plan.split and sorted(plan.roles.values()) == ["decode", "decode", "prefill", "prefill"]
    for node in ("n0", "n1"):   # each node has both kinds, so KV handoff can stay on the node
        assert {plan.roles[w.worker_id] for w in ws if w.node_id == node} == {"prefill", "decode"}
    for m in models:            # every model can prefill and decode
        assert {plan.roles[w] for w in plan.workers_for(m)} == {"prefill", "decode"}
    assert policy.plan(ws, models, in_flight(a=3), now=2).split         # low, but cooling down
    assert policy.plan(ws, models, in_flight(a=10), now=5).split        # between thresholds: stays
    assert policy.plan(ws, models, in_flight(a=3), now=6).split
    assert not policy.plan(ws, models, in_flight(a=3), now=17).split    # low for a full cooldown


def test_a_single_worker_never_splits():
    plan = PlacementPolicy(PlacementConfig(split_load=1, merge_load=0)).plan(
        workers(1), sized(a=GB), in_flight(a=100))
    assert plan.roles == {"w0": "mixed"}


def test_rate_counts_as_demand_by_littles_law():
    cfg = PlacementConfig(request_s=4.0, scale_out_load=8, **NO_SPLIT)
    policy = PlacementPolicy(cfg)
    plan = policy.plan(workers(3), sized(a=GB), {"a": ModelLoad(rate_rps=5.0)})
    assert plan.demand["a"] == pytest.approx(20.0) and len(plan.workers_for("a")) == 3   # <= 8 each


def test_plan_round_trips_through_a_dict():
    plan = PlacementPolicy().plan(workers(2), {"a": ModelInfo(GB, 4096), "b": ModelInfo(GB)}, in_flight(a=3),
                                  slos={"a": SLO(ttft_s=2, tbt_s=0.1)})
    d = plan.to_dict()
    assert d["models"]["a"] == {"weight_bytes": GB, "kv_bytes_per_token": 4096}
    assert PlacementPlan.from_dict(d).to_dict() == d
    assert PlacementPlan.from_dict(d).slo_for("a") == SLO(ttft_s=2, tbt_s=0.1)


@pytest.mark.parametrize("kw, match", [
    ({"scale_in_load": 9, "scale_out_load": 8}, "scale_in_load"),
    ({"merge_load": 20, "split_load": 10}, "merge_load"),
    ({"prefill_fraction": 1.0}, "prefill_fraction"),
    ({"request_s": 0}, "request_s"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        PlacementConfig(**kw)


def test_bad_model_and_load_figures_are_rejected():
    with pytest.raises(ValueError, match="weight_bytes"):
        PlacementPolicy().plan(workers(1), sized(a=0))
    with pytest.raises(ValueError, match="load figures"):
        PlacementPolicy().plan(workers(1), sized(a=GB), {"a": ModelLoad(rate_rps=-1)})
    with pytest.raises(ValueError, match="unique"):
        PlacementPolicy().plan(workers(1) * 2, sized(a=GB))


@settings(max_examples=150, deadline=None)
@given(
    slots=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    nodes=st.integers(1, 3),
    models=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 20), min_size=1),
    loads=st.lists(st.dictionaries(st.sampled_from("abcdefghz"), st.integers(0, 80)), min_size=1, max_size=6),
    cooldown=st.sampled_from([0.0, 1.0, 5.0]),
)
def test_property_plans_fit_and_serve_every_placeable_model(slots, nodes, models, loads, cooldown):
    ws = [WorkerView(worker_id=f"w{i}", node_id=f"n{i % nodes}", slot_bytes=s * GB) for i, s in enumerate(slots)]
    info = {m: ModelInfo(gb * GB) for m, gb in models.items()}
    policy = PlacementPolicy(PlacementConfig(cooldown_s=cooldown, split_load=40, merge_load=10))
    slot_of = {w.worker_id: w.slot_bytes for w in ws}
    for t, load in enumerate(loads):
        plan = policy.plan(ws, info, {m: ModelLoad(queued=n) for m, n in load.items() if m in info}, now=float(t))
        assert set(plan.roles) == set(slot_of)
        for m, ids in plan.assignments.items():
            assert ids and len(set(ids)) == len(ids)
            assert all(slot_of[w] >= info[m].weight_bytes for w in ids), (m, ids)
        for m in info:   # each model is either served by >= 1 worker or unplaceable because it fits nowhere
            assert (m in plan.assignments) != (m in plan.unplaceable)
            assert (m in plan.unplaceable) == (info[m].weight_bytes > max(slot_of.values()))
        views = [w for w in ws]
        for m in plan.assignments:
            assert RoutingPolicy().pick(m, views, SLO(), plan) in plan.workers_for(m)
        with pytest.raises(NoWorkerError):
            RoutingPolicy().pick("not-a-model", views, SLO(), plan)


def test_while_replicas_register_the_router_may_use_those_that_hold_the_model_already():
    """A burst's replicas on workers that hold the model are routable at once; the ones still
    registering join later, and a model none of whose new workers is ready keeps its old ones."""
    views = [WorkerView(worker_id=w, node_id="n0", slot_bytes=4 * GB, registered=frozenset(reg))
             for w, reg in (("w0", {"a"}), ("w1", {"a", "b"}), ("w2", set()), ("w3", set()))]
    previous = PlacementPlan(assignments={"a": ("w0",), "b": ("w1",)}, roles={})
    plan = PlacementPlan(assignments={"a": ("w0", "w1", "w2"), "b": ("w3",), "c": ("w2",)}, roles={}, version=7)
    now = routable_now(plan, views, previous)
    assert dict(now.assignments) == {"a": ("w0", "w1"), "b": ("w1",)}   # c: no worker holds it yet
    assert now.version == plan.version and now.roles == plan.roles
    assert "c" not in routable_now(plan, views, None).assignments


def test_a_moe_checkpoint_is_placed_by_every_experts_bytes_not_its_active_ones(zoo_model):
    """mixtral-tiny-a reads 2 of its 4 experts per token, but a worker must hold all of them:
    the checkpoint's entry counts every tensor, and a slot sized to the active weights is refused."""
    from actors.model_spec import ModelSpec
    from actors.weight_layout import WeightLayout
    from cluster.placement_service import model_entry

    path = zoo_model("mixtral-tiny-a")
    _, info = model_entry("moe", str(path))
    spec = ModelSpec.from_dir(path)
    active = spec.num_active_params * spec.dtype_bytes
    assert info.weight_bytes == WeightLayout.from_dir(path).total_bytes > active
    small = PlacementPolicy().plan(workers(2, slot=active), {"moe": info})
    assert "moe" in small.unplaceable and not small.workers_for("moe")
    assert PlacementPolicy().plan(workers(2, slot=info.weight_bytes), {"moe": info}).workers_for("moe")
