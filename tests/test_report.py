"""Reports and re-scoring: records written and read back, analysis with CIs, JSON, Markdown, PNGs."""
import json

import pytest

from cluster.planner.metrics import RequestRecord, Turn, summarize
from load_tests.analysis import analyze_trace, slo_sensitivity, slo_variants
from load_tests.records import PointKey, RecordSet, read_records, write_records
from load_tests.report import (README_BEGIN, README_END, build_report, plot_attainment_bands, plot_cdfs,
                               published_markdown, to_markdown, update_readme, write_report)
from scheduler.slo import SLO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLO_1 = SLO(ttft_s=1.0, tbt_s=0.2)


def _records(ttft, tbt, n=20, model="m"):
    return [RequestRecord(str(i), model, float(i), None,
                          [i + ttft + k * tbt for k in range(5)], end=i + ttft + 4 * tbt)
            for i in range(n)]


def _inputs():
    records = {"tokenmux": _records(0.5, 0.1), "request-level": _records(2.0, 0.1)}
    summaries = {n: summarize(rs, SLO_1) for n, rs in records.items()}
    turns = {"tokenmux": [Turn("w0", "a", 0, 1), Turn("w0", "b", 1, 2), Turn("w1", "b", 0, 2)]}
    return summaries, records, turns


def test_build_report_columns():
    summaries, _, _ = _inputs()
    report = build_report(summaries)
    tm, rl = report["tokenmux"], report["request-level"]
    assert tm["attainment_goodput"] == tm["attainment_strict"] == 1.0 and rl["attainment_strict"] == 0.0
    for key in ("attainment_cumulative", "goodput_rps", "strict_rps", "ttft_p50_s", "ttft_p99_s",
                "tpot_p99_s", "tbt_p50_s", "tbt_p99_s"):
        assert key in tm
    assert tm["ttft_p50_s"] == pytest.approx(0.5)
    md = to_markdown(report, "demo")
    assert md.splitlines()[2].startswith("| contender | attainment_goodput")
    assert "| tokenmux | 1 |" in md


def test_write_report_files(tmp_path):
    summaries, records, turns = _inputs()
    files = write_report(tmp_path / "out", summaries, records=records, turns=turns)
    assert set(files) == {"json", "markdown", "ttft_cdf", "tbt_cdf", "timeline_tokenmux"}
    assert json.loads(files["json"].read_text())["tokenmux"]["attainment_strict"] == 1.0
    for key in ("ttft_cdf", "tbt_cdf", "timeline_tokenmux"):
        blob = files[key].read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5_000, key


# -- records -> analysis -------------------------------------------------------------------


def _point(ttft, tbt, n=10, fail=0):
    recs = _records(ttft, tbt, n)
    for r in recs[:fail]:
        r.error = "timeout"
    return recs


def _record_set():
    """token meets the SLO up to 4 req/s and degrades at 8; request only at 1 req/s; the
    Serve peer never. Three seeds per point, slightly different."""
    rs = RecordSet(run={"slo": {"ttft_s": 1.0, "tbt_s": 0.2}})
    plan = {"token": {1.0: 0, 2.0: 0, 4.0: 0, 8.0: 6}, "request": {1.0: 0, 2.0: 4, 4.0: 7, 8.0: 9},
            "multiplexed-1": {1.0: 8}, "multiplexed-8": {1.0: 6}}
    for contender, points in plan.items():
        for rate, fail in points.items():
            for seed in range(3):
                rs.add(PointKey(contender, "bursty", rate, seed), _point(0.5, 0.1, fail=min(10, fail + seed % 2)))
    return rs


def test_records_round_trip_and_rescore_without_rerunning(tmp_path):
    rs = _record_set()
    path = write_records(tmp_path / "r.jsonl.gz", rs)
    back = read_records(path)
    assert back.run == rs.run and set(back.points) == set(rs.points)
    key = PointKey("token", "bursty", 8.0, 1)
    assert [r.token_times for r in back.points[key]] == [r.token_times for r in rs.points[key]]
    assert analyze_trace(back, "bursty", SLO_1) == analyze_trace(rs, "bursty", SLO_1)
    # a tighter SLO judges the same records harder: nothing meets a 0.05 s TBT
    tight = analyze_trace(back, "bursty", SLO(1.0, 0.05))
    assert tight["contenders"]["token"]["points"]["1.0"]["goodput"]["mean"] == 0.0
    (tmp_path / "bad.jsonl").write_text('{"kind": "run"}\n{"kind": "request", "contender": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_records(tmp_path / "bad.jsonl")


def test_analysis_max_rates_ratios_and_never_below():
    result = analyze_trace(_record_set(), "bursty", SLO_1)
    token = result["contenders"]["token"]
    assert token["points"]["4.0"]["goodput"]["mean"] == pytest.approx(29 / 30) and token["points"]["4.0"]["num_seeds"] == 3
    est = token["max_rate_at_90"]["goodput"]
    assert est["kind"] == "measured" and 4.0 < est["value"] < 8.0 and est["lo"] <= est["value"] <= est["hi"]
    assert result["contenders"]["request"]["max_rate_at_90"]["goodput"]["kind"] == "measured"
    assert result["token_vs_request_rate_kind"] == "measured" and result["token_vs_request_rate"] > 2
    lo, hi = result["token_vs_request_rate_ci"]
    assert lo <= result["token_vs_request_rate"] <= hi
    # both Serve configurations miss at the lowest rate: the best one is named, the ratio censored
    assert result["best_multiplexed"] == "multiplexed-8"
    assert result["token_vs_multiplexed_rate_kind"] == "lower bound"
    assert result["token_vs_multiplexed_rate"] == pytest.approx(est["value"] / 1.0)
    for m in ("strict", "cumulative"):
        assert f"token_vs_request_rate_{m}" in result and f"token_vs_request_rate_{m}_kind" in result
    assert result["token_never_below_request"] is True   # on the point estimates, within 0.03
    assert result["token_never_below_request_beyond_ci"] is True and result["token_never_below_request_tolerance"] == 0.03
    assert [row["rate"] for row in result["token_never_below_request_detail"]["goodput"]] == [1.0, 2.0, 4.0, 8.0]
    # the same three seeds for both: the ratio's interval is a paired bootstrap, each seed's ratio beside it
    assert result["token_vs_request_rate_ci_from"] == "paired bootstrap over 3 seeds"
    assert set(result["token_vs_request_rate_per_seed"]) == {"0", "1", "2"}
    reverse = analyze_trace(_record_set(), "bursty", SLO_1)
    assert reverse["token_vs_request_rate_ci"] == result["token_vs_request_rate_ci"]   # seeded: reproducible


def test_slo_sensitivity_rows():
    slo = SLO(0.5, 0.01)
    rows = slo_variants(slo)
    assert rows["ttft:tpot=16"] == SLO(0.16, 0.01) and rows["ttft:tpot=100"] == SLO(1.0, 0.01)
    assert rows["x2"] == SLO(1.0, 0.02) and rows["x0.5"] == SLO(0.25, 0.005)
    table = slo_sensitivity(_record_set(), "bursty", SLO_1)
    assert set(table["rows"]) == {"measured", "ttft:tpot=16", "ttft:tpot=100", "x0.5", "x1", "x2"}
    assert table["rows"]["x0.5"]["token"]["value"] is not None and "scheduled" in table["note"]


def test_published_outputs_plots_markdown_and_readme(tmp_path):
    rs = _record_set()
    result = analyze_trace(rs, "bursty", SLO_1)
    result["run"] = {"preset": {"seeds": [0, 1, 2], "max_requests": 10}}
    result["slo_sensitivity"] = slo_sensitivity(rs, "bursty", SLO_1)
    (tmp_path / "loadtest-bursty.json").write_text(json.dumps(result))
    png = plot_attainment_bands(result, tmp_path / "bands.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    cdfs = plot_cdfs(rs, "bursty", result, tmp_path / "lat")
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in cdfs.values())
    md = published_markdown(tmp_path, {"traces": {"bursty": {}}, "max_models_per_worker_at_90": 12,
                                       "max_models_per_worker_at_90_kind": "measured"})
    assert "| token | 1 |" in md and "never reaches 90% even at 1" in md and "token_vs_request_rate" in md
    assert "max_models_per_worker_at_90" in md and "SLO sensitivity" in md
    # goodput at every measured rate, per contender, with its interval (token first: 29 of 30 at 4 req/s)
    row = next(line for line in md.splitlines() if line.startswith("| 4 | "))
    assert row.split(" | ")[1].startswith("0.97 [")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\nrest\n")
    assert update_readme(readme, md)
    text = readme.read_text()
    assert "old" not in text and "| token | 1 |" in text and text.endswith("rest\n")
    assert not update_readme(tmp_path / "none.md", md)


def test_the_rate_axis_labels_the_measured_rates_and_no_minor_ticks():
    """Rates within one decade on a log axis: matplotlib labels every minor tick by default
    and they print over each other; the plot labels the measured rates only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from load_tests.report import MAX_RATE_TICKS, _rate_ticks

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    ax.plot([0.3, 0.45, 0.6], [1, 1, 1])
    _rate_ticks(ax, [0.3, 0.45, 0.6])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] == []
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.3", "0.45", "0.6"]
    many = [0.1 * 1.3 ** k for k in range(20)]
    _rate_ticks(ax, many)
    assert len(ax.get_xticks()) <= MAX_RATE_TICKS
    plt.close(fig)
