"""The short form of `tokenmux loadtest`: the whole harness end to end on tiny models.

Contenders run on real DeviceWorker actors one after another on the same trace; the
output JSON keeps the contract benchmarks read. Speed floors are never asserted here:
this proves the harness measures, not how fast anything is.
"""
from __future__ import annotations

import json

import pytest

from deploy.cli.main import build_parser
from load_tests.contenders import Deployment, make_contender
from load_tests.runner import rate_ratio, run
from load_tests.slo import StepTimes, default_slo
from load_tests.sweep import RunSettings, at_rate
from load_tests.workloads import FixedLengths, Gamma, Uniform, generate

CONTRACT_ROW = ("attainment_strict", "attainment_cumulative", "goodput_rps", "ttft_p50_s",
                "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "max_rate_at_90")
MAX_REQUESTS = 8


def test_contract_flags_parse_into_the_loadtest_command():
    args = build_parser().parse_args([
        "loadtest", "--trace", "t.csv", "--contenders", "token,request,dedicated,multiplexed",
        "--workers", "2", "--sweep", "rate", "--json", "o.json", "--plots", "d"])
    assert args.contenders == ["token", "request", "dedicated", "multiplexed"]
    assert (args.trace, args.workers, args.sweep, args.json_path, args.plots) == (
        "t.csv", 2, ["rate"], "o.json", "d")


def test_unknown_contender_is_refused_by_name():
    with pytest.raises(ValueError, match="vllm"):
        make_contender("vllm")
    args = build_parser().parse_args(["loadtest", "--contenders", "token,vllm"])
    with pytest.raises(ValueError, match="vllm"):
        run(args)


def test_every_model_has_one_worker_and_dedicated_leaves_the_rest_unserved():
    d = Deployment({f"m{i}": "/x" for i in range(5)}, num_workers=2, engine={"num_slots": 2})
    shared = d.assignment("token")
    assert shared == d.assignment("request") == {"m0": 0, "m1": 1, "m2": 0, "m3": 1, "m4": 0}
    assert d.assignment("dedicated") == {"m0": 0, "m1": 1}
    assert "3 of 5 models have no worker" in make_contender("dedicated").notes(d)[0]
    with pytest.raises(ValueError, match="policy"):
        Deployment({"m": "/x"}, 1, {"policy": "token"})


def test_time_scaling_keeps_the_same_requests_closer_together():
    w = generate(Gamma(1.0, 4.0), Uniform(), ["a", "b"], FixedLengths(4, 4), seed=3, num_requests=50)
    settings = RunSettings(max_requests=20)
    slow, fast = at_rate(w, 1.0, settings), at_rate(w, 4.0, settings)
    assert len(slow) == len(fast) == 20
    assert [r.model for r in slow] == [r.model for r in fast]
    assert fast.duration_s == pytest.approx(slow.duration_s / 4)
    assert (len(fast) - 1) / fast.duration_s == pytest.approx(4.0)


def test_default_slo_scales_with_the_measured_step_times():
    t = StepTimes("m", 128, 4, 1, prefill_s=0.1, decode_s=0.02, switch_s=0.05)
    slo = default_slo(t, tbt_factor=5, ttft_factor=10)
    assert (slo.tbt_s, slo.ttft_s) == (pytest.approx(0.1), pytest.approx(1.5))
    slower = default_slo(StepTimes("m", 128, 4, 1, prefill_s=0.2, decode_s=0.04, switch_s=0.1),
                         tbt_factor=5, ttft_factor=10)
    assert slower.tbt_s == pytest.approx(2 * slo.tbt_s) and slower.ttft_s == pytest.approx(2 * slo.ttft_s)


def test_rate_ratio_says_when_it_is_only_a_bound():
    rows = {"token": {"k": 8.0}, "request": {"k": 2.0}, "multiplexed": {"k": None}}
    assert rate_ratio(rows, "token", "request", "k", [1.0, 2.0, 8.0]) == (4.0, "lower bound: token met "
                                                                           "the threshold at every rate")
    assert rate_ratio(rows, "token", "request", "k", [1.0, 16.0])[1] == "measured"
    value, kind = rate_ratio(rows, "token", "multiplexed", "k", [1.0, 2.0, 16.0])
    assert value == 8.0 and kind.startswith("lower bound")
    assert rate_ratio(rows, "token", "dedicated", "k", [1.0])[0] is None


def test_side_by_side_run_writes_the_json_contract(ray_session, zoo_model, tmp_path):
    zoo_model("llama-tiny-a")
    out, plots = tmp_path / "out.json", tmp_path / "plots"
    args = build_parser().parse_args([
        "loadtest", "--contenders", "token,request,dedicated", "--workers", "1",
        "--models", "3", "--checkpoint", "llama-tiny-a", "--slots", "1", "--kv-mb", "16",
        "--popularity", "uniform", "--max-requests", str(MAX_REQUESTS), "--rate", "4",
        "--rates", "4,16", "--sweep", "rate", "--max-output", "12", "--max-input", "32",
        "--threads-per-worker", "1", "--request-timeout", "30",
        "--json", str(out), "--plots", str(plots)])
    assert run(args) == 0
    data = json.loads(out.read_text())

    slo = data["slo"]
    assert slo["ttft_s"] > 0 and slo["tbt_s"] > 0
    assert slo["tbt_s"] == pytest.approx(slo["tbt_factor"] * slo["derived_from"]["decode_s"], rel=1e-2, abs=1e-4)
    assert data["contenders"] == ["token", "request", "dedicated"]
    for name in data["contenders"]:
        row = data[name]
        assert set(CONTRACT_ROW) <= set(row)
        assert row["num_requests"] == MAX_REQUESTS
        for key in ("attainment_strict", "attainment_cumulative"):
            assert 0.0 <= row[key] <= 1.0
        assert row["attainment_strict"] <= row["attainment_cumulative"] + 1e-9
        assert row["goodput_rps"] >= 0
        assert set(row["sweep"]) == {"4.0", "16.0"}
        assert row["max_rate_at_90"] is None or 4.0 <= row["max_rate_at_90"] <= 16.0
    for name in ("token", "request"):  # light load, every model served: nothing fails
        row = data[name]
        assert row["num_errors"] == 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["tbt_p50_s"] <= row["tbt_p99_s"]
    # 3 models, 1 weight slot, uniform popularity: the token-level worker switches models
    assert data["token"]["switches_per_s_mean"] > 0
    # dedicated: one worker holds one model; the other two models' requests fail
    assert data["dedicated"]["num_errors"] > 0 and data["notes"]
    assert data["dedicated"]["attainment_strict"] < 1.0

    ratio, kind = data["token_vs_request_rate"], data["token_vs_request_rate_kind"]
    t, r = data["token"]["max_rate_at_90"], data["request"]["max_rate_at_90"]
    if t is not None and r is not None:
        assert ratio == pytest.approx(t / r) and kind
    assert data["token_vs_multiplexed_rate"] is None  # not run here
    for name in ("report.md", "attainment_vs_rate.png", "ttft_cdf.png", "tbt_cdf.png", "timeline_token.png"):
        assert (plots / name).stat().st_size > 0
    assert "TTFT" in (plots / "report.md").read_text()
