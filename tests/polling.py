"""Waiting in tests for something another thread, process or actor does: one polling loop.

`poll_until` answers whether the condition came true in time (a scenario script records
that as an observation); `wait_until` insists and raises TimeoutError naming what it waited for.
"""
from __future__ import annotations

import time
from typing import Callable


def poll_until(cond: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """True as soon as cond() holds; False if it still does not after timeout_s (checked once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05,
               what: str = "condition") -> bool:
    """Like poll_until, but a timeout raises TimeoutError naming `what`; returns True."""
    if not poll_until(cond, timeout_s, interval_s):
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
    return True
