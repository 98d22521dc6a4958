"""Prometheus for a tokenmux cluster: a scrape config over Ray's service-discovery file.

Every Ray node runs a metrics agent that exports what its processes record through
`ray.util.metrics` (tokenmux's metrics, actors/metrics.py) at `<node ip>:<MetricsExportPort>`.
Ray's dashboard keeps a Prometheus file-SD document listing those targets at
`<session dir>/prom_metrics_service_discovery.json` (Prometheus's `file_sd_configs` format,
refreshed every 5 s). The scrape config written here points there, so nodes that join are
scraped without editing it.

Without Ray's dashboard (tokenmux starts local Ray with `include_dashboard=False`; CI
does too) nothing writes that file, so `write_service_discovery` writes it in the same
format from the nodes alive now; nodes that join later need it written again (or a Ray
with its dashboard, `ray start --head`).

`loopback=True` adds one relabel rule that rewrites this host's node address to 127.0.0.1,
for a Prometheus on the same machine that must only scrape loopback (tests, a laptop).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

SD_FILE = "prom_metrics_service_discovery.json"   # ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
RAY_SD_REFRESH_S = 5.0                              # how often Ray's dashboard rewrites it


def session_dir() -> Path:
    """The connected Ray cluster's session directory on this host."""
    import ray

    if not ray.is_initialized():
        raise ValueError("not connected to Ray; join the cluster first (tokenmux ... --address)")
    # Ray has no public accessor for it; the global node object holds it in every driver.
    from ray._private import worker as ray_worker

    return Path(ray_worker._global_node.get_session_dir_path())


def service_discovery_targets() -> list[str]:
    """`host:port` of the metrics agent of every alive node."""
    import ray

    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def ray_maintains(sd_path: Path, now: float | None = None) -> bool:
    """True when a recent rewrite shows Ray's dashboard keeps the file current."""
    try:
        age = (now or time.time()) - sd_path.stat().st_mtime
    except FileNotFoundError:
        return False
    return age < 3 * RAY_SD_REFRESH_S


def write_service_discovery(sd_path: Path, targets: list[str]) -> Path:
    """Ray's file-SD document for `targets`, written atomically (Prometheus may be reading it)."""
    if not targets:
        raise ValueError("no Ray node exports metrics (MetricsExportPort missing)")
    sd_path = Path(sd_path)
    tmp = sd_path.with_name("tmp_" + sd_path.name)
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(tmp, sd_path)
    return sd_path


def scrape_config(sd_path: Path, scrape_interval_s: float = 5.0, loopback_hosts: list[str] | None = None) -> str:
    """prometheus.yml text: one job scraping every target in Ray's service-discovery file."""
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape_interval_s must be > 0, got {scrape_interval_s!r}")
    interval = f"{scrape_interval_s:g}s"
    lines = ["# Written by `tokenmux metrics prometheus-config`: scrape every Ray node's metrics agent,",
             "# as listed in Ray's service-discovery file. tokenmux metrics are ray_tokenmux_*.",
             "global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}",
             "scrape_configs:", "  - job_name: ray", "    file_sd_configs:",
             f"      - files: ['{Path(sd_path)}']", "        refresh_interval: 5s"]
    if loopback_hosts:
        hosts = "|".join(re.escape(h) for h in sorted(set(loopback_hosts)))
        lines += ["    relabel_configs:", "      # this host's node address -> loopback",
                  "      - source_labels: [__address__]", f"        regex: '(?:{hosts}):(\\d+)'",
                  "        target_label: __address__", "        replacement: '127.0.0.1:$1'"]
    return "\n".join(lines) + "\n"


def write_prometheus_config(out: Path, scrape_interval_s: float = 5.0, loopback: bool = False,
                            sd_path: Path | None = None) -> dict:
    """Write the scrape config (and Ray's SD file if nothing keeps it); returns what was done."""
    sd_path = Path(sd_path) if sd_path else session_dir() / SD_FILE
    targets = service_discovery_targets()
    wrote_sd = not ray_maintains(sd_path)
    if wrote_sd:
        write_service_discovery(sd_path, targets)
    local = [_this_host()] if loopback else None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(scrape_config(sd_path, scrape_interval_s, local))
    return {"config": str(out), "service_discovery": str(sd_path), "wrote_service_discovery": wrote_sd,
            "targets": targets}


def _this_host() -> str:
    import ray

    return ray.util.get_node_ip_address()
