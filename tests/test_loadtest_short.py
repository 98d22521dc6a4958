"""The short form of `tokenmux loadtest`: the whole harness end to end on tiny models.

Contenders run on real DeviceWorker actors one after another on the same trace; the
output JSON keeps the contract benchmarks read. Speed floors are never asserted here:
this proves the harness measures, not how fast anything is.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.planner.workloads import FixedLengths, Gamma, Uniform, generate
from deploy.cli.main import build_parser
from load_tests.contenders import Deployment, make_contender
from load_tests.runner import run, scheduler_overrides
from load_tests.slo import StepTimes, default_slo
from load_tests.sweep import RunSettings, at_rate

CONTRACT_ROW = ("attainment_goodput", "attainment_strict", "attainment_cumulative", "goodput_rps",
                "strict_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "tbt_p50_s", "tbt_p99_s")
MAX_REQUESTS = 8


def test_contract_flags_parse_into_the_loadtest_command():
    args = build_parser().parse_args([
        "loadtest", "--trace", "t.csv", "--contenders", "token,request,dedicated,multiplexed",
        "--workers", "2", "--sweep", "rate", "--json", "o.json", "--plots", "d"])
    assert args.contenders == ["token", "request", "dedicated", "multiplexed"]
    assert (args.trace, args.workers, args.sweep, args.json_path, args.plots) == (
        "t.csv", 2, ["rate"], "o.json", "d")
    assert args.sweep_metric == "goodput" and args.seeds == [0, 1, 2, 3, 4]
    assert (args.sustain_s, args.sustain_requests, args.burst, args.via) == (60.0, 300, False, "engine")
    args = build_parser().parse_args(["loadtest", "--sweep-metric", "cumulative", "--no-quota-cap",
                                      "--no-overload-control", "--published", "--quick"])
    assert args.sweep_metric == "cumulative" and args.published and args.quick
    assert scheduler_overrides(args) == {"quota_switch_factor": None, "overload_control": False}
    assert scheduler_overrides(build_parser().parse_args(["loadtest", "--no-ttft-slack"])) == {"ttft_slack": False}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["loadtest", "--sweep-metric", "median"])


def test_ablation_and_peer_contenders_by_name():
    assert make_contender("token-no-overload").scheduler == {"overload_control": False}
    assert make_contender("token-no-cap").scheduler == {"quota_switch_factor": None}
    assert make_contender("token", {"overload_control": False}).scheduler == {"overload_control": False}
    assert make_contender("request", {"overload_control": False}).scheduler == {}
    assert [make_contender(f"multiplexed-{n}").max_ongoing_requests for n in (1, 2, 8)] == [1, 2, 8]


def test_unknown_contender_is_refused_by_name():
    with pytest.raises(ValueError, match="vllm"):
        make_contender("vllm")
    args = build_parser().parse_args(["loadtest", "--contenders", "token,vllm"])
    with pytest.raises(ValueError, match="vllm"):
        run(args)


def test_every_model_has_one_worker_and_dedicated_gets_a_device_per_model():
    d = Deployment({f"m{i}": "/x" for i in range(5)}, num_workers=2, engine={"num_slots": 2})
    shared = d.assignment("token")
    assert shared == d.assignment("request") == {"m0": 0, "m1": 1, "m2": 0, "m3": 1, "m4": 0}
    assert d.assignment("dedicated") == {f"m{i}": i for i in range(5)}
    assert d.devices("dedicated") == 5 and d.devices("token") == 2
    assert "5 devices (one per model)" in make_contender("dedicated").notes(d)[0]
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


def test_the_wait_for_a_quiet_machine_is_bounded_by_the_environment(monkeypatch):
    from load_tests.slo import QUIET_WAIT_ENV, wait_for_quiet

    monkeypatch.setenv(QUIET_WAIT_ENV, "0")
    start = time.monotonic()
    assert wait_for_quiet(busy_cores=-1, window_s=0.05) >= 0   # never quiet enough: returns at the bound
    assert time.monotonic() - start < 5


def test_short_preset_grid_doubles_until_token_misses_and_no_further():
    from load_tests.published import Preset, grid_until_miss

    measured = []

    def point(capacity):   # attainment 1 up to `capacity` req/s, then 0.5
        return lambda r: measured.append(r) or (1.0 if r <= capacity else 0.5)

    assert grid_until_miss(point(30), (0.1, 0.2), 10.0, 0.9, 6.4) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert measured == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]   # each rate once; stops at the first miss
    measured.clear()
    assert grid_until_miss(point(1e9), (0.1, 0.2), 10.0, 0.9, 1.6) == [1.0, 2.0, 4.0, 8.0, 16.0]  # the cap
    assert grid_until_miss(point(1.5), (0.1, 0.2), 10.0, 0.9, 6.4) == [1.0, 2.0]   # missed inside the grid
    assert grid_until_miss(point(1e9), (0.1, 0.2), 10.0, 0.9, None) == [1.0, 2.0]  # no extension asked
    short = Preset.short()
    assert len(short.seeds) >= 3 and short.metric == "goodput" and short.threshold == 0.9
    for trace, top in short.extend_until_miss.items():   # past mu, where every contender must miss
        assert top > 1.0 > short.fixed_fractions[trace][-1]


def test_side_by_side_run_writes_the_json_contract_and_records_that_rescore(ray_session, zoo_model, tmp_path):
    zoo_model("llama-tiny-a")
    out, plots = tmp_path / "out.json", tmp_path / "plots"
    args = build_parser().parse_args([
        "loadtest", "--contenders", "token,request,dedicated", "--workers", "1",
        "--models", "3", "--checkpoint", "llama-tiny-a", "--slots", "1", "--kv-mb", "16",
        "--popularity", "uniform", "--max-requests", str(MAX_REQUESTS), "--rate", "4",
        "--rates", "4,16", "--sweep", "rate", "--max-output", "12", "--max-input", "32",
        "--threads-per-worker", "1", "--request-timeout", "30", "--seeds", "0,1",
        "--settle", "0.2",   # a short pause between points: the figures are not what this checks
        "--sustain-s", "1.5", "--sustain-requests", "4", "--warmup-s", "0.5",   # sustained, tiny
        "--json", str(out), "--plots", str(plots)])
    assert args.sweep_metric == "goodput"
    assert run(args) == 0
    data = json.loads(out.read_text())

    slo = data["slo"]
    assert slo["ttft_s"] > 0 and slo["tbt_s"] > 0
    assert slo["tbt_s"] == pytest.approx(slo["tbt_factor"] * slo["derived_from"]["decode_s"], rel=1e-2, abs=1e-4)
    rounds = slo["derived_from"]["decode_rounds_s"]   # the step is measured in rounds; their spread is reported
    assert len(rounds) == 5 and min(rounds) <= slo["derived_from"]["decode_s"] <= max(rounds)
    assert slo["decode_spread"] == pytest.approx(max(rounds) / min(rounds))
    assert list(data["contenders"]) == ["token", "request", "dedicated"]
    assert data["measure"] == "goodput" and data["seeds"] == [0, 1]
    # the same arrivals per seed for every contender, the order alternating between seeds
    assert data["order"] == [{"seed": 0, "contenders": ["token", "request", "dedicated"]},
                             {"seed": 1, "contenders": ["dedicated", "request", "token"]}]
    assert data["sustain"] == {"sustain_s": 1.5, "sustain_requests": 4, "warmup_s": 0.5}
    assert data["provenance"]["revision"] and "cpu_model" in data["provenance"]["machine"]
    assert data["regime"]["tbt_slack"] > 0 and data["regime"]["favours"] in ("token", "request", "neither")
    counts = {}
    for name, row in data["contenders"].items():
        assert set(row["points"]) == {"4.0", "16.0"}
        for rate, point in row["points"].items():
            assert point["num_seeds"] == 2 and isinstance(point["held"], bool)
            counts.setdefault(rate, set()).add(point["num_requests"])
            for m in ("goodput", "strict", "cumulative"):
                assert point[m]["lo"] <= point[m]["mean"] <= point[m]["hi"] and 0 <= point[m]["mean"] <= 1
            assert point["strict"]["mean"] <= point["cumulative"]["mean"] + 1e-9
        for m in ("goodput", "strict", "cumulative"):
            est = row["max_rate_at_90"][m]
            assert est["kind"] in ("measured", "lower bound", "upper bound")
            assert est["value"] is None or 4.0 <= est["value"] <= 16.0
        ref = row["at_reference_rate"]
        assert ref["rate"] == 4.0 and set(CONTRACT_ROW) <= set(ref)
    assert all(len(c) == 1 for c in counts.values())   # every contender scored on the same requests
    assert data["contenders"]["dedicated"]["devices"] == 3   # one per model, never failing the others
    for name in ("token", "request", "dedicated"):  # light load, every model served: nothing fails
        ref = data["contenders"][name]["at_reference_rate"]
        assert ref["num_errors"] == 0
        # tokens reach the client in frames, so many gaps are 0: per-gap TBT is a diagnostic
        assert 0 < ref["ttft_p50_s"] <= ref["ttft_p99_s"] and 0 <= ref["tbt_p50_s"] <= ref["tbt_p99_s"]
        assert 0 < ref["tpot_p50_s"] <= ref["tpot_p99_s"]
    for key in ("token_vs_request_rate", "token_vs_dedicated_rate", "token_vs_request_rate_strict",
                "token_vs_request_rate_cumulative"):
        assert key in data and f"{key}_kind" in data and f"{key}_ci" in data
    assert isinstance(data["token_never_below_request"], bool)
    assert "token_vs_multiplexed_rate" not in data  # not run here
    for name in ("report.md", "attainment_vs_rate.png", "latency-ttft-cdf.png", "latency-tbt-cdf.png"):
        assert (plots / name).stat().st_size > 0
    assert "goodput" in (plots / "report.md").read_text()

    # the records beside the JSON re-score the run without re-running it
    records = Path(data["records"])
    assert records.is_file() and records.name.endswith(".records.jsonl.gz")
    again = tmp_path / "again.json"
    rescore = build_parser().parse_args(["loadtest", "--rescore", str(records), "--json", str(again)])
    assert run(rescore) == 0
    trace = json.loads(again.read_text())["traces"][data["trace"]]
    for rate, point in data["contenders"]["token"]["points"].items():   # records keep times to 1 us
        again_point = trace["contenders"]["token"]["points"][rate]
        for m in ("goodput", "strict", "cumulative"):
            assert again_point[m]["mean"] == pytest.approx(point[m]["mean"], abs=1e-3)
        assert again_point["ttft_p99_s"] == pytest.approx(point["ttft_p99_s"], abs=1e-5)
    looser = tmp_path / "looser.json"
    run(build_parser().parse_args(["loadtest", "--rescore", str(records), "--slo-tbt", "10", "--slo-ttft", "10",
                                   "--json", str(looser)]))
    loose = json.loads(looser.read_text())["traces"][data["trace"]]["contenders"]["request"]["points"]["16.0"]
    assert loose["goodput"]["mean"] >= data["contenders"]["request"]["points"]["16.0"]["goodput"]["mean"]


def test_published_quick_run_writes_every_file_and_resumes_from_its_records(ray_session, zoo_model, tmp_path,
                                                                          monkeypatch):
    from load_tests.published import run_published

    zoo_model("llama-tiny-a")
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- loadtest-published:begin -->\n<!-- loadtest-published:end -->\n")
    summary = run_published(tmp_path / "results", quick=True, readme=readme)
    out = tmp_path / "results"
    for trace in ("bursty", "poisson"):
        data = json.loads((out / f"loadtest-{trace}.json").read_text())
        for key in ("token_vs_request_rate", "token_vs_multiplexed_rate", "token_vs_request_rate_strict",
                    "token_vs_multiplexed_rate_cumulative", "token_never_below_request"):
            assert key in data, key
            if not key.startswith("token_never"):
                assert f"{key}_kind" in data
        assert data["best_multiplexed"] == "multiplexed-1"
        assert data["contenders"]["dedicated"]["devices"] == 3
        assert set(data["slo_sensitivity"]["rows"]) >= {"measured", "ttft:tpot=16", "ttft:tpot=100", "x2"}
        assert (out / f"loadtest-{trace}-attainment.png").stat().st_size > 0
    assert "token-no-overload" in json.loads((out / "loadtest-bursty.json").read_text())["contenders"]
    models = json.loads((out / "loadtest-models.json").read_text())
    assert "max_models_per_worker_at_90" in models and models["rate_per_model"] == 0.1
    assert "max_models_per_worker_at_90" in summary
    assert (out / "loadtest-records.jsonl.gz").stat().st_size > 0
    assert "token_vs_request_rate" in readme.read_text()
    # --resume: the records' SLO and points are kept; nothing is measured or even started again
    from load_tests.experiment import Session
    from load_tests.published import Preset
    from load_tests.records import read_records

    before = read_records(out / "loadtest-records.jsonl.gz")

    def no_start(self):
        raise AssertionError(f"{self.name} started on resume with every point recorded")

    monkeypatch.setattr(Session, "_start", no_start)
    again = run_published(out, quick=True, readme=None, sweep_models=False, resume=True)
    after = read_records(out / "loadtest-records.jsonl.gz")
    assert after.run["slo"] == before.run["slo"] and after.points.keys() == before.points.keys()
    assert after.run["resumed"] == 1 and again["meta"]["elapsed_s"] >= summary["meta"]["elapsed_s"]
    assert again["traces"]["bursty"]["token_vs_request_rate"] == summary["traces"]["bursty"]["token_vs_request_rate"]
    with pytest.raises(ValueError, match="max_requests"):
        run_published(out, preset=replace(Preset.quick(), max_requests=9), readme=None, resume=True)


def test_via_http_drives_token_and_request_through_the_serve_app(ray_session, zoo_model, tmp_path):
    """--via http: each policy brought up as the Serve app (HTTP edge, router, workers) and
    driven over HTTP by the client `--url` uses; nothing is left deployed after."""
    from ray import serve

    zoo_model("llama-tiny-a")
    out = tmp_path / "http.json"
    args = build_parser().parse_args([
        "loadtest", "--via", "http", "--contenders", "token,request", "--workers", "1", "--models", "2",
        "--checkpoint", "llama-tiny-a", "--slots", "1", "--kv-mb", "16", "--popularity", "uniform",
        "--rates", "2", "--rate", "2", "--sweep", "rate", "--max-output", "8", "--max-input", "32",
        "--threads-per-worker", "1", "--request-timeout", "30", "--seeds", "0", "--settle", "0.2",
        "--sustain-s", "1.5", "--sustain-requests", "3", "--warmup-s", "0.5", "--json", str(out)])
    assert run(args) == 0
    data = json.loads(out.read_text())
    assert data["deployment"]["via"] == "http"
    assert all("Serve app" in data["descriptions"][n] for n in ("token", "request"))
    from load_tests.records import read_records

    records = read_records(data["records"])
    for name in ("token", "request"):
        recs = [r for k, v in records.points.items() if k.contender == name for r in v]
        assert recs and sum(r.ok for r in recs) >= len(recs) // 2, [r.error for r in recs if not r.ok]
        assert all(len(r.token_times) <= 8 for r in recs)
    assert not [a for a in serve.status().applications if a.startswith("loadtest-")]
    with pytest.raises(ValueError, match="token and request"):
        run(build_parser().parse_args(["loadtest", "--via", "http", "--contenders", "token,dedicated"]))
