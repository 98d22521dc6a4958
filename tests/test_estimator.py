"""StepLatencyEstimator: online linear fits, switch estimates, seeding from real GPU profiles."""
import json
import os

import pytest

from scheduler.estimator import OnlineLinearFit, StepLatencyEstimator

PROFILES = "/work/shared/data/profiles"


def test_online_fit_recovers_a_linear_cost():
    est = StepLatencyEstimator()
    for batch in range(1, 30, 3):
        for ctx in (100, 2000, 9000):
            est.observe_decode("m", batch, ctx, 0.004 + 0.0002 * batch + 1e-6 * ctx)
    assert est.predict_decode("m", 40, 20000) == pytest.approx(0.004 + 0.008 + 0.02, rel=1e-3)
    for n in (16, 256, 1024, 4096):
        est.observe_prefill("m", n, 1, 0.01 + 5e-5 * n)
    assert est.predict_prefill("m", 2048) == pytest.approx(0.01 + 5e-5 * 2048, rel=1e-3)


def test_fit_follows_the_machine_when_it_changes():
    est = StepLatencyEstimator(forget=0.9)
    for _ in range(50):
        est.observe_decode("m", 4, 400, 0.010)
    for _ in range(100):
        est.observe_decode("m", 4, 400, 0.030)
    assert est.predict_decode("m", 4, 400) == pytest.approx(0.030, rel=0.01)


def test_slopes_never_go_negative():
    fit = OnlineLinearFit(2)
    for x, y in ((1, 0.02), (2, 0.019), (3, 0.018)):  # noisy "faster with more tokens"
        fit.observe([1.0, x], y)
    assert fit.coef[1] == 0.0 and fit.predict([1.0, 3]) == pytest.approx(0.019, rel=1e-3)


def test_defaults_before_any_measurement():
    est = StepLatencyEstimator(default_prefill_s_per_token=1e-3, default_decode_step_s=0.05,
                               switch_bandwidth_bytes_s=1e9)
    est.register_model("m", weight_bytes=2_000_000_000)
    assert est.predict_prefill("m", 100) == pytest.approx(0.1)
    assert est.predict_decode("m", 8, 1000) == pytest.approx(0.05)
    assert est.predict_switch("m") == pytest.approx(2.0)  # bytes / bandwidth
    est.observe_switch("m", 1.0)
    assert est.predict_switch("m") == pytest.approx(1.0)  # measured beats the estimate
    est.observe_switch("m", 2.0)
    assert 1.0 < est.predict_switch("m") < 2.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="switch_bandwidth"):
        StepLatencyEstimator(switch_bandwidth_bytes_s=0)
    with pytest.raises(ValueError, match="does not exist"):
        StepLatencyEstimator().seed_from_profile("m", "/nonexistent/profiles")
    with pytest.raises(ValueError, match="switch time"):
        StepLatencyEstimator().observe_switch("m", -1.0)


def test_seed_from_profile_rejects_empty_and_malformed_dirs(tmp_path):
    with pytest.raises(ValueError, match="no iNbB.json"):
        StepLatencyEstimator().seed_from_profile("m", str(tmp_path))
    (tmp_path / "i16b1.json").write_text(json.dumps({"avg_prefill_latency": 0.1}))
    with pytest.raises(ValueError, match="i16b1.json"):
        StepLatencyEstimator().seed_from_profile("m", str(tmp_path))


@pytest.mark.skipif(not os.path.isdir(PROFILES), reason="shared profiles not present")
@pytest.mark.parametrize("model_gpu", ["qwen2_5_7b/H20", "llama2_13b_chat/H800", "qwen2_5_7b/A10"])
def test_seed_from_real_profiles_predicts_them(model_gpu):
    directory = os.path.join(PROFILES, model_gpu)
    est = StepLatencyEstimator()
    count = est.seed_from_profile("m", directory)
    names = [n for n in os.listdir(directory) if n.endswith(".json")]
    assert count == len(names)
    prefill_err, decode_err = [], []
    for name in names:
        n_in, batch = (int(x) for x in name[1:-5].split("b"))
        with open(os.path.join(directory, name)) as f:
            data = json.load(f)
        prefill_err.append(abs(est.predict_prefill("m", n_in * batch, batch) / data["avg_prefill_latency"] - 1))
        decode_err.append(abs(est.predict_decode("m", batch, n_in * batch) / data["avg_decode_latency"] - 1))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    # a linear cost model cannot match every point, but the typical step is close
    assert median(prefill_err) < 0.25 and median(decode_err) < 0.25
    # bigger models are slower: llama2-13b's decode step beats qwen2.5-7b's on the same GPU
    big = StepLatencyEstimator()
    big.seed_from_profile("m", os.path.join(PROFILES, "llama2_13b_chat/H20"))
    small = StepLatencyEstimator()
    small.seed_from_profile("m", os.path.join(PROFILES, "qwen2_5_7b/H20"))
    assert big.predict_decode("m", 8, 4096) > small.predict_decode("m", 8, 4096)
