"""The device-count sweep's reading (load_tests/device_sweep.py): the fewest devices that hold
the threshold, said as a bound where the grid does not bracket it, and token / request with
a paired bootstrap over seeds."""
from __future__ import annotations

import pytest

from load_tests.device_sweep import device_ratio, fewest_devices, paired_device_ratio
from load_tests.stats import LOWER_BOUND, MEASURED, UNDEFINED, UPPER_BOUND


def test_the_fewest_devices_is_the_first_count_that_meets_the_threshold_bracketed_or_a_bound():
    assert fewest_devices({2: 0.5, 3: 0.85, 4: 0.93, 6: 0.99}, 0.9) == {"value": 4, "kind": MEASURED, "below": 3}
    # met at the smallest count tried: it needs at most that many
    assert fewest_devices({2: 0.95, 4: 1.0}, 0.9)["kind"] == UPPER_BOUND
    # never met: more than the largest tried
    assert fewest_devices({2: 0.1, 4: 0.6}, 0.9) == {"value": 4, "kind": LOWER_BOUND, "below": 4}


def test_a_device_ratio_carries_its_bounds():
    m = lambda v: {"value": v, "kind": MEASURED}   # noqa: E731
    assert device_ratio(m(3), m(6)) == {"value": 0.5, "kind": MEASURED}
    # token at most 2, request more than 6: token / request is at most 2/6
    assert device_ratio({"value": 2, "kind": UPPER_BOUND}, {"value": 6, "kind": LOWER_BOUND}) == \
        {"value": 2 / 6, "kind": UPPER_BOUND}
    assert device_ratio({"value": 6, "kind": LOWER_BOUND}, m(3))["kind"] == LOWER_BOUND
    assert device_ratio({"value": 6, "kind": LOWER_BOUND}, {"value": 6, "kind": LOWER_BOUND})["kind"] == UNDEFINED


def test_the_paired_ratio_uses_each_contenders_own_counts_and_keeps_the_per_seed_ratios():
    # token stopped at 3 devices (its mean met 0.9 there); request went on to 6
    token = {0: {2: 0.6, 3: 0.95}, 1: {2: 0.7, 3: 0.92}, 2: {2: 0.5, 3: 0.97}}
    request = {0: {2: 0.3, 3: 0.6, 4: 0.8, 6: 0.93}, 1: {2: 0.4, 3: 0.7, 4: 0.91, 6: 0.95},
               2: {2: 0.2, 3: 0.5, 4: 0.85, 6: 0.92}}
    r = paired_device_ratio(token, request, 0.9, reps=200)
    assert r["kind"] == MEASURED and r["value"] == 3 / 6
    assert r["per_seed"]["1"] == {"value": 3 / 4, "kind": MEASURED}
    assert r["lo"] <= 0.5 <= r["hi"] and r["censored_draws"] == 0
    # a seed on which token never met it where it ran: that seed's ratio is a lower bound
    token[2][3] = 0.8
    r = paired_device_ratio(token, request, 0.9, reps=200)
    assert r["per_seed"]["2"]["kind"] == LOWER_BOUND and r["censored_draws"] > 0


def test_the_sweep_serves_every_contender_on_paced_devices_and_stops_a_contender_once_it_holds(
        ray_session, zoo_model, tmp_path):
    """A light load both hold on one device: the sweep measures that count and no larger one,
    keeps each count's records, and writes the seed's workload as a trace `tokenmux plan`
    replays request for request."""
    import json

    from cluster.planner.traces import read_trace
    from deploy.cli.main import build_parser
    from load_tests.records import read_records
    from load_tests.runner import run

    zoo_model("llama-10m")
    out = tmp_path / "devices.json"
    args = build_parser().parse_args([
        "loadtest", "--sweep", "devices", "--device-counts", "1,2", "--contenders", "token,request",
        "--models", "3", "--slots", "2", "--arrival", "poisson", "--popularity", "uniform", "--lengths",
        "lognormal", "--max-input", "32", "--max-output", "8", "--rate", "0.5", "--seeds", "0",
        "--sustain-s", "3", "--sustain-requests", "1", "--warmup-s", "1", "--request-timeout", "20",
        "--device-slowdown", "2", "--slo-ttft", "10", "--slo-tbt", "1", "--json", str(out)])
    assert run(args) == 0
    data = json.loads(out.read_text())
    sweep = data["device_sweep"]
    assert sweep["device_counts"] == [1]   # both held on one device: two were never started
    assert {f["kind"] for f in sweep["fewest_devices"].values()} == {UPPER_BOUND}
    assert data["deployment"]["engine"]["device_slowdown"] == 2.0
    records = read_records(data["records"]["1"])
    offered = read_trace(data["workload_files"]["0"])
    for name in ("token", "request"):
        sent = records.select(name, data["trace"])[0.5][0]
        assert len(sent) == len(offered) and all(r.error is None for r in sent)
    with pytest.raises(ValueError, match="runs alone"):
        run(build_parser().parse_args(["loadtest", "--sweep", "devices,rate", "--rate", "1"]))
