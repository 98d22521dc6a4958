"""The DeviceWorker's metrics thread: engine counters and device telemetry to Ray, off the hot path.

Every `interval_s` (1 s) the thread asks the engine loop for a sample (`EngineRecorder.take`
runs between two steps, on the engine thread), exports it with `ray.util.metrics`, samples
the device (actors/device_telemetry.py) and exports that. The engine thread never makes a
Ray metrics call; per token it appends one float to a list.

`summary()` keeps running totals for `tokenmux status --watch` (tokens and swaps so far,
alpha, KV usage, the latest device reading), so the live view needs no Prometheus.
"""
from __future__ import annotations

import logging
import time

from actors.device_telemetry import device_sampler, export_reading
from actors.engine_metrics import export_sample
from actors.metrics import MetricsExporter
from actors.periodic import PeriodicThread

logger = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 10.0


class WorkerMetrics:
    def __init__(self, worker_id: str, engine, engine_loop, num_threads: int | None = None,
                 interval_s: float = 1.0, exporter: MetricsExporter | None = None):
        self.worker_id = worker_id
        self.engine = engine
        self.engine_loop = engine_loop
        self.exporter = exporter or MetricsExporter()
        self.device = device_sampler(engine.config.device, worker_id.rsplit("-", 1)[-1],
                                     engine.memory.total_bytes, num_threads)
        self.totals = {"generation_tokens": 0, "prompt_tokens": 0, "swaps": 0, "switches": 0, "finished": 0}
        self.latest: dict = {"time": time.time(), "alpha": None, "kv_usage": 0.0, "device": None}
        self.num_flushes = 0
        self._thread = PeriodicThread(self.flush, interval_s, name="tokenmux-metrics")

    def flush(self) -> None:
        sample = self.engine_loop.call(self.engine.metrics.take, self.engine).result(TAKE_TIMEOUT_S)
        export_sample(sample, self.exporter, self.worker_id)
        reading = None
        if self.device is not None:
            copied = sum(sample.swap_bytes.values()) / max(1e-9, sample.wall_s)
            reading = self.device.sample(copied)
            export_reading(reading, self.exporter, self.worker_id)
        t = self.totals
        for acc in sample.models.values():
            t["generation_tokens"] += acc.generation_tokens
            t["prompt_tokens"] += acc.prompt_tokens
            t["switches"] += acc.switches
            t["finished"] += sum(acc.finished.values())
        t["swaps"] += sum(sample.swaps.values())
        self.latest = {"time": time.time(), "alpha": sample.alpha, "kv_usage": sample.kv_usage,
                       "device": reading.to_dict() if reading is not None else None}
        self.num_flushes += 1

    def summary(self) -> dict:
        """Running totals and the latest gauges (a plain dict: it crosses the actor boundary)."""
        return {"worker_id": self.worker_id, **self.totals, **self.latest}

    def stop(self) -> None:
        self._thread.stop(timeout_s=5)
        close = getattr(self.device, "close", None)
        if close is not None:
            close()
