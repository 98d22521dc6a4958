"""`tokenmux plan` against a real run: the same trace through the simulator and through
`tokenmux loadtest` (real DeviceWorkers on this machine) agree within 10 points of attainment.

The device cost is this machine, measured in the same test by `tokenmux profile` (one
worker's share of the cores), and the SLO is the one the load test derives from the step
times it measures, so both sides judge by the same clock on the same machine. One worker,
three copies of a small zoo model, two weight slots: token-level switches models,
request-level makes the other models wait, dedicated gives each model a device of its
own (the load test scores dedicated on the fleet it needs; the plan is asked for that many). The load is moderate on purpose: this shared machine's speed drifts by up to 2x
between a profile and a run when other jobs start, and at a load near saturation that
alone moves attainment by more than 10 points (measured: the same real run gave 0.83 and
1.00). Bounded: 32 requests over ~30 s of trace per contender, whose idle stretches the
driver skips.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.planner import plan_cli
from deploy.cli.main import build_parser
from load_tests import profiler, runner

MODEL = "llama-10m"
NUM_REQUESTS = 32
POLICIES = ("token", "request", "dedicated")


def write_trace(path, rate: float, n: int, num_models: int, seed: int = 0) -> str:
    """An Aegaeon-format trace: Poisson arrivals, short prompts and outputs for a small model."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, n))
    lines = ["Request Time,Model Name,Input Length,Output Length"]
    for t in times:
        minutes, seconds = divmod(float(t), 60)
        lines.append(f"00:{int(minutes):02d}:{seconds:06.3f},m{rng.integers(num_models)},"
                     f"{rng.integers(16, 96)},{rng.integers(16, 80)}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
def test_plan_and_loadtest_of_the_same_trace_agree_within_ten_points(ray_session, zoo_model, tmp_path):
    checkpoint = zoo_model(MODEL)
    parser = build_parser()
    profile_dir = tmp_path / "profile"
    assert profiler.run(parser.parse_args([
        "profile", "--model", str(checkpoint), "--out", str(profile_dir), "--threads", "1",
        "--inputs", "16,32,64,128", "--batches", "1,2,4,8", "--repeats", "2"])) == 0
    trace = write_trace(tmp_path / "trace.csv", rate=1.0, n=NUM_REQUESTS, num_models=3)

    measured = tmp_path / "loadtest.json"
    assert runner.run(parser.parse_args([
        "loadtest", "--trace", trace, "--contenders", ",".join(POLICIES), "--workers", "1", "--models", "3",
        "--checkpoint", MODEL, "--slots", "2", "--kv-mb", "64", "--threads-per-worker", "1",
        "--burst", "--max-requests", str(NUM_REQUESTS), "--request-timeout", "60", "--seeds", "0",
        "--idle-skip", "0.5", "--settle", "0.2",   # the trace's idle stretches (most of its ~30 s) pass at once; its busy ones do not
        "--json", str(measured)])) == 0
    real = json.loads(measured.read_text())

    real = {p: real["contenders"][p] for p in POLICIES} | {"slo": real["slo"]}
    dedicated_devices = real["dedicated"]["devices"]
    assert dedicated_devices == 3   # one per model

    def plan(policies: str, gpus: int) -> dict:
        planned = tmp_path / f"plan-{policies}.json"
        assert plan_cli.run(parser.parse_args([
            "plan", "--trace", trace, "--gpu", str(profile_dir / "device.json"), "--model-mix", str(profile_dir),
            "--slots", "2", "--kv-gb", str(64 / 1024), "--reserve-frac", "0", "--slab-mb", "4",
            "--host-kv-gb", str(128 / 1024), "--slo-ttft", str(real["slo"]["ttft_s"]),
            "--slo-tpot", str(real["slo"]["tbt_s"]), "--policies", policies, "--gpus", str(gpus),
            "--quota-max", "4", "--no-progress", "--json", str(planned)])) == 0
        return json.loads(planned.read_text())

    sims = {"token": plan("token,request", 1), "dedicated": plan("dedicated", dedicated_devices)}
    sims["request"] = sims["token"]

    compared = {policy: {"plan": sims[policy]["policies"][policy]["attainment"],
                         "loadtest": real[policy]["at_reference_rate"]["attainment_strict"]} for policy in POLICIES}
    print("plan vs loadtest, strict attainment:", json.dumps({"slo": real["slo"], "policies": compared}))
    for policy in POLICIES:
        sim = sims[policy]
        assert real[policy]["at_reference_rate"]["num_requests"] == NUM_REQUESTS == sim["workload"]["num_requests"]
        got, want = compared[policy]["plan"], compared[policy]["loadtest"]
        assert abs(got - want) <= 0.10, (policy, {"plan": got, "loadtest": want, "slo": real["slo"]})
