"""SLO metrics on hand-computed examples."""
import pytest

from cluster.planner.metrics import (RequestRecord, Turn, attainment_key, cumulative_attainment,
                                     meets_goodput, meets_strict, summarize, switches_per_second)
from scheduler.slo import SLO


def rec(times, arrival=0.0, model="m", error=None, rid="r"):
    times = list(times)
    return RequestRecord(rid, model, arrival, times[0] if times else None, times,
                         end=times[-1] if times else arrival + 1, num_output_tokens=len(times),
                         error=error)


SLO_3_2 = SLO(ttft_s=3.0, tbt_s=2.0)


def test_aegaeon_worked_example():
    # Aegaeon artifact's example: tokens at 3, 6, 7, 8; TTFT 3, TBT 2 -> in deadline during
    # (0, 3) and (6, 8): 5 of 8 seconds. Strictly, token 1 (due 5, came 6) is a miss.
    r = rec([3, 6, 7, 8])
    assert cumulative_attainment(r, SLO_3_2) == pytest.approx(5 / 8)
    assert not meets_strict(r, SLO_3_2)


def test_arrival_offsets_every_deadline():
    r = rec([103, 106, 107, 108], arrival=100.0)
    assert cumulative_attainment(r, SLO_3_2) == pytest.approx(5 / 8)


def test_all_on_time():
    r = rec([1, 3, 5, 7])
    assert meets_strict(r, SLO_3_2)
    assert cumulative_attainment(r, SLO_3_2) == 1.0


def test_strict_uses_cumulative_deadlines_not_gaps():
    # second token comes 3.5 s after the first (> TBT 2) but before its deadline 3 + 2 = 5
    r = rec([1.0, 4.5])
    assert meets_strict(r, SLO_3_2)
    assert cumulative_attainment(r, SLO_3_2) == 1.0


def test_late_first_token_then_fast():
    # token 0 at 5 > 3: nothing credited before it; then the segment from 5 to 6 is on time
    r = rec([5.0, 5.5, 6.0])
    assert not meets_strict(r, SLO_3_2)
    assert cumulative_attainment(r, SLO_3_2) == pytest.approx(1 / 6)


def test_single_stall_fails_strict_but_costs_cumulative_only_the_stall():
    # 20 tokens 1 s apart from t=1, one stall of 4 s before token 10
    times = [1.0 + k for k in range(10)] + [14.0 + k for k in range(10)]
    r = rec(times)
    # token 10 due 3 + 10 * 2 = 23 > 14: the stall is inside the accumulated slack
    assert meets_strict(r, SLO_3_2) and cumulative_attainment(r, SLO_3_2) == 1.0
    tight = SLO(ttft_s=1.0, tbt_s=1.0)  # token k due 1 + k: token 10 (due 11, came 14) late
    assert not meets_strict(r, tight)
    # credited: (0, due of token 9 = 10) + final segment (14, 23) -> 19 of 23 s
    assert cumulative_attainment(r, tight) == pytest.approx(19 / 23)


def test_failed_requests_are_misses_and_out_of_latencies():
    good = rec([0.5, 1.0], rid="a")
    failed = rec([0.2, 0.4], error="boom", rid="b")
    empty = rec([], rid="c")
    for r in (failed, empty):
        assert not meets_strict(r, SLO_3_2)
        assert cumulative_attainment(r, SLO_3_2) == 0.0
    s = summarize([good, failed, empty], SLO_3_2, duration_s=10.0)
    assert s["attainment_strict"] == pytest.approx(1 / 3)
    assert s["attainment_cumulative"] == pytest.approx(1 / 3)
    assert s["num_errors"] == 1
    assert s["ttft_p50_s"] == 0.5  # only the good request's TTFT
    assert s["goodput_rps"] == pytest.approx(0.1) and s["strict_rps"] == pytest.approx(0.1)


def test_summary_percentiles_goodput_and_per_model():
    records = [rec([t, t + 0.1 * (i + 1)], arrival=0.0, model="a" if i < 3 else "b", rid=str(i))
               for i, t in enumerate([1.0, 2.0, 3.0, 4.0, 5.0])]
    s = summarize(records, SLO(ttft_s=3.0, tbt_s=1.0))
    assert s["ttft_p50_s"] == 3.0
    assert s["ttft_p99_s"] == pytest.approx(4.96)
    assert s["tbt_p50_s"] == pytest.approx(0.3)
    assert s["e2e_p50_s"] == pytest.approx(3.3)
    assert s["attainment_strict"] == pytest.approx(3 / 5)  # TTFT 4 and 5 miss 3 s
    assert s["duration_s"] == pytest.approx(5.5)  # first arrival 0, last end 5.5
    assert s["strict_rps"] == pytest.approx(3 / 5.5)
    assert s["goodput_rps"] == pytest.approx(3 / 5.5)   # here goodput and strict agree
    assert s["per_model"]["a"]["attainment_strict"] == 1.0
    assert s["per_model"]["b"]["attainment_strict"] == 0.0
    assert s["per_model"]["b"]["num_requests"] == 2


def test_switches_per_second_per_worker():
    turns = [Turn("w0", "A", 0, 1), Turn("w0", "B", 1, 2), Turn("w0", "B", 2, 3),
             Turn("w0", "A", 3, 4), Turn("w1", "A", 0, 10)]
    assert switches_per_second(turns) == {"w0": 0.5, "w1": 0.0}
    s = summarize([rec([1.0])], SLO_3_2, turns=turns)
    assert s["switches_per_s_mean"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="ends before it starts"):
        Turn("w", "A", 2, 1)


def test_goodput_judges_ttft_and_mean_tpot_not_each_gap():
    # TTFT 2.9 <= 3, then a stall: token 1 comes at 5.5, after its strict deadline 3 + 2 = 5,
    # but the mean TPOT (5.9 - 2.9) / 5 = 0.6 s is well inside TBT 2
    stalled = rec([2.9, 5.5, 5.6, 5.7, 5.8, 5.9])
    assert meets_goodput(stalled, SLO_3_2) and stalled.tpot == pytest.approx(0.6)
    assert not meets_strict(stalled, SLO_3_2)
    slow = rec([1.0, 3.5, 6.0])   # mean TPOT 2.5 > 2, though TTFT is fine
    assert not meets_goodput(slow, SLO_3_2)
    late = rec([3.5, 4.0])   # fast afterwards, but the first token came after 3 s
    assert not meets_goodput(late, SLO_3_2)
    one = rec([2.0])   # one token: TTFT alone decides
    assert meets_goodput(one, SLO_3_2) and one.tpot is None
    assert not meets_goodput(rec([1.0, 1.5], error="boom"), SLO_3_2)
    s = summarize([stalled, slow, late, one], SLO_3_2, duration_s=4.0)
    assert s["attainment_goodput"] == pytest.approx(2 / 4)
    assert s["goodput_rps"] == pytest.approx(2 / 4.0)
    assert s["tpot_p50_s"] == pytest.approx(0.6)   # of 0.6, 2.5, 0.5
    assert attainment_key("goodput") == "attainment_goodput"
    with pytest.raises(ValueError, match="metric"):
        attainment_key("median")


def test_records_round_trip_through_dicts():
    r = rec([1.0, 2.0], rid="x")
    r.server_token_times = [0.9, 1.9]
    assert RequestRecord.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown request record fields"):
        RequestRecord.from_dict({**r.to_dict(), "colour": "red"})
