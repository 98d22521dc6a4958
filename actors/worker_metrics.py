"""The DeviceWorker's metrics thread: engine counters and device telemetry to Ray, off the hot path.

Every `interval_s` (1 s) the thread asks the engine loop for a sample (`EngineRecorder.take`
runs between two steps, on the engine thread), adds it to the running totals and samples the
device: what `tokenmux status --watch` shows. It exports to `ray.util.metrics` only every
`export_interval_s`, by default as often as Ray itself sends metrics on to its agent
(`metrics_report_interval_ms`, 10 s; Prometheus reads the agent): the samples between two
exports are merged into one (counts add up, histograms get every value, gauges are the
latest), so no value is lost, and the ~800 Ray calls of a flush (8 models x 5 histograms x
their buckets) are not made ten times for one export. The engine thread never makes a Ray
metrics call; per token it appends one float to a list.

`summary()` is a WorkerTelemetry (actors/worker_reports.py): running totals for `tokenmux status
--watch` (tokens and swaps so far, alpha, KV usage, the latest device reading), so the live
view needs no Prometheus.
"""
from __future__ import annotations

import logging
import time

from actors.device_telemetry import device_sampler, export_reading
from actors.engine_metrics import export_sample
from actors.metrics import MetricsExporter
from actors.periodic import PeriodicThread
from actors.worker_reports import WorkerTelemetry

logger = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 10.0
RAY_REPORT_INTERVAL_S = 10.0   # Ray's default metrics_report_interval_ms, where Ray is not up to ask


def ray_report_interval_s() -> float:
    """How often Ray sends a process's metrics to its agent (Ray floors it at 1 s)."""
    import ray

    if not ray.is_initialized():
        return RAY_REPORT_INTERVAL_S
    return max(1.0, ray._config.metrics_report_interval_ms() / 1000.0)


class WorkerMetrics:
    def __init__(self, worker_id: str, engine, engine_loop, num_threads: int | None = None,
                 interval_s: float = 1.0, exporter: MetricsExporter | None = None,
                 export_interval_s: float | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.worker_id = worker_id
        self.engine = engine
        self.engine_loop = engine_loop
        self.exporter = exporter or MetricsExporter()
        self.export_interval_s = max(interval_s, ray_report_interval_s() if export_interval_s is None
                                     else export_interval_s)
        self.device = device_sampler(engine.config.device, worker_id.rsplit("-", 1)[-1],
                                     engine.memory.total_bytes, num_threads)
        self.totals = {"generation_tokens": 0, "prompt_tokens": 0, "swaps": 0, "switches": 0, "finished": 0}
        self.latest = WorkerTelemetry(worker_id, time.time())
        self.num_flushes = self.num_exports = 0
        self._pending = None   # the samples taken since the last export, merged
        self._reading = None   # the latest device reading
        self._exported_at = time.monotonic()
        self._thread = PeriodicThread(self.flush, interval_s, name="tokenmux-metrics")

    def flush(self, export: bool | None = None) -> None:
        """Take a sample (the live view's totals); export what is pending when the export
        interval has passed (export=None), or now (True), or not (False)."""
        sample = self.engine_loop.call(self.engine.metrics.take, self.engine).result(TAKE_TIMEOUT_S)
        reading = None
        if self.device is not None:
            copied = sum(sample.swap_bytes.values()) / max(1e-9, sample.wall_s)
            reading = self._reading = self.device.sample(copied)
        t = self.totals
        for acc in sample.models.values():
            t["generation_tokens"] += acc.generation_tokens
            t["prompt_tokens"] += acc.prompt_tokens
            t["switches"] += acc.switches
            t["finished"] += sum(acc.finished.values())
        t["swaps"] += sum(sample.swaps.values())
        self.latest = WorkerTelemetry(self.worker_id, time.time(), **t, alpha=sample.alpha, kv_usage=sample.kv_usage,
                                      device=reading)
        self.num_flushes += 1
        self._pending = sample if self._pending is None else self._pending.merge(sample)
        if export or (export is None and time.monotonic() - self._exported_at >= self.export_interval_s - 1e-3):
            self.export()

    def export(self) -> None:
        """Send what is pending to Ray (the flusher thread; stop() sends the rest)."""
        pending, self._pending = self._pending, None
        self._exported_at = time.monotonic()
        if pending is not None:
            export_sample(pending, self.exporter, self.worker_id)
        if self._reading is not None:
            export_reading(self._reading, self.exporter, self.worker_id)
        self.num_exports += 1

    def summary(self) -> WorkerTelemetry:
        """Running totals and the latest gauges, as of the latest flush."""
        return self.latest

    def stop(self) -> None:
        self._thread.stop(timeout_s=5)
        if self._pending is not None:
            try:
                self.export()   # what the last interval recorded
            except Exception:   # noqa: BLE001 - stopping: the worker is going away anyway
                logger.exception("%s: last metrics export failed", self.worker_id)
        close = getattr(self.device, "close", None)
        if close is not None:
            close()
