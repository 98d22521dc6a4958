"""Synthetic workloads: arrival statistics, popularity calibration, lengths from a real trace."""
from pathlib import Path

import numpy as np
import pytest

from cluster.planner.traces import lengths_from_azure
from cluster.planner.workloads import (AEGAEON_TAIL_MODEL_SHARE, AEGAEON_TAIL_REQUEST_SHARE,
                                       FixedLengths, Gamma, LogNormalLengths,
                                       LongTail, OnOff, Poisson, TraceRequest, Uniform, Workload,
                                       Zipf, generate, sample_models)

AZURE_CODE = Path("/work/shared/data/traces/azure-llm-2023/code.csv")
needs_data = pytest.mark.skipif(not AZURE_CODE.exists(), reason="shared trace data not present")


def _gaps(times):
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.parametrize("rate", [0.5, 20.0])
def test_poisson_rate_and_cv(rate):
    t = Poisson(rate).sample(np.random.default_rng(1), num_requests=20_000)
    g = _gaps(t)
    assert 1 / g.mean() == pytest.approx(rate, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_matches_rate_and_burstiness(cv):
    t = Gamma(rate=5.0, cv=cv).sample(np.random.default_rng(2), num_requests=40_000)
    g = _gaps(t)
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.08)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.1)


@pytest.mark.parametrize("cv", [2.0, 4.0])
def test_gamma_bursts_never_put_arrivals_at_one_instant(cv):
    rate = 3.0
    t = Gamma(rate=rate, cv=cv).sample(np.random.default_rng(5), num_requests=20_000)
    g = _gaps(t)
    assert g.min() >= 0.05 / rate * (1 - 1e-9)   # no gap under 5% of the mean gap
    assert 1 / g.mean() == pytest.approx(rate, rel=0.08) and g.std() / g.mean() == pytest.approx(cv, rel=0.1)
    # still bursty: most gaps are short, a few are very long
    assert np.median(g) < 0.5 / rate
    # the plain Gamma (no floor) puts most gaps within a hair of 0, which no client sends
    plain = _gaps(Gamma(rate=rate, cv=cv, min_gap_frac=0.0).sample(np.random.default_rng(5), num_requests=20_000))
    assert (plain < 1e-3 / rate).mean() > 0.1
    with pytest.raises(ValueError, match="min_gap_frac"):
        Gamma(rate, cv, min_gap_frac=1.0)


def test_duration_bound_and_mean_rate():
    t = Poisson(10.0).sample(np.random.default_rng(3), duration_s=200.0)
    assert t.max() < 200.0 and np.all(np.diff(t) >= 0)
    assert len(t) / 200.0 == pytest.approx(10.0, rel=0.08)
    both = Poisson(10.0).sample(np.random.default_rng(3), duration_s=200.0, num_requests=50)
    assert len(both) == 50


def test_on_off_bursts_only_in_on_windows():
    proc = OnOff(rate_on=20.0, on_s=2.0, off_s=8.0)
    t = proc.sample(np.random.default_rng(4), duration_s=500.0)
    assert np.all(t % 10.0 < 2.0)  # nothing arrives during the off periods
    assert t.max() < 500.0
    assert len(t) / 500.0 == pytest.approx(proc.mean_rate, rel=0.1)  # 4 req/s on average


def test_same_seed_same_workload_different_seed_differs():
    args = (Gamma(2.0, 3.0), Zipf(1.2), [f"m{i}" for i in range(8)], LogNormalLengths())
    a = generate(*args, seed=7, num_requests=200)
    b = generate(*args, seed=7, num_requests=200)
    c = generate(*args, seed=8, num_requests=200)
    assert a == b
    assert a != c


def test_zipf_and_uniform_weights():
    assert np.allclose(Uniform().weights(4), 0.25)
    w = Zipf(1.0).weights(3)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0) and w[0] / w[2] == pytest.approx(3.0)


@pytest.mark.parametrize("num_models", [10, 17, 100, 500])
def test_long_tail_calibration_holds(num_models):
    pop = LongTail()
    w = pop.weights(num_models)
    n_tail = round(AEGAEON_TAIL_MODEL_SHARE * num_models)
    assert n_tail == pop.num_tail_models(num_models)
    assert w.sum() == pytest.approx(1.0)
    assert np.all(np.diff(w) <= 0)  # rank order
    assert w[num_models - n_tail:].sum() == pytest.approx(AEGAEON_TAIL_REQUEST_SHARE, rel=1e-6)


def test_long_tail_sampled_requests_follow_calibration():
    models = [f"m{i:03d}" for i in range(100)]
    names = sample_models(LongTail(), models, 200_000, np.random.default_rng(5))
    tail = set(models[100 - LongTail().num_tail_models(100):])
    share = sum(n in tail for n in names) / len(names)
    assert share == pytest.approx(AEGAEON_TAIL_REQUEST_SHARE, rel=0.1)


def test_long_tail_other_targets_and_errors():
    w = LongTail(tail_model_share=0.8, tail_request_share=0.2).weights(10)
    assert w[2:].sum() == pytest.approx(0.2, rel=1e-6)
    with pytest.raises(ValueError, match="not a long tail"):
        LongTail(tail_model_share=0.5, tail_request_share=0.6).weights(10)
    with pytest.raises(ValueError, match="at least 2"):
        LongTail().weights(1)


@needs_data
def test_lengths_from_azure_trace_scaled_and_clipped():
    raw = lengths_from_azure(AZURE_CODE)
    assert len(raw.pairs) == 8819
    rng = np.random.default_rng(6)
    i, o = raw.sample(5000, rng)
    # resampled lengths keep the trace's distribution: medians close to the trace's own
    assert np.median(i) == pytest.approx(np.median(raw.pairs[:, 0]), rel=0.15)
    short = lengths_from_azure(AZURE_CODE, input_scale=0.1, max_input=96, max_output=32)
    i2, o2 = short.sample(5000, np.random.default_rng(6))
    assert i2.max() <= 96 and o2.max() <= 32 and i2.min() >= 1 and o2.min() >= 1
    assert np.median(i2) < np.median(i)


def test_fixed_and_lognormal_lengths():
    i, o = FixedLengths(8, 4).sample(5, np.random.default_rng(0))
    assert list(i) == [8] * 5 and list(o) == [4] * 5
    i, o = LogNormalLengths(input_median=100, output_median=10, sigma=0.5,
                            max_output=12).sample(20_000, np.random.default_rng(0))
    assert np.median(i) == pytest.approx(100, rel=0.05)
    assert o.max() <= 12


def test_bad_input_is_rejected_with_a_reason():
    with pytest.raises(ValueError, match="rate"):
        Poisson(0)
    with pytest.raises(ValueError, match="cv"):
        Gamma(1.0, -1)
    with pytest.raises(ValueError, match="duration_s or num_requests"):
        Poisson(1.0).sample(np.random.default_rng(0))
    with pytest.raises(ValueError, match="output_len"):
        TraceRequest(0.0, "m", 1, 0)
    with pytest.raises(ValueError, match="sorted"):
        Workload((TraceRequest(1.0, "m", 1, 1), TraceRequest(0.5, "m", 1, 1)))
    with pytest.raises(ValueError, match="distinct"):
        sample_models(Uniform(), ["a", "a"], 3, np.random.default_rng(0))


def test_workload_window_and_speedup():
    w = Workload(tuple(TraceRequest(float(t), "m", 1, 1) for t in range(10)))
    win = w.window(2.0, 6.0)
    assert [r.arrival_s for r in win] == [0.0, 1.0, 2.0, 3.0]
    assert len(w.window(max_requests=3)) == 3
    assert [r.arrival_s for r in w.time_scaled(2.0)][:3] == [0.0, 0.5, 1.0]


AEGAEON_16 = Path("/work/shared/data/traces/aegaeon-synth/synth-16-0.5-1.0-1.0.csv")


@pytest.mark.skipif(not AEGAEON_16.exists(), reason="shared trace data not present")
def test_a_load_test_draws_its_lengths_from_any_trace_file():
    """`tokenmux loadtest --lengths FILE`: a synthetic workload at any rate with the lengths of
    an Aegaeon trace (ShareGPT-like, mean output 284), scaled and clipped like Azure's."""
    import argparse

    from load_tests.run_setup import make_workload
    from load_tests.runner import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--arrival", "poisson", "--popularity", "uniform", "--lengths", str(AEGAEON_16),
            "--input-scale", "0.5", "--output-scale", "0.5", "--max-input", "1024", "--max-output", "1024"]
    args = parser.parse_args(argv)
    names = [f"m{i:02d}" for i in range(16)]
    workload = make_workload(args, names, rate=50.0, num_requests=2000)
    outputs = np.array([r.output_len for r in workload])
    assert len(outputs) == 2000 and len({r.model for r in workload}) == 16
    assert 120 <= outputs.mean() <= 165          # the file's mean output, 284, halved
    assert outputs.max() <= 1024
    with pytest.raises(ValueError, match="not azure, lognormal or a trace file"):
        make_workload(parser.parse_args(["--lengths", "no/such.csv"]), names, rate=1.0, num_requests=10)
