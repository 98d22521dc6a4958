"""`tokenmux status --watch`: a live terminal view of every worker, refreshed in place.

    WORKER  ROLE  RESIDENT  QUEUED/RUNNING  TOKENS/S  ALPHA  SWAPS/S  KV  DEVICE MEM  UTIL

Each refresh asks the app for the topology's status (the same as `tokenmux status`) and
each worker for `telemetry()` (a WorkerTelemetry: running totals kept by its metrics thread,
actors/worker_metrics.py), and turns the totals into rates against the previous refresh.
No Prometheus is needed. The table is drawn with rich's Live display, which rewrites it in
place on a terminal (and prints one table per refresh elsewhere).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.worker_reports import WorkerTelemetry
    from cluster.status import ClusterStatus

RATES = ("generation_tokens", "swaps", "switches")   # totals shown per second


@dataclass
class WatchState:
    """Previous telemetry per worker, for rates."""

    previous: dict[str, "WorkerTelemetry"] = field(default_factory=dict)

    def rates(self, telemetry: dict[str, "WorkerTelemetry"]) -> dict[str, dict[str, float]]:
        out = {}
        for wid, now in telemetry.items():
            before = self.previous.get(wid)
            dt = (now.time - before.time) if before else 0.0
            out[wid] = {key: (getattr(now, key) - getattr(before, key)) / dt if dt > 0 else 0.0 for key in RATES}
        self.previous = dict(telemetry)
        return out


def gather(app: str) -> tuple["ClusterStatus", dict[str, "WorkerTelemetry"]]:
    """(status, worker id -> telemetry) of the running app; a worker that does not answer is left out."""
    import ray

    from deploy.app_handles import cluster_handle, cluster_status

    status = cluster_status(app)
    handles = cluster_handle(app).worker_handles.remote().result(timeout_s=30)
    refs = {wid: h.telemetry.remote() for wid, h in handles.items()}
    telemetry = {}
    for wid, ref in refs.items():
        try:
            telemetry[wid] = ray.get(ref, timeout=10)
        except Exception:   # dead or stuck: the status row says so
            continue
    return status, telemetry


def render(status: "ClusterStatus", telemetry: dict[str, "WorkerTelemetry"], rates: dict[str, dict[str, float]]):
    """A rich Table of the workers."""
    from rich.table import Table

    from actors.device_memory import format_bytes
    from cluster.status import WorkerDown

    table = Table(title=f"tokenmux  {time.strftime('%H:%M:%S')}  policy {status.policy or '-'}  "
                        f"plan v{status.plan.version if status.plan else '-'}", expand=False)
    for column in ("WORKER", "ROLE", "RESIDENT", "QUEUED / RUNNING", "TOKENS/S", "ALPHA", "SWAPS/S", "KV USED",
                   "DEVICE MEMORY", "UTIL"):
        table.add_column(column, justify="right" if column in ("TOKENS/S", "ALPHA", "SWAPS/S", "KV USED", "UTIL")
                         else "left")
    for wid, w in sorted(status.workers.items()):
        if isinstance(w, WorkerDown):
            table.add_row(wid, "DEAD", w.error, *[""] * 7)
            continue
        t, r = telemetry.get(wid), rates.get(wid, {})
        queued = ",".join(f"{m}:{n}" for m, n in sorted(w.engine.queue_depth.items())) or "-"
        running = ",".join(f"{m}:{n}" for m, n in sorted(w.engine.running.items())) or "-"
        device = t.device if t else None
        memory = (f"{format_bytes(device.memory_used_bytes)} / {format_bytes(device.memory_total_bytes)}"
                  + (" (virtual)" if device.virtual else "")) if device else "-"
        alpha = t.alpha if t else None
        table.add_row(wid, w.role, ",".join(w.engine.resident) or "-", f"{queued} / {running}",
                      f"{r.get('generation_tokens', 0.0):.1f}", f"{alpha:.2f}" if alpha is not None else "-",
                      f"{r.get('swaps', 0.0):.2f}", f"{t.kv_usage:.0%}" if t else "-", memory,
                      f"{device.utilization:.0%}" if device else "-")
    return table


def watch(app: str = "tokenmux", interval_s: float = 2.0, iterations: int | None = None, console=None) -> int:
    """Refresh the table every interval_s until Ctrl-C (or `iterations` refreshes)."""
    from rich.console import Console
    from rich.live import Live

    if interval_s <= 0:
        raise ValueError(f"--interval must be > 0, got {interval_s}")
    console = console or Console()
    state = WatchState()
    status, telemetry = gather(app)
    state.rates(telemetry)
    done = 0
    with Live(render(status, telemetry, {}), console=console, auto_refresh=False) as live:
        while iterations is None or done < iterations:
            time.sleep(interval_s)
            status, telemetry = gather(app)
            live.update(render(status, telemetry, state.rates(telemetry)), refresh=True)
            done += 1
    return 0
