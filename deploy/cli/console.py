"""What an operator sees on the console: Ray's log lines kept off it, one-line answers when
nothing is running, a taken port refused before anything starts, and a clean stop on SIGTERM.

Ray Serve logs to the console at INFO ("Started Serve in namespace ...", "Connecting to
existing Serve app ... New http_options will not be applied", which reads as if --port
were ignored: tokenmux starts Serve with them before `serve.run`, which reconnects); they
are all in Ray's own log files, and `-v` shows them. SIGTERM: Ray's core worker installs a
C handler that prints a stack dump and aborts; a Python handler installed after the
connect raises KeyboardInterrupt instead, so `serve` undeploys and stops Ray as on Ctrl-C.
"""
from __future__ import annotations

import errno
import logging
import signal
import socket

from deploy.app_handles import NothingRunning  # re-exported: the CLI catches it from here

RAY_LOGGERS = ("ray", "ray.serve", "ray.data", "ray.train")
# "Token authentication is enabled for this Ray cluster ..." on every local start: that is
# the setting tokenmux wants (cluster/ray_runtime.py), not news.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def quiet_ray(verbose: bool) -> None:
    """Ray's INFO lines off the console unless `verbose`. A filter, not just a level:
    Serve sets its logger back to INFO when it starts."""
    if verbose:
        return
    for name in RAY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        if _warnings_only not in logger.filters:
            logger.addFilter(_warnings_only)
    logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread (call after connecting to Ray)."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def check_port_free(host: str, port: int) -> None:
    """ValueError unless `host:port` can be bound now. Serve's proxy binds with SO_REUSEPORT,
    so a second server on a taken port would start and share the port's connections with the
    first; a plain bind (no SO_REUSEPORT) fails with EADDRINUSE while anything listens there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on {host}: {e.strerror or e}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed server's TIME_WAIT owns nothing
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} is in use (another tokenmux serve? `tokenmux shutdown`)") from None
            raise ValueError(f"cannot serve on {host}:{port} ({e.strerror or e})") from None


def check_reachable(address: str, timeout_s: float = 2.0) -> None:
    """NothingRunning unless something accepts connections at `host:port` (a quick probe
    before ray.init, which would otherwise retry a dead address for a long while)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return   # a form Ray resolves itself (ray://, a bare host): let it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as e:
        raise NothingRunning(f"no Ray cluster answers at {address} ({e.strerror or e})") from None
