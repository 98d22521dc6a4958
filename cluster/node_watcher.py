"""A daemon thread that calls `refresh()` every `interval_s` until stopped.

The topology uses it to notice nodes that join or leave the Ray cluster (Ray has no
membership callback a driver can subscribe to). A failing refresh is logged and retried
on the next tick; it never ends the watcher (actors/periodic.py).
"""
from __future__ import annotations

from collections.abc import Callable

from actors.periodic import PeriodicThread


class NodeWatcher(PeriodicThread):
    def __init__(self, refresh: Callable[[], object], interval_s: float = 1.0):
        super().__init__(refresh, interval_s, name="tokenmux-node-watcher")
        self.refresh = refresh
