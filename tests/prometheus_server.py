"""A real Prometheus server for tests: start the `prometheus` binary on loopback, query it.

Tests that need it skip with PROMETHEUS_MISSING when the binary is absent; `make test`
installs Debian's `prometheus` package first when it runs as root.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.net import free_port

PROMETHEUS_MISSING = ("the `prometheus` binary is not on PATH: `make test` installs Debian's package when run as "
                      "root (apt-get install -y prometheus); otherwise install it with your package manager or put "
                      "a Prometheus 2.x binary on PATH")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    def __init__(self, config: Path, data_dir: Path, binary: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(data_dir) / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [binary or prometheus_binary() or "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={Path(data_dir) / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s; see {self.log.name}")

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result vector (empty: no data)."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        if body.get("status") != "success":
            raise ValueError(f"query {expr!r} failed: {body.get('error') or body}")
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
