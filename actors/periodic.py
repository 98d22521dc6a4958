"""A daemon thread that calls `tick()` every `interval_s` until stopped.

What runs beside the hot path without being part of it uses one: the worker's metrics
flusher and device sampler (actors/worker_metrics.py), and the topology's node watcher
(cluster/node_watcher.py). A failing tick is logged and retried on the next one; it
never ends the thread.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeriodicThread:
    def __init__(self, tick: Callable[[], object], interval_s: float, name: str):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.tick = tick
        self.interval_s = interval_s
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 35.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:
                self.num_errors += 1
                logger.exception("%s: tick failed (will retry)", self._thread.name)
