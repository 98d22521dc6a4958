"""The capacity simulator: real scheduler policies on a virtual clock with GPU-profile costs."""
from __future__ import annotations

from pathlib import Path

import pytest

from load_tests.metrics import summarize
from load_tests.simulator import SimConfig, simulate, workers_needed
from load_tests.traces import read_trace
from scheduler.kv_blocks import KVShape
from scheduler.slo import SLO

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PROFILE = DATA / "profiles" / "qwen2_5_7b" / "H20"
TRACE = DATA / "traces" / "aegaeon-synth" / "synth-16-0.1-1.0-1.0.csv"
SLO_7B = SLO(ttft_s=10.0, tbt_s=0.1)


def _config(n: int, policy: str = "token") -> SimConfig:
    # Qwen2.5-7B in bf16 on an H20: 15.2 GB of weights, 28 layers x 4 KV heads x 128
    return SimConfig(num_workers=n, profile_dir=str(PROFILE), weight_bytes=15_200_000_000,
                     kv_shape=KVShape(28, 4, 128, 2), policy=policy)


@pytest.fixture(scope="module")
def workload():
    if not TRACE.exists():
        pytest.skip(f"shared data not found at {TRACE}")
    return read_trace(str(TRACE)).window(0, 120)


def test_every_request_is_served_with_ordered_token_times(workload):
    records, turns = simulate(workload, _config(4), SLO_7B)
    assert len(records) == len(workload)
    for r in records:
        assert r.ok and r.num_output_tokens > 0
        assert r.token_times == sorted(r.token_times) and r.token_times[0] >= r.arrival
    assert {t.worker for t in turns} == {"w0", "w1", "w2", "w3"}


def test_token_level_keeps_more_service_time_in_slo_than_request_level_under_load(workload):
    token = summarize(simulate(workload, _config(2, "token"), SLO_7B)[0], SLO_7B)
    request = summarize(simulate(workload, _config(2, "request"), SLO_7B)[0], SLO_7B)
    assert token["attainment_cumulative"] > request["attainment_cumulative"]


def test_more_workers_never_hurt_and_capacity_search_finds_the_knee(workload):
    attainments = [summarize(simulate(workload, _config(n), SLO_7B)[0], SLO_7B)["attainment_strict"]
                   for n in (2, 4, 8)]
    assert attainments == sorted(attainments)
    needed = workers_needed(workload, _config(1), SLO_7B, target=0.9, max_workers=16)
    assert needed is not None and 2 <= needed <= 16
    assert summarize(simulate(workload, _config(needed), SLO_7B)[0], SLO_7B)["attainment_strict"] >= 0.9


def test_dedicated_serves_only_models_that_have_a_device(workload):
    records, _ = simulate(workload, _config(4, "dedicated"), SLO_7B)
    served = {r.model for r in records if r.ok}
    failed = {r.model for r in records if not r.ok}
    assert len(served) <= 4 and failed and all("no dedicated device" in r.error for r in records if not r.ok)
