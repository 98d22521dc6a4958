"""Reports: max-rate interpolation, JSON/Markdown contents, PNG files."""
import json

import pytest

from load_tests.metrics import RequestRecord, Turn, summarize
from load_tests.report import build_report, max_rate_at, to_markdown, write_report
from scheduler.slo import SLO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_max_rate_at_interpolates_between_last_above_and_first_below():
    # 0.95 at 2 req/s, 0.85 at 4 req/s: 0.9 is crossed halfway -> 3 req/s
    assert max_rate_at({1.0: 1.0, 2.0: 0.95, 4.0: 0.85, 8.0: 0.2}, 0.9) == pytest.approx(3.0)
    assert max_rate_at({4.0: 0.85, 2.0: 0.95}) == pytest.approx(3.0)  # order does not matter
    assert max_rate_at({1.0: 0.99, 2.0: 0.97}) == 2.0  # never below: the highest tested
    assert max_rate_at({1.0: 0.5, 2.0: 0.4}) is None  # below from the start
    assert max_rate_at({1.0: 0.9, 2.0: 0.0}) == pytest.approx(1.0)
    # a noisy recovery after the first drop is ignored
    assert max_rate_at({1.0: 1.0, 2.0: 0.8, 3.0: 0.95}) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="empty"):
        max_rate_at({})
    with pytest.raises(ValueError, match="threshold"):
        max_rate_at({1.0: 1.0}, 1.5)


def _records(ttft, tbt, n=20, model="m"):
    return [RequestRecord(str(i), model, float(i), None,
                          [i + ttft + k * tbt for k in range(5)], end=i + ttft + 4 * tbt)
            for i in range(n)]


def _inputs():
    slo = SLO(ttft_s=1.0, tbt_s=0.2)
    records = {"tokenmux": _records(0.5, 0.1), "request-level": _records(2.0, 0.1)}
    summaries = {n: summarize(rs, slo) for n, rs in records.items()}
    sweeps = {"tokenmux": {1.0: 1.0, 2.0: 0.95, 4.0: 0.85},
              "request-level": {1.0: 0.92, 2.0: 0.5, 4.0: 0.1}}
    turns = {"tokenmux": [Turn("w0", "a", 0, 1), Turn("w0", "b", 1, 2), Turn("w1", "b", 0, 2)]}
    return summaries, sweeps, records, turns


def test_build_report_columns_and_ratios():
    summaries, sweeps, _, _ = _inputs()
    report = build_report(summaries, sweeps=sweeps, baseline="request-level")
    tm, rl = report["tokenmux"], report["request-level"]
    assert tm["attainment_strict"] == 1.0 and rl["attainment_strict"] == 0.0
    assert tm["max_rate_at_90"] == pytest.approx(3.0)
    assert rl["max_rate_at_90"] == pytest.approx(1.0 + 0.02 / 0.42)
    assert tm["max_rate_at_90_vs_request-level"] == pytest.approx(3.0 / rl["max_rate_at_90"])
    assert tm["goodput_rps_vs_request-level"] is None  # baseline goodput is 0
    for key in ("attainment_cumulative", "goodput_rps", "ttft_p50_s", "ttft_p99_s",
                "tbt_p50_s", "tbt_p99_s"):
        assert key in tm
    assert tm["ttft_p50_s"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="baseline"):
        build_report(summaries, baseline="nope")
    md = to_markdown(report, "demo")
    assert md.splitlines()[2].startswith("| contender | attainment_strict")
    assert "| tokenmux | 1 |" in md


def test_write_report_files(tmp_path):
    summaries, sweeps, records, turns = _inputs()
    files = write_report(tmp_path / "out", summaries, sweeps=sweeps, records=records,
                         turns=turns, baseline="request-level")
    assert set(files) == {"json", "markdown", "attainment_vs_rate", "ttft_cdf", "tbt_cdf",
                          "timeline_tokenmux"}
    data = json.loads(files["json"].read_text())
    assert data["tokenmux"]["max_rate_at_90"] == pytest.approx(3.0)
    assert "| request-level |" in files["markdown"].read_text()
    for key in ("attainment_vs_rate", "ttft_cdf", "tbt_cdf", "timeline_tokenmux"):
        blob = files[key].read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5_000, key


def test_write_report_without_optional_inputs(tmp_path):
    summaries, _, _, _ = _inputs()
    files = write_report(tmp_path, summaries)
    assert set(files) == {"json", "markdown"}
    assert "max_rate_at_90" not in json.loads(files["json"].read_text())["tokenmux"]
