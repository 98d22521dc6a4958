"""A daemon thread that calls `refresh()` every `interval_s` until stopped.

The topology uses it to notice nodes that join or leave the Ray cluster (Ray has no
membership callback a driver can subscribe to). A failing refresh is logged and retried
on the next tick; it never ends the watcher.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class NodeWatcher:
    def __init__(self, refresh: Callable[[], object], interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.refresh = refresh
        self.interval_s = interval_s
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmux-node-watcher", daemon=True)
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
                self.refresh()
            except Exception:
                self.num_errors += 1
                logger.exception("node watcher: refresh failed (will retry)")
