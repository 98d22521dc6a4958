"""The mixed-load experiment of issue 44 (load_tests/experiments/tp_mix/run.py) at a tiny size:
a TP-2 model alone on 2 virtual devices and beside two single-device models, the same
arrivals of the TP model on both; every output equals generate(), and the mixed setup's
timelines show the group's steps on both devices between their own model's. (The figures
themselves are the benchmark's: docs/benchmarks.md.)"""
from __future__ import annotations

import pytest

from load_tests.experiments.tp_mix.run import Load, run


@pytest.mark.timeout(240)
def test_the_tp_mix_experiment_scores_both_setups_and_every_output_is_exact(ray_session):
    result = run(ray_session, [0, 1], Load(bursts=1, burst=2, single_burst=2, max_tokens=8), log=lambda _: None)
    assert result["all_outputs_exact"]
    assert [r["order"] for r in result["per_seed"]] == [["alone", "mixed"], ["mixed", "alone"]]
    for row in result["per_seed"]:
        assert row["alone"]["tp_requests"] == row["mixed"]["tp_requests"] == 2
        assert row["mixed"]["requests"] == 6 and 0 <= row["mixed"]["tbt_attainment"] <= 1
    assert result["tbt_slo_s"] == pytest.approx(5 * result["tp_decode_step_alone_s"])
    for device in ("leader", "member"):
        turns = result["mixed_timeline_turns"][device]
        assert turns["group_runs"] >= 1 and turns["own_runs"] >= 1, (device, turns)
    assert set(result["summary"]["tbt_attainment"]) == {"alone", "mixed", "alone_minus_mixed"}
