"""Tensor-parallel models in the app config, placement and routing: a TP-N model gets N
distinct workers of one node, each holding its share; its requests go to the leader."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.placement import ModelInfo, ModelLoad, PlacementPlan, PlacementPolicy, routable_now
from scheduler.routing import NoWorkerError, RoutingPolicy, WorkerView
from scheduler.tp_groups import check_fits_device, check_tensor_parallel, min_tensor_parallel

GB = 10 ** 9


def workers(n, slot=4 * GB, nodes=1, **kw):
    return [WorkerView(worker_id=f"w{i}", node_id=f"n{i % nodes}", slot_bytes=slot, **kw) for i in range(n)]


# ---- the setting ------------------------------------------------------------------------

@pytest.mark.parametrize("value, per_node, match", [
    (0, None, "positive int"), (-2, None, "positive int"), (True, None, "positive int"), (1.5, None, "positive int"),
    (3, None, "power of two"), (6, 8, "power of two"), (4, 2, "does not divide"),
])
def test_a_bad_degree_is_refused_naming_tensor_parallel(value, per_node, match):
    with pytest.raises(ValueError, match=match) as err:
        check_tensor_parallel(value, per_node, model="big")
    assert "tensor_parallel" in str(err.value) and "'big'" in str(err.value)


def test_app_args_take_a_degree_per_model_and_name_the_field_when_wrong():
    from pydantic import ValidationError

    from deploy.serve_app.app_args import parse_app_args

    args = parse_app_args({"models": {"big": "/ckpt/big", "small": "/ckpt/small"},
                           "tensor_parallel": {"big": 2}, "devices_per_node": 2})
    assert args.tensor_parallel == {"big": 2}
    bad = [({"big": 3}, 2, "power of two"), ({"big": 4}, 2, "does not divide"), ({"nope": 2}, 2, "not among"),
           ({"big": 0}, None, "positive int")]
    for tp, per_node, match in bad:
        with pytest.raises(ValidationError, match=match) as err:
            parse_app_args({"models": {"big": "/ckpt/big"}, "tensor_parallel": tp, "devices_per_node": per_node})
        assert "tensor_parallel" in str(err.value)


def test_a_model_larger_than_one_slot_is_refused_unless_it_asks_for_enough_devices(zoo_model):
    from actors.model_spec import ModelSpec
    from deploy.serve_app.app_args import check_model_fits, parse_app_args

    path = str(zoo_model("llama-tiny-a"))
    weights = ModelSpec.from_dir(path).weight_bytes
    raw = {"models": {"big": path}, "budget_bytes": weights, "num_slots": 1, "kv_fraction": 0.25,
           "devices_per_node": 2}
    args = parse_app_args(raw)
    assert weights // 2 < args.weight_slot_bytes < weights   # one device is too small, half the weights fit
    with pytest.raises(ValueError, match="tensor_parallel: 2"):
        check_model_fits(args, args.models)
    check_model_fits(parse_app_args({**raw, "tensor_parallel": {"big": 2}}), args.models)


def test_the_refusal_names_the_smallest_degree_that_fits():
    assert min_tensor_parallel(145 * GB, 80 * GB) == 2 and min_tensor_parallel(145 * GB, 30 * GB) == 8
    with pytest.raises(ValueError, match="tensor_parallel: 4"):
        check_fits_device("m", 145 * GB, 2, 40 * GB)
    check_fits_device("m", 145 * GB, 4, 40 * GB)


# ---- placement ---------------------------------------------------------------------------

def test_a_tp2_model_gets_two_workers_of_one_node_and_routes_to_its_leader():
    ws = workers(4, slot=4 * GB, nodes=2)
    plan = PlacementPolicy().plan(ws, {"big": ModelInfo(7 * GB, tensor_parallel=2), "a": ModelInfo(2 * GB)})
    group = plan.group_of("big")
    assert len(set(group)) == 2 and len({w.node_id for w in ws if w.worker_id in group}) == 1
    assert plan.workers_for("big") == group[:1]
    for wid in group:   # every member registers (holds its share of) the model
        assert "big" in plan.models_for(wid)
    assert RoutingPolicy().pick("big", ws, plan=plan) == group[0]
    assert PlacementPlan.from_dict(plan.to_dict()).group_of("big") == group


def test_a_group_is_never_split_across_nodes():
    """Two nodes of one worker each: two devices exist, but not on one node."""
    plan = PlacementPolicy().plan(workers(2, nodes=2), {"big": ModelInfo(6 * GB, tensor_parallel=2)})
    assert "big" in plan.unplaceable and "one node" in plan.unplaceable["big"]
    assert not plan.workers_for("big") and not plan.group_of("big")


def test_a_model_too_big_for_one_slot_says_tensor_parallel():
    plan = PlacementPolicy().plan(workers(2), {"big": ModelInfo(6 * GB)})
    assert "tensor_parallel" in plan.unplaceable["big"]


def test_single_device_models_share_the_groups_devices():
    """Two workers, a TP-2 model on both, and two small models: all four are served there."""
    ws = workers(2)
    plan = PlacementPolicy().plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2), "a": ModelInfo(GB), "b": ModelInfo(GB)})
    assert set(plan.group_of("big")) == {"w0", "w1"}
    assert not plan.unplaceable and plan.workers_for("a") and plan.workers_for("b")


def test_a_group_stays_put_while_its_members_live_and_moves_when_one_dies():
    policy = PlacementPolicy()
    ws = workers(4, nodes=2)
    first = policy.plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2)}).group_of("big")
    assert policy.plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2)}).group_of("big") == first
    dead = first[1]
    ws = [WorkerView(worker_id=w.worker_id, node_id=w.node_id, slot_bytes=w.slot_bytes,
                     alive=w.worker_id != dead) for w in ws]
    moved = policy.plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2)}).group_of("big")
    assert moved and dead not in moved


def test_a_dead_member_takes_its_group_out_of_routing():
    ws = workers(2)
    plan = PlacementPolicy().plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2), "a": ModelInfo(GB)})
    member = plan.group_of("big")[1]
    ws = [WorkerView(worker_id=w.worker_id, node_id=w.node_id, slot_bytes=w.slot_bytes,
                     alive=w.worker_id != member) for w in ws]
    with pytest.raises(NoWorkerError):
        RoutingPolicy().pick("big", ws, plan=plan)
    assert "big" not in RoutingPolicy().servable(ws, plan)


@settings(max_examples=80, deadline=None)
@given(nodes=st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=4), min_size=1, max_size=3),
       models=st.lists(st.tuples(st.integers(1, 24), st.sampled_from([1, 2, 4])), min_size=1, max_size=6),
       demand=st.lists(st.integers(0, 20), min_size=6, max_size=6))
def test_property_groups_are_distinct_workers_of_one_node_within_each_slot(nodes, models, demand):
    ws = [WorkerView(worker_id=f"n{n}w{i}", node_id=f"n{n}", slot_bytes=s * GB)
          for n, slots in enumerate(nodes) for i, s in enumerate(slots)]
    node_of = {w.worker_id: w.node_id for w in ws}
    slot_of = {w.worker_id: w.slot_bytes for w in ws}
    infos = {f"m{i}": ModelInfo(size * GB, tensor_parallel=tp) for i, (size, tp) in enumerate(models)}
    load = {m: ModelLoad(queued=d) for m, d in zip(infos, demand)}
    policy = PlacementPolicy()
    for _ in range(2):   # a replan too (sticky groups)
        plan = policy.plan(ws, infos, load)
        for m, info in infos.items():
            group = plan.group_of(m)
            placed = bool(plan.workers_for(m))
            assert placed != (m in plan.unplaceable)
            for wid in plan.workers_for(m) + group:   # every device it touches holds its share
                assert slot_of[wid] >= info.device_weight_bytes
            if info.tensor_parallel == 1:
                assert not group
                continue
            can = any(sum(slot_of[w.worker_id] >= info.device_weight_bytes for w in ws if w.node_id == n)
                      >= info.tensor_parallel for n in set(node_of.values()))
            assert placed == can
            if placed:
                assert len(group) == len(set(group)) == info.tensor_parallel
                assert len({node_of[w] for w in group}) == 1
                assert plan.workers_for(m) == group[:1]


def test_the_placement_services_entries_carry_the_configured_degree():
    from cluster.placement_service import model_entry

    _, info = model_entry("big", {"path": "/ckpt/big", "weight_bytes": 6 * GB}, tensor_parallel=2)
    assert info.tensor_parallel == 2 and info.device_weight_bytes == 3 * GB
    with pytest.raises(ValueError, match="tensor_parallel"):
        model_entry("big", {"path": "/ckpt/big", "weight_bytes": 6 * GB, "tensor_parallel": 3})


def test_a_group_is_routable_only_once_every_member_has_registered_the_model():
    ws = workers(2)
    plan = PlacementPolicy().plan(ws, {"big": ModelInfo(6 * GB, tensor_parallel=2)})
    leader, member = plan.group_of("big")
    views = [WorkerView(worker_id=w.worker_id, node_id="n0", slot_bytes=w.slot_bytes,
                        registered=frozenset({"big"}) if w.worker_id == leader else frozenset()) for w in ws]
    assert not routable_now(plan, views, None).workers_for("big")   # the leader alone cannot step
    views = [WorkerView(worker_id=w.worker_id, node_id="n0", slot_bytes=w.slot_bytes, registered=frozenset({"big"}))
             for w in ws]
    ready = routable_now(plan, views, None)
    assert ready.workers_for("big") == (leader,) and ready.group_of("big") == (leader, member)


def test_a_member_whose_registration_failed_takes_its_group_out_of_the_plan():
    from cluster.placement_service import without_failed

    plan = PlacementPolicy().plan(workers(3), {"big": ModelInfo(6 * GB, tensor_parallel=2), "a": ModelInfo(GB)})
    leader, member = plan.group_of("big")
    applied = without_failed(plan, {(member, "big"): "out of host memory"})
    assert not applied.workers_for("big") and not applied.group_of("big")
    assert "out of host memory" in applied.unplaceable["big"]
    assert applied.workers_for("a") == plan.workers_for("a")   # the others are untouched
    assert without_failed(plan, {}) is plan
