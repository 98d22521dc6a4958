"""What a worker reports of itself to the layers above it, one producer each:

    WorkerHealth      worker -> supervisor          (DeviceWorker.health, the watchdog; cluster/supervisor.py)
    WorkerTelemetry   worker -> `status --watch`    (actors/worker_metrics.py, with a DeviceReading of
                                                     actors/device_telemetry.py; deploy/cli/status_watch.py)
    StepRecord        worker -> load tests, demo    (actors/engine.py, the timeline: one per step)

They live beside their producer: the readers (cluster/, deploy/, load_tests/) sit above actors/,
which may not import them. The scheduler's own messages stay in scheduler/messages.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerHealth:
    """Whether a worker's engine loop is alive and stepping (producer: DeviceWorker.health, which
    answers off the engine thread; read by cluster/supervisor.py)."""

    worker_id: str
    healthy: bool
    reason: str = ""     # why not: the engine loop stopped, or one step ran past the watchdog's bound
    pid: int = 0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if not isinstance(self.healthy, bool):
            raise ValueError(f"healthy must be a bool, got {self.healthy!r}")
        if self.healthy and self.reason:
            raise ValueError("a healthy worker has no reason")


@dataclass(frozen=True)
class DeviceReading:
    """One sample of a worker's device (producer: actors/device_telemetry.py's samplers)."""

    device: str                     # label: gpu<NVML index>, or the worker's device name when virtual
    virtual: bool
    utilization: float              # 0-1
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float | None = None
    temperature_celsius: float | None = None
    pcie_rx_bytes_per_s: float | None = None   # host -> device
    pcie_tx_bytes_per_s: float | None = None   # device -> host


@dataclass(frozen=True)
class WorkerTelemetry:
    """A worker's running totals since it started and its latest gauges, for `tokenmux status
    --watch` (producer: WorkerMetrics.summary, actors/worker_metrics.py, sent by
    DeviceWorker.telemetry); the watcher turns two of them into rates."""

    worker_id: str
    time: float                     # wall clock (time.time()) of the latest sample
    generation_tokens: int = 0
    prompt_tokens: int = 0
    swaps: int = 0
    switches: int = 0
    finished: int = 0
    alpha: float | None = None      # quota rule's alpha of the latest round (token-level policy)
    kv_usage: float = 0.0           # share of the KV pool in use, 0-1
    device: DeviceReading | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage!r}")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, wall clock (producer: Engine, one per step into its timeline; read through
    DeviceWorker.timeline). A multi-step run's steps share its time equally."""

    model: str
    start: float
    end: float
    is_prefill: bool

    @property
    def seconds(self) -> float:
        return self.end - self.start
