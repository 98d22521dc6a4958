"""The engine's metrics recorder on a real Engine: what a user would read off the dashboards."""
from __future__ import annotations

import time

import pytest

from actors.engine import Engine, EngineConfig
from actors.engine_metrics import EngineRecorder, export_sample
from actors.metrics import CATALOG, MetricSpec, MetricsExporter, prometheus_name
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

MiB = 1 << 20


class RecordingExporter(MetricsExporter):
    """Keeps what would go to Ray (validation by the real exporter's label check)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, float, dict]] = []

    def inc(self, name, value, tags=None):
        if value > 0:
            self.calls.append(("inc", name, value, self._tags(name, tags)))

    def set(self, name, value, tags=None):
        self.calls.append(("set", name, value, self._tags(name, tags)))

    def observe(self, name, value, tags=None):
        self.calls.append(("observe", name, value, self._tags(name, tags)))

    def observe_many(self, name, values, tags=None):
        for v in values:
            self.observe(name, v, tags)

    def total(self, name, **match) -> float:
        return sum(v for _, n, v, t in self.calls if n == name and all(t.get(k) == x for k, x in match.items()))

    def count(self, name, **match) -> int:
        return sum(1 for _, n, _, t in self.calls if n == name and all(t.get(k) == x for k, x in match.items()))


@pytest.fixture(scope="module")
def engine(zoo_model):
    # one slot + a prefetch slot for two models: every switch is a swap-in
    e = Engine(EngineConfig(budget_bytes=48 * MiB, kv_bytes=16 * MiB, num_slots=2, slab_bytes=1 * MiB))
    e.register_model("a", zoo_model("llama-tiny-a"))
    e.register_model("b", zoo_model("qwen2-tiny-b"))
    e.register_model("c", zoo_model("llama-tiny-c"))
    return e


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()


def _req(rid, model, n, **kw):
    return GenerateRequest(rid, model, (5, 6, 7, 8), SamplingParams(max_tokens=n, ignore_eos=True, **kw),
                           arrival_time=time.time())


def test_counts_match_what_the_engine_produced(engine):
    engine.metrics.take(engine)   # start clean
    requests = [_req(f"r{i}-{m}", m, 6) for i in range(3) for m in ("a", "b", "c")]
    _run(engine, requests)
    sample = engine.metrics.take(engine)
    out = RecordingExporter()
    export_sample(sample, out, "w0")
    for m in ("a", "b", "c"):
        assert out.total("tokenmux_generation_tokens_total", model=m) == 3 * 6
        assert out.total("tokenmux_prompt_tokens_total", model=m) == 3 * 4
        assert out.total("tokenmux_request_success_total", model=m, finished_reason="length") == 3
        assert out.count("tokenmux_time_to_first_token_seconds", model=m) == 3
        assert out.count("tokenmux_inter_token_latency_seconds", model=m) == 3 * 5
        assert out.count("tokenmux_e2e_request_latency_seconds", model=m) == 3
    # three models through two slots: the engine switched and swapped
    assert out.total("tokenmux_model_switches_total") >= 2
    assert out.total("tokenmux_swaps_total") >= 2
    assert out.total("tokenmux_swap_bytes_total") >= 2 * min(m.layout.total_bytes for m in engine.models.values())
    assert out.count("tokenmux_turn_seconds") >= 2
    assert 0 < out.total("tokenmux_device_busy_seconds_total") <= sample.wall_s
    # nothing left in flight: gauges read zero
    assert out.total("tokenmux_num_requests_running") == 0
    assert out.total("tokenmux_kv_cache_usage_perc") == 0


def test_latencies_are_real_time_intervals(engine):
    engine.metrics.take(engine)
    _run(engine, [_req("lat", "a", 8)])
    acc = engine.metrics.take(engine).models["a"]
    assert len(acc.ttft) == 1 and 0 < acc.ttft[0] < 30
    assert len(acc.itl) == 7 and all(g >= 0 for g in acc.itl)
    assert acc.e2e[0] >= acc.ttft[0] + sum(acc.itl) - 1e-6


def test_a_stop_string_counts_as_stop(engine):
    engine.metrics.take(engine)
    tok = engine.models["a"].tokenizer
    text = tok.decode([9, 10, 11])
    _run(engine, [GenerateRequest("stop", "a", (9, 10, 11) * 3,
                                  SamplingParams(max_tokens=40, ignore_eos=True, stop=[text[-2:]] if text else None),
                                  arrival_time=time.time())])
    acc = engine.metrics.take(engine).models["a"]
    assert sum(acc.finished.values()) == 1


def test_gauges_see_requests_in_flight(engine):
    engine.metrics.take(engine)
    for i in range(3):
        engine.add_request(_req(f"g{i}", "b", 20))
    engine.step()   # a prefill: these are running now
    sample = engine.metrics.take(engine)
    assert sample.running["b"] + sample.waiting["b"] == 3 and sample.running["b"] >= 1
    assert sample.kv_usage > 0
    _run(engine, [])


def test_unknown_arrival_gives_no_latency_but_still_counts_tokens(engine):
    engine.metrics.take(engine)
    _run(engine, [GenerateRequest("noarr", "c", (5, 6), SamplingParams(max_tokens=3, ignore_eos=True))])
    acc = engine.metrics.take(engine).models["c"]
    assert acc.generation_tokens == 3 and acc.ttft == [] and acc.e2e == []


def test_handoff_records_bytes_and_seconds():
    rec = EngineRecorder()
    rec.handoff_started("x")
    rec.handoff_finished("x", "m", 4096, True)
    rec.handoff_finished("y", "m", 4096, False)
    acc = rec._models["m"]
    assert (acc.handoffs, acc.handoffs_kept, acc.handoff_bytes, len(acc.handoff_s)) == (1, 1, 4096, 1)


def test_catalogue_names_survive_ray_export():
    for name, s in CATALOG.items():
        assert ":" not in name and prometheus_name(name) == "ray_" + name
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("tokenmux_foo", "counter", "x", ())
    with pytest.raises(ValueError, match="':'"):
        MetricSpec("tokenmux:foo_total", "counter", "x", ())
    with pytest.raises(ValueError, match="labels"):
        MetricsExporter()._tags("tokenmux_swaps_total", {"model": "m"})
    with pytest.raises(ValueError, match="unknown metric"):
        prometheus_name("tokenmux_nope")


def test_histograms_are_exported_as_prometheus_bucket_series_in_one_call_per_series(monkeypatch):
    """A flush's values become cumulative `_bucket{le}` totals (with +Inf), an exact `_sum` and
    `_count`: a few Ray calls per flush whatever the token rate, and every exporter of the
    process adds to the same running totals."""
    import ray.util.metrics as ray_metrics

    import actors.metrics as metrics

    calls = []

    class FakeGauge:
        def __init__(self, name, description="", tag_keys=()):
            self.name, self.tag_keys = name, tuple(tag_keys)

        def set(self, value, tags=None):
            assert set(tags) == set(self.tag_keys)
            calls.append((self.name, value, dict(tags)))

    monkeypatch.setattr(ray_metrics, "Gauge", FakeGauge)
    monkeypatch.setattr(metrics, "_histograms", {})
    name = "tokenmux_inter_token_latency_seconds"
    bounds = CATALOG[name].buckets
    values = [0.0005, 0.001, 0.003, 0.003, 0.02, 99.0] * 500   # 0.001 is in the le="0.001" bucket
    MetricsExporter().observe_many(name, values, {"model": "m", "worker": "w"})
    MetricsExporter().observe(name, 0.003, {"model": "m", "worker": "w"})   # another exporter, same totals
    assert len(calls) == 2 * (len(bounds) + 3)   # per call: every bucket, +Inf, _sum, _count
    last = {(n, t.get("le")): v for n, v, t in calls}
    buckets = {le: v for (n, le), v in last.items() if n == name + "_bucket"}
    assert buckets["0.001"] == 1000 and buckets["0.0025"] == 1000 and buckets["0.005"] == 2001
    assert buckets["0.025"] == 2501 and buckets["10.0"] == 2501 and buckets["+Inf"] == 3001
    assert last[(name + "_count", None)] == 3001
    assert last[(name + "_sum", None)] == pytest.approx(500 * (0.0005 + 0.001 + 0.006 + 0.02 + 99.0) + 0.003)


class _SyncLoop:
    """EngineLoop.call run on the caller's thread (the engine is idle between the test's runs)."""

    def call(self, fn, *args):
        import concurrent.futures

        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done


def test_the_worker_samples_every_flush_but_exports_merged_samples_at_the_export_interval(engine):
    from actors.worker_metrics import WorkerMetrics

    out = RecordingExporter()
    engine.metrics.take(engine)   # start clean
    metrics = WorkerMetrics("w0-cpu0", engine, _SyncLoop(), 1, interval_s=3600.0, exporter=out,
                            export_interval_s=3600.0)
    try:
        for i in range(3):   # three flushes between two exports
            _run(engine, [_req(f"m{i}-{m}", m, 5) for m in ("a", "b")])
            metrics.flush()
            assert metrics.summary().generation_tokens == (i + 1) * 2 * 5   # the live view: every flush
        assert out.calls == [] and metrics.num_exports == 0
        metrics.flush(export=True)
        assert metrics.num_exports == 1
        for m in ("a", "b"):   # nothing lost in the merge: counters add up, histograms get every value
            assert out.total("tokenmux_generation_tokens_total", model=m) == 3 * 5
            assert out.total("tokenmux_request_success_total", model=m, finished_reason="length") == 3
            assert out.count("tokenmux_time_to_first_token_seconds", model=m) == 3
            assert out.count("tokenmux_inter_token_latency_seconds", model=m) == 3 * 4
        assert out.total("tokenmux_num_requests_running") == 0   # gauges: the latest sample's
        _run(engine, [_req("last", "a", 3)])
        metrics.flush(export=False)
    finally:
        metrics.stop()   # exports what the last interval recorded
    assert out.total("tokenmux_generation_tokens_total", model="a") == 3 * 5 + 3
