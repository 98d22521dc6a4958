"""The fleet simulator: real placement, routing and per-worker policies on a virtual clock."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster.planner.cost_model import fit_profile, num_fits
from cluster.planner.devices import DEVICES, DeviceLayout, device_spec
from cluster.planner.marketplace import DEFAULT_MIX, MODEL_TYPES, Marketplace, assign_types, parse_mix
from cluster.planner.metrics import summarize
from cluster.planner.simulator import FleetConfig, simulate
from cluster.planner.traces import read_trace
from cluster.planner.workloads import TraceRequest, Workload
from scheduler.placement import PlacementConfig
from scheduler.routing import RoutingConfig
from scheduler.slo import SLO

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TRACE = DATA / "traces" / "aegaeon-synth" / "synth-16-0.5-1.0-1.0.csv"
SLO_7B = SLO(ttft_s=10.0, tbt_s=0.1)
H100 = DEVICES["H100"]
NO_SPLIT = dict(split_load=float("inf"), merge_load=1e300)

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"shared data not found at {TRACE}")


@pytest.fixture(scope="module")
def workload():
    return read_trace(str(TRACE))


@pytest.fixture(scope="module")
def market(workload):
    return Marketplace.build(workload.models, parse_mix(DEFAULT_MIX), "H100", DATA / "profiles")


def fleet(n, market, policy="token", device=H100, slots=2, **placement):
    layout = DeviceLayout.carve(device, market.largest_weight_bytes(), slots)
    cfg = PlacementConfig(request_s=14.0, scale_out_load=24, scale_in_load=9, swap_bytes_per_s=device.h2d_bytes_per_s,
                          max_models_per_worker=1 if policy == "dedicated" else 32, **{**NO_SPLIT, **placement})
    return FleetConfig(n, layout, policy, SLO_7B, placement=cfg,
                       routing=RoutingConfig(swap_bytes_per_s=device.h2d_bytes_per_s))


def demand_of(workload):
    counts = {}
    for r in workload:
        counts[r.model] = counts.get(r.model, 0) + 1
    return {m: n / workload.duration_s for m, n in counts.items()}


def test_every_request_is_served_with_ordered_token_times_on_a_deterministic_clock(workload, market):
    a = simulate(workload, market, fleet(6, market), demand_of(workload))
    assert len(a.records) == len(workload)
    for r, tr in zip(a.records, workload):
        assert r.ok and r.num_output_tokens == tr.output_len
        assert r.token_times == sorted(r.token_times) and r.token_times[0] >= r.arrival
    assert len({t.worker for t in a.turns}) == 6
    b = simulate(workload, market, fleet(6, market), demand_of(workload))
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]


def test_placement_keeps_each_model_on_one_worker_instead_of_spreading_it(workload, market):
    result = simulate(workload, market, fleet(8, market), demand_of(workload))
    plan = result.plans[-1]
    assert all(len(plan.workers_for(m)) == 1 for m in market.models)
    assert max(result.stats["models_per_worker"].values()) <= 3
    for r in result.records:   # routing follows the plan: every request ran where its model is placed
        assert r.worker_id in plan.workers_for(r.model)


def test_token_level_meets_more_slos_than_request_level_on_the_same_fleet(workload, market):
    token = summarize(simulate(workload, market, fleet(6, market, "token"), demand_of(workload)).records, SLO_7B)
    request = summarize(simulate(workload, market, fleet(6, market, "request"), demand_of(workload)).records, SLO_7B)
    assert token["attainment_strict"] > request["attainment_strict"] + 0.2
    assert request["ttft_p99_s"] > SLO_7B.ttft_s > token["ttft_p99_s"]   # head-of-line blocking


def test_dedicated_gives_a_model_a_device_and_refuses_models_without_one(workload, market):
    full = simulate(workload, market, fleet(len(market.models), market, "dedicated"), demand_of(workload))
    assert all(r.ok for r in full.records) and set(full.stats["models_per_worker"].values()) == {1}
    short = simulate(workload, market, fleet(4, market, "dedicated"), demand_of(workload))
    failed = [r for r in short.records if not r.ok]
    assert failed and all("no worker can serve" in r.error for r in failed)
    assert len({r.model for r in short.records if r.ok}) == 4


def test_prefill_workers_hand_kv_to_decode_workers(workload, market):
    cfg = fleet(8, market, split_load=1.0, merge_load=0.0)
    result = simulate(workload, market, cfg, demand_of(workload))
    roles = result.stats["roles"]
    assert set(roles.values()) == {"prefill", "decode"}
    assert result.stats["num_handoffs"] > 0.9 * len(workload)
    decoded_on = {t.worker for t in result.turns if roles[t.worker] == "decode"}
    assert decoded_on and all(r.ok for r in result.records)
    # The handoff's bytes are paid: a slower device-to-device link makes first-to-second token gaps longer.
    slow = replace(cfg, layout=replace(cfg.layout, device=replace(H100, d2d_bytes_per_s=2e8)))
    gap = lambda res: sorted(r.token_times[1] - r.token_times[0] for r in res.records if len(r.token_times) > 1)
    fast_gaps, slow_gaps = gap(result), gap(simulate(workload, market, slow, demand_of(workload)))
    assert slow_gaps[len(slow_gaps) // 2] > fast_gaps[len(fast_gaps) // 2] + 0.05


def test_host_kv_swaps_cost_host_link_time():
    # One model, always resident: the host link carries only KV swapped out and back in.
    market = Marketplace.build(["m"], parse_mix("qwen2.5-7b"), "H100", DATA / "profiles")
    work = Workload(tuple(TraceRequest(0.01 * i, "m", 1500, 600) for i in range(64)))
    base = DeviceLayout.carve(H100, market.largest_weight_bytes(), 1, kv_bytes=2 << 30, slab_bytes=16 << 20)

    def run(h2d):
        layout = replace(base, device=replace(H100, h2d_bytes_per_s=h2d))
        cfg = FleetConfig(1, layout, "token", SLO_7B, placement=PlacementConfig(**NO_SPLIT))
        return simulate(work, market, cfg, {"m": 1.0})

    fast, slow = run(50e9), run(1e9)
    assert fast.stats["num_preemptions"] > 0 and fast.stats["num_weight_swaps"] == 1
    end = lambda res: max(r.token_times[-1] for r in res.records)
    assert end(slow) > end(fast) * 1.05


def test_profiles_are_fitted_once_per_model_type_not_per_worker(workload, market):
    before = num_fits()
    other = Marketplace.build(workload.models, parse_mix(DEFAULT_MIX), "H100", DATA / "profiles")
    simulate(workload, other, fleet(16, other), demand_of(workload))
    assert num_fits() == before   # three types, fitted when `market` was built; 16 workers add none
    fit = fit_profile(DATA / "profiles" / "qwen2_5_7b" / "H100")
    assert fit.prefill_prompts_s([2048]) > 2 * fit.prefill_prompts_s([512])   # prefill grows with tokens
    assert fit.decode_s(32, 32 * 1000) > fit.decode_s(1, 1000)


def test_a_run_mixes_model_types_as_asked():
    types = assign_types([f"m{i}" for i in range(20)], parse_mix(DEFAULT_MIX))
    counts = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    assert counts == {"qwen2.5-7b": 12, "yi-9b": 4, "llama2-13b": 4}
    head = [types[f"m{i}"].name for i in range(5)]   # interleaved: the popular head gets the mix too
    assert len(set(head)) == 3


def test_a_layout_that_does_not_fit_the_device_is_refused_with_the_numbers():
    llama = MODEL_TYPES["llama2-13b"].weight_bytes
    with pytest.raises(ValueError, match=r"2 slots x 24\.24 GiB \+ KV 40\.00 GiB \+ reserve 7\.96 GiB "
                                         r"= 96\.45 GiB > 79\.65 GiB"):
        DeviceLayout.carve(H100, llama, 2, kv_bytes=40 << 30)
    with pytest.raises(ValueError, match="less than one"):
        DeviceLayout.carve(H100, llama, 3)   # three llama2-13b slots leave no KV
    assert DeviceLayout.carve(H100, llama, 2).kv_bytes > 15 << 30
    assert device_spec("h100", h2d_bytes_per_s=16e9).h2d_bytes_per_s == 16e9
    with pytest.raises(ValueError, match="unknown device 'B200'"):
        device_spec("B200")
