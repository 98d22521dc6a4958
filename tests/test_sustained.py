"""Sustained points: a rate offered for a warm-up and a scored window, and whether it was held."""
import pytest

from cluster.planner.metrics import RequestRecord
from cluster.planner.workloads import FixedLengths, Gamma, Poisson, Uniform, generate
from load_tests.sustained import SustainSpec, draw_span, queue_at


def test_the_window_covers_both_the_seconds_and_the_requests_asked_for():
    spec = SustainSpec(sustain_s=60, sustain_requests=300, warmup_s=10)
    assert spec.window_s(10.0) == 60.0            # 600 requests expected in 60 s
    assert spec.window_s(2.0) == 150.0            # 300 requests need 150 s at 2 req/s
    assert spec.offered_s(2.0) == 160.0
    with pytest.raises(ValueError, match="sustain_requests"):
        SustainSpec(sustain_requests=0)


@pytest.mark.parametrize("process", [Poisson(1.0), Gamma(1.0, 4.0)])
def test_arrivals_are_the_trace_process_scaled_to_the_rate_over_the_whole_span(process):
    spec = SustainSpec(sustain_s=200, sustain_requests=10, warmup_s=20)
    rate = 5.0
    sample = generate(process, Uniform(), ["a", "b"], FixedLengths(4, 4), seed=1, duration_s=draw_span(rate, spec))
    w = spec.workload(sample, rate, nominal_rate=1.0)
    assert w.duration_s < spec.offered_s(rate) and w.duration_s > 0.9 * spec.offered_s(rate)
    # the rate offered over the span, not a burst of a fixed count: ~rate x span requests
    assert len(w) / spec.offered_s(rate) == pytest.approx(rate, rel=0.35 if isinstance(process, Gamma) else 0.1)
    # the same draw scaled: arrival gaps keep their shape (a Gamma stays bursty)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w, w.requests[1:])]
    cv = (sum((g - sum(gaps) / len(gaps)) ** 2 for g in gaps) / len(gaps)) ** 0.5 / (sum(gaps) / len(gaps))
    assert cv > 2.0 if isinstance(process, Gamma) else 0.8 < cv < 1.2


def _steady(rate: float, span: float, service_s: float) -> list[RequestRecord]:
    n = int(rate * span)
    return [RequestRecord(f"r{i}", "m", arrival=i / rate, end=i / rate + service_s, token_times=[i / rate + 0.01])
            for i in range(n)]


def test_a_rate_is_held_when_the_queue_does_not_grow_over_the_window():
    spec = SustainSpec(sustain_s=20, sustain_requests=1, warmup_s=5)
    kept_up = _steady(4.0, spec.offered_s(4.0), service_s=0.3)
    held = spec.held(kept_up, 4.0)
    assert held["held"] and held["queue_end"] <= held["queue_start"] + 1
    # a server that finishes one request per second while four arrive: the backlog grows
    behind = [RequestRecord(f"r{i}", "m", arrival=i / 4.0, end=1.0 + i * 1.0) for i in range(100)]
    lost = spec.held(behind, 4.0)
    assert not lost["held"] and lost["queue_end"] > lost["queue_start"] + 10
    # scored: only the window's requests, not the warm-up's
    scored = spec.scored(kept_up, 4.0)
    assert min(r.arrival for r in scored) >= 5.0 and len(scored) == len(kept_up) - 20
    assert queue_at(behind, 10.0) == 41 - 10   # 41 arrived by t = 10, 10 finished (ends 1..10; one at 10 still counts as done)


def test_the_regime_is_said_from_the_workload_and_the_slo():
    from cluster.planner.workloads import TraceRequest
    from load_tests.regime import describe, regime
    from scheduler.slo import SLO

    long_decodes = [TraceRequest(0.0, "m", 8, 100)] * 3      # 100 tokens x 10 ms = 1 s against a 0.2 s TTFT
    r = regime(long_decodes, SLO(0.2, 0.05), decode_s=0.01)
    assert r["decode_vs_ttft"] == 5.0 and r["tbt_slack"] == 5.0 and r["favours"] == "token"
    assert regime(long_decodes, SLO(5.0, 0.05), decode_s=0.01)["favours"] == "neither"   # waits fit the TTFT budget
    assert regime(long_decodes, SLO(0.2, 0.015), decode_s=0.01)["favours"] == "request"  # no room to share
    assert "TBT slack" in describe(r) and "said before measuring" in describe(r)
