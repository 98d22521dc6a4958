"""`tokenmux plan`: the GPU-count search, its JSON, table and plot, and bad input refused."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.planner.marketplace import MODEL_TYPES, Marketplace
from cluster.planner.plan_cli import build_spec
from cluster.planner.planner import Point, search
from deploy.cli.main import build_parser, main

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not (DATA / "profiles").is_dir(), reason="shared profiles not found")


def _curve(values: dict[int, float], calls: list[int]):
    def evaluate(spec, policy, n, stop_early=True):
        calls.append(n)
        return Point(n, values.get(n, 1.0), {}, 0.0)
    return evaluate


class _Spec:   # search only reads these
    target = 0.9
    market = Marketplace({f"m{i}": MODEL_TYPES["qwen2.5-7b"] for i in range(3)}, {})   # no fits: never simulated


@pytest.mark.parametrize("curve, expected", [
    ({1: 0.1, 2: 0.5, 3: 0.8, 4: 0.95}, 4),                        # monotone: the knee
    ({1: 0.1, 2: 0.5, 3: 0.95, 4: 0.7, 5: 0.8, 6: 0.92}, 6),       # 3 is a lucky dip: 4 fails again
    ({1: 0.1, 2: 0.95, 3: 0.91, 4: 0.5, 5: 0.6, 6: 0.7, 7: 0.8, 8: 0.95}, 2),  # bisection lands on 8; 2 is found below
])
def test_search_verifies_neighbours_because_the_curve_need_not_be_monotone(curve, expected):
    calls: list[int] = []
    plan = search(_Spec(), "token", 16, evaluate_fn=_curve(curve, calls))
    assert plan.gpus == expected
    assert plan.points[expected].attainment >= 0.9 and plan.points[expected + 1].attainment >= 0.9
    assert len(calls) == len(set(calls)) and len(calls) <= 10   # each count simulated once


def test_search_answers_none_when_no_count_reaches_the_target_and_dedicated_starts_at_one_per_model():
    calls: list[int] = []
    assert search(_Spec(), "token", 5, evaluate_fn=_curve({n: 0.5 for n in range(1, 6)}, calls)).gpus is None
    assert max(calls) == 5
    calls.clear()
    plan = search(_Spec(), "dedicated", 8, evaluate_fn=_curve({}, calls))
    assert plan.gpus == 3 and min(calls) == 3
    assert search(_Spec(), "dedicated", 2, evaluate_fn=_curve({}, [])).gpus is None


def test_scan_evaluates_every_count_up_to_a_stable_answer():
    calls: list[int] = []
    plan = search(_Spec(), "token", 10, mode="scan", evaluate_fn=_curve({1: 0.2, 2: 0.95, 3: 0.4, 4: 0.9}, calls))
    assert plan.gpus == 4 and calls == [1, 2, 3, 4, 5]


def test_plan_writes_the_json_table_and_plot_for_a_long_tail_marketplace(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--models", "24", "--popularity", "longtail", "--rate", "2", "--duration", "60",
              "--max-gpus", "30", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert ended.value.code == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"token", "request", "dedicated"}
    for name, row in data["policies"].items():
        assert isinstance(row["gpus"], int) and 0 < row["attainment"] <= 1
        assert row["attainment"] >= data["target"] and row["curve"][str(row["gpus"])] == row["attainment"]
    assert data["policies"]["dedicated"]["gpus"] >= 24   # every model a device
    assert data["policies"]["token"]["gpus"] <= data["policies"]["request"]["gpus"] < 24
    assert data["savings_vs_dedicated"]["token"] == pytest.approx(
        1 - data["policies"]["token"]["gpus"] / data["policies"]["dedicated"]["gpus"])
    table = capsys.readouterr().out
    assert "token" in table and "vs dedicated" in table
    assert png.stat().st_size > 0


def test_no_count_up_to_max_gpus_gives_null_gpus(tmp_path):
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit):
        main(["plan", "--models", "8", "--popularity", "uniform", "--rate", "8", "--duration", "30",
              "--max-gpus", "1", "--policies", "token,dedicated", "--json", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert data["policies"]["token"]["gpus"] is None and 0 <= data["policies"]["token"]["attainment"] < 0.9
    assert data["policies"]["dedicated"] == {**data["policies"]["dedicated"], "gpus": None, "attainment": None}


def test_dedicated_gets_a_device_per_model_beyond_64_models_without_max_gpus(tmp_path):
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--models", "70", "--popularity", "longtail", "--rate", "0.5", "--duration", "20",
              "--policies", "token,dedicated", "--json", str(out), "--no-progress"])
    assert ended.value.code == 0
    data = json.loads(out.read_text())
    assert data["max_gpus"] == 71 and data["policies"]["dedicated"]["gpus"] == 70
    assert data["savings_vs_dedicated"]["token"] >= 0.8


@pytest.mark.parametrize("flags, message", [
    (["--slots", "3"], "layout leaves"),
    (["--kv-gb", "40"], "layout does not fit the H100: 2 slots x 24.24 GiB"),
    (["--gpu", "B200"], "unknown device 'B200'"),
    (["--model-mix", "gpt-5:1"], "unknown model type 'gpt-5'"),
    (["--gpu", "A10", "--model-mix", "yi-9b"], "no A10 profile of yi-9b"),
    (["--policies", "token,vllm"], "--policies takes token,request,dedicated"),
])
def test_bad_input_is_refused_with_a_clear_message(flags, message, capsys):
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--models", "4", "--rate", "1", "--duration", "10", "--no-progress", *flags])
    assert ended.value.code == 2
    assert message in capsys.readouterr().err


def test_the_spec_follows_the_flags():
    args = build_parser().parse_args(["plan", "--trace", str(DATA / "traces" / "aegaeon-synth" /
                                                             "synth-16-0.5-1.0-1.0.csv"), "--h2d-gbps", "16"])
    spec, about = build_spec(args)
    assert about["num_models"] == 16 and about["type_counts"] == {"qwen2.5-7b": 10, "yi-9b": 3, "llama2-13b": 3}
    assert spec.layout.device.h2d_bytes_per_s == 16e9 and spec.slo.ttft_s == 10.0 and spec.slo.tbt_s == 0.1
    mean_weight = sum(t.weight_bytes for t in spec.market.types.values()) / 16
    # Aegaeon's Q_max = 4 s for a 14 GB swap at 16 GB/s, scaled to this mix's mean swap at 16 GB/s
    assert spec.scheduler.quota_max_s == pytest.approx(4.0 * (mean_weight / 16e9) / (14 / 16), abs=1e-3)
    assert spec.placement.quota_max_s == spec.scheduler.quota_max_s   # packing prices the same rule
    # the simulated policies plan by the deadlines the plan scores (scheduler/deadlines.py)
    assert spec.fleet("token", 2).scheduler.slo_measure == "per_token"   # strict, the default
    assert replace(spec, metric="cumulative").fleet("token", 2).scheduler.slo_measure == "per_token"
    assert replace(spec, metric="goodput").fleet("token", 2).scheduler.slo_measure == "mean_tpot"


def test_a_moe_type_steps_by_its_active_parameters_and_swaps_all_its_weights():
    """Qwen3-30B-A3B beside the measured Qwen2.5-7B on an H100: a decode step costs less (3.3B
    parameters read against 7.6B) while a switch copies four times the bytes (every expert)."""
    from cluster.planner.marketplace import MODEL_TYPES, Marketplace, parse_mix

    market = Marketplace.build(["moe", "dense"], parse_mix("qwen3-30b-a3b:1,qwen2.5-7b:1"), "H100")
    assert market.types["moe"].name == "qwen3-30b-a3b"
    moe, dense = market.fits["moe"], market.fits["dense"]
    assert "scaled" in moe.source   # derived from the dense profile, and says so
    for batch in (1, 4):   # small batches: the weights read dominate
        assert moe.decode_s(batch, batch * 512) < dense.decode_s(batch, batch * 512)
    # the attention term follows the KV per token, which is larger (48 layers against 28)
    assert moe.decode_coef[2] / dense.decode_coef[2] == pytest.approx(48 / 28)
    assert moe.prefill_prompts_s([1024]) < dense.prefill_prompts_s([1024])
    moe_type, dense_type = MODEL_TYPES["qwen3-30b-a3b"], MODEL_TYPES["qwen2.5-7b"]
    assert moe_type.weight_bytes > 3 * dense_type.weight_bytes > 3 * moe_type.step_bytes
    assert market.largest_weight_bytes() == moe_type.weight_bytes   # slots are sized for every expert
