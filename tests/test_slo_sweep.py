"""The SLO sweep (`tokenmux loadtest --sweep slo`): each contender re-run at each SLO shape,
with that shape's SLO on the requests the engines get. Behaviour only, never speed."""
from __future__ import annotations

import json

import pytest

from deploy.cli.main import build_parser
from load_tests.records import read_records
from load_tests.slo_sweep import SHAPES, check_contenders, floors, shape_slos, slug
from scheduler.slo import SLO

CONTENDERS = ("token", "request", "multiplexed-1")


def test_shapes_derive_from_the_measured_slo():
    measured = SLO(0.06, 0.005)
    shapes = shape_slos(measured)
    assert list(shapes) == list(SHAPES) and shapes["measured"] == measured
    for ratio in (16, 100):
        shape = shapes[f"ttft:tpot={ratio}"]
        assert (shape.ttft_s, shape.tbt_s) == (pytest.approx(ratio * measured.tbt_s), measured.tbt_s)
    assert (shapes["x2"].ttft_s, shapes["x2"].tbt_s) == (pytest.approx(2 * measured.ttft_s),
                                                         pytest.approx(2 * measured.tbt_s))
    assert shapes["x0.5"].ttft_s == pytest.approx(measured.ttft_s / 2)
    with pytest.raises(ValueError, match="x3"):
        shape_slos(measured, ("x3",))
    assert len({slug(s) for s in SHAPES}) == len(SHAPES) and all(":" not in slug(s) for s in SHAPES)


def test_contenders_are_token_first_and_never_scored_fleets():
    assert check_contenders(("request", "token", "multiplexed-8")) == ("token", "request", "multiplexed-8")
    for bad in (("request",), ("token", "dedicated"), ("token", "token-no-cap"), ("token", "token")):
        with pytest.raises(ValueError):
            check_contenders(bad)


def test_floors_name_the_shape_they_hold_at():
    def ratio(value, lo):
        return {"value": value, "kind": "measured", "ci": [lo, value * 2]}

    shapes = {"measured": {"traces": {"bursty": {"token_vs_request_rate": ratio(2.5, 1.5),
                                                 "token_vs_multiplexed_rate": ratio(4.0, 3.2),
                                                 "token_never_below_request": True}}},
              "x2": {"traces": {"bursty": {"token_vs_request_rate": ratio(0.5, 0.2),
                                           "token_never_below_request": False}}}}
    rows = {(f["shape"], f["floor"]): f for f in floors(shapes)}
    assert rows[("measured", "token_vs_request_rate >= 2")]["met"]
    assert not rows[("measured", "token_vs_request_rate >= 2")]["met_beyond_ci"]
    assert rows[("measured", "token_vs_multiplexed_rate >= 3")]["met_beyond_ci"]
    assert not rows[("x2", "token_never_below_request")]["met"]
    assert ("x2", "token_vs_request_rate >= 2") not in rows   # the 2x floor is the measured SLO's


def test_sweep_runs_each_contender_at_the_shape_with_its_slo(ray_session, zoo_model, tmp_path, monkeypatch):
    zoo_model("llama-tiny-a")
    out = tmp_path / "sweep"
    args = build_parser().parse_args([
        "loadtest", "--sweep", "slo", "--quick", "--slo-shapes", "ttft:tpot=100",
        "--contenders", ",".join(CONTENDERS), "--seeds", "0", "--out", str(out), "--no-ttft-slack"])
    from load_tests.runner import run

    assert run(args) == 0
    base = json.loads((out / "measured-slo.json").read_text())
    data = json.loads((out / "ttft-tpot-100.json").read_text())
    assert data["slo"] == {"ttft_s": pytest.approx(100 * base["tbt_s"]), "tbt_s": base["tbt_s"]}
    assert data["slo"]["ttft_s"] != base["ttft_s"]   # not the measured SLO the engines got
    given = data["slo_given_to_engines"]
    assert given["token"] == given["request"] == data["slo"]   # on every request the engines got
    assert given["multiplexed-1"] is None   # the Serve peer takes no SLO
    records = read_records(out / data["records"])
    assert records.run["slo"] == data["slo"] and records.run["shape"] == "ttft:tpot=100"
    assert data["scheduler"] == records.run["scheduler"] == {"ttft_slack": False}   # the ablation flag
    for trace in ("bursty", "poisson"):
        row = data["traces"][trace]
        assert set(row["max_rate"]) == set(CONTENDERS) == set(row["rates"])
        for name in CONTENDERS:
            selected = records.select(name, trace)
            assert set(selected) == set(row["rates"][name]) and selected
            assert all(len(recs) == 4 for seeds in selected.values() for recs in seeds.values())
        assert isinstance(row["token_never_below_request"], bool)
        assert {"token_vs_request_rate", "token_vs_multiplexed_rate"} <= set(row)
        assert row["analysis"]["slo"] == data["slo"]
    summary = json.loads((out / "slo-sweep-summary.json").read_text())
    assert list(summary["shapes"]) == ["ttft:tpot=100"]
    assert any(f["floor"] == "token_vs_request_rate >= 1" for f in summary["floors"])
    assert "ttft:tpot=100" in (out / "slo-sweep-report.md").read_text()

    # the same folder again: the shape is there, so nothing is started, and the SLO is read back
    from load_tests.experiment import Session

    def no_start(self):
        raise AssertionError(f"{self.name} started for a shape already measured")

    monkeypatch.setattr(Session, "_start", no_start)
    assert run(args) == 0
    assert json.loads((out / "measured-slo.json").read_text()) == base
