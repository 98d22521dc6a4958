"""Loopback helpers for tests: a free TCP port for a server the test starts (HTTP, Prometheus)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (the only address tests send traffic to)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
